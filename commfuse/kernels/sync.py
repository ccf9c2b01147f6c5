"""Cross-GPU signalling shared by every kernel: epoch flags with system-scope release/acquire, and
bounded waits that record who did not arrive instead of hanging.

A flag slot holds the epoch its writer last reached: ``(count << TAG_BITS) | tag`` (``codes.py``),
the call's number and what the call is. Counts only grow, so a wait is for the flag's count to
reach the call's (``reached``) and no flag is reset between calls (only when the workspace
restarts its epochs near their limit, collectively). A wait that passes ``timeout_ns`` writes ``[ERR_TIMEOUT, op, rank, peer, count]``
into a pinned host word (the workspace's ``err``, ``runtime/errors.py`` reads it) and lets the
kernel finish; the run-time raises on its next check. A wait that finds its peer at the same count
with another nonzero tag writes ``ERR_MISMATCH`` and both tags the same way, without reading the
peer's data. Grids are at most as many programs as fit
on the GPU at once (one per SM, or what the fused kernel's compiled size allows), so all programs
are resident and spinning cannot starve a signaller, unless other work holds SMs while they spin
(docs/kernels.md, Residency).
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

try:
    import iris
    # iris's own translation of a symmetric address into a peer's (what iris.store does), for
    # stores iris has no primitive for: TMA stores through a descriptor made on the device
    from iris.mem.triton.context import __translate as peer_pointer
except Exception as exc:  # pragma: no cover - import failure is reported when a kernel is used
    iris = peer_pointer = None
    _IRIS_ERROR = exc

from .codes import (ERR_MISMATCH, ERR_TIMEOUT, FUSED_AG_OP, FUSED_AR_OP, FUSED_RS_OP, FUSED_SPLIT_K_OP,  # noqa: F401
                    GRAPH_LANE_OP, OP_ALL_GATHER_MM, OP_MM_ALL_REDUCE, OP_MM_REDUCE_SCATTER, OPS, TAG_BITS)

#: ``codes.py``'s flag layout and error kinds as constants the kernels compile in.
TAG_SHIFT = tl.constexpr(TAG_BITS)
TAG_FIELD = tl.constexpr((1 << TAG_BITS) - 1)
KIND_TIMEOUT, KIND_MISMATCH = tl.constexpr(ERR_TIMEOUT), tl.constexpr(ERR_MISMATCH)


@triton.jit
def signal_peers(flags, slot, epoch, rank, heap_bases, WORLD: tl.constexpr):
    """Tell every rank (self included) that this rank's program reached ``epoch`` at ``slot``."""
    tl.debug_barrier()  # every thread's earlier stores happen before the release below
    for peer in tl.static_range(WORLD):
        iris.atomic_xchg(flags + slot * WORLD + rank, epoch, rank, peer, heap_bases,
                         sem="release", scope="sys")


@triton.jit
def now():
    """The GPU's nanosecond timer, the same value in every thread of the program. Each thread
    reads ``%globaltimer`` on its own; a wait that compared per-thread readings could let some
    warps leave its loop an iteration before others, which then wait at a barrier (inside the
    scalar atomic) that the early ones no longer reach. The minimum over a block that spans
    every warp (up to 1024 threads) goes through shared memory and reaches all threads alike."""
    t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [tl.arange(0, 1024)],
                                  dtype=tl.int64, is_pure=False, pack=1)
    return tl.min(t, axis=0)


#: Slots per program of a kernel trace (benchmarks: ``prepare(trace=...)`` of the fused kernels):
#: its start, a second time (the all-gather: its pushes' end; the all-reduce: its end), then
#: (position, a time, its end) for each of its first ``TRACE_TILES`` positions (the middle time:
#: the all-gather's wait end, the all-reduce's start of the position).
TRACE_TILES = 8
TRACE_SLOTS = 2 + 3 * TRACE_TILES
_TILES, _SLOTS = tl.constexpr(TRACE_TILES), tl.constexpr(TRACE_SLOTS)  # the same, for kernels


@triton.jit
def trace_time(trace, slot, TRACE: tl.constexpr):
    """With ``TRACE``, the GPU time into this program's ``slot`` of the trace."""
    if TRACE:
        tl.store(trace + tl.program_id(0) * _SLOTS + slot, now())


@triton.jit
def trace_tile(trace, j, i, part, TRACE: tl.constexpr):
    """With ``TRACE``: ``part`` 0 records position ``i`` and the time as the program's ``j``-th
    tile's middle time, ``part`` 1 the time as its end (the first ``TRACE_TILES`` tiles only)."""
    if TRACE:
        if j < _TILES:
            if part == 0:
                tl.store(trace + tl.program_id(0) * _SLOTS + 2 + 3 * j, i.to(tl.int64))
            trace_time(trace, 3 + part + 3 * j, TRACE)


@triton.jit
def _poll(ptr, rank, peer, heap_bases, REMOTE: tl.constexpr):
    """One acquire read (system scope) of a flag: this rank's, or with ``REMOTE`` the same slot in
    ``peer``'s memory (over NVLink)."""
    if REMOTE:
        return iris.atomic_add(ptr, 0, rank, peer, heap_bases, sem="acquire", scope="sys")
    else:
        return tl.atomic_add(ptr, 0, sem="acquire", scope="sys")


#: A wait that has waited this long looks at its group's error word, and again as often after:
#: once any wait of the group timed out, the later ones end at once instead of each waiting out its
#: bound (a graphed model with a dead peer would otherwise wait the bound once per call).
STICKY_CHECK_NS = tl.constexpr(100_000)


@triton.jit
def failed(err):
    """Whether a wait of this group already timed out (the error word is set), read alike by every
    thread of the program (as ``now``: the maximum of one read per thread, through shared memory)."""
    word = tl.load(err + tl.arange(0, 128) * 0, volatile=True)
    return tl.max(word, axis=0) != 0


@triton.jit
def mismatched(seen, epoch):
    """Whether flag value ``seen`` is the same call count as ``epoch`` under another tag (both
    nonzero: a call that carries no tag is not compared)."""
    seen_tag = seen & TAG_FIELD
    tag = epoch & TAG_FIELD
    return ((seen >> TAG_SHIFT) == (epoch >> TAG_SHIFT)) & (seen_tag != tag) & (seen_tag != 0) & (tag != 0)


@triton.jit
def reached(seen, epoch):
    """Whether flag value ``seen`` is at ``epoch``'s call count or past it (counts, not tags:
    ``mismatched`` tells calls apart)."""
    return (seen >> TAG_SHIFT) >= (epoch >> TAG_SHIFT)


@triton.jit
def paired(seen, epoch):
    """Whether flag value ``seen`` releases a wait for ``epoch``: reached, and not another call."""
    return reached(seen, epoch) & (mismatched(seen, epoch) == 0)


@triton.jit
def wait_flag(ptr, epoch, start, timeout, err, rank=0, peer=0, heap_bases=None, REMOTE: tl.constexpr = False):
    """Spin until ``*ptr`` has ``reached`` ``epoch`` (acquire, system scope) or ``timeout`` ns
    after ``start`` (a ``now()`` reading); returns (code, the flag value seen): code 0 if the flag
    came, 1 if it came late, 2 if an earlier wait of the group timed out (``failed``: this one gave
    up without waiting out its bound), 3 if the peer reached this call's count under another tag
    (``mismatched``). Every thread of the program takes the same decision: the flag comes from one
    scalar atomic and the time from ``now()``. With ``REMOTE`` the flag is read in ``peer``'s memory (``ptr`` is
    this rank's address of the slot)."""
    seen = _poll(ptr, rank, peer, heap_bases, REMOTE)
    late = 0
    look = start + STICKY_CHECK_NS
    while (reached(seen, epoch) == 0) & (late == 0):
        seen = _poll(ptr, rank, peer, heap_bases, REMOTE)
        t = now()
        if t - start > timeout:
            late = 1
        elif t > look:
            look = t + STICKY_CHECK_NS
            if failed(err):
                late = 2
    if late == 0:
        if mismatched(seen, epoch):
            late = 3
    return late, seen


@triton.jit
def record_late(err, OP: tl.constexpr, rank, peer, epoch, seen, KIND: tl.constexpr):
    """Name the kind, the op, this rank, the peer and the call (its count; for a mismatch both
    tags) in the error word (the host raises on it). The word stays set: later waits of the group
    end at once (``failed``)."""
    tl.store(err + 1, OP)
    tl.store(err + 2, rank)
    tl.store(err + 3, peer)
    tl.store(err + 4, (epoch >> TAG_SHIFT).to(tl.int32))
    tl.store(err + 5, (epoch & TAG_FIELD).to(tl.int32))
    tl.store(err + 6, (seen & TAG_FIELD).to(tl.int32))
    tl.store(err, KIND)


@triton.jit
def wait_or_record(ptr, epoch, start, timeout, err, OP: tl.constexpr, rank, peer, heap_bases=None,
                   REMOTE: tl.constexpr = False):
    """``wait_flag`` for the flag ``peer`` raises (with ``REMOTE``, in ``peer``'s memory); a wait
    that timed out or met another call names itself in the error word (one that gave up after an
    earlier timeout leaves the first one's record). Returns nonzero if late or mismatched."""
    late, seen = wait_flag(ptr, epoch, start, timeout, err, rank, peer, heap_bases, REMOTE)
    if late == 1:
        record_late(err, OP, rank, peer, epoch, seen, KIND_TIMEOUT)
    elif late == 3:
        record_late(err, OP, rank, peer, epoch, seen, KIND_MISMATCH)
    return late


@triton.jit
def wait_other_ranks(flags, row, epoch, rank, err, timeout, OP: tl.constexpr, WORLD: tl.constexpr):
    """Wait until every other rank raised flag ``[row, peer]`` (``flags + row * WORLD + peer``) to
    ``epoch``, all within ``timeout`` ns of one start; after a late one waits no more (the error
    word names it). Returns 1 if one came late."""
    start = now()
    late = rank * 0
    for k in tl.static_range(1, WORLD):
        peer = (rank + k) % WORLD
        if late == 0:
            late = wait_or_record(flags + row * WORLD + peer, epoch, start, timeout, err, OP, rank, peer)
    tl.debug_barrier()
    return late


@triton.jit
def wait_peers(flags, slot, epoch, rank, err, timeout, OP: tl.constexpr, WORLD: tl.constexpr):
    """Wait until every rank signalled ``epoch`` at ``slot``, or until ``timeout`` ns have passed.
    Returns nonzero if a peer was late (the error word names it)."""
    start = now()
    any_late = 0
    for peer in tl.static_range(WORLD):
        late = wait_or_record(flags + slot * WORLD + peer, epoch, start, timeout, err, OP, rank, peer)
        if late != 0:
            any_late = 1
    tl.debug_barrier()
    return any_late


def require_iris() -> None:
    if iris is None:
        raise RuntimeError(f"commfuse: the GPU paths need Iris (pip install tokenspeed-iris): {_IRIS_ERROR}")
