"""``mm_all_reduce`` in one persistent kernel: each tile is reduced in the epilogue of the program
that multiplied it, while other tiles are still being multiplied, and every byte that crosses
NVLink is a store (pushed), never a load, so no program waits a remote round trip per element
(except in the reduce-scatter's ``PULL`` form, below).

Tile t belongs to rank t % world. Every rank multiplies the tiles of the ranks after it first and
its own tiles last ("own last"), so by the time it multiplies a tile it owns, the peers pushed
their partials of that tile long ago. A peer-owned tile's partial is stored straight into the
owner's workspace (its slab for this rank). An owned tile adds the peers' slabs (local reads) to
its fp32 accumulator, writes the output and pushes the sum into each peer's result area. Flags
(``ready`` on the owner, ``done`` on the peers) are released after the program's *next* tile is
multiplied, so the release finds the stores landed instead of stalling on them. The sums that
peers pushed are copied into this rank's output by the multiplying programs themselves: the
copies are positions of the ticket order after this rank's own tiles (``_interleaved``; with
the default lag and up to ~1000 tiles at 2 ranks all of them come after the last own tile, in
larger calls they interleave with the own tiles, ``lag`` tiles behind), so every program
multiplies. With the static order (or a tiling with ``reducers`` > 0) a few ``reducers``
programs copy them instead, as they arrive.

Each rank sends (world - 1) / world of the partial and of the result, as a two-shot all-reduce
does, spread over the whole GEMM instead of after it. Waits are bounded (``sync.wait_flag``): a
program whose wait timed out writes NaN for the rest of its tiles (and still releases them), and
the error word names the op, this rank and the peer (a copy's timeout too, which makes that
program's later own tiles NaN on every rank, as an own tile's timeout does). Own tiles
wait only for the peers' earlier segments, which never wait. A copy of a peer's tile j waits
for that peer's own tile j, which a running program claimed or will claim: every program of
that peer that could be stuck is at an earlier position, a copy of a tile with a smaller index,
so a cycle of waits would need ever smaller indices; and no program waits while it holds an
unreleased tile (a copy releases it first). With the static tile assignment the argument needs
every compute program resident (as the exchange kernels need theirs). Parity
halves alternate between calls as in ``exchange.py``: a rank finishes call e only after every
owner pushed it the sums of e, so every peer has started e (and finished e - 1); a rank can
therefore be at most one call ahead, and call e + 2, the next to reuse e's half, cannot start on
any rank while a peer still reads or writes e's.

Per parity the workspace holds ``world`` slabs of the owned tiles (slab p: rank p's partials,
tile t at index t // world) and a result area indexed by tile, each tile a dense BM x BN block.

With ``SCATTER`` the same kernel is ``mm_reduce_scatter`` along rows: rank o owns the tiles of its
share of the rows (numbered o * per + slot), and an own tile's sum is this rank's output only:
no result area, no ``done`` flags, no reducers. With ``PULL`` too (``Options.pull``, a kernel
option no path selects) a peer's tile stays in the writer's own memory, in the owner's slab
there, released at once, and the owner loads it (``_pull_partials``); the reuse argument is the
same, as an owner's call e + 1 waits for every writer's partials of e + 1.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import tiles
from .launch import Bound
from .sync import (TRACE_SLOTS, FUSED_AR_OP, FUSED_RS_OP, iris, now, paired, peer_pointer, require_iris, trace_tile,
                   trace_time, wait_or_record, wait_other_ranks)
from .tiles import claim, mma_tile, scale_tile, tile_coords, tile_epilogue
from .sizes.fused_all_reduce import Options, data_elems, num_tiles, tile_flag_slots  # noqa: F401


#: Ablations of the kernel for a benchmark's breakdown of its time (``Options.ablate``; results
#: are wrong with any of them): pushes stored into this rank's own workspace instead of
#: the peer's (no NVLink data), no waits, reducers that copy nothing.
NO_REMOTE, NO_WAIT, NO_COPY = tl.constexpr(1), tl.constexpr(2), tl.constexpr(4)
ABLATIONS = {"no_remote": 1, "no_wait": 2, "no_copy": 4}


@triton.jit
def _schedule(i, rank, num_tiles, WORLD: tl.constexpr):
    """The tile at position ``i`` of this rank's order: the tiles of rank+1, rank+2, ... first
    (each in increasing order), its own last."""
    tile = i * 0
    start = i * 0
    for k in tl.static_range(WORLD):
        o = (rank + 1 + k) % WORLD
        size = (num_tiles - o + WORLD - 1) // WORLD
        tile = tl.where((i >= start) & (i < start + size), o + WORLD * (i - start), tile)
        start += size
    return tile


@triton.jit
def _tile_block(data, index, BM: tl.constexpr, BN: tl.constexpr):
    """Pointers to dense tile ``index`` of a workspace area."""
    return data + index.to(tl.int64) * (BM * BN) + tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]


@triton.jit
def _interleaved(q, rank, num_tiles, slab_tiles, lag, WORLD: tl.constexpr):
    """Ticket position ``q`` of the order with the copies inline (no reducers): (kind, where),
    kind 0 a multiplication at position ``where`` of ``_schedule``'s order, 1 the copy of the
    pushed sum of tile ``where``, 2 nothing (a peer with fewer tiles). The peers' tiles come
    first, as in ``_schedule``; then this rank's own tiles, the u-th followed, from u = ``lag``
    on, by the copy of each peer's (u - ``lag``)-th own tile, which that peer multiplied at
    about the time this rank multiplied its (u - ``lag``)-th: ``lag`` units later its sum has
    usually been pushed and released; then the copies left."""
    own = (num_tiles - rank + WORLD - 1) // WORLD
    first = num_tiles - own  # positions of the peers' tiles
    solo = tl.minimum(lag, own)  # own tiles with no copy after them
    paired = tl.maximum(own - lag, 0)  # own tiles followed by WORLD - 1 copies
    v = q - first
    w = v - solo
    unit = lag + w // WORLD
    sub = w % WORLD
    r = w - WORLD * paired  # the copies left, WORLD - 1 per tile index
    PEERS: tl.constexpr = WORLD - 1 if WORLD > 1 else 1
    peer = tl.where(r >= 0, rank + 1 + r % PEERS, rank + sub) % WORLD
    j = tl.where(r >= 0, paired + r // PEERS, unit - lag)
    copy_tile = peer + WORLD * j
    multiply = (q < first) | (v < solo) | ((r < 0) & (sub == 0))
    kind = tl.where(multiply, 0, tl.where(copy_tile < num_tiles, 1, 2))
    where = tl.where(q < first, q, tl.where(v < solo, first + v,
                                             tl.where(multiply, first + unit, copy_tile)))
    return kind, where


def inline_positions(count: int, world: int, rank: int, lag: int) -> int:
    """Ticket positions of the inline order (``_interleaved``) for ``count`` tiles."""
    own = (count - rank + world - 1) // world
    paired = max(own - lag, 0)
    return count - own + min(lag, own) + world * paired + (world - 1) * (tiles.cdiv(count, world) - paired)


@triton.jit
def _copy_pushed(data, out, tile, pid_m, pid_n, M, N, result_at, late, BM: tl.constexpr,
                 BN: tl.constexpr, SUB_M: tl.constexpr):
    """Copy the sum a peer pushed for one of its tiles into ``out``; NaN if its wait was late."""
    for sub in tl.static_range(BM // SUB_M):
        r = sub * SUB_M + tl.arange(0, SUB_M)
        c = tl.arange(0, BN)
        val = tl.load(data + (result_at + tile).to(tl.int64) * (BM * BN) + r[:, None] * BN + c[None, :])
        if late != 0:
            val = tl.full((SUB_M, BN), float("nan"), tl.float32).to(val.dtype)
        rows = pid_m * BM + r
        cols = pid_n * BN + c
        tl.store(out + rows[:, None].to(tl.int64) * N + cols[None, :], val,
                 mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _copy_position(tile, prev, late, data, out, flags, heap_bases, epoch, rank, err, timeout, M, N,
                   num_m, num_n, num_tiles, slab_tiles, result_at, OP: tl.constexpr,
                   WORLD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr,
                   SUB_M: tl.constexpr, SCATTER: tl.constexpr, ABLATE: tl.constexpr,
                   TMA_PUSH: tl.constexpr):
    """Inline copy: a peer's pushed sum of ``tile`` into ``out``. A sum not yet released is waited
    for only after this program released its own pending tile (``prev``), so no two programs wait
    on each other's unreleased flags. Returns (prev, late)."""
    owner = _owner(tile, slab_tiles, WORLD, SCATTER)
    pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
    if (late == 0) & (ABLATE & NO_WAIT == 0):
        flag = flags + num_tiles * WORLD + tile
        if paired(tl.atomic_add(flag, 0, sem="acquire", scope="sys"), epoch) == 0:
            if prev >= 0:
                _release(flags, prev, epoch, rank, heap_bases, num_tiles, slab_tiles, WORLD, SCATTER, TMA_PUSH)
                prev = prev * 0 - 1
            late = wait_or_record(flag, epoch, now(), timeout, err, OP, rank, owner)
        tl.debug_barrier()
    if ABLATE & NO_COPY == 0:
        _copy_pushed(data, out, tile, pid_m, pid_n, M, N, result_at, late, BM, BN, SUB_M)
    return prev, late


@triton.jit
def _place(i, rank, M, num_m, num_n, num_tiles, GROUP_M: tl.constexpr, WORLD: tl.constexpr,
           BM: tl.constexpr, SCATTER: tl.constexpr):
    """Where position ``i`` of this rank's order lies: (tile, first row, column block, end of the
    owner's rows). All-reduce: tile t belongs to rank t % world (``_owner``). Reduce-scatter:
    rank o owns the tiles of its share of the rows, numbered o * per + slot."""
    if SCATTER:
        share = M // WORLD
        share_m = tl.cdiv(share, BM)
        per = share_m * num_n
        owner = (rank + 1 + i // per) % WORLD
        local_m, pid_n = tile_coords(i % per, share_m, num_n, GROUP_M)
        return owner * per + i % per, owner * share + local_m * BM, pid_n, (owner + 1) * share
    else:
        tile = _schedule(i, rank, num_tiles, WORLD)
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        return tile, pid_m * BM, pid_n, M


@triton.jit
def _owner(tile, slab_tiles, WORLD: tl.constexpr, SCATTER: tl.constexpr):
    if SCATTER:
        return tile // slab_tiles
    else:
        return tile % WORLD


@triton.jit
def _slot(tile, slab_tiles, WORLD: tl.constexpr, SCATTER: tl.constexpr):
    """The tile's index in its owner's slabs."""
    if SCATTER:
        return tile % slab_tiles
    else:
        return tile // WORLD


@triton.jit
def _bulk_stores_done():
    """Wait until this thread's TMA stores (``TMA_PUSH``) have been written, then order them
    before its later generic accesses (the flag's release): a wait on every bulk group, not only
    on their shared-memory reads as Triton's own wait, and a proxy fence."""
    tl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tmov.u32 $0, 0;",
                              "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _push(data, index, val, rank, to, heap_bases, rows, BM: tl.constexpr, BN: tl.constexpr,
          TMA_PUSH: tl.constexpr):
    """Store dense tile ``index`` of a workspace area into rank ``to``'s copy of it: from the
    registers (each thread's stores held up until NVLink takes them), or with ``TMA_PUSH`` by
    the TMA unit from shared memory (the program goes on at once; ``_release`` waits for it)."""
    if TMA_PUSH:
        desc = tl.make_tensor_descriptor(peer_pointer(data, rank, to, heap_bases), shape=[rows, BN],
                                         strides=[BN, 1], block_shape=[BM, BN])
        desc.store([index * BM, 0], val)
    else:
        iris.store(_tile_block(data, index, BM, BN), val, rank, to, heap_bases, hint=(1, 16))


@triton.jit
def _release(flags, tile, epoch, rank, heap_bases, num_tiles, slab_tiles, WORLD: tl.constexpr,
             SCATTER: tl.constexpr, TMA_PUSH: tl.constexpr = False):
    """After a tile's stores: ``ready`` on its owner for a peer's tile; for an owned tile,
    ``done`` on every peer (all-reduce: the sum was pushed) or nothing (reduce-scatter: the sum
    goes nowhere else)."""
    if TMA_PUSH:
        _bulk_stores_done()
    owner = _owner(tile, slab_tiles, WORLD, SCATTER)
    if SCATTER:
        if owner != rank:
            tl.debug_barrier()  # every thread's stores before the release below
            iris.atomic_xchg(flags + tile * WORLD + rank, epoch, rank, owner, heap_bases,
                             sem="release", scope="sys")
    else:
        tl.debug_barrier()  # every thread's stores before the release below
        if owner == rank:
            for i in tl.static_range(1, WORLD):
                iris.atomic_xchg(flags + num_tiles * WORLD + tile, epoch, rank, (rank + i) % WORLD,
                                 heap_bases, sem="release", scope="sys")
        else:
            iris.atomic_xchg(flags + tile * WORLD + rank, epoch, rank, owner, heap_bases,
                             sem="release", scope="sys")


@triton.jit
def _peers_ready(flags, tile, epoch, rank, heap_bases, WORLD: tl.constexpr):
    """1 if every peer has released its partial of ``tile`` already (one poll each, no wait)."""
    ready = rank * 0 + 1
    for k in tl.static_range(1, WORLD):
        peer = (rank + k) % WORLD
        seen = iris.atomic_add(flags + tile * WORLD + peer, 0, rank, peer, heap_bases, sem="acquire",
                               scope="sys")
        ready = tl.where(paired(seen, epoch), ready, 0)  # another call's tag: the wait names it
    return ready


@triton.jit
def _pull_partials(flags, data, tile, slot, slab_tiles, epoch, rank, heap_bases, err, timeout, late,
                   OP: tl.constexpr, WORLD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   ABLATE: tl.constexpr):
    """``PULL``, an own tile: wait until every peer released its partial of ``tile`` in its own
    workspace, then load them (remote loads) and sum them in fp32. Each rank keeps its partials
    of owner o's tiles in slab o of its own workspace (its slab of its own tiles stays unused).
    Returns (sum, late)."""
    if (late == 0) & (ABLATE & NO_WAIT == 0):
        start = now()
        for k in tl.static_range(1, WORLD):
            peer = (rank + k) % WORLD
            if late == 0:
                late = wait_or_record(flags + tile * WORLD + peer, epoch, start, timeout, err, OP, rank,
                                      peer, heap_bases, True)
        tl.debug_barrier()  # every thread reads the partials after the acquires
    pulled = tl.zeros((BM, BN), tl.float32)
    for k in tl.static_range(1, WORLD):
        peer = (rank + k) % WORLD
        src = rank if ABLATE & NO_REMOTE else peer
        pulled += iris.load(_tile_block(data, rank * slab_tiles + slot, BM, BN), rank, src, heap_bases,
                            hint=(1, 16)).to(tl.float32)
    return pulled, late


@triton.jit
def _multiply_position(i, prev, late, a_desc, b_desc, bias, data, out, M, N, K, stride_bm,
                       stride_bn, flags, heap_bases, epoch, rank, err, timeout, num_m, num_n,
                       num_tiles, slab_tiles, result_at, OP: tl.constexpr, WORLD: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       GROUP_M: tl.constexpr, B_TRANSPOSED: tl.constexpr, HAS_BIAS: tl.constexpr,
                       SCATTER: tl.constexpr, ABLATE: tl.constexpr, PULL: tl.constexpr = False,
                       TMA_PUSH: tl.constexpr = False, scale_a=None, scale_b=None, SCALED: tl.constexpr = False,
                       ROWWISE: tl.constexpr = False, IMPRECISE: tl.constexpr = None):
    """Multiply the tile at position ``i`` of this rank's order, release ``prev`` (the previous
    tile's stores had this whole K loop to land), then push the partial to its owner or, for an
    own tile, add the pushed partials and write ``out`` (all-reduce: every row, and push the sum
    to the peers; reduce-scatter: this rank's share of the rows). ``PULL`` (reduce-scatter only):
    a peer's tile is stored in this rank's own memory and released at once; an own tile loads
    the peers' partials from theirs (``_pull_partials``): before its K loop if they are released
    already, else after it. ``TMA_PUSH``: pushes go through the TMA unit (``_push``). Returns
    (the tile to release after the next one, or -1; late)."""
    tile, off_m, pid_n, row_end = _place(i, rank, M, num_m, num_n, num_tiles, GROUP_M, WORLD, BM,
                                         SCATTER)
    owner = _owner(tile, slab_tiles, WORLD, SCATTER)
    slot = _slot(tile, slab_tiles, WORLD, SCATTER)
    if PULL:  # partials already released are loaded before the K loop, in flight while it runs
        pulled = tl.zeros((BM, BN), tl.float32)
        early = rank * 0
        if owner == rank:
            early = _peers_ready(flags, tile, epoch, rank, heap_bases, WORLD)
            if early != 0:
                pulled, late = _pull_partials(flags, data, tile, slot, slab_tiles, epoch, rank,
                                              heap_bases, err, timeout, late, OP, WORLD, BM, BN, ABLATE)
    acc = mma_tile(a_desc, b_desc, off_m, pid_n * BN, K, BM, BN, BK, B_TRANSPOSED, IMPRECISE)
    if SCALED:  # FP8: this rank's scales on its own partial, before any exchange
        acc = scale_tile(acc, scale_a, scale_b, off_m + tl.arange(0, BM), pid_n * BN + tl.arange(0, BN), M, N,
                         ROWWISE)
    rows, cols, mask, acc = tile_epilogue(acc, bias, off_m, pid_n * BN, row_end, N,
                                          stride_bm, stride_bn, BM, BN, HAS_BIAS)
    if prev >= 0:
        _release(flags, prev, epoch, rank, heap_bases, num_tiles, slab_tiles, WORLD, SCATTER, TMA_PUSH)
    later = tile
    if PULL:
        later = tile * 0 - 1  # a peer's tile was released below, with its local stores
    if owner == rank:
        if PULL:
            if early == 0:  # released during the K loop (or not yet): wait, then load
                pulled, late = _pull_partials(flags, data, tile, slot, slab_tiles, epoch, rank,
                                              heap_bases, err, timeout, late, OP, WORLD, BM, BN, ABLATE)
            acc += pulled
        else:
            if (late == 0) & (ABLATE & NO_WAIT == 0):
                late = wait_other_ranks(flags, tile, epoch, rank, err, timeout, OP, WORLD)
            for k in tl.static_range(1, WORLD):
                peer = (rank + k) % WORLD
                acc += tl.load(_tile_block(data, peer * slab_tiles + slot, BM, BN)).to(tl.float32)
        if late != 0:
            acc = tl.full((BM, BN), float("nan"), tl.float32)
        val = acc.to(out.dtype.element_ty)
        if SCATTER:  # ``out`` holds this rank's share only
            tl.store(out + (rows - rank * (M // WORLD))[:, None].to(tl.int64) * N + cols[None, :],
                     val, mask=mask)
        else:
            tl.store(out + rows[:, None].to(tl.int64) * N + cols[None, :], val, mask=mask)
            for k in tl.static_range(1, WORLD):
                to = rank if ABLATE & NO_REMOTE else (rank + k) % WORLD
                _push(data, result_at + tile, val, rank, to, heap_bases, (result_at + num_tiles) * BM,
                      BM, BN, TMA_PUSH)
    else:
        if PULL:  # into this rank's own memory, in the owner's slab there; the owner pulls it
            tl.store(_tile_block(data, owner * slab_tiles + slot, BM, BN), acc.to(out.dtype.element_ty))
            tl.debug_barrier()  # every thread's stores before the release below
            tl.atomic_xchg(flags + tile * WORLD + rank, epoch, sem="release", scope="sys")
        else:
            to = rank if ABLATE & NO_REMOTE else owner
            _push(data, rank * slab_tiles + slot, acc.to(out.dtype.element_ty), rank, to, heap_bases,
                  (result_at + num_tiles) * BM, BM, BN, TMA_PUSH)
    return later, late


@triton.jit
def _stagger(pid, programs, spread_ns):
    """Hold program ``pid`` until ``pid / programs`` of ``spread_ns`` after it began. Programs that
    start together finish their tiles together and push them at once, so the link idles during
    the next K loops and then throttles every push."""
    until = now() + (pid.to(tl.int64) * spread_ns) // programs
    while now() < until:
        pass


@triton.jit(do_not_specialize=["rank", "epoch", "ticket_base", "compute", "lag", "positions", "stagger"])
def gemm_all_reduce_kernel(a_desc, b_desc, bias, data, out, M, N, K, stride_bm, stride_bn,
                           flags, heap_bases, epoch, rank, err, timeout, ticket, ticket_base,
                           trace, compute, lag, positions, stagger, scale_a, scale_b, OP: tl.constexpr,
                           WORLD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                           GROUP_M: tl.constexpr, SUB_M: tl.constexpr, B_TRANSPOSED: tl.constexpr,
                           HAS_BIAS: tl.constexpr, TICKETS: tl.constexpr,
                           SCATTER: tl.constexpr = False, ABLATE: tl.constexpr = 0,
                           PULL: tl.constexpr = False, TRACE: tl.constexpr = False,
                           INLINE: tl.constexpr = False, TMA_PUSH: tl.constexpr = False,
                           STAGGER: tl.constexpr = False, SCALED: tl.constexpr = False,
                           ROWWISE: tl.constexpr = False, IMPRECISE: tl.constexpr = None):
    """The all-reduce (module docstring); with ``SCATTER`` the reduce-scatter along rows: the
    same order and pushes, each rank's share of the rows is what it owns, and nothing is pushed
    back (no result area, no reducers: launch ``compute`` programs only). ``INLINE`` (all-reduce,
    ticket order): no reducers either; the copies of the peers' pushed sums are positions of the
    ticket order (``_interleaved``, ``lag`` units behind), so every program multiplies.
    ``positions``: how many positions the ticket order has (``inline_positions``; the tile count
    without ``INLINE``), counted once on the host.
    ``TMA_PUSH`` (pushed forms): the pushes are TMA stores into the peers' memory.
    ``ABLATE``: bits of ``ABLATIONS``, for timing only (results are wrong); 0 in every real call.
    ``TRACE`` (ticket order only): GPU times into ``trace`` (``sync.TRACE_SLOTS`` per program:
    its start, its end, each multiplied position's start and end), for the benchmarks.
    ``STAGGER`` (ticket order only): program p starts its first tile p / ``compute`` of
    ``stagger`` ns late (``_stagger``, ``stagger_ns``). ``SCALED``: FP8 operands with
    ``_scaled_mm``'s scales (``tiles.scale_tile``; ``ROWWISE``, ``IMPRECISE`` as
    ``tiles.matmul_kernel``'s), applied to each tile before it is pushed or summed: the partials
    exchanged are the output dtype's."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    if SCATTER:
        num_tiles = WORLD * tl.cdiv(M // WORLD, BM) * num_n
    else:
        num_tiles = num_m * num_n
    slab_tiles = tl.cdiv(num_tiles, WORLD)
    result_at = WORLD * slab_tiles  # the result area follows the slabs
    late = pid * 0  # once a wait timed out, this program waits no more: the rest of its tiles are NaN
    trace_time(trace, 0, TRACE)
    if pid < compute:
        prev = pid * 0 - 1
        if TICKETS:  # positions claimed in order: no residency needed (docs/kernels.md, Residency)
            if STAGGER:
                _stagger(pid, compute, stagger)
            j = 0  # positions this program multiplied (the trace's index)
            q = claim(ticket, ticket_base)
            while q < positions:
                kind = q * 0
                i = q
                if INLINE:
                    kind, i = _interleaved(q, rank, num_tiles, slab_tiles, lag, WORLD)
                if kind == 0:
                    trace_tile(trace, j, i, 0, TRACE)
                    prev, late = _multiply_position(
                        i, prev, late, a_desc, b_desc, bias, data, out, M, N, K, stride_bm,
                        stride_bn, flags, heap_bases, epoch, rank, err, timeout, num_m, num_n,
                        num_tiles, slab_tiles, result_at, OP, WORLD, BM, BN, BK, GROUP_M,
                        B_TRANSPOSED, HAS_BIAS, SCATTER, ABLATE, PULL, TMA_PUSH, scale_a, scale_b, SCALED,
                        ROWWISE, IMPRECISE)
                    trace_tile(trace, j, i, 1, TRACE)
                    j += 1
                elif kind == 1:
                    prev, late = _copy_position(
                        i, prev, late, data, out, flags, heap_bases, epoch, rank, err, timeout, M,
                        N, num_m, num_n, num_tiles, slab_tiles, result_at, OP, WORLD, BM, BN,
                        GROUP_M, SUB_M, SCATTER, ABLATE, TMA_PUSH)
                q = claim(ticket, ticket_base)
        else:  # static: program p takes positions p, p + compute, ...
            for i in range(pid, num_tiles, compute):
                prev, late = _multiply_position(
                    i, prev, late, a_desc, b_desc, bias, data, out, M, N, K, stride_bm, stride_bn,
                    flags, heap_bases, epoch, rank, err, timeout, num_m, num_n, num_tiles,
                    slab_tiles, result_at, OP, WORLD, BM, BN, BK, GROUP_M, B_TRANSPOSED, HAS_BIAS,
                    SCATTER, ABLATE, PULL, TMA_PUSH, scale_a, scale_b, SCALED, ROWWISE, IMPRECISE)
        if prev >= 0:
            _release(flags, prev, epoch, rank, heap_bases, num_tiles, slab_tiles, WORLD, SCATTER, TMA_PUSH)
    else:
        reducers = tl.num_programs(0) - compute
        # the peers' tiles in the order their sums arrive: j-th tile of every peer, then the next
        for u in range(pid - compute, (WORLD - 1) * slab_tiles, reducers):
            owner = (rank + 1 + u % (WORLD - 1)) % WORLD
            tile = owner + WORLD * (u // (WORLD - 1))
            if tile < num_tiles:  # a reducer holds no tile of its own (prev -1)
                _, late = _copy_position(
                    tile, pid * 0 - 1, late, data, out, flags, heap_bases, epoch, rank, err, timeout,
                    M, N, num_m, num_n, num_tiles, slab_tiles, result_at, OP, WORLD, BM, BN, GROUP_M,
                    SUB_M, SCATTER, ABLATE, TMA_PUSH)
    trace_time(trace, 1, TRACE)


#: Reducers of a tiling without any (``reducers`` 0: inline copies) when the tile order is static.
STATIC_REDUCERS = 16


def copy_lag(waves: float, compute: int) -> int:
    """Own tiles (``_interleaved``'s units) the inline copies trail this rank's own tiles by:
    ``waves`` times ``compute``. A peer's own tile is released after that program's next tile,
    about two waves of ``compute`` tiles after it began, so at least 2 waves are needed."""
    return int(round(waves * compute))


#: (config, dtype, world, weight layout, bias, device, tickets, scatter, ablate, pull, traced,
#: TMA pushes) -> programs per SM
_resident: dict[tuple, int] = {}


#: The fused kernel's arguments that change from call to call (``launch.Bound``).
_PER_CALL = ("a_desc", "b_desc", "bias", "data", "out", "stride_bm", "stride_bn", "epoch", "ticket_base",
             "trace", "scale_a", "scale_b")


class _Plan(NamedTuple):
    """What a fused call's launch depends on beyond its operands' addresses, kept per workspace
    (``Workspace.launches``): worked out once per shape, layout and setting, not per call. The
    grid, constants, programs and positions are the kept launch's (``bound.fixed``)."""
    bound: Bound
    elems: int  # data elements per parity
    #: what the launch runs beyond the plain kernel: ``pull`` (the owners pull the partials),
    #: ``inline`` (no reducers: the copies inline), ``tma`` (pushes through the TMA unit)
    variants: tuple[str, ...]


def _plan(ws, m: int, k: int, n: int, dtype: torch.dtype, a_desc, b_desc, b_t: bool, full_bias, sbm: int,
          sbn: int, out: torch.Tensor, cfg: tiles.TileConfig, scatter: bool, opts: "Options", traced: bool,
          device: torch.device, fp8: tuple | None = None) -> _Plan:
    """``dtype``: the partials' (the output's); ``fp8``: ``(rowwise, imprecise)`` of an FP8 call."""
    if tile_flag_slots(m, n, ws.world, cfg, scatter) > ws.tile_flags.numel():
        raise RuntimeError("commfuse: too many tiles for the workspace's tile flags")
    if scatter and m % ws.world:
        raise RuntimeError(f"commfuse: {m} rows do not split into {ws.world} shares")
    elems = data_elems(m, n, ws.world, cfg, scatter)
    fixed = dict(M=m, N=n, K=k, flags=ws.tile_flags, heap_bases=ws.heap_bases, rank=ws.rank,
                 err=ws.err, timeout=ws.timeout_ns, ticket=ws.ticket)
    inline = not scatter and cfg.reducers == 0 and opts.tickets
    count = num_tiles(m, n, ws.world, cfg, scatter)
    # the staggered start is compiled in where any spread is asked for; its value is set below
    staggered = opts.tickets and max(opts.stagger_ns) > 0
    consts = dict(OP=FUSED_RS_OP if scatter else FUSED_AR_OP, WORLD=ws.world, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk,
                  GROUP_M=cfg.group_m, SUB_M=max(1, min(cfg.bm, 16384 // cfg.bn)), B_TRANSPOSED=b_t,
                  HAS_BIAS=full_bias is not None, TICKETS=opts.tickets, SCATTER=scatter, ABLATE=opts.ablate,
                  PULL=opts.pull and scatter, TRACE=traced, INLINE=inline,
                  TMA_PUSH=opts.tma_push and not (opts.pull and scatter), STAGGER=staggered,
                  SCALED=fp8 is not None, ROWWISE=fp8 is not None and fp8[0],
                  IMPRECISE=fp8[1] if fp8 is not None else None, num_warps=cfg.warps, num_stages=cfg.stages)
    key = (cfg, dtype, ws.world, b_t, full_bias is not None, device.index, consts["TICKETS"], scatter,
           opts.ablate, consts["PULL"], traced, consts["TMA_PUSH"], consts["STAGGER"], fp8)
    if key not in _resident:  # compiled, not launched: how many programs fit on an SM
        compiled = gemm_all_reduce_kernel.warmup(
            a_desc=a_desc, b_desc=b_desc, bias=full_bias if full_bias is not None else out,
            data=ws.data(0, (elems,), dtype), out=out, stride_bm=sbm, stride_bn=sbn, epoch=0,
            ticket_base=0, trace=ws.ticket, compute=1, lag=0, positions=1, stagger=0, scale_a=ws.err,
            scale_b=ws.err, grid=(1,), **fixed, **consts)
        compiled._init_handles()
        _resident[key] = tiles.resident_programs(compiled, device)
    per_sm = min(cfg.per_sm, _resident[key])
    if per_sm < 1:
        raise RuntimeError(f"commfuse: the fused kernel with {cfg} does not fit on an SM")
    programs = per_sm * ws.max_programs
    if scatter or inline:  # nothing pushed back, or copied by the multiplying programs
        compute, reducers = max(1, min(count, programs)), 0
    else:
        wanted = cfg.reducers or STATIC_REDUCERS  # the static order cannot copy inline
        compute = max(1, min(count, programs - wanted))
        reducers = max(1, min(wanted, programs - compute))
    # any lag past this rank's own tiles gives the same order (all copies after them); the
    # clamp keeps the kernel argument a 32-bit integer
    lag = min(copy_lag(opts.copy_lag_waves, compute), count) if inline else 0
    positions = inline_positions(count, ws.world, ws.rank, lag) if inline else count
    spread = (opts.stagger_ns[0] if count > compute else opts.stagger_ns[1]) if staggered else 0
    bound = Bound(gemm_all_reduce_kernel, (compute + reducers,), _PER_CALL, compute=compute, lag=lag,
                  positions=positions, stagger=spread, **fixed, **consts)
    variants = tuple(word for word, on in (("pull", consts["PULL"]), ("inline", inline), ("tma", consts["TMA_PUSH"]))
                     if on)
    return _Plan(bound, elems, variants)


def prepare(ws, a: torch.Tensor, b: torch.Tensor, bias, out: torch.Tensor, cfg: tiles.TileConfig,
            scatter: bool = False, opts: Options = Options(), trace: torch.Tensor | None = None,
            scales: tuple | None = None, use_fast_accum: bool = True):
    """What of a call can fail on one rank alone (operand copies, descriptors, the first compile
    of a configuration), done before the call's epoch begins; returns ``launch(epoch, parity)``,
    which writes ``out = sum over the group of (a @ b + bias)`` through ``ws`` (``data_elems`` per
    parity); with ``scatter``, this rank's share of its rows (``out`` is [M / world, N], M a
    multiple of the world size). The launch itself still encodes the TMA descriptors and
    compiles a new specialisation of a known configuration. ``trace``: an int64 tensor of at
    least ``TRACE_SLOTS`` per program, filled with GPU times (benchmarks only; the ticket order;
    -1 where a program left slots unused). What depends only on the shapes, layouts and options
    is worked out once per workspace (``_plan``): a model step waits for this host work.
    ``scales``: ``(scale_a, scale_b)`` of FP8 operands (``_scaled_mm``'s: one float32 each, or
    ``[M, 1]`` and ``[1, N]``), with ``use_fast_accum``; ``out``'s dtype is the partials'."""
    require_iris()
    m, k = a.shape
    n = b.shape[1]
    a_desc, b_desc, b_t = tiles.descriptor_operands(a, b, cfg)
    full_bias, sbm, sbn = tiles.bias_strides(bias, m, n)
    traced = trace is not None
    dtype = out.dtype
    scale_a, scale_b, fp8 = tiles.fp8_scales(scales, m, n, use_fast_accum, cfg.bk, ws.err)
    # every option the plan reads is in its key, so a changed one makes a new plan
    key = ("fused_all_reduce", m, k, n, a.dtype, dtype, b_t, bias is not None, cfg, scatter, opts, traced, fp8,
           ws.err.data_ptr(), ws.timeout_ns)
    plan = ws.kept(key, lambda: _plan(ws, m, k, n, dtype, a_desc, b_desc, b_t, full_bias, sbm, sbn, out, cfg,
                                      scatter, opts, traced, a.device, fp8))
    consts = plan.bound.fixed
    if consts["TMA_PUSH"]:  # device-made descriptors need an allocator, which Triton keeps per thread
        tiles.ensure_allocator()
    if traced and trace.numel() < plan.bound.grid[0] * TRACE_SLOTS:
        raise ValueError(f"commfuse: the trace needs {plan.bound.grid[0] * TRACE_SLOTS} slots")

    def launch(epoch: int, parity: int) -> None:
        base = ws.ticket_base
        if traced:
            trace.fill_(-1)
        plan.bound(a_desc=a_desc, b_desc=b_desc, bias=full_bias if full_bias is not None else out,
                   data=ws.data(parity, (plan.elems,), dtype), out=out, stride_bm=sbm, stride_bn=sbn,
                   epoch=epoch, ticket_base=base, trace=trace if traced else ws.ticket, scale_a=scale_a,
                   scale_b=scale_b)
        if consts["TICKETS"]:  # every position claimed once, plus one failed claim per program
            ws.ticket_base = base + consts["positions"] + consts["compute"]

    launch.variants = plan.variants  # (what ran: the caller may count it)
    return launch
