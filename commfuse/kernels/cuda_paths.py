"""CUDA implementations of the ops through a symmetric workspace (``dispatch.py`` picks the path).

``mm_all_reduce``: one persistent Triton kernel that multiplies tiles and reduces finished ones
while later ones multiply (``fused``, ``fused_all_reduce.py``); for few rows a split-K GEMM that
pushes each tile's sum as it completes (``split_k``, ``fused_split_k.py``); or cuBLAS writes the partial
straight into the workspace, then a Triton kernel reduces it over the peers (one-shot or
two-shot); or, for GEMM-bound calls, cuBLAS in row chunks while the copy engines pull each
finished chunk from the peers (``ce_overlap``). ``all_gather_mm``: the
shard is copied into the workspace (one copy); a Triton kernel pulls every shard, then cuBLAS
multiplies; or the local shard multiplies while the copy engines pull the others (``overlap``);
or one persistent Triton kernel multiplies the local rows while it pushes them to the peers
(``fused``, ``fused_all_gather.py``). ``mm_reduce_scatter``: the same two shapes of path, pulling
only this rank's share, or the fused all-reduce kernel's reduce-scatter form (``fused``). Every rank
returns the reduced / gathered result, never its own partial. Side-stream work is joined back to
the caller's stream before returning.
"""

from __future__ import annotations

import collections
import contextlib
import math

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from . import (call_times, ce_graphs, dispatch, exchange, fused_all_gather, fused_all_reduce, fused_split_k,
               reference, shards, symm, tiles)
from .sync import GRAPH_LANE_OP, OP_ALL_GATHER_MM, OP_MM_ALL_REDUCE, OP_MM_REDUCE_SCATTER, ErrorWord

_side_streams: dict[int, torch.cuda.Stream] = {}
_ce_side_streams: dict[int, tuple] = {}
#: Calls per chosen path (``mm_all_reduce:fused``, ...) since import: tests check which path ran.
PATHS: collections.Counter[str] = collections.Counter()


def _ran_instead(op: str, algo: str, instead: str) -> None:
    """``PATHS`` counts the path a call took: ``algo`` was chosen but ``instead`` ran."""
    PATHS[f"{op}:{algo}"] -= 1
    PATHS[f"{op}:{instead}"] += 1


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device.index not in _side_streams:
        _side_streams[device.index] = torch.cuda.Stream(device)
    return _side_streams[device.index]


def _ce_streams(device: torch.device) -> tuple:
    """The copy-engine all-reduce's side streams: (pulls, adds, barriers) (``dispatch.ce_streams``)."""
    if device.index not in _ce_side_streams:
        _ce_side_streams[device.index] = tuple(torch.cuda.Stream(device) for _ in range(3))
    return _ce_side_streams[device.index]


def _matmul_into(a, b, bias, out) -> None:
    reference.matmul(a, b, bias, out=out)


def _per_row(bias) -> bool:
    """A 2-D bias with a row per output row (sliced with the rows); else broadcast, or none."""
    return bias is not None and bias.dim() >= 2 and bias.shape[0] != 1


def _rows(bias, lo: int, hi: int):
    """The bias for output rows lo:hi (a per-row 2-D bias is sliced; a broadcast one is not)."""
    return bias[lo:hi] if _per_row(bias) else bias


def _sum_rank_order(parts: list, out) -> None:
    """``out = parts[0] + parts[1] + ...`` in rank order, on every rank alike (at 2 ranks rounded once,
    as the Triton kernels round; beyond, after each add)."""
    if len(parts) == 1:  # one rank (the host-cost benchmark forces the paths there)
        out.copy_(parts[0])
        return
    torch.add(parts[0], parts[1], out=out)
    for part in parts[2:]:
        out.add_(part)


@contextlib.contextmanager
def _exchange(ws, op: str):
    """Start a call's epoch; if anything fails once it has begun, the ranks' call counters may
    differ, so the workspace refuses further calls instead of pairing up mismatched epochs."""
    epoch, parity = ws.next_epoch()
    try:
        yield epoch, parity
    except BaseException as exc:
        ws.broken = (
            f"commfuse.{op}: an earlier call on group {ws.group_name!r} failed after its exchange "
            f"began ({type(exc).__name__}: {exc}); the ranks' call counters may differ. Call "
            "commfuse.kernels.symm.release_all() on every rank to start over."
        )
        raise


def _path(op: str, group_name: str, key: tuple, world: int, own_size: int, device, decide) -> str:
    """A call's path: NCCL for the eager twin of a call a CUDA-graph capture sent to NCCL (a
    re-warming rank meets its peer's replay, with no size agreement before it: the replay has
    none), NCCL where the ranks' own sizes (``own_size``: K, or the all-gather's N) differ, since
    no path that reads that size may be taken; else ``decide()``. A captured call that runs NCCL
    is recorded for its twins."""
    capturing = dispatch.capturing()
    if symm.captured_to_nccl(op, group_name, key, capturing):
        return "nccl"
    algo = "nccl" if world > 1 and not shards.alike(group_name, op, own_size, device) else decide()
    symm.record_capture(op, group_name, key, algo, capturing)
    return algo


def _all_reduce_key(a: torch.Tensor, b: torch.Tensor) -> tuple:
    """What tells one ``mm_all_reduce`` call's shapes from another's (``symm.captured_to_nccl``)."""
    return tuple(a.shape), tuple(b.shape), a.dtype


@call_times.timed("mm_all_reduce", PATHS)
def mm_all_reduce(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group_name: str) -> torch.Tensor:
    ErrorWord.check("mm_all_reduce")
    group = _resolve_process_group(group_name)
    m, n = a.shape[0], b.shape[1]
    algo = _path("mm_all_reduce", group_name, _all_reduce_key(a, b), group.size(), a.shape[1], a.device,
                 lambda: dispatch.mm_all_reduce(m, a.shape[1], n, a.dtype, group.size(),
                                                symm.replayed_lane_bytes(group_name)))
    PATHS[f"mm_all_reduce:{algo}"] += 1
    if algo == "graph":
        return _graph_lane_all_reduce(a, b, bias, group_name)
    if algo == "nccl":
        return reference.mm_all_reduce(a, b, bias, group_name)
    if algo == "fused":
        out = torch.empty((m, n), dtype=a.dtype, device=a.device)
        return _fused(a, b, bias, out, group_name, group.size(), "mm_all_reduce", scatter=False)
    if algo == "split_k":
        return _split_k(a, b, bias, group_name, group.size())
    ws = symm.workspace(group_name, m * n * a.dtype.itemsize, a.device)
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)  # allocations before the epoch
    recv = torch.empty((ws.world - 1, m, n), dtype=a.dtype, device=a.device) if algo == "ce_overlap" else None
    tail = dispatch.ce_tail() if algo == "ce_overlap" else None  # a bad setting raises before the epoch
    streams = dispatch.ce_streams() if algo == "ce_overlap" else None
    graphs = algo == "ce_overlap" and ce_graphs.enabled()  # replayed as a CUDA graph where it can be
    rows = dispatch.copy_engine_rows(m) if algo == "ce_overlap" else None
    setting = (tail, rows, streams) if graphs else None
    with _exchange(ws, "mm_all_reduce") as (epoch, parity):
        partial = ws.data(parity, (m, n), a.dtype)
        if algo == "overlap":
            _overlapped(ws, a, b, bias, partial, out, epoch)
            return out
        if algo == "ce_overlap":
            peers = [ws.peer_data(p, parity, (m, n), a.dtype) for p in range(ws.world)]
            if m and all(p is not None for p in peers):
                if graphs:
                    ce_graphs.run(ws, epoch, ce_graphs.key(parity, (a, b, bias, out, recv), setting), lambda sides: (
                        _copy_engine_overlapped(ws, a, b, bias, partial, out, recv, peers, None, tail, sides, streams,
                                                rows)),
                        a.device.index)
                else:
                    _copy_engine_overlapped(ws, a, b, bias, partial, out, recv, peers, epoch, tail, streams=streams,
                                            rows=rows)
                return out
            _ran_instead("mm_all_reduce", algo, "one_shot")
            algo = "one_shot"  # no rows to chunk, or the provider has no peer views
        _matmul_into(a, b, bias, partial)
        exchange.all_reduce(ws, partial, out, epoch, algo, OP_MM_ALL_REDUCE)
        return out


def _fused(a, b, bias, out, group_name: str, world: int, op: str, scatter: bool) -> torch.Tensor:
    """One persistent Triton kernel: GEMM tiles, their exchange and sum overlapped
    (``fused_all_reduce.py``); ``scatter``: its reduce-scatter form along rows."""
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    cfg = dispatch.tile_config(m, k, n, scatter)
    ws = symm.workspace(group_name, dispatch.fused_workspace_bytes(m, k, n, a.dtype, world, scatter), a.device)
    launch = fused_all_reduce.prepare(ws, a, b, bias, out.view(-1, n), cfg, scatter,
                                      pull=scatter and dispatch.scatter_pull())  # before the epoch
    with _exchange(ws, op) as (epoch, parity):
        launch(epoch, parity)
    return out


def _split_k(a, b, bias, group_name: str, world: int) -> torch.Tensor:
    """Few rows: the split-K GEMM that pushes each tile's sum as it completes
    (``fused_split_k.py``), one kernel."""
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    ws = symm.workspace(group_name, dispatch.split_k_workspace_bytes(m, k, n, a.dtype, world), a.device)
    cfg = dispatch.split_k_config(m, k, n, ws.max_programs)  # the group's SM count
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    launch = fused_split_k.prepare(ws, a, b, bias, out, cfg)  # before the epoch
    with _exchange(ws, "mm_all_reduce") as (epoch, parity):
        launch(epoch, parity)
    return out


def _graph_lane_all_reduce(a, b, bias, group_name: str) -> torch.Tensor:
    """cuBLAS into a local buffer, then the staged one-shot kernel over the graph lane, whose
    epochs live on the device: what runs inside CUDA graphs (and, forced, outside them); for the
    few-rows shapes the split-K kernel instead, in the same lane and epochs."""
    nbytes = a.shape[0] * b.shape[1] * a.dtype.itemsize
    capturing = dispatch.capturing()
    lane = symm.graph_lane(group_name)
    if lane is None and not capturing:  # allocation is collective: never in a capture
        symm.workspace(group_name, nbytes, a.device)
        lane = symm.graph_lane(group_name)
    if lane is None or nbytes > lane.data_bytes:
        dispatch.nccl_fallback("mm_all_reduce", "no graph lane yet: the group's first call "
                               "was captured" if lane is None else "larger than the graph lane")
        symm.record_capture("mm_all_reduce", group_name, _all_reduce_key(a, b), "nccl",
                            capturing)  # its eager twins must meet the replays
        return reference.mm_all_reduce(a, b, bias, group_name)
    if capturing:
        symm.mark_replayed(group_name)
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    cfg = dispatch.graph_split_k(m, k, n, a.dtype, lane)
    if cfg is not None:  # few rows: the split-K kernel, in the lane
        out = torch.empty((m, n), dtype=a.dtype, device=a.device)
        fused_split_k.prepare(lane, a, b, bias, out, cfg, lane=True)()
        return out
    partial = reference.matmul(a, b, bias)
    out = torch.empty_like(partial)
    exchange.staged_all_reduce(lane, partial, out, GRAPH_LANE_OP)
    return out


def _gather_overlapped(ws, shard, mine, b, bias, gathered, out, peers, epoch, return_gathered: bool,
                       slabs: int = 1, copy: bool = False) -> None:
    """Copy the local shard into the workspace (``mine``), where the peers pull it; multiply it
    at once while the copy engines (no SMs) pull the peers' shards on a side stream; then
    multiply the peers' rows. ``COMMFUSE_AG_LOCAL`` says what the local GEMM reads: the
    workspace copy (the default) or the local rows copied into ``gathered`` first (``copy``;
    read before the call's epoch begins, so a bad value cannot break the workspace).
    ``slabs``: the gathered rows are that many slabs (a batch of sequences gathered along the
    sequence), each holding every rank's block of rows in rank order; each slab is one GEMM
    and one copy per block."""
    world, rank, k = ws.world, ws.rank, shard.shape[-1]
    inner = shard.numel() // k // slabs  # rows of one rank's block in one slab
    g3, o3 = gathered.view(slabs, world * inner, k), out.view(slabs, world * inner, out.shape[-1])
    mine3 = mine.view(slabs, inner, k)
    side = _side_stream(shard.device)
    main = torch.cuda.current_stream(shard.device)
    lo, hi = rank * inner, (rank + 1) * inner

    def rows_of(o, start, stop):  # the bias of slab o's rows start:stop
        return _rows(bias, o * world * inner + start, o * world * inner + stop)

    mine.copy_(shard)
    for o in range(slabs if copy else 0):
        g3[o, lo:hi].copy_(mine3[o])
    side.wait_stream(main)  # the shard is in the workspace; gathered and out were allocated on main
    with torch.cuda.stream(side):
        exchange.barrier(ws, epoch, OP_ALL_GATHER_MM)
        for p, view in enumerate(peers):
            if p != rank:
                for o, block in enumerate(view.view(slabs, inner, k)):
                    g3[o, p * inner:(p + 1) * inner].copy_(block, non_blocking=True)
        for o in range(slabs if return_gathered and not copy else 0):
            g3[o, lo:hi].copy_(mine3[o], non_blocking=True)
    for o in range(slabs):
        _matmul_into(g3[o, lo:hi] if copy else mine3[o], b, rows_of(o, lo, hi), o3[o, lo:hi])
    main.wait_stream(side)
    for o in range(slabs):
        for start, stop in ((0, lo), (hi, world * inner)):  # the peers' rows, in at most two GEMMs
            if stop > start:
                _matmul_into(g3[o, start:stop], b, rows_of(o, start, stop), o3[o, start:stop])


def _copy_engine_overlapped(ws, a, b, bias, partial, out, recv, peers, epoch, tail: str = "copy",
                            sides: tuple | None = None, streams: int = 1, rows: tuple | None = None) -> None:
    """cuBLAS per row chunk; as each chunk lands, the copy engines (no SMs) pull the peers' rows
    of it on a side stream and one local add sums them, while the next chunk multiplies. Every
    GEMM is queued first, then the side streams' work, each chunk's behind its GEMM's event:
    the same order on the GPU, and the host switches streams once per side stream, not per chunk.
    The host's work is what a model step waits for here (``NOTES.md`` §30-31): every chunk's
    views come from one ``split`` per tensor, and the barriers from one kept launch. ``tail``
    ``one_shot`` (``dispatch.ce_tail()``): the last chunk is pulled and summed by the one-shot
    kernel on the caller's stream right after its GEMM, in flag slots after the chunks' barriers.
    ``streams`` (``dispatch.ce_streams()``): 1, each chunk's barrier, pull and add in turn on one
    side stream; 2, the adds on a second, each behind an event recorded after its pull; 3, the
    barriers on a third too, each pull behind an event recorded after its barrier, so the pulls
    run back to back while later barriers wait. ``epoch`` None: the kernels read it from the
    workspace's epoch cell, and the call may be captured in a CUDA graph (``ce_graphs.py``;
    ``sides``: the capture's (pulls, adds, barriers) side streams). Consecutive calls on a group
    must come from one stream (or streams ordered after each other): a call's barriers follow its
    first GEMM on the caller's stream, which follows the previous call's pulls, and that is what
    keeps a peer from writing a partial this rank still pulls. ``rows``: each chunk's rows (default
    ``dispatch.copy_engine_rows``; the caller passes the ones its graph key holds)."""
    rows = list(rows or dispatch.copy_engine_rows(a.shape[0]))
    a_rows, partial_rows, out_rows = a.split(rows), partial.split(rows), out.split(rows)
    bias_rows = _row_chunks(bias, rows)
    # the one-shot's flag slots follow the chunks' barriers: where they do not fit (hundreds of
    # chunks at many ranks), every rank alike keeps the copy engines for the last chunk too
    one_shot_tail = (len(a_rows) > 1 and tail == "one_shot"
                     and (len(a_rows) + exchange.MAX_PROGRAMS) * ws.world <= ws.flags.numel())
    side, adder, syncer = sides or _ce_streams(a.device)
    adder = adder if streams >= 2 else side
    syncer = syncer if streams >= 3 else side
    main = torch.cuda.current_stream(a.device)
    side.wait_stream(main)  # out and recv were allocated on main (the events below also order them)
    done = []
    for a_i, bias_i, partial_i in zip(a_rows, bias_rows, partial_rows):
        _matmul_into(a_i, b, bias_i, partial_i)
        done.append(main.record_event())
    if one_shot_tail:
        done.pop()
        exchange.all_reduce(ws, partial_rows[-1], out_rows[-1], epoch, "one_shot", OP_MM_ALL_REDUCE,
                            slot_base=len(a_rows))
    others = [p for p in range(ws.world) if p != ws.rank]
    pulls = [(recv[j].split(rows), peers[p].split(rows)) for j, p in enumerate(others)]
    # the parts of each chunk in rank order: this rank's partial, the others' pulled rows
    ordered = [partial_rows if p == ws.rank else pulls[others.index(p)][0] for p in range(ws.world)]
    ready, pulled = list(done), []
    if syncer is not side:
        with torch.cuda.stream(syncer):
            for i, event in enumerate(done):
                syncer.wait_event(event)
                exchange.barrier(ws, epoch, OP_MM_ALL_REDUCE, slot=i)  # every rank's chunk i is ready
                ready[i] = syncer.record_event()
    with torch.cuda.stream(side):
        for i, event in enumerate(ready):
            side.wait_event(event)
            if syncer is side:
                exchange.barrier(ws, epoch, OP_MM_ALL_REDUCE, slot=i)
            for into, src in pulls:
                into[i].copy_(src[i], non_blocking=True)
            if adder is side:
                _sum_rank_order([part[i] for part in ordered], out_rows[i])
            else:
                pulled.append(side.record_event())
    if pulled:
        with torch.cuda.stream(adder):
            for i, event in enumerate(pulled):  # (each pull follows its chunk's GEMM event)
                adder.wait_event(event)
                _sum_rank_order([part[i] for part in ordered], out_rows[i])
    for stream in {adder, syncer} - {side}:
        main.wait_stream(stream)
    main.wait_stream(side)


def _row_chunks(bias, rows: list) -> list:
    """``_rows`` of each chunk of the output, the chunks of ``rows`` rows each (one ``split``)."""
    return list(bias.split(rows)) if _per_row(bias) else [bias] * len(rows)


def _overlapped(ws, a, b, bias, partial, out, epoch) -> None:
    """cuBLAS per row chunk on the current stream; each finished chunk is reduced one-shot by a
    few programs on a side stream while the next chunk multiplies. The chunks' kernels reuse the
    call's epoch in disjoint flag slots, so the call still costs one epoch and one parity."""
    chunks, programs = dispatch.overlap_config(a.shape[0])
    side = _side_stream(a.device)
    main = torch.cuda.current_stream(a.device)
    side.wait_stream(main)  # out was allocated on main
    rows = tiles.cdiv(a.shape[0], chunks)
    for i, lo in enumerate(range(0, a.shape[0], rows)):
        hi = min(lo + rows, a.shape[0])
        _matmul_into(a[lo:hi], b, _rows(bias, lo, hi), partial[lo:hi])
        side.wait_stream(main)
        with torch.cuda.stream(side):
            exchange.all_reduce(ws, partial[lo:hi], out[lo:hi], epoch, "one_shot", OP_MM_ALL_REDUCE,
                                block=8192, max_programs=programs, num_warps=16,
                                slot_base=i * programs)
    main.wait_stream(side)


@call_times.timed("all_gather_mm", PATHS)
def all_gather_mm(shard: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, gather_dim: int,
                  world_size: int, group_name: str, return_gathered: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``return_gathered=False``: the fused kernel may skip writing the gathered tensor (None)."""
    ErrorWord.check("all_gather_mm")
    k = shard.shape[-1]
    rows = shard.numel() // k * world_size if k else 0
    rows_dim = dispatch.rows_dim(shard.shape, gather_dim)  # 0: each rank's rows are one block
    slabs = dispatch.row_slabs(shard.shape, rows_dim)  # else a block in each of these slabs
    algo = _path("all_gather_mm", group_name, (tuple(shard.shape), tuple(b.shape), shard.dtype, gather_dim),
                 world_size, b.shape[1], shard.device,  # N is the rank's own size here
                 lambda: dispatch.all_gather_mm(rows, k, b.shape[1], shard.dtype, world_size, rows_dim, slabs))
    PATHS[f"all_gather_mm:{algo}"] += 1
    if algo == "nccl":
        return reference.all_gather_mm(shard, b, bias, gather_dim, world_size, group_name)
    shape = list(shard.shape)
    shape[gather_dim] *= world_size
    out = torch.empty((rows, b.shape[1]), dtype=shard.dtype, device=shard.device)
    if algo == "fused":  # rows_dim 0 (dispatch): the shard is a block of the gathered rows
        gathered = torch.empty(shape, dtype=shard.dtype, device=shard.device) if return_gathered else None
        ws = symm.workspace(group_name, dispatch.fused_gather_workspace_bytes(rows, k, shard.dtype, world_size),
                            shard.device)
        push = dispatch.gather_push(shard.numel() * shard.element_size())
        side = _side_stream(shard.device) if push == "ce" else None
        launch = fused_all_gather.prepare(ws, shard.reshape(-1, k), b, bias,
                                          None if gathered is None else gathered.view(-1, k), out,
                                          dispatch.gather_tile_config(rows, k, b.shape[1]), side=side)
        # (all before the epoch)
        with _exchange(ws, "all_gather_mm") as (epoch, parity):
            launch(epoch, parity)
        return out, gathered
    ws = symm.workspace(group_name, shard.numel() * shard.element_size(), shard.device)
    gathered = torch.empty(shape, dtype=shard.dtype, device=shard.device)  # before the epoch
    copy = algo == "overlap" and dispatch.gather_local_source() == "copy"  # raises before it, too
    with _exchange(ws, "all_gather_mm") as (epoch, parity):
        mine = ws.data(parity, shard.shape, shard.dtype)
        if algo == "overlap" and slabs:
            peers = [ws.peer_data(p, parity, shard.shape, shard.dtype) for p in range(ws.world)]
            if all(p is not None for p in peers):
                _gather_overlapped(ws, shard, mine, b, bias, gathered, out, peers, epoch, return_gathered, slabs,
                                   copy)
                return out, gathered if return_gathered else None
        if algo == "overlap":  # too many slabs, or no peer views for the copy engines
            _ran_instead("all_gather_mm", algo, "symm")
        mine.copy_(shard)
        outer = math.prod(shard.shape[:gather_dim])
        inner = math.prod(shard.shape[gather_dim:])
        exchange.gather(ws, mine, gathered, outer, inner, epoch, OP_ALL_GATHER_MM)
        _matmul_into(gathered.view(-1, k), b, bias, out)
        return out, gathered


@call_times.timed("mm_reduce_scatter", PATHS)
def mm_reduce_scatter(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, shape: list[int],
                      scatter_dim: int, world_size: int, group_name: str) -> torch.Tensor:
    ErrorWord.check("mm_reduce_scatter")
    m, n = a.shape[0], b.shape[1]
    shape = reference.resolve_shape(shape, m * n)
    rows_dim = dispatch.rows_dim(shape, scatter_dim)  # 0: each rank's share is one block of rows
    slabs = dispatch.row_slabs(shape, rows_dim)  # else a block in each of these slabs
    algo = _path("mm_reduce_scatter", group_name, (tuple(a.shape), tuple(b.shape), a.dtype, tuple(shape), scatter_dim),
                 world_size, a.shape[1], a.device,
                 lambda: dispatch.mm_reduce_scatter(m, a.shape[1], n, a.dtype, world_size, rows_dim, slabs))
    PATHS[f"mm_reduce_scatter:{algo}"] += 1
    if algo == "nccl":
        return reference.mm_reduce_scatter(a, b, bias, shape, scatter_dim, world_size, group_name)
    out_shape = list(shape)
    out_shape[scatter_dim] //= world_size
    out = torch.empty(out_shape, dtype=a.dtype, device=a.device)  # allocations before the epoch
    if algo == "fused":  # rows_dim 0 (dispatch): the share is rows of the [m, n] product
        return _fused(a, b, bias, out, group_name, world_size, "mm_reduce_scatter", scatter=True)
    ws = symm.workspace(group_name, m * n * a.dtype.itemsize, a.device)
    overlap = algo == "ce_overlap" and bool(slabs)
    chunks = dispatch.scatter_chunks(m // world_size // slabs, world_size, slabs) if overlap else 0
    overlap = overlap and chunks > 0
    recv = torch.empty((world_size - 1, m // world_size, n), dtype=a.dtype, device=a.device) if overlap else None
    own = torch.empty((m // world_size, n), dtype=a.dtype, device=a.device) if chunks * slabs == 1 else None
    with _exchange(ws, "mm_reduce_scatter") as (epoch, parity):
        partial = ws.data(parity, (m, n), a.dtype)
        if overlap:
            peers = [ws.peer_data(p, parity, (m, n), a.dtype) for p in range(ws.world)]
            if all(p is not None for p in peers):
                _scatter_overlapped(ws, a, b, bias, partial, out.view(-1, n), recv, own, chunks, peers, epoch,
                                    slabs)
                return out
        if algo == "ce_overlap":  # too many slabs, no chunk fits the flags, or no peer views
            _ran_instead("mm_reduce_scatter", algo, "symm")
        _matmul_into(a, b, bias, partial)
        outer = math.prod(shape[:scatter_dim])
        exchange.reduce_scatter(ws, partial, out, outer, m * n // outer // world_size, epoch,
                                OP_MM_REDUCE_SCATTER)
        return out


def _scatter_overlapped(ws, a, b, bias, partial, out, recv, own, chunks: int, peers, epoch,
                        slabs: int = 1) -> None:
    """Multiply the peers' shares of the rows first, each in turn and in row chunks; as chunk c of
    share p lands, rank p's copy engines pull it on their side stream while this rank multiplies
    the next chunk. This rank's own share comes last, chunk by chunk: each GEMM adds the pulled
    partials of its rows (summed in rank order, then this rank's bias) in its epilogue
    (``addmm``), so no separate pass sums the shares; this rank's product is added last and
    unrounded, which differs from the rank-order sum of rounded partials by rounding only.
    With one chunk nothing is pulled before the own share's GEMM could start, so that GEMM runs
    at once into ``own`` while the pulls land, and one pass sums the shares in rank order.
    ``slabs``: the rows are that many slabs (a batch of sequences scattered along the sequence),
    each holding every rank's share in rank order; the chunks are taken slab by slab."""
    world, rank, rows = ws.world, ws.rank, a.shape[0] // ws.world // slabs  # a share's rows in a slab
    step_rows = tiles.cdiv(rows, chunks)
    # (first row of the slab in the product, first of it in a share, chunk start, chunk stop)
    bounds = [(o * world * rows, o * rows, lo, min(lo + step_rows, rows))
              for o in range(slabs) for lo in range(0, rows, step_rows)]
    side = _side_stream(a.device)
    main = torch.cuda.current_stream(a.device)
    side.wait_stream(main)  # out and recv were allocated on main (the events below also order them)
    done = []  # (step, chunk, the event after its GEMM): GEMMs queued first, as in the all-reduce
    for step in range(1, world):
        p = (rank + step) % world
        for c, (base, share, lo, hi) in enumerate(bounds):
            r0, r1 = base + p * rows + lo, base + p * rows + hi
            _matmul_into(a[r0:r1], b, _rows(bias, r0, r1), partial[r0:r1])
            done.append((step, c, main.record_event()))
    landed = []
    with torch.cuda.stream(side):
        for step, c, event in done:
            q = (rank - step) % world  # at this step rank q multiplied this rank's share
            base, share, lo, hi = bounds[c]
            side.wait_event(event)
            exchange.barrier(ws, epoch, OP_MM_REDUCE_SCATTER, slot=(step - 1) * len(bounds) + c)
            mine = base + rank * rows
            recv[step - 1, share + lo:share + hi].copy_(peers[q][mine + lo:mine + hi], non_blocking=True)
            if step == world - 1:
                landed.append(side.record_event())
    if own is not None:  # one chunk: multiply the own share while the pulls run, sum after
        r0, r1 = rank * rows, (rank + 1) * rows
        _matmul_into(a[r0:r1], b, _rows(bias, r0, r1), own)
        main.wait_event(landed[0])
        # recv[step - 1] came from rank (rank - step) % world
        _sum_rank_order([own if q == rank else recv[(rank - q) % world - 1] for q in range(world)], out)
        main.wait_stream(side)
        return
    for c, (base, share, lo, hi) in enumerate(bounds):
        main.wait_event(landed[c])  # every peer's partial of these rows is here
        # recv[step - 1] came from rank (rank - step) % world: add the peers' parts in rank order
        parts = [recv[(rank - q) % world - 1, share + lo:share + hi] for q in range(world) if q != rank]
        acc = parts[0]
        if len(parts) > 1:
            _sum_rank_order(parts, acc)  # in place: the first part becomes the sum
        r0, r1 = base + rank * rows + lo, base + rank * rows + hi
        row_bias = _rows(bias, r0, r1)
        if row_bias is not None:
            acc.add_(row_bias)
        torch.addmm(acc, a[r0:r1], b, out=out[share + lo:share + hi])
    main.wait_stream(side)
