"""Turning a kernel's timed-out wait into a Python error, and keeping a group out of step from
pairing calls again.

A wait that passes its bound writes ``[ERR_TIMEOUT, op, rank, peer, call count]`` into its group's
error word (a pinned host int32[8], ``workspace.error_word``), leaves NaN where the late peer's data
would go and lets the kernel finish; one that meets a peer at the same count under another pairing
tag (``COMMFUSE_PAIRING_CHECK``) writes ``ERR_MISMATCH`` and both tags after the count instead.
The host reads the word, with no synchronisation, at the group's next call (``check``) or whenever
``check_errors()`` is called. The error names the group, the op, the global ranks of the waiter
and of the peer, and the call.

The word stays set: every later wait of the group's kernels looks at it once it has waited a
little (``kernels/sync.py``, ``failed``) and ends at once, its outputs NaN, so a CUDA graph of many
calls with a dead peer raises after one bound, not one per call. The group refuses further calls
until ``commfuse.release_all()`` (a new group state, a clear word): a peer slower than the bound may
since have paired its waits with this rank's later calls.
"""

from __future__ import annotations

import functools

import torch

from ..kernels.codes import ERR_MISMATCH, ERR_TIMEOUT, GRAPH_LANE_OP, OPS
from . import capture, counters
from . import groups as groups_mod


def _message(group, op: int, rank: int, peer: int, epoch: int, during: str | None, timeout_s: float,
             kind: int = ERR_TIMEOUT, tags: tuple = (0, 0)) -> str:
    now = f" (noticed when {during} was called)" if during else ""
    lane = "'s graph lane" if op == GRAPH_LANE_OP else ""  # (the lane counts its own calls, on the device)
    call = f" in call {epoch} of the group{lane}" if epoch > 0 else ""
    if kind == ERR_MISMATCH:
        return (
            f"commfuse.{OPS.get(op, op)}: on group {group.name!r}, call {epoch} of the group{lane} on rank "
            f"{group.global_rank(rank)} (tag {tags[0]}) met a different call on rank {group.global_rank(peer)} "
            f"(tag {tags[1]}; group ranks {rank} and {peer}){now}: another op, shape or path at the same call "
            "count. A rank skipped, added or reordered a fused call (data-dependent control flow, a rank that "
            "raised mid-step). Results of that call are invalid.")
    return (
        f"commfuse.{OPS.get(op, op)}: on group {group.name!r}, rank {group.global_rank(rank)} timed out after "
        f"{timeout_s:g} s waiting for rank {group.global_rank(peer)} (group ranks {rank} and {peer}){call}{now}. "
        "The peer did not reach the same collective call: a rank that raised, skipped the call or diverged. "
        "Results of that call are invalid. COMMFUSE_TIMEOUT_S sets the bound.")


def check(group, during: str | None = None) -> None:
    """Raise if a kernel of ``group`` timed out (once: the group then refuses calls, with this
    message, until ``release_all``)."""
    if group.err_host[0] == 0 or group.broken:
        return
    kind = int(group.err_host[0])
    op, rank, peer, epoch, mine, theirs = (int(x) for x in group.err_host[1:7])
    ws = group.workspace if group.workspace is not None else group.lane
    timeout_s = (ws.timeout_ns if ws is not None else 0) / 1e9
    msg = _message(group, op, rank, peer, epoch, during, timeout_s, kind, (mine, theirs))
    if op == GRAPH_LANE_OP:  # its epochs are on the device: this group's ranks stay out of step
        capture.fail(group, msg)
    group.broken = (f"{msg} Group {group.name!r} refuses further calls: call commfuse.release_all() on every "
                    "rank to start over.")
    if ws is not None:
        ws.broken = group.broken
    counters.bump()
    raise RuntimeError(msg)


def check_errors() -> None:
    """Synchronise the current device and raise if a commfuse wait of any group timed out, also in
    a CUDA graph captured before ``release_all`` that still replays on a dropped group's lane."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if groups_mod._deferred:
        groups_mod.free_deferred()
    for group in groups_mod.all_groups() + groups_mod.held():
        check(group)


def check_held(during: str) -> None:
    """``check`` of the dropped groups whose lanes graphs still replay (cheap: a word per group)."""
    for group in groups_mod.held():
        if group.err_host[0] and not group.broken:
            check(group, f"{during}; the wait was in a CUDA graph captured before release_all()")


class Watch:
    """The groups whose error words a compiled graph's runs read (``watch_runs``): the names of the
    groups its commfuse ops call, filled by the graph pass as the forward and then the backward
    graph are compiled, or ``every`` group where the pass did not run for a graph that calls
    them (one a cache served whose code calls a commfuse op: ``inductor_plugin/backend.py``)."""

    __slots__ = ("names", "every")

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.every = False


#: What noticed the errors a compiled graph's run raises (its CUDA-graph replays report there).
_RUN = "a compiled graph of commfuse ops"


def after_run(watch: Watch) -> None:
    """Raise if a kernel of a group ``watch`` names reported a failure, or if such a group already
    refuses calls. Reads pinned host words only: no synchronisation, so a replay that is still
    running is seen at a later run, the first after it completed. A CUDA graph's replay has no
    host step of its own, so this is where its timed-out waits become an exception. It is also
    where what a capture let go of (``groups.let_go``) is freed when every later step only replays:
    no eager call, which would free it, may come."""
    if groups_mod._deferred:
        groups_mod.free_deferred()
    for group in tuple(groups_mod._groups.values()):  # (another thread may make a group meanwhile)
        if watch.every or group.name in watch.names:
            if group.err_host[0] and not group.broken:
                check(group, _RUN)
            if group.broken:  # the graph would only replay NaN: refuse, as eager calls do
                raise RuntimeError(group.broken)
    if groups_mod._held:
        check_held(_RUN)


def watch_runs(compiled, watch: Watch):
    """``compiled`` (what Inductor returned), each run followed by ``after_run(watch)``.

    The arguments pass through untouched, so Inductor's calling convention holds either way: a
    boxed callable (``_boxed_call``, copied with the other attributes) gets the caller's list and
    empties it, and this wrapper keeps no reference to the inputs after the call."""

    @functools.wraps(compiled)
    def run(*args, **kwargs):
        out = compiled(*args, **kwargs)
        del args, kwargs  # (an unboxed call's inputs are not kept alive past the graph's own use)
        if watch.names or watch.every:
            after_run(watch)
        return out

    run.commfuse_watch = watch
    return run
