"""``mm_all_reduce`` for few rows (decode, small batches) in one kernel: a split-K GEMM whose
last K slice of each tile sums the tile's slices, pushes the sum to every peer and raises one
flag per peer (or pushes LL words, below); each rank then adds the ranks' sums of the tile in one
fixed order. No grid-wide barrier, no second kernel, no pull: what is left after the GEMM is one push
and one flag (LL: the push alone).

With few rows the GEMM streams the weight and the output is small, so the exchange costs
latency, not bandwidth; a tile-per-program GEMM has too few tiles to keep every SM streaming the
weight, hence the split of K into ``SPLIT`` slices: unit u is (tile u // SPLIT, slice u % SPLIT). A
unit stores its fp32 slice into this rank's workspace and counts itself in the tile's arrival
counter (local, gpu scope); the unit that arrives last adds the ``SPLIT`` slices in slice order (the
same rounding whichever unit is last), adds the bias, rounds to the output dtype as the unfused
partial is rounded, stores that sum into slot [rank, tile] of every rank's workspace and releases
flag [tile, rank] on every peer. The tile's output is written after the program's next unit (the
peers' pushes had that long to land): wait for the peers' flags (bounded, ``sync.wait_or_record``),
add slots [0..world-1, tile] in rank order, so every rank writes the same bits.

Where few bytes are pushed (``uses_ll``; 16-bit outputs, not in a graph lane) the sums travel
with their flags, as NCCL's LL protocol does: each 8-byte word holds two output values and a flag
made from the epoch, stored whole (an aligned 8-byte element is single-copy atomic), and the
reader polls the words themselves until every flag is the call's. That drops the release fence
(a round trip over NVLink for the stores' acknowledgements) and the separate flag, the latency
that is most of the tail at few rows, for twice the bytes on the link. The flag's top bits are a
pattern arithmetic never writes (read as fp32 or bf16 a signalling NaN, as fp16 a negative NaN
with a payload), its low ``LL_EPOCH_BITS`` bits the epoch's; the workspace restarts its epochs
before those bits repeat and zeroes its data then and at allocation
(``runtime.workspace.Workspace.restart_epochs``), so a stale word carries the current flag only if
raw bytes copied into the data halves held exactly that NaN. The reader loads the ranks' words of a
tile in groups (``ll_group``: at 2 ranks both at once for blocks of up to 2048 values, the 16-row
ones) and sums them in one fixed order, so a later rank, whose peers' words are already there, pays
one local round trip per group instead of one per rank.

In a graph lane (``runtime.workspace.GraphLane``) the kernel keeps its epoch on the device, as
the lane's staged one-shot kernel does, and shares that kernel's epoch counters and flags: a CUDA
graph can capture the launch and replay it.

Where the units fit one wave (by default wherever the tiles do not outnumber the SMs: the
slices are chosen so), program p takes unit p and no program touches the workspace's ticket:
a claim costs the ticket's round trip at the start of every program and a failed claim's at its
end, a visible share of calls this short. That needs all programs resident at once (the grid is at
most one per SM, ``ws.max_programs``), as the exchange kernels' barriers do: where a kernel of
another stream holds SMs on one rank, the programs that start late there hold up their peers' waits,
which count against ``COMMFUSE_TIMEOUT_S`` (NaN and the error word beyond it). Calls of more units
than programs claim every unit in order from the ticket by running programs, so no wait there
depends on a program that has not started: a program waits only for a tile whose units it has all
claimed, and so (claims being in the same order on every rank) has every rank that waits for it; a
claimed unit pushes before its program waits. Parity halves alternate between calls as in
``fused_all_reduce.py``.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from . import tiles
from .launch import Bound
from .sync import (FUSED_SPLIT_K_OP, GRAPH_LANE_OP, KIND_TIMEOUT, STICKY_CHECK_NS, TAG_SHIFT, failed, iris, now,
                   record_late, require_iris, wait_other_ranks)
from .tiles import claim, mma_range, scale_tile, tile_coords, tile_epilogue
from .sizes.fused_split_k import (LL_MAX_PUSHED, MAX_ROWS, NARROW_MIN_K, NARROW_MIN_N, SplitConfig,  # noqa: F401
                                  config, data_bytes, flag_slots, misfit_sizes, num_tiles, one_row_block,
                                  sums_elems, unsupported, uses_ll, wide_tile)


@triton.jit
def _block(area, index, BM: tl.constexpr, BN: tl.constexpr):
    """Pointers to dense [BM, BN] block ``index`` of a workspace area."""
    return area + index.to(tl.int64) * (BM * BN) + tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]


#: Bits of the epoch an LL word's flag holds (above them the flag's fixed NaN pattern).
LL_EPOCH_BITS = 21
_LL_MARK = tl.constexpr(0xFFA00000)  # sign, all-ones exponent, quiet bit clear: a signalling NaN
_LL_MASK = tl.constexpr((1 << LL_EPOCH_BITS) - 1)


@triton.jit
def _ll_flag(epoch):
    return ((epoch.to(tl.int64) & _LL_MASK) | _LL_MARK) << 32


@triton.jit
def _ll_pack(val, flag, BM: tl.constexpr, BN: tl.constexpr):
    """[BM, BN] 16-bit values as [BM, BN // 2] words: columns 2j and 2j + 1 in the low 32 bits,
    ``flag`` (``_ll_flag``) in the high ones."""
    lo, hi = tl.split(tl.reshape(val.to(tl.int16, bitcast=True), (BM, BN // 2, 2)))
    return (lo.to(tl.int64) & 0xFFFF) | ((hi.to(tl.int64) & 0xFFFF) << 16) | flag


@triton.jit
def _ll_missing(words, flag):
    """Per rank (the first axis of [GROUP, BM, BN // 2] ``words``), how many words do not carry
    ``flag`` (the same counts in every thread)."""
    return tl.sum(tl.sum(((words & -4294967296) != flag).to(tl.int32), 2), 1)


@triton.jit
def _ll_read(sums, tile, num_tiles, first, epoch, late, start, timeout, err, OP: tl.constexpr, rank,
             WORLD: tl.constexpr, GROUP: tl.constexpr, dtype: tl.constexpr, BM: tl.constexpr,
             BN: tl.constexpr):
    """(values, late): the blocks of ``tile`` (``_ll_pack`` words) of ranks ``first`` to ``first +
    GROUP - 1``, loaded together (one round trip, not one per rank) and unpacked to [GROUP, BM, BN]
    ``dtype`` once every word carries the flag of ``epoch``'s count, polled until then or
    ``timeout`` ns after ``start`` (then late, the first rank with words missing named in the error word; a program
    already late polls no more). Ranks from ``WORLD`` on (padding) read as zeros."""
    flag = _ll_flag(epoch >> TAG_SHIFT)
    ranks = first + tl.arange(0, GROUP)
    at = _ll_block(sums, (ranks * num_tiles + tile)[:, None, None], BM, BN)  # [GROUP, BM, BN // 2]
    real = (ranks < WORLD)[:, None, None]
    words = tl.load(at, mask=real, other=flag, volatile=True)
    if late == 0:
        missing = _ll_missing(words, flag)
        look = start + STICKY_CHECK_NS
        while (tl.sum(missing, 0) != 0) & (late == 0):
            words = tl.load(at, mask=real, other=flag, volatile=True)
            missing = _ll_missing(words, flag)
            if tl.sum(missing, 0) != 0:
                t = now()
                if t - start > timeout:
                    late = 1
                elif t > look:  # an earlier wait of the group timed out: give up at once
                    look = t + STICKY_CHECK_NS
                    if failed(err):
                        late = 2
        if late == 1:
            record_late(err, OP, rank, tl.min(tl.where(missing != 0, ranks, WORLD), 0), epoch, epoch, KIND_TIMEOUT)
    words = tl.where(real, words, 0)
    lo = (words & 0xFFFF).to(tl.int16).to(dtype, bitcast=True)
    hi = ((words >> 16) & 0xFFFF).to(tl.int16).to(dtype, bitcast=True)
    return tl.reshape(tl.join(lo, hi), (GROUP, BM, BN)), late


@triton.jit
def _ll_block(sums, index, BM: tl.constexpr, BN: tl.constexpr):
    """Pointers to LL block ``index`` (``_ll_pack`` words) of the sums area."""
    return _block(sums.to(tl.pointer_type(tl.int64), bitcast=True), index, BM, BN // 2)


@triton.jit
def _finish(tile, late, sums, out, M, N, num_m, num_n, num_tiles, flags, epoch, rank, err, timeout,
            OP: tl.constexpr, WORLD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
            GROUP_M: tl.constexpr, LL: tl.constexpr, LL_GROUP: tl.constexpr):
    """Wait for the peers' sums of ``tile`` and write its output: NaN if a peer came late."""
    acc = tl.zeros((BM, BN), tl.float32)
    if LL:  # one fixed order of the ranks' sums on every rank: the same bits everywhere
        start = now()
        for first in tl.static_range(0, WORLD, LL_GROUP):
            parts, late = _ll_read(sums, tile, num_tiles, first, epoch, late, start, timeout, err,
                                   OP, rank, WORLD, LL_GROUP, out.dtype.element_ty, BM, BN)
            acc += tl.sum(parts.to(tl.float32), 0)
    else:
        if late == 0:
            late = wait_other_ranks(flags, tile, epoch, rank, err, timeout, OP, WORLD)
        for p in tl.static_range(WORLD):  # rank order on every rank: the same bits everywhere
            acc += tl.load(_block(sums, p * num_tiles + tile, BM, BN), cache_modifier=".cg").to(tl.float32)
    if late != 0:
        acc = tl.full((BM, BN), float("nan"), tl.float32)
    pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    tl.store(out + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(out.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))
    return late


@triton.jit(do_not_specialize=["rank", "epoch", "ticket_base"])
def split_k_all_reduce_kernel(a_desc, b_desc, bias, parts0, sums0, half_parts, half_sums, out, M,
                              N, K, stride_bm, stride_bn, flags, counters, heap_bases, epoch, rank,
                              err, timeout, ticket, ticket_base, epochs, scale_a, scale_b, OP: tl.constexpr,
                              WORLD: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr,
                              BN: tl.constexpr, BK: tl.constexpr, B_TRANSPOSED: tl.constexpr,
                              HAS_BIAS: tl.constexpr, DEVICE_EPOCH: tl.constexpr,
                              EPOCH_SLOTS: tl.constexpr, LL: tl.constexpr = False,
                              LL_GROUP: tl.constexpr = 0, GROUP_M: tl.constexpr = 1, SCALED: tl.constexpr = False,
                              ROWWISE: tl.constexpr = False, IMPRECISE: tl.constexpr = None):
    """The module docstring. ``parts0``: fp32 [tiles, SPLIT] blocks (local only); ``sums0``: the
    output dtype's [WORLD, tiles] blocks (``LL``: of [BM, BN / 2] int64 words, twice the bytes),
    written by every rank; both of parity 0, parity 1
    ``half_*`` elements on. ``DEVICE_EPOCH`` (the graph lane, CUDA-graph replays): the call's
    count is ``epochs[0] + 1``, ``epoch`` holds only its tag (``codes.flag_value(0, tag)``), and
    the ticket starts at 0; the last program to leave stores the count into all ``EPOCH_SLOTS``
    slots of ``epochs`` and zeroes ``ticket[0:2]`` (ticket, exits). LL words carry the count
    alone (their flag has no room for a tag): with the pairing check on, the run-time asks for
    flags instead (``runtime.paths.split_k``).
    ``GROUP_M``: the tiles' order (``tiles.tile_coords``; the tiling's ``group_m``, 1 in every
    default, whose calls have one or two row blocks). ``SCALED``: FP8 operands, this rank's
    ``_scaled_mm`` scales applied to each tile's sum of slices before its bias (``tiles.scale_tile``;
    ``ROWWISE``, ``IMPRECISE`` as ``tiles.matmul_kernel``'s): what is pushed is the output dtype's."""
    tl.static_assert(not (LL and DEVICE_EPOCH), "LL words need host epochs, which restart")
    tl.static_assert(not LL or LL_GROUP > 0, "LL reads LL_GROUP ranks' words at once")
    if DEVICE_EPOCH:
        count = tl.load(epochs) + 1
        epoch = (count << TAG_SHIFT) | epoch
        ticket_base = 0
    else:
        count = epoch >> TAG_SHIFT
    parts = parts0 + (count % 2) * half_parts
    sums = sums0 + (count % 2) * half_sums
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    num_tiles = num_m * num_n
    k_blocks = tl.cdiv(K, BK)
    per = tl.cdiv(k_blocks, SPLIT)
    late = tl.program_id(0) * 0  # after one late wait the program waits no more (NaN outputs)
    pending = late - 1  # a tile this program pushed, whose output it writes after its next unit
    one_wave = num_tiles * SPLIT <= tl.num_programs(0)  # then no claims (the module docstring)
    if one_wave:
        u = tl.program_id(0)
    else:
        u = claim(ticket, ticket_base)
    while u < num_tiles * SPLIT:
        tile = u // SPLIT
        s = u % SPLIT
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        acc = mma_range(a_desc, b_desc, off_m, off_n, s * per, tl.minimum(s * per + per, k_blocks),
                        BM, BN, BK, B_TRANSPOSED, IMPRECISE)
        last = True
        if SPLIT > 1:
            tl.store(_block(parts, tile * SPLIT + s, BM, BN), acc)
            tl.debug_barrier()  # every thread's slice before the count below releases it
            last = tl.atomic_add(counters + tile, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
            if last:
                tl.debug_barrier()
                acc = tl.zeros((BM, BN), tl.float32)
                for j in range(SPLIT):  # slice order, whichever unit came last
                    acc += tl.load(_block(parts, tile * SPLIT + j, BM, BN), cache_modifier=".cg")
                tl.atomic_xchg(counters + tile, 0, sem="relaxed", scope="gpu")  # zero for the next call
        if last:
            if SCALED:
                acc = scale_tile(acc, scale_a, scale_b, off_m + tl.arange(0, BM), off_n + tl.arange(0, BN), M, N,
                                 ROWWISE)
            rows, cols, mask, acc = tile_epilogue(acc, bias, off_m, off_n, M, N, stride_bm,
                                                  stride_bn, BM, BN, HAS_BIAS)
            val = acc.to(out.dtype.element_ty)  # rounded as the unfused partial is
            if LL:  # the flags travel in the words: no fence, no flag store
                words = _ll_pack(val, _ll_flag(count), BM, BN)
                dst = _ll_block(sums, rank * num_tiles + tile, BM, BN)
                for k in tl.static_range(WORLD):
                    iris.store(dst, words, rank, (rank + k) % WORLD, heap_bases, hint=(1, 16))
            else:
                dst = _block(sums, rank * num_tiles + tile, BM, BN)
                for k in tl.static_range(WORLD):
                    iris.store(dst, val, rank, (rank + k) % WORLD, heap_bases, hint=(1, 16))
                tl.debug_barrier()  # every thread's pushes before the releases below
                for k in tl.static_range(1, WORLD):
                    iris.atomic_xchg(flags + tile * WORLD + rank, epoch, rank, (rank + k) % WORLD,
                                     heap_bases, sem="release", scope="sys")
        if pending >= 0:
            late = _finish(pending, late, sums, out, M, N, num_m, num_n, num_tiles, flags, epoch, rank,
                           err, timeout, OP, WORLD, BM, BN, GROUP_M, LL, LL_GROUP)
        pending = tl.where(last, tile, -1)
        if one_wave:
            u = num_tiles * SPLIT
        else:
            u = claim(ticket, ticket_base)
    if pending >= 0:
        _finish(pending, late, sums, out, M, N, num_m, num_n, num_tiles, flags, epoch, rank, err, timeout,
                OP, WORLD, BM, BN, GROUP_M, LL, LL_GROUP)
    if DEVICE_EPOCH:  # every program read the epoch before any left: the last one advances it
        tl.debug_barrier()
        if tl.atomic_add(ticket + 1, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
            for slot in range(EPOCH_SLOTS):
                tl.store(epochs + slot, count)
            tl.store(ticket, 0)
            tl.store(ticket + 1, 0)


#: Values of the LL words a program reads at once (``ll_group``): 32 registers of words a thread.
LL_GROUP_VALUES = 4096


def ll_group(world: int, bm: int, bn: int) -> int:
    """How many ranks' LL blocks of a tile a program loads together: every rank's (rounded up to a
    power of two, the padding read as zeros) as far as ``LL_GROUP_VALUES`` allows, at least one."""
    fit = max(1, LL_GROUP_VALUES // (bm * bn))
    return min(triton.next_power_of_2(world), 1 << (fit.bit_length() - 1))  # a power of two


def misfit(ws, m: int, n: int, cfg: SplitConfig, dtype: torch.dtype, lane: bool) -> str | None:
    """What of a call does not fit ``ws`` (a workspace, or with ``lane`` a graph lane): its flag
    slots, arrival counters or one parity's bytes; None if all fit."""
    return misfit_sizes(m, n, ws.world, cfg, dtype, lane, (ws.flags if lane else ws.tile_flags).numel(),
                        ws.tile_counters.numel(), ws.data_bytes)


#: The split-K kernel's arguments that change from call to call (``launch.Bound``): the operands'
#: descriptors and addresses, the epoch, the ticket's base.
_PER_CALL = ("a_desc", "b_desc", "bias", "out", "stride_bm", "stride_bn", "epoch", "ticket_base", "scale_a", "scale_b")


#: The kernel's specialisations compiled in this process (``_plan`` warms each up once).
_compiled: set = set()


def _plan(ws, m: int, k: int, n: int, dtype: torch.dtype, a_desc, b_desc, b_t: bool, full_bias, sbm: int, sbn: int,
          out: torch.Tensor, cfg: SplitConfig, lane: bool, fp8: tuple | None = None):
    """What a call's launch depends on beyond its operands' addresses, worked out once per
    workspace, shape, layout and tiling (``Workspace.kept``): the fit, the views, the constants,
    the first compile (before the call's epoch: a compile that fails on one rank must not leave its
    peers waiting), and a kept launch. Returns (the ``Bound`` launch, units, programs). ``dtype``:
    the output's (the sums'); ``fp8``: ``(rowwise, imprecise)`` of FP8 operands."""
    why = misfit(ws, m, n, cfg, dtype, lane)
    if why:
        raise RuntimeError(f"commfuse: {why}")
    half = ws.data_bytes
    count = num_tiles(m, n, cfg)
    block = cfg.tile.bm * cfg.tile.bn
    ll = uses_ll(cfg, m, n, ws.world, dtype, lane)
    sums = sums_elems(m, n, ws.world, cfg, dtype, lane)
    parts_at = tiles.cdiv(sums * dtype.itemsize, 256) * 256
    units = count * cfg.split
    programs = max(1, min(units, ws.max_programs))
    if lane:
        sums0, parts0 = ws.data(dtype), ws.data(torch.float32)[parts_at // 4:]
        flags, ticket, epochs = ws.flags, ws.ticket, ws.counter
    else:
        sums0 = ws.data(0, (sums,), dtype)
        parts0 = ws.data(0, (count * cfg.split * block,), torch.float32, parts_at)
        flags, ticket, epochs = ws.tile_flags, ws.ticket, ws.ticket  # (epochs: unused)
    consts = dict(OP=GRAPH_LANE_OP if lane else FUSED_SPLIT_K_OP, WORLD=ws.world, SPLIT=cfg.split,
                  BM=cfg.tile.bm, BN=cfg.tile.bn, BK=cfg.tile.bk, B_TRANSPOSED=b_t,
                  HAS_BIAS=full_bias is not None, DEVICE_EPOCH=lane,
                  EPOCH_SLOTS=epochs.numel() if lane else 1, LL=ll,
                  LL_GROUP=ll_group(ws.world, cfg.tile.bm, cfg.tile.bn), GROUP_M=cfg.tile.group_m,
                  SCALED=fp8 is not None, ROWWISE=fp8 is not None and fp8[0], IMPRECISE=fp8[1] if fp8 else None,
                  num_warps=cfg.tile.warps, num_stages=cfg.tile.stages)
    fixed = dict(parts0=parts0, sums0=sums0, half_parts=half // 4, half_sums=half // dtype.itemsize, M=m, N=n, K=k,
                 flags=flags, counters=ws.tile_counters, heap_bases=ws.heap_bases, rank=ws.rank, err=ws.err,
                 timeout=ws.timeout_ns, ticket=ticket, epochs=epochs)
    # Triton specialises integers on being 1 or a multiple of 16: one compile serves every M alike
    spec = (tuple(sorted((key, v) for key, v in consts.items())), k, n, dtype, m == 1, m % 16 == 0, sbm, sbn,
            half, ws.timeout_ns, ws.rank, out.data_ptr() % 16 == 0,
            full_bias is None or full_bias.data_ptr() % 16 == 0)
    if hasattr(split_k_all_reduce_kernel, "warmup") and spec not in _compiled:  # (not interpreted)
        split_k_all_reduce_kernel.warmup(a_desc=a_desc, b_desc=b_desc, bias=full_bias if full_bias is not None else out,
                                         out=out, stride_bm=sbm, stride_bn=sbn, epoch=0, ticket_base=0,
                                         scale_a=ws.err, scale_b=ws.err, grid=(1,), **fixed, **consts)
        if len(_compiled) >= 1024:
            _compiled.clear()
        _compiled.add(spec)  # (only once compiled: a failed warm-up is tried again)
    return Bound(split_k_all_reduce_kernel, (programs,), _PER_CALL, **fixed, **consts), units, programs


def prepare(ws, a: torch.Tensor, b: torch.Tensor, bias, out: torch.Tensor, cfg: SplitConfig,
            lane: bool = False, scales: tuple | None = None, use_fast_accum: bool = True):
    """What can fail on one rank alone (copies, descriptors, the first compile) before the call's
    epoch; returns ``launch(epoch, parity)``, which writes ``out = sum over the group of (a @ b +
    bias)`` through ``ws`` (``data_bytes`` per parity). ``lane``: ``ws`` is the group's graph lane
    (``runtime.workspace.GraphLane``) and the call count lives on the device, so the launch may
    be captured in a CUDA graph and replayed; ``launch``'s ``epoch`` then carries only the call's
    tag (``codes.flag_value(0, tag)``) and its parity is not used. ``scales``: ``(scale_a,
    scale_b)`` of FP8 operands (``_scaled_mm``'s), with ``use_fast_accum``; ``out``'s dtype is
    what the ranks push and sum."""
    require_iris()
    m, k = a.shape
    n = b.shape[1]
    a_desc, b_desc, b_t = tiles.descriptor_operands(a, b, cfg.tile)
    full_bias, sbm, sbn = tiles.bias_strides(bias, m, n)
    scale_a, scale_b, fp8 = tiles.fp8_scales(scales, m, n, use_fast_accum, cfg.tile.bk, ws.err)
    # every input of the plan is in its key (and the operands' alignment, which Triton specialises on)
    key = ("split_k", m, k, n, a.dtype, out.dtype, b_t, full_bias is not None, sbm, sbn, cfg, lane, fp8,
           ws.err.data_ptr(), ws.timeout_ns, out.data_ptr() % 16 == 0,
           full_bias is None or full_bias.data_ptr() % 16 == 0)
    bound, units, programs = ws.kept(key, lambda: _plan(ws, m, k, n, out.dtype, a_desc, b_desc, b_t, full_bias, sbm,
                                                          sbn, out, cfg, lane, fp8))

    def launch(epoch: int = 0, parity: int = 0) -> None:
        base = 0 if lane else ws.ticket_base
        bound(a_desc=a_desc, b_desc=b_desc, bias=full_bias if full_bias is not None else out, out=out,
              stride_bm=sbm, stride_bn=sbn, epoch=epoch, ticket_base=base, scale_a=scale_a, scale_b=scale_b)
        if not lane:
            # one wave: no claims; else every unit claimed once, one failed claim each
            ws.ticket_base = base + (0 if units <= programs else units + programs)

    return launch
