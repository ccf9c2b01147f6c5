"""Triton exchange kernels over a symmetric workspace: all-reduce (one-shot, two-shot) of a partial
that a GEMM already wrote into symmetric memory, the graph lane's staged one-shot of a local
tensor, the pull of peers' shards for an all-gather, a reduce-scatter, and a bare barrier.

Peers' memory is read with ``iris.load`` against the workspace's heap-bases table. Every kernel
starts with the epoch signal/wait of ``sync.py``, except the staged one-shot, which first copies
its blocks of the local tensor into this rank's half of the lane (its signal then tells the peers
those blocks are there to read).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tiles
from .codes import flag_value
from .launch import Bound, run as run_kernel
from .sync import TAG_SHIFT, iris, require_iris, signal_peers, wait_peers

#: Elements per program per step, programs per grid (capped at one per SM), warps per program.
#: Epochs and flag slots change every call, so no kernel specialises on them: Triton would compile
#: and load a new variant (stalling the host) each time one became divisible by 16. No kernel of
#: commfuse specialises on the rank either: every rank runs one binary, so ranks emulated on one GPU
#: (``tests/gpu/test_gpu_one_device.py``) never load a kernel while another rank's spins (a
#: module load may wait for the running kernels: a deadlock until the wait's timeout).
BLOCK, MAX_PROGRAMS, NUM_WARPS = 8192, 132, 16


def _programs(ws, n: int, block: int, max_programs: int) -> int:
    """At most one program per SM of the group's smallest GPU, so all are resident and spin
    safely, and every rank launches the same grid (program p waits for program p of each peer)."""
    return max(1, min(tiles.cdiv(n, block), max_programs, ws.max_programs))


@triton.jit
def peer_load(ptr, rank, peer, heap_bases, mask, VEC: tl.constexpr):
    """A peer's elements. ``VEC``: 1 if ``ptr`` is a 1-D block of 16-byte aligned runs, 2 if each
    row of a 2-D block is, so the loads vectorise to 16 bytes; 0 for no such promise. (Triton 3.6
    rejects a hint tuple passed in as a constexpr, hence literals here.)"""
    if VEC == 2:
        return iris.load(ptr, rank, peer, heap_bases, mask=mask, hint=(1, 16))
    elif VEC == 1:
        return iris.load(ptr, rank, peer, heap_bases, mask=mask, hint=16)
    else:
        return iris.load(ptr, rank, peer, heap_bases, mask=mask)


@triton.jit
def sum_over_peers(ptr, mask, rank, heap_bases, WORLD: tl.constexpr, VEC: tl.constexpr):
    """Sum in rank order 0..WORLD-1 on every rank, so every rank rounds the same way."""
    acc = tl.zeros(ptr.shape, tl.float32)
    for peer in tl.static_range(WORLD):
        acc += peer_load(ptr, rank, peer, heap_bases, mask, VEC).to(tl.float32)
    return acc


@triton.jit
def poison(out, start, n, step, BLOCK: tl.constexpr):
    """NaN into this program's blocks of ``out``: a call whose peer never came must not look valid."""
    for s in range(start, n, step):
        offs = s + tl.arange(0, BLOCK)
        tl.store(out + offs, tl.full((BLOCK,), float("nan"), tl.float32).to(out.dtype.element_ty),
                 mask=offs < n)


@triton.jit
def sum_or_poison(src, out, n, start, step, late, rank, heap_bases, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                  VEC: tl.constexpr):
    """This program's blocks of ``out`` (from ``start``, every ``step``): every rank's ``src``
    summed in rank order, or NaN if a peer came ``late``."""
    if late != 0:
        poison(out, start, n, step, BLOCK)
    else:
        for s in range(start, n, step):
            offs = s + tl.arange(0, BLOCK)
            mask = offs < n
            acc = sum_over_peers(src + offs, mask, rank, heap_bases, WORLD, VEC)
            tl.store(out + offs, acc.to(out.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["rank", "slot_base", "epoch"])
def one_shot_kernel(partial, out, n, slot_base, flags, heap_bases, epoch, rank, err, timeout, epoch_at,
                    OP: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr = 1,
                    DEVICE_EPOCH: tl.constexpr = False):
    """Every rank reads every peer's whole partial and sums: one hop, world x the reads. ``VEC``
    (``peer_load``): 0 where ``partial`` is not 16-byte aligned (a chunk of a larger partial).
    ``DEVICE_EPOCH``: the epoch is ``*epoch_at`` (a cell the host fills before a CUDA-graph replay,
    ``ce_graphs.py``), not the ``epoch`` argument. A late peer leaves NaN in this program's blocks
    of ``out``, never a sum with whatever that peer's half held."""
    if DEVICE_EPOCH:
        epoch = tl.load(epoch_at)
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    signal_peers(flags, slot_base + pid, epoch, rank, heap_bases, WORLD)
    late = wait_peers(flags, slot_base + pid, epoch, rank, err, timeout, OP, WORLD)
    sum_or_poison(partial, out, n, pid * BLOCK, step, late, rank, heap_bases, WORLD, BLOCK, VEC)


@triton.jit(do_not_specialize=["rank", "epoch"])
def staged_one_shot_kernel(src, out, data, n, half_elems, flags, counter, heap_bases, epoch, rank, err,
                           timeout, OP: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                           SLOTS: tl.constexpr):
    """One-shot all-reduce of a local ``src`` through the graph lane, with the epoch on the device:
    program p reads the call count from ``counter[p]`` (``epoch`` holds only the call's tag,
    ``codes.flag_value(0, tag)``), stages its blocks of ``src`` into this rank's data half of the
    count's parity, signals, sums every rank's half, and stores the new count into every counter
    slot it owns (p, p + grid, ...), so all slots agree whatever the next call's grid is.
    No host state changes between calls: a CUDA graph can replay the launch. A late peer leaves NaN
    in ``out`` (and the error word set), since no host code runs between replays to raise."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    step = nprog * BLOCK
    count = tl.load(counter + pid) + 1
    epoch = (count << TAG_SHIFT) | epoch
    half = data + (count % 2) * half_elems
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(half + offs, tl.load(src + offs, mask=mask), mask=mask)
    signal_peers(flags, pid, epoch, rank, heap_bases, WORLD)
    late = wait_peers(flags, pid, epoch, rank, err, timeout, OP, WORLD)
    sum_or_poison(half, out, n, pid * BLOCK, step, late, rank, heap_bases, WORLD, BLOCK, 1)
    for slot in range(pid, SLOTS, nprog):
        tl.store(counter + slot, count)


@triton.jit(do_not_specialize=["rank", "epoch"])
def two_shot_kernel(partial, out, n, share, flags, heap_bases, epoch, rank, err, timeout,
                    OP: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """Reduce-scatter (each rank sums its share, in place), then all-gather the reduced shares.

    Program p handles the same blocks of every share in both phases, so it only waits for program
    p of each peer. A late peer in the first phase leaves NaN in this rank's share (of ``out`` and
    of the partial its peers gather), one in either phase NaN in this program's blocks of the
    peers' shares of ``out``.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    step = nprog * BLOCK
    signal_peers(flags, pid, epoch, rank, heap_bases, WORLD)
    late = wait_peers(flags, pid, epoch, rank, err, timeout, OP, WORLD)
    lo = rank * share
    hi = tl.minimum(lo + share, n)
    for start in range(lo + pid * BLOCK, hi, step):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < hi
        val = sum_over_peers(partial + offs, mask, rank, heap_bases, WORLD, 1)
        if late != 0:
            val = tl.full((BLOCK,), float("nan"), tl.float32)
        val = val.to(out.dtype.element_ty)
        tl.store(partial + offs, val, mask=mask)  # my share of my partial: only I read or write it
        tl.store(out + offs, val, mask=mask)
    signal_peers(flags, nprog + pid, epoch, rank, heap_bases, WORLD)
    late2 = wait_peers(flags, nprog + pid, epoch, rank, err, timeout, OP, WORLD)
    for i in tl.static_range(1, WORLD):
        peer = (rank + i) % WORLD
        plo = peer * share
        phi = tl.minimum(plo + share, n)
        if (late | late2) != 0:
            poison(out, plo + pid * BLOCK, phi, step, BLOCK)
        else:
            for start in range(plo + pid * BLOCK, phi, step):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < phi
                tl.store(out + offs, peer_load(partial + offs, rank, peer, heap_bases, mask, 1), mask=mask)


@triton.jit(do_not_specialize=["rank", "epoch"])
def pull_gather_kernel(shard, out, outer, inner, flags, heap_bases, epoch, rank, err, timeout,
                       OP: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                       VEC: tl.constexpr):
    """Copy every rank's shard (``outer`` rows of ``inner`` elements) into ``out``, rank r's row o
    at ``out[o, r]`` of an ``[outer, WORLD, inner]`` view: a gather along any leading dimension.
    ``VEC``: 1 when rows start on 16-byte boundaries, so peer loads may be vectorised. A late peer
    leaves NaN in this program's blocks of the peers' rows (its own rows are copied as usual); in
    a gather of bytes, bytes of all ones, which read as NaN in FP8 and in float32 alike."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    signal_peers(flags, pid, epoch, rank, heap_bases, WORLD)
    late = wait_peers(flags, pid, epoch, rank, err, timeout, OP, WORLD)
    per_row = tl.cdiv(inner, BLOCK)
    for i in tl.static_range(WORLD):
        peer = (rank + i) % WORLD
        for blk in range(pid, outer * per_row, nprog):
            row = blk // per_row
            offs = (blk % per_row) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < inner
            val = peer_load(shard + row.to(tl.int64) * inner + offs, rank, peer, heap_bases, mask, VEC)
            if i != 0:  # a peer's rows (i is a compile-time index)
                if late != 0:
                    if val.dtype == tl.uint8:  # bytes (FP8 rows with their float32 scales): all ones,
                        val = tl.full((BLOCK,), 255, tl.uint8)  # a NaN in FP8 and in float32
                    else:
                        val = tl.full((BLOCK,), float("nan"), tl.float32).to(val.dtype)
            dst = out + (row.to(tl.int64) * WORLD + peer) * inner + offs
            tl.store(dst, val, mask=mask)


@triton.jit(do_not_specialize=["rank", "epoch"])
def reduce_scatter_kernel(partial, out, outer, inner, flags, heap_bases, epoch, rank, err, timeout,
                          OP: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                          VEC: tl.constexpr):
    """``out[o] = sum over peers of partial[o, rank]`` for ``partial`` viewed ``[outer, WORLD,
    inner]``: this rank's share of a sum scattered along any leading dimension. A late peer leaves
    NaN in this program's blocks of ``out``."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    signal_peers(flags, pid, epoch, rank, heap_bases, WORLD)
    late = wait_peers(flags, pid, epoch, rank, err, timeout, OP, WORLD)
    per_row = tl.cdiv(inner, BLOCK)
    for blk in range(pid, outer * per_row, nprog):
        row = blk // per_row
        offs = (blk % per_row) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < inner
        src = partial + (row.to(tl.int64) * WORLD + rank) * inner + offs
        acc = sum_over_peers(src, mask, rank, heap_bases, WORLD, VEC)
        if late != 0:
            acc = tl.full((BLOCK,), float("nan"), tl.float32)
        tl.store(out + row.to(tl.int64) * inner + offs, acc.to(out.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["rank", "slot", "epoch"])
def barrier_kernel(slot, flags, heap_bases, epoch, rank, err, timeout, epoch_at, OP: tl.constexpr,
                   WORLD: tl.constexpr, DEVICE_EPOCH: tl.constexpr = False):
    """Signal and wait only: orders a rank's earlier writes before its peers' later reads.
    ``DEVICE_EPOCH``: the epoch is ``*epoch_at``, as in ``one_shot_kernel``."""
    if DEVICE_EPOCH:
        epoch = tl.load(epoch_at)
    signal_peers(flags, slot, epoch, rank, heap_bases, WORLD)
    wait_peers(flags, slot, epoch, rank, err, timeout, OP, WORLD)


def _launch_rowwise(kernel, source: str, ws, src: torch.Tensor, out: torch.Tensor, outer: int, inner: int,
                    epoch: int, op_code: int, block: int, max_programs: int, num_warps: int) -> None:
    """Launch a kernel that walks ``outer`` rows of ``inner`` elements (gather, reduce-scatter),
    kept per workspace and launch shape as the one-shot's: a call puts its tensors, sizes and
    epoch into the kept launch. ``source``: the kernel's name for ``src``."""
    require_iris()
    grid = (_programs(ws, outer * inner, block, max_programs),)
    vec = int((inner * src.element_size()) % 16 == 0 and src.data_ptr() % 16 == 0)
    bound = ws.kept((kernel, grid, op_code, block, vec, num_warps, ws.err.data_ptr(), ws.timeout_ns),
                    lambda: Bound(kernel, grid, (source, "out", "outer", "inner", "epoch"), flags=ws.flags,
                                  heap_bases=ws.heap_bases, rank=ws.rank, err=ws.err, timeout=ws.timeout_ns,
                                  OP=op_code, WORLD=ws.world, BLOCK=block, VEC=vec, num_warps=num_warps))
    bound(**{source: src}, out=out, outer=outer, inner=inner, epoch=epoch)


def reduce_scatter(ws, partial: torch.Tensor, out: torch.Tensor, outer: int, inner: int, epoch: int,
                   op_code: int, block: int = BLOCK, max_programs: int = MAX_PROGRAMS,
                   num_warps: int = NUM_WARPS) -> None:
    """This rank's share of the sum of ``partial`` (viewed ``[outer, world, inner]``) into ``out``."""
    _launch_rowwise(reduce_scatter_kernel, "partial", ws, partial, out, outer, inner, epoch, op_code, block,
                    max_programs, num_warps)


def barrier(ws, epoch: int | None, op_code: int, slot: int = 0) -> None:
    """Launch ``barrier_kernel`` on the current stream. The copy-engine overlaps launch one per
    chunk, so the launch is kept per workspace, op, error word and timeout (``launch.Bound``):
    only the epoch and slot change between them. ``epoch`` None: the kernel reads it from the
    workspace's epoch cell (``Workspace.epoch_cell``), so a CUDA graph may replay the launch."""
    if slot >= ws.flags.numel() // ws.world:
        raise RuntimeError(f"commfuse: flag slot {slot} is past the workspace's flag area")
    fixed = _common(ws, 0)
    del fixed["epoch"]
    device = epoch is None
    bound = ws.kept(("barrier", op_code, fixed["err"], fixed["timeout"], device), lambda: Bound(
        barrier_kernel, (1,), ("slot", "epoch"), **fixed, epoch_at=_epoch_at(ws, device), OP=op_code,
        WORLD=ws.world, DEVICE_EPOCH=device, num_warps=1))
    bound(slot=slot, epoch=0 if device else epoch)


def _epoch_at(ws, device: bool) -> torch.Tensor:
    """The epoch cell a ``DEVICE_EPOCH`` kernel reads, else any int32 pointer (never read)."""
    return ws.epoch_cell if device else ws.flags


def _common(ws, epoch):
    require_iris()
    return dict(flags=ws.flags, heap_bases=ws.heap_bases, epoch=epoch, rank=ws.rank,
                err=ws.err, timeout=ws.timeout_ns)


def all_reduce(ws, partial: torch.Tensor, out: torch.Tensor, epoch: int | None, algo: str, op_code: int,
               block: int = BLOCK, max_programs: int = MAX_PROGRAMS, num_warps: int = NUM_WARPS,
               slot_base: int = 0) -> None:
    """Sum ``partial`` (in ``ws``, same offset on every rank) over the group into ``out``.

    ``slot_base`` offsets the flag slots (one-shot only), for several kernels in one epoch.
    ``epoch`` None (one-shot only): read from the workspace's epoch cell, as ``barrier``.
    """
    n = partial.numel()
    device = epoch is None
    if device and algo != "one_shot":
        raise ValueError(f"commfuse: only the one-shot all-reduce reads its epoch on the device, not {algo!r}")
    if algo == "one_shot":
        grid = (_programs(ws, n, block, max_programs),)
        if (slot_base + grid[0]) * ws.world > ws.flags.numel():
            raise RuntimeError("commfuse: not enough flag slots for this launch")
        vec = int(partial.data_ptr() % 16 == 0)
        # kept per workspace and launch shape: later calls put only what changes into the launch
        fixed = _common(ws, 0)
        del fixed["epoch"]
        bound = ws.kept(("one_shot", grid, op_code, block, vec, device, num_warps, ws.err.data_ptr(), ws.timeout_ns),
                        lambda: Bound(one_shot_kernel, grid, ("partial", "out", "n", "slot_base", "epoch"), **fixed,
                                      epoch_at=_epoch_at(ws, device), OP=op_code, WORLD=ws.world, BLOCK=block,
                                      VEC=vec, DEVICE_EPOCH=device, num_warps=num_warps))
        bound(partial=partial, out=out, n=n, slot_base=slot_base, epoch=0 if device else epoch)
    elif algo == "two_shot":
        share = tiles.cdiv(tiles.cdiv(n, ws.world), block) * block
        # two phases, one flag slot per program per rank each
        grid = (_programs(ws, share, block, min(max_programs, ws.flags.numel() // (2 * ws.world))),)
        fixed = _common(ws, 0)
        del fixed["epoch"]
        bound = ws.kept(("two_shot", grid, op_code, block, num_warps, ws.err.data_ptr(), ws.timeout_ns),
                        lambda: Bound(two_shot_kernel, grid, ("partial", "out", "n", "share", "epoch"), **fixed,
                                      OP=op_code, WORLD=ws.world, BLOCK=block, num_warps=num_warps))
        bound(partial=partial, out=out, n=n, share=share, epoch=epoch)
    else:
        raise ValueError(f"commfuse: unknown all-reduce algorithm {algo!r}")


def staged_all_reduce(lane, src: torch.Tensor, out: torch.Tensor, op_code: int, tag: int = 0,
                      block: int = BLOCK, num_warps: int = NUM_WARPS) -> None:
    """Sum the local contiguous ``src`` over the group into ``out`` through the graph lane: safe to
    capture in a CUDA graph (the lane must exist before the capture; ``src`` fits one half).
    ``tag``: the call's pairing tag (``codes.py``), fixed in a captured launch."""
    require_iris()
    n = src.numel()
    # one flag slot per program per rank: at large world sizes the flag area bounds the grid
    grid = (_programs(lane, n, block, lane.flags.numel() // lane.world),)
    run_kernel(staged_one_shot_kernel, grid, src, out, lane.data(src.dtype), n, lane.half_elems(src.dtype),
               lane.flags, lane.counter, lane.heap_bases, flag_value(0, tag), lane.rank, lane.err, lane.timeout_ns,
               OP=op_code, WORLD=lane.world, BLOCK=block, SLOTS=lane.counter.numel(), num_warps=num_warps)


def gather(ws, shard: torch.Tensor, out: torch.Tensor, outer: int, inner: int, epoch: int,
           op_code: int, block: int = BLOCK, max_programs: int = MAX_PROGRAMS,
           num_warps: int = NUM_WARPS) -> None:
    """Every rank's ``shard`` (``outer`` rows of ``inner``) into ``out`` viewed ``[outer, world, inner]``."""
    _launch_rowwise(pull_gather_kernel, "shard", ws, shard, out, outer, inner, epoch, op_code, block,
                    max_programs, num_warps)
