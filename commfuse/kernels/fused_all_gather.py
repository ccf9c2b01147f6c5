"""``all_gather_mm`` in one persistent kernel: the tiles of this rank's own rows multiply at once,
with no wait, while a few ``pusher`` programs store the shard into every peer's workspace in
chunks of rows, each chunk followed by a flag on that peer. A tile of a peer's rows waits only
for the chunks it reads. Every tile reads its rows through one TMA descriptor over the
workspace's gathered rows; the launcher copies the shard into this rank's own rows of it first
(one local copy, stream-ordered before the kernel), since two descriptors, one per source, would
each get their own pipeline buffers and no longer fit in shared memory.

Programs claim tile positions in order from the workspace's ticket (own rows first, then
rank+1's, rank+2's, ...), so no wait depends on a program that has not started. Pushers never
wait while they push; afterwards they copy the peers' chunks, as they land, into the gathered
tensor the op returns (when the graph uses it), then claim tiles like the others. Every byte
that crosses NVLink is a store. Waits are bounded
(``sync.wait_or_record``): a tile whose wait timed out is NaN and the error word names the op,
this rank and the peer.

The peers' rows reach this rank through generic stores and an acquire on their flag; the GEMM
reads them through TMA (the async proxy), so a proxy fence sits between the two.

Parity halves alternate between calls as for the other kernels: a rank finishes call e only
after every peer pushed all its chunks of e, so every peer has started e (and finished e - 1);
call e + 2, the next to write e's half, cannot start on a peer while this rank still reads it.
Per parity the workspace holds the gathered rows ``[world * rows, K]``. Chunk c of rank s is
flagged in tile-flag slot ``c * world + s``: like every other fused-kernel slot, one writer per
slot (slot = writer mod world), so a slot's value only grows even when a fast rank's next call,
of any op, writes the same region. Ranks push to rank - 1 first: it reads their rows first.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from . import tiles
from .launch import Bound
from .sync import TRACE_SLOTS, FUSED_AG_OP, iris, now, require_iris, trace_tile, trace_time, wait_or_record
from .tiles import claim, mma_tile, scale_tile, tile_coords, tile_epilogue
from .sizes.fused_all_gather import (CHUNK_ROWS, PUSHERS, ce_chunks, ce_flag_base, chunk_flag_slots,  # noqa: F401
                                     data_elems, rowwise_scales_offset)

@triton.jit
def _proxy_fence():
    """Order this thread's earlier generic-proxy accesses (the flag acquire) before its later
    async-proxy ones (TMA loads of the rows the flag guards)."""
    tl.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.u32 $0, 0;", "=r", [],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _chunk_ptrs(base, first_row, c, K, k0, row_end, CH: tl.constexpr, PUSH_K: tl.constexpr):
    """Pointers and mask of a [CH, PUSH_K] block of a dense [*, K] area: rows ``first_row + c*CH``
    onwards (up to ``row_end``), columns ``k0`` onwards. The accesses are 16-byte vectors when
    Triton specialises K as a multiple of 16 (hidden sizes are); other K (multiples of 8, as
    ``runtime.paths.base.tile_support`` lets through) still work, with 2-byte accesses."""
    rows = first_row + c * CH + tl.arange(0, CH)
    cols = k0 + tl.arange(0, PUSH_K)
    mask = (rows[:, None] < row_end) & (cols[None, :] < K)
    return base + rows[:, None].to(tl.int64) * K + cols[None, :], mask


@triton.jit
def _push_and_copy(gathered, data, rows, K, flags, heap_bases, epoch, rank, err, timeout, pid,
                   pushers, chunks, row_scales, OP: tl.constexpr, WORLD: tl.constexpr, CH: tl.constexpr,
                   PUSH_K: tl.constexpr, GATHER: tl.constexpr, ROWWISE: tl.constexpr = False):
    """A pusher: store this rank's chunks (pid, pid + pushers, ...) into every peer's workspace
    (and, with ``GATHER``, into its own rows of ``gathered``), releasing each chunk's flag on the
    peers; then, with ``GATHER``, copy the peers' chunks into ``gathered`` as their flags arrive
    (NaN after a late one). ``ROWWISE``: each chunk's rows' scales (``row_scales``, the float32
    beside the gathered rows) go with it, under the same flag. Returns 1 if a wait came late."""
    mine = rank * rows
    for c in range(pid, chunks, pushers):
        for k0 in range(0, K, PUSH_K):
            ptrs, mask = _chunk_ptrs(data, mine, c, K, k0, mine + rows, CH, PUSH_K)
            val = tl.load(ptrs, mask=mask)
            for i in tl.static_range(1, WORLD):  # the same rows of every peer's workspace
                iris.store(ptrs, val, rank, (rank - i + WORLD) % WORLD, heap_bases, mask=mask,
                           hint=(1, 16))
            if GATHER:
                own, _ = _chunk_ptrs(gathered, mine, c, K, k0, mine + rows, CH, PUSH_K)
                tl.store(own, val, mask=mask)
        if ROWWISE:
            at = mine + c * CH + tl.arange(0, CH)
            inside = at < mine + rows
            scales = tl.load(row_scales + at, mask=inside)
            for i in tl.static_range(1, WORLD):
                iris.store(row_scales + at, scales, rank, (rank - i + WORLD) % WORLD, heap_bases, mask=inside)
        tl.debug_barrier()  # every thread's stores before the releases below
        for i in tl.static_range(1, WORLD):  # rank - 1 reads this rank's rows first
            iris.atomic_xchg(flags + c * WORLD + rank, epoch, rank, (rank - i + WORLD) % WORLD,
                             heap_bases, sem="release", scope="sys")
    late = pid * 0
    if GATHER:
        for u in range(pid, (WORLD - 1) * chunks, pushers):
            src = (rank + 1 + u // chunks) % WORLD
            c = u % chunks
            if late == 0:
                late = wait_or_record(flags + c * WORLD + src, epoch, now(), timeout, err, OP, rank,
                                      src)
            for k0 in range(0, K, PUSH_K):
                ptrs, mask = _chunk_ptrs(data, src * rows, c, K, k0, (src + 1) * rows, CH, PUSH_K)
                val = tl.load(ptrs, mask=mask)
                if late != 0:
                    val = tl.full((CH, PUSH_K), float("nan"), tl.float32).to(val.dtype)
                dst, _ = _chunk_ptrs(gathered, src * rows, c, K, k0, (src + 1) * rows, CH, PUSH_K)
                tl.store(dst, val, mask=mask)
    return late


@triton.jit
def _wait_rows(flags, src, first_chunk, last_chunk, epoch, rank, err, timeout, OP: tl.constexpr,
               WORLD: tl.constexpr):
    """Wait for chunks ``first_chunk .. last_chunk - 1`` of rank ``src``; 1 if one came late."""
    start = now()
    late = 0
    for c in range(first_chunk, last_chunk):
        if late == 0:
            late = wait_or_record(flags + c * WORLD + src, epoch, start, timeout, err, OP, rank, src)
    _proxy_fence()
    return late


@triton.jit(do_not_specialize=["rank", "epoch", "ticket_base", "pushers", "flag_rows"])
def all_gather_gemm_kernel(g_desc, b_desc, gathered, bias, out, data, rows, N, K, stride_bm, stride_bn, flags, heap_bases, epoch, rank, err,
                           timeout, ticket, ticket_base, trace, pushers, flag_rows, scale_a, scale_b,
                           OP: tl.constexpr,
                           WORLD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                           BK: tl.constexpr, GROUP_M: tl.constexpr, CH: tl.constexpr,
                           PUSH_K: tl.constexpr, B_TRANSPOSED: tl.constexpr,
                           HAS_BIAS: tl.constexpr, GATHER: tl.constexpr,
                           TRACE: tl.constexpr = False, SCALED: tl.constexpr = False,
                           IMPRECISE: tl.constexpr = None, ROWWISE: tl.constexpr = False):
    """``out = all_gather(shard) @ b (+ bias)`` and, with ``GATHER``, ``gathered =
    all_gather(shard)`` (module docstring); ``rows``: of each rank's shard; ``g_desc`` is over
    this parity's gathered rows in the workspace (``data``), whose own rows hold the shard
    already. Pushers, once done, multiply too (their SMs are not lost to the GEMM). A peer's
    chunk of ``flag_rows`` rows is flagged once: ``CH`` with pushers; with none (the copy
    engines push, ``prepare``), the host's chunk. ``TRACE``: GPU times into ``trace``
    (``sync.TRACE_SLOTS`` per program: the second time is the pushes' end, each tile's middle
    time its wait's end), for the benchmarks. ``SCALED``: FP8 shards and weight with one float32
    scale each (``tiles.scale_tile``; ``IMPRECISE`` as ``tiles.matmul_kernel``'s): the FP8 bytes
    are what crosses the links. ``ROWWISE`` too: a scale per gathered row (``scale_a``: this
    parity's float32 area beside the gathered rows, this rank's own rows' filled before the launch,
    the peers' pushed with their chunks) and per column of ``b`` (``scale_b``); pushers only (no
    copy-engine push) and no gathered copy."""
    pid = tl.program_id(0)
    chunks = tl.cdiv(rows, CH)
    late = pid * 0  # once a wait timed out, this program waits no more: its later tiles are NaN
    trace_time(trace, 0, TRACE)
    if pid < pushers:
        late = _push_and_copy(gathered, data, rows, K, flags, heap_bases, epoch, rank, err, timeout,
                              pid, pushers, chunks, scale_a, OP, WORLD, CH, PUSH_K, GATHER, ROWWISE)
        trace_time(trace, 1, TRACE)  # the pushes' end
    share_m = tl.cdiv(rows, BM)
    num_n = tl.cdiv(N, BN)
    per = share_m * num_n
    j = 0  # tiles this program multiplied (the trace's index)
    i = claim(ticket, ticket_base)
    while i < WORLD * per:
        src = (rank + i // per) % WORLD  # own rows first, then the next ranks'
        local_m, pid_n = tile_coords(i % per, share_m, num_n, GROUP_M)
        if (src != rank) & (late == 0):
            late = _wait_rows(flags, src, local_m * BM // flag_rows,
                              tl.cdiv(tl.minimum((local_m + 1) * BM, rows), flag_rows), epoch, rank,
                              err, timeout, OP, WORLD)
        trace_tile(trace, j, i, 0, TRACE)  # the wait's end
        first = src * rows + local_m * BM
        acc = mma_tile(g_desc, b_desc, first, pid_n * BN, K, BM, BN, BK, B_TRANSPOSED, IMPRECISE)
        if SCALED:
            acc = scale_tile(acc, scale_a, scale_b, first + tl.arange(0, BM), pid_n * BN + tl.arange(0, BN),
                             (src + 1) * rows, N, ROWWISE)
        r, cols, mask, acc = tile_epilogue(acc, bias, first, pid_n * BN, (src + 1) * rows, N,
                                           stride_bm, stride_bn, BM, BN, HAS_BIAS)
        if late != 0:
            acc = tl.full((BM, BN), float("nan"), tl.float32)
        tl.store(out + r[:, None].to(tl.int64) * N + cols[None, :], acc.to(out.dtype.element_ty),
                 mask=mask)
        trace_tile(trace, j, i, 1, TRACE)
        j += 1
        i = claim(ticket, ticket_base)


#: (config, dtype, output dtype, world, weight layout, bias, device, push width, gathered, traced, scaled,
#: FP8 accumulation) -> programs per SM
_resident: dict[tuple, int] = {}


def copy_engine_flags():
    """torch's stream write of a 32-bit value (the copy-engine pushes' flags), or None: it issues
    a system-scope fence first, so the pushed rows are visible before their flag."""
    try:
        return torch.ops.symm_mem.stream_write_value32_
    except (AttributeError, RuntimeError):
        return None


#: The kernel's arguments that change from call to call (``launch.Bound``): the operands and
#: outputs, this parity's rows and their descriptor, the bias's strides, the epoch, the ticket.
_PER_CALL = ("g_desc", "b_desc", "gathered", "bias", "out", "data", "stride_bm", "stride_bn", "epoch", "ticket_base",
             "trace", "scale_a", "scale_b")


class _Plan:
    """What a call's launch depends on beyond its operands (``prepare``), worked out once per
    workspace, shapes, layout and options (``Workspace.kept``): the gathered rows of each parity
    and their descriptors (the workspace's addresses do not move), the peers' views, the flags,
    the grid and the kept launch."""

    def __init__(self, ws, rows: int, k: int, n: int, dtype: torch.dtype, out_dtype: torch.dtype, b_t: bool,
                 has_bias: bool, gathered: bool, cfg: tiles.TileConfig, traced: bool, ce_wanted: bool, pushers: int,
                 ce_chunk_count: int, fp8: tuple | None, rowwise: bool, device: torch.device, call: dict):
        """``call``: the first call's arguments of ``_PER_CALL`` but the parity's rows and the
        counts (the first compile takes them)."""
        world, rank = ws.world, ws.rank
        if cfg.bm % CHUNK_ROWS:
            raise RuntimeError(f"commfuse: tile height {cfg.bm} is not a multiple of {CHUNK_ROWS}")
        if chunk_flag_slots(rows, world) > ws.tile_flags.numel():
            raise RuntimeError("commfuse: too many row chunks for the workspace's tile flags")
        self.gathered_rows = [ws.data(p, (world * rows, k), dtype) for p in (0, 1)]
        self.write_flag = write_flag = copy_engine_flags() if ce_wanted else None
        self.peers = peers = [(rank - i) % world for i in range(1, world)]  # rank - 1 reads this rank's rows first
        self.peer_rows = {(q, parity): ws.peer_data(q, parity, (world * rows, k), dtype)
                          for q in peers for parity in (0, 1)} if write_flag is not None else {}
        self.peer_flags = {q: ws.peer_tile_flags(q) for q in peers} if write_flag is not None else {}
        self.ce = ce = write_flag is not None and all(
            v is not None for v in (*self.peer_rows.values(), *self.peer_flags.values()))
        self.flag_rows = flag_rows = tiles.cdiv(rows, ce_chunks(rows, ce_chunk_count)) if ce else CHUNK_ROWS
        self.flag_base = ce_flag_base(rows, world) if ce else 0
        # each parity's rows, dense in the workspace: descriptors made once
        self.g_descs = [tiles.rows_descriptor(g, [cfg.bm, cfg.bk]) for g in self.gathered_rows]
        push_k = min(256, triton.next_power_of_2(k))
        self.gather_in_kernel = gathered and not ce  # else copied from the workspace after
        if not self.gather_in_kernel:  # (the kernel takes the output in its place, as every call will)
            call = {**call, "gathered": call["out"]}
        self.scale_areas = None
        if rowwise:
            at = rowwise_scales_offset(rows, k, world, dtype.itemsize)
            self.scale_areas = [ws.data(p, (world * rows,), torch.float32, offset_bytes=at) for p in (0, 1)]
            call = {**call, "scale_a": self.scale_areas[0]}  # (the kernel reads them there, as every call will)
        imprecise = fp8[1] if fp8 else None
        consts = dict(OP=FUSED_AG_OP, WORLD=world, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk,
                      GROUP_M=cfg.group_m, CH=CHUNK_ROWS, PUSH_K=push_k, B_TRANSPOSED=b_t,
                      HAS_BIAS=has_bias, GATHER=self.gather_in_kernel, TRACE=traced,
                      SCALED=fp8 is not None, IMPRECISE=imprecise, ROWWISE=rowwise, num_warps=cfg.warps,
                      num_stages=cfg.stages)
        fixed = dict(rows=rows, N=n, K=k, flags=ws.tile_flags[self.flag_base:], heap_bases=ws.heap_bases, rank=rank,
                     err=ws.err, timeout=ws.timeout_ns, ticket=ws.ticket, flag_rows=flag_rows)
        key = (cfg, dtype, out_dtype, world, b_t, has_bias, device.index, push_k,
               self.gather_in_kernel, traced, fp8 is not None, imprecise, rowwise)
        if key not in _resident:  # compiled, not launched: how many programs fit on an SM
            compiled = all_gather_gemm_kernel.warmup(
                g_desc=self.g_descs[0], data=self.gathered_rows[0], epoch=0, ticket_base=0, pushers=PUSHERS,
                grid=(1,), **call, **fixed, **consts)
            compiled._init_handles()
            _resident[key] = tiles.resident_programs(compiled, device)
        per_sm = min(cfg.per_sm, _resident[key])
        if per_sm < 1:
            raise RuntimeError(f"commfuse: the fused all-gather kernel with {cfg} does not fit on an SM")
        self.count = count = world * tiles.cdiv(rows, cfg.bm) * tiles.cdiv(n, cfg.bn)
        programs = per_sm * ws.max_programs
        self.pushers = 0 if ce else max(1, min(pushers, tiles.cdiv(rows, CHUNK_ROWS), programs // 4))
        self.compute = max(1, min(count, programs - self.pushers))
        self.mine = slice(rank * rows, (rank + 1) * rows)
        self.bound = Bound(all_gather_gemm_kernel, (self.pushers + self.compute,), _PER_CALL, pushers=self.pushers,
                           **fixed, **consts)


def prepare(ws, shard: torch.Tensor, b: torch.Tensor, bias, gathered: torch.Tensor | None,
            out: torch.Tensor, cfg: tiles.TileConfig, trace: torch.Tensor | None = None,
            side: torch.cuda.Stream | None = None, pushers: int = PUSHERS, ce_chunk_count: int = 1,
            scales: tuple | None = None, use_fast_accum: bool = True, rowwise: bool = False):
    """What of a call can fail on one rank alone (operand copies, descriptors, peer views, the
    first compile of a configuration), done before the call's epoch begins; returns
    ``launch(epoch, parity)``, which writes ``out = all_gather(shard) @ b (+ bias)`` and, unless
    it is None, ``gathered`` [world * rows, K], through ``ws`` (``data_elems`` per parity).
    ``shard`` is [rows, K], this rank's rows. ``side``: a stream on which the copy engines push
    the shard into the peers' workspaces, in ``ce_chunk_count`` chunks each followed by its flag
    (a stream write); every program then multiplies. Without it, or without peer views or the
    stream write, ``pushers`` programs push. ``trace``: an int64 tensor of at least
    ``TRACE_SLOTS`` per program, which the kernel fills with GPU times (benchmarks only; -1
    where a program left slots unused). ``scales``: ``(scale_a, scale_b)`` of an FP8 shard and
    weight (one float32 each, ``_scaled_mm``'s), with ``use_fast_accum``; ``out`` is of the
    output dtype, ``gathered`` of the shard's. ``rowwise``: ``scale_a`` holds one float32 per row
    of the shard and ``scale_b`` one per column of ``b``; the row scales are gathered with the rows
    (``rowwise_scales_offset``), by pushers (``side`` is ignored), and no ``gathered`` is made.
    What depends only on the shapes, layouts and options is worked out once per workspace
    (``_Plan``): a model step waits for this host work."""
    require_iris()
    rows, k = shard.shape
    n = b.shape[1]
    if rowwise:
        if gathered is not None or scales is None:
            raise ValueError("commfuse: the row-wise gather takes scales and makes no gathered tensor")
        side = None
    b_desc, b_t = tiles.weight_descriptor(b, cfg)
    full_bias, sbm, sbn = tiles.bias_strides(bias, ws.world * rows, n)
    scale_a, scale_b, fp8 = tiles.fp8_scales(scales, rows, n, use_fast_accum, cfg.bk, ws.err)
    if rowwise and (scale_a.numel() != rows or scale_b.numel() != n):
        raise ValueError(f"commfuse: row-wise scales must be [{rows}] and [{n}]")
    traced = trace is not None
    # (the gathered tensor: the kernel writes it only where it gathers; ``_Plan`` says)
    call = dict(b_desc=b_desc, gathered=gathered if gathered is not None else out,
                bias=full_bias if full_bias is not None else out, out=out, stride_bm=sbm, stride_bn=sbn,
                trace=trace if traced else ws.ticket, scale_a=scale_a, scale_b=scale_b)
    # every input of the plan is in its key
    key = ("fused_all_gather", rows, k, n, shard.dtype, out.dtype, b_t, full_bias is not None, gathered is not None,
           cfg, traced, side is not None, pushers, ce_chunk_count, fp8, rowwise, ws.err.data_ptr(), ws.timeout_ns)
    plan = ws.kept(key, lambda: _Plan(ws, rows, k, n, shard.dtype, out.dtype, b_t, full_bias is not None,
                                      gathered is not None, cfg, traced, side is not None, pushers, ce_chunk_count,
                                      fp8, rowwise, shard.device, call))
    if traced and trace.numel() < (plan.pushers + plan.compute) * TRACE_SLOTS:
        raise ValueError(f"commfuse: the trace needs {(plan.pushers + plan.compute) * TRACE_SLOTS} slots")
    if not plan.gather_in_kernel:
        call["gathered"] = out
    ce, gathered_rows, mine = plan.ce, plan.gathered_rows, plan.mine

    def push(epoch: int, parity: int) -> None:
        """The copy engines store the shard into every peer's rows, chunk by chunk, each chunk's
        flag written after it. Queued behind everything this rank's stream holds: its previous
        call has ended, so every peer has started that call and no longer reads this parity's
        half from two calls ago (the kernel's own argument, module docstring)."""
        main = torch.cuda.current_stream(shard.device)
        side.wait_stream(main)
        rank, world, flag_rows, flag_base = ws.rank, ws.world, plan.flag_rows, plan.flag_base
        with torch.cuda.stream(side):
            for c, lo in enumerate(range(0, rows, flag_rows)):
                hi = min(lo + flag_rows, rows)
                for q in plan.peers:
                    plan.peer_rows[(q, parity)][rank * rows + lo:rank * rows + hi].copy_(shard[lo:hi],
                                                                                         non_blocking=True)
                    plan.write_flag(plan.peer_flags[q], flag_base + c * world + rank, epoch)

    def launch(epoch: int, parity: int) -> None:
        base = ws.ticket_base
        if traced:
            trace.fill_(-1)
        try:
            if ce:
                push(epoch, parity)
            gathered_rows[parity][mine].copy_(shard)
            if rowwise:  # this rank's rows' scales beside its rows; the pushers take them from there
                row_scales = call["scale_a"] = plan.scale_areas[parity]
                row_scales[mine].copy_(scale_a)
            plan.bound(g_desc=plan.g_descs[parity], data=gathered_rows[parity], epoch=epoch, ticket_base=base,
                       **call)
            if ce and gathered is not None:  # every peer's rows are in the workspace once the kernel ends
                gathered.copy_(gathered_rows[parity])
        finally:  # also when something failed: the caller's stream never runs ahead of the pushes
            if ce:
                torch.cuda.current_stream(shard.device).wait_stream(side)
        # every position claimed once, and one failed claim per program
        ws.ticket_base = base + plan.count + plan.pushers + plan.compute

    launch.variants = ("ce_push",) if ce else ()  # (what ran: the caller may count it)
    return launch
