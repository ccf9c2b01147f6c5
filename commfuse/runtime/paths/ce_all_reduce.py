"""``ce_overlap``: ``mm_all_reduce`` as cuBLAS in row chunks, each chunk's exchange done by the copy
engines (no SMs) while the next chunk multiplies.

    unfused:   mm(a, b) ----------------------> all_reduce -> out
    this path: mm(chunk 0) mm(chunk 1) ... mm(chunk c-1) [one-shot of chunk c-1 on the SMs]
                        barrier 0, pull 0, add 0  barrier 1, pull 1, add 1 ...   (side streams)

Every chunk's GEMM is queued first, then the side streams' work, each chunk's behind its GEMM's
event: the same order on the GPU, and the host switches streams once per side stream, not per
chunk. A barrier kernel learns that every rank's rows of a chunk are ready, the copy engines pull
the peers' rows of it and one local add sums them in rank order; barriers, pulls and adds each run
on a side stream of their own, so the pulls go back to back while later barriers wait. The last
chunk, after the last GEMM, is pulled and summed by the one-shot kernel on the SMs the GEMMs have
left (where its flag slots fit after the chunks' barriers; else the copy engines take it too).
A call whose operands, output and scratch sit where an earlier call of its shape had them is
replayed as a CUDA graph (``ce_graphs.py``): one fill of the epoch cell and one graph launch
instead of a launch per chunk's GEMM, barrier, pulls and add.

What keeps a peer from writing a partial this rank still pulls: consecutive calls on a group come
from one stream (or streams ordered after each other: ``Workspace.order`` in
``runtime/workspace.py``, through ``paths/common.exchange``), a call's barriers follow its first
GEMM on the caller's stream, which follows the previous call's pulls.
"""

from __future__ import annotations

import dataclasses

import torch

from ... import env
from ...kernels import exchange
from ...kernels.sync import OP_MM_ALL_REDUCE
from .. import ce_graphs
from .base import Call, Context, Path
from .common import exchange as epoch_of, matmul_into, ran_instead, row_chunks, sum_rank_order, workspace

#: Rows per chunk the default aims for, and the chunk count's bounds: each chunk costs a GEMM, a
#: barrier, a pull per peer and an add; fewer rows per chunk leave a shorter exposed tail.
CHUNK_ROWS, MIN_CHUNKS, MAX_CHUNKS = 1024, 2, 8
#: One flag slot per chunk: at most this many chunks.
CHUNK_LIMIT = 256


@dataclasses.dataclass(frozen=True)
class CeConfig:
    rows: tuple[int, ...]  # each chunk's rows, in order
    graphs: bool = True  # replay the call as a CUDA graph where its addresses repeat


def chunk_rows(m: int, chunks: int | None = None, last: int = 0) -> tuple[int, ...]:
    """Each chunk's rows: ``chunks`` equal chunks (default 1024-row ones, 2 to 8; the last shorter
    by the remainder); ``last`` > 0 sets the last chunk's rows instead, the others sharing the rest
    in multiples of 64 rows (a value that leaves them no rows keeps the even chunks)."""
    chunks = max(1, min(chunks or min(MAX_CHUNKS, max(MIN_CHUNKS, m // CHUNK_ROWS)), m, CHUNK_LIMIT))
    if chunks < 2 or not 0 < last < m - (chunks - 2):
        rows = max(1, -(-m // chunks))
        return tuple(min(rows, m - lo) for lo in range(0, m, rows))
    rest = m - last
    rows = -(-rest // ((chunks - 1) * 64)) * 64
    return tuple(min(rows, rest - lo) for lo in range(0, rest, rows)) + (last,)


class CeAllReduce(Path):
    op = "mm_all_reduce"
    name = "ce_overlap"

    def supports(self, call: Call, facts) -> str | None:
        why = super().supports(call, facts)
        if why is None and not facts.copy_engines:
            why = f"the {facts.provider} provider gives no per-peer views for the copy engines"
        return why

    def workspace_bytes(self, call: Call) -> int:
        return call.m * call.n * call.itemsize

    def config(self, call: Call, facts, variant=None) -> CeConfig:
        return CeConfig(chunk_rows(call.m), graphs=env.current().ce_graphs)

    def run(self, ctx: Context, args) -> torch.Tensor:
        a, b, bias = args.a, args.b, args.bias
        m, n = a.shape[0], b.shape[1]
        cfg: CeConfig = ctx.config or self.config(ctx.call, ctx.facts)
        ws = workspace(ctx, m * n * a.dtype.itemsize, a.device)
        out = torch.empty((m, n), dtype=a.dtype, device=a.device)  # allocations before the epoch
        recv = torch.empty((ws.world - 1, m, n), dtype=a.dtype, device=a.device)
        sides = ctx.group.side_streams(a.device)
        with epoch_of(ctx, ws, self.op) as (epoch, parity):
            partial = ws.data(parity, (m, n), a.dtype)
            peers = [ws.peer_data(p, parity, (m, n), a.dtype) for p in range(ws.world)]
            if not all(p is not None for p in peers):  # (``supports`` keeps such providers away)
                ran_instead(self.op, self.name, "one_shot")
                matmul_into(a, b, bias, partial)
                exchange.all_reduce(ws, partial, out, epoch, "one_shot", OP_MM_ALL_REDUCE)
                return out
            if cfg.graphs and ce_graphs.enabled():
                key = ce_graphs.key(ws, parity, (a, b, bias, out, recv), cfg.rows)
                ce_graphs.run(ws, epoch, key, lambda capture_sides: overlapped(
                    ws, a, b, bias, partial, out, recv, peers, None, cfg, capture_sides or sides), a.device.index)
            else:
                overlapped(ws, a, b, bias, partial, out, recv, peers, epoch, cfg, sides)
        return out


def overlapped(ws, a, b, bias, partial, out, recv, peers, epoch, cfg: CeConfig, sides: tuple) -> None:
    """The call's work on the caller's stream and ``sides`` = (pulls, adds, barriers) (module
    docstring). ``epoch`` None: the kernels read it from the workspace's epoch cell, and the call
    may be captured in a CUDA graph."""
    rows = list(cfg.rows)
    a_rows, partial_rows, out_rows = a.split(rows), partial.split(rows), out.split(rows)
    bias_rows = row_chunks(bias, rows)
    # the one-shot's flag slots follow the chunks' barriers: where they do not fit (hundreds of
    # chunks at many ranks), every rank alike keeps the copy engines for the last chunk too
    one_shot_tail = len(a_rows) > 1 and (len(a_rows) + exchange.MAX_PROGRAMS) * ws.world <= ws.flags.numel()
    side, adder, syncer = sides
    main = torch.cuda.current_stream(a.device)
    side.wait_stream(main)  # out and recv were allocated on main (the events below also order them)
    done = []
    for a_i, bias_i, partial_i in zip(a_rows, bias_rows, partial_rows):
        matmul_into(a_i, b, bias_i, partial_i)
        done.append(main.record_event())
    if one_shot_tail:
        done.pop()
        exchange.all_reduce(ws, partial_rows[-1], out_rows[-1], epoch, "one_shot", OP_MM_ALL_REDUCE,
                            slot_base=len(a_rows))
    others = [p for p in range(ws.world) if p != ws.rank]
    pulls = [(recv[j].split(rows), peers[p].split(rows)) for j, p in enumerate(others)]
    # the parts of each chunk in rank order: this rank's partial, the others' pulled rows
    ordered = [partial_rows if p == ws.rank else pulls[others.index(p)][0] for p in range(ws.world)]
    ready, pulled = [], []
    with torch.cuda.stream(syncer):
        for i, event in enumerate(done):
            syncer.wait_event(event)
            exchange.barrier(ws, epoch, OP_MM_ALL_REDUCE, slot=i)  # every rank's chunk i is ready
            ready.append(syncer.record_event())
    with torch.cuda.stream(side):
        for i, event in enumerate(ready):
            side.wait_event(event)
            for into, src in pulls:
                into[i].copy_(src[i], non_blocking=True)
            pulled.append(side.record_event())
    with torch.cuda.stream(adder):
        for i, event in enumerate(pulled):  # (each pull follows its chunk's GEMM event)
            adder.wait_event(event)
            sum_rank_order([part[i] for part in ordered], out_rows[i])
    main.wait_stream(syncer)
    main.wait_stream(adder)
    main.wait_stream(side)


CE_OVERLAP = CeAllReduce()
