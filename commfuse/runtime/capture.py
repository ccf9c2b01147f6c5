"""CUDA-graph capture: what a group's captures did, and which calls take its graph lane.

A graph lane (``workspace.GraphLane``) is a group buffer whose epochs live on the device, so a
capture may record a call on it once and replay it any number of times; the group's buffers
(``groups.py``) hold and free it. This module holds the rest, one ``State`` per group
(``groups.Group.capture``):

* whether a capture launched the lane (``replayed``), and what owns the graphs that did, so a
  lane they may replay is kept past a ``release`` (``groups.py``) while they live;
* the (op, shapes) a capture sent to NCCL: their eager twins run NCCL too, with nothing before
  them (``at_call``);
* a lane timeout, after which the group's lanes refuse calls until ``release_all``.

and answers, for one call, what capture changes about it: the entry asks ``at_call`` once per
call (capturing, an eager twin, the bytes of a replayed lane) and the policy asks ``Selection``
once per decision (the lane's path and variant for the call).

What must hold: every answer reads only the capture state, which ranks share by capturing
alike, so every rank decides alike. A rank whose graph tree re-warms (eager calls) while its
peer replays must meet those replays: on the lane for calls that fit a replayed lane, on NCCL for
calls a capture sent there, and in neither case after a check or agreement the replaying peer
would never join.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref

import torch

from . import counters
from .paths import REGISTRY

log = logging.getLogger("commfuse")

_CUDA = torch.cuda.is_available()

#: Per op, the path that runs its calls on the graph lane (a symmetric path a capture may run).
LANES = {path.op: path for path in REGISTRY.values() if path.capture and path.symmetric}


@dataclasses.dataclass(eq=False)
class State:
    """One group's CUDA-graph state on this rank."""

    replayed: bool = False  # a capture launched the lane: replays will use it
    failure: str | None = None  # a lane wait timed out: its device epochs differ for good
    #: (op, shapes) of calls a capture of this process sent to NCCL: their eager twins run NCCL
    nccl: set = dataclasses.field(default_factory=set)
    #: weak references to the owners of the CUDA graphs that captured the lane (Inductor's graph
    #: tree managers), and whether a capture had no owner commfuse can see (the user's own
    #: ``torch.cuda.graph``): a kept lane is freed once every owner is gone and there was none
    owners: list = dataclasses.field(default_factory=list)
    unowned: bool = False

    def replays_gone(self) -> bool:
        """Every capture that launched the lane was recorded by an owner commfuse sees, and each
        of those owners is gone (its graphs with it): no graph can replay the lane any more."""
        return bool(self.owners) and not self.unowned and all(r() is None for r in self.owners)

    def forget_calls(self) -> None:
        """Drop what concerns calls (a released group): what concerns the lane stays with it."""
        self.nccl.clear()


def capturing() -> bool:
    """Whether this thread's current stream is capturing a CUDA graph (a capture on another
    thread in ``capture_error_mode="global"`` is not seen: docs/reliability.md)."""
    return _CUDA and torch.cuda.is_current_stream_capturing()


def lane_bytes(group) -> int:
    """The lane's per-parity bytes once captured graphs use it, else 0. Eager calls that fit then
    take the lane too: a rank whose graph tree re-warms (eager) must meet a peer that replays."""
    return group.lane.data_bytes if group.capture.replayed and group.lane is not None else 0


def at_call(group, op: str, key: tuple) -> tuple[bool, bool, int]:
    """What capture changes about a call of ``op`` with shapes ``key`` on ``group``: (capturing,
    twin, replayed lane bytes). ``twin``: inside a capture, calls the graph lane cannot take run
    NCCL, so once this process captured a call to NCCL, eager calls of the same op, group and
    shapes run NCCL too, with nothing before them (no size agreement: the replay has none)."""
    state = group.capture
    if capturing():
        return True, False, lane_bytes(group)
    return False, bool(state.nccl) and (op, key) in state.nccl, lane_bytes(group)


def record(group, op: str, key: tuple, algo: str) -> None:
    """A call inside a capture that runs ``algo``: if NCCL, its eager twins will too."""
    state = group.capture
    if algo == "nccl" and (op, key) not in state.nccl:
        state.nccl.add((op, key))
        counters.bump()


def owner():
    """What owns the CUDA graph this thread is capturing, where commfuse can see it: the graph
    tree manager of Inductor's ``mode="reduce-overhead"`` recording on its own stream, else None."""
    try:
        from torch._inductor import cudagraph_trees  # noqa: PLC0415  (only inside a capture)

        if not torch._C._is_key_in_tls("tree_manager_containers"):
            return None
        manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
        if manager is not None and manager.stream == torch.cuda.current_stream():
            return manager
    except Exception:  # noqa: BLE001 - another torch's internals: an owner not seen (kept until told)
        log.debug("commfuse: the owner of a CUDA-graph capture could not be told", exc_info=True)
    return None


def mark_replayed(group) -> None:
    """A CUDA-graph capture launched the group's lane: its replays will keep using it (and the lane
    is kept, past a ``release``, while that graph's owner lives)."""
    state = group.capture
    who = owner()
    if who is None:
        state.unowned = True
    elif not any(r() is who for r in state.owners):
        state.owners.append(weakref.ref(who))
    if not state.replayed:
        state.replayed = True
        counters.bump()


def lane(group):
    """The group's graph lane, or None before its first symmetric call allocated it. Raises once
    a graph-lane call timed out."""
    if group.capture.failure:
        raise RuntimeError(
            f"commfuse: the graph lanes of group {group.name!r} are out of step after an earlier failure "
            f"({group.capture.failure}). Call commfuse.release_all() on every rank and capture the graphs again.")
    return group.lane


def fail(group, message: str) -> None:
    """A wait on the group's lane timed out (``errors.check``): its device epochs differ for good."""
    group.capture.failure = message


def restarted(group) -> None:
    """The group's kept lane started its epochs over on every rank (``groups.release``)."""
    group.capture.failure = None


def fits_lane(call, facts) -> bool:
    """Whether a capture of ``call`` could take the graph lane (what a later capture asks the
    tuner for: ``tuning.Tuner.answer``)."""
    return call.op in LANES and call.exchanged_bytes <= facts.lane_bytes


class Selection:
    """The graph lane's part of one call's decision, which the policy asks once per decision:
    the lane's path for the call's op, the variant it takes (a capture's: the capture rules'),
    and whether an eager call takes a replayed lane.

    ``capture_rules()``: the policy's decision from the capture rules for the call, made only
    where an answer needs it."""

    def __init__(self, call, facts, lane_bytes: int, capture_rules):
        self.call, self.facts, self.lane_bytes = call, facts, lane_bytes
        self.path = LANES.get(call.op)
        self._capture_rules = capture_rules

    @functools.cached_property
    def rules(self):
        """What the capture rules pick for the call (the policy's ``Decision``)."""
        return self._capture_rules()

    def variant(self, path) -> dict | None:
        """The variant ``path`` takes for the call: for the lane, the capture rules' (as a capture
        takes it), else None."""
        if path is None or path is not self.path:
            return None
        rules = self.rules
        return rules.variant if rules.path is path else None

    def replayed(self):
        """The lane, where this eager call fits a lane that captured graphs replay and the lane
        supports it (whatever a capture's answer or ``COMMFUSE_ALGO`` says: calls whose capture
        ran NCCL were sent to NCCL before, ``at_call``), else None."""
        if self.path is None or not self.lane_bytes or self.call.exchanged_bytes > self.lane_bytes:
            return None
        if self.path.supports_variant(self.call, self.facts, self.variant(self.path)) is None:
            return self.path
        return None
