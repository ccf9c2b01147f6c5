"""What the run-time keeps per process group, in one object (``Group``) tied to the process-group
object itself, not only to its name: its agreed facts, buffers (workspace, graph lane) and error
word, its capture state (``capture.State``), its call plans, its tuner and the decisions the
report shows. Releasing a group (``release``) drops all of it.

torch gives groups names that come back after ``destroy_process_group()`` and a new
``init_process_group()`` ("0", then counters). State found under a name whose group is now another
object belongs to the old group (its members, its epochs, its sizes): it is dropped and the new
group starts afresh, collectively, as every rank re-creates its groups alike. A group that went
away (its object collected, or its name no longer resolving) loses its state within
``SWEEP_EVERY`` calls on other groups, when a group is made, or at ``release()``, and its buffers
are freed, except graph lanes that captured CUDA graphs may still replay (``_held``: freed once
no graph that captured them is left, or by ``free_kept_lanes``).

Every release of symmetric memory or of cached CUDA graphs goes through ``let_go``: freeing a
symmetric buffer synchronises the device, which a CUDA-graph capture forbids (the capture fails,
and a throw from the destructor aborts the process), and a sweep or a re-created group can come
inside a capture. What is let go of while this thread's stream captures waits in ``_deferred``
until the first call outside it.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import logging
import threading
import weakref

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from .. import env
from . import capture, counters, plans
from . import facts as facts_mod
from .facts import GroupFacts
from .workspace import (ALIGN, FLAG_BYTES, GRAPH_FLAG_BYTES, HEADER_BYTES, MIN_DATA_BYTES, GraphLane, Workspace,
                        allocate_iris, allocate_torch, error_word, header, outside_graph_pools, round_up)

log = logging.getLogger("commfuse")


@dataclasses.dataclass(eq=False)
class Group:
    """One process group's run-time state on this rank."""

    name: str
    ref: weakref.ref  # the process-group object
    members: tuple[int, ...]  # the group's global ranks
    rank: int
    world: int
    provider: str
    err: torch.Tensor  # this group's error word: the kernels of its workspace and lane write it
    facts: GroupFacts | None = None
    workspace: Workspace | None = None
    lane: GraphLane | None = None
    broken: str | None = None  # a wait timed out: no call may pair up on this group again
    calls: int = 0  # eager calls on this group so far, outside capture and replay (``verify.py``)
    #: the settings object under which the ranks last compared their settings (``alike.py``): a
    #: call under the same object compares nothing
    settings_of: object = None
    tuning_timeout_ns: int | None = None  # while tuning: the bound of buffers allocated meanwhile
    #: what CUDA-graph captures did on this group (``capture.py``)
    capture: capture.State = dataclasses.field(default_factory=capture.State)
    #: call signature -> its kept plan (``entry.Plan``)
    plans: dict = dataclasses.field(default_factory=dict)
    #: the group's tuned answers (``tuning.Tuner``), made at its first tuned call
    tuner: object = None
    #: (call, as the report words it) -> (path, source, reason) of its latest decision, newest last
    decisions: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)
    #: (op, rank-local size) -> whether every rank had that size (``shards.py``), and the ops whose
    #: sizes were found to differ (every later call of them agrees anew)
    shard_sizes: dict = dataclasses.field(default_factory=dict)
    uneven_ops: set = dataclasses.field(default_factory=set)
    #: the side streams of this group's overlapped paths, per device: never shared between groups,
    #: so two groups issued in different orders on different ranks cannot wait on each other
    streams: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.err_host = self.err.numpy()  # read per call without a tensor op

    def side_streams(self, device: torch.device, count: int = 3) -> tuple:
        """This group's side streams on ``device`` (made once)."""
        streams = self.streams.get(device.index)
        if streams is None:
            streams = self.streams[device.index] = tuple(torch.cuda.Stream(device) for _ in range(count))
        return streams

    def pg(self):
        return self.ref()

    def global_rank(self, group_rank: int) -> int:
        return self.members[group_rank] if 0 <= group_rank < len(self.members) else group_rank

    def buffers(self) -> tuple:
        """The group's symmetric buffers this rank holds (workspace, graph lane)."""
        return tuple(b for b in (self.workspace, self.lane) if b is not None)

    def forget(self) -> None:
        """Drop what the group decided and learned (a released or re-created group): its plans,
        tuner, decisions, shard answers and captured calls. Its buffers go through ``_retire``."""
        self.plans.clear()
        self.decisions.clear()
        self.tuner = None
        self.shard_sizes.clear()
        self.uneven_ops.clear()
        self.capture.forget_calls()


_groups: dict[tuple[str, str], Group] = {}
#: Dropped groups whose graph lane captured graphs may still replay: a lane is kept while a graph
#: that captured it may (``_drop_unreplayable``, ``free_kept_lanes``), and its error word is still
#: read (``errors.check_errors``, every call).
_held: list[Group] = []
#: Buffers and graphs let go of while a stream was capturing: freed at the first chance outside it.
_deferred: list = []
_lock = threading.Lock()
#: Calls between two looks for destroyed groups (whose state and buffers are then dropped).
SWEEP_EVERY = 256
_calls = 0


def let_go(*things) -> None:
    """Release ``things`` (workspaces, lanes, CUDA graphs): now, or, while this thread's stream
    captures a CUDA graph, at the first chance outside the capture (``free_deferred``)."""
    _deferred.extend(t for t in things if t is not None)
    free_deferred()


def free_deferred() -> None:
    """Free what ``let_go`` deferred, unless this thread's stream is capturing."""
    if _deferred and not capture.capturing():
        _deferred.clear()


def _members(pg) -> tuple[int, ...]:
    try:
        return tuple(dist.get_process_group_ranks(pg))
    except Exception:  # noqa: BLE001 - a backend that does not say (the fake test backend): group ranks
        return tuple(range(pg.size()))


def get(name: str, pg=None) -> Group:
    """The state of the group now called ``name`` (made, and an old group's dropped, as needed)."""
    pg = pg if pg is not None else _resolve_process_group(name)
    provider = env.current().symm_provider
    key = (name, provider)
    group = _groups.get(key)
    if group is not None and group.ref() is pg:
        global _calls
        _calls += 1
        # a destroyed subgroup's buffers, and kept lanes no graph replays any more, go soon
        if _calls % SWEEP_EVERY == 0 and (len(_groups) > 1 or _held):
            with _lock:
                _sweep()
        if _deferred:
            free_deferred()
        return group
    with _lock:
        group = _groups.get(key)
        if group is not None and group.ref() is pg:
            return group
        if group is not None:
            log.info("commfuse: group %r is a new process group under an old name; its state starts afresh", name)
            _retire(group)
        group = Group(name, weakref.ref(pg), _members(pg), pg.rank(), pg.size(), provider, error_word())
        _groups[key] = group
        _sweep()
        counters.bump()
        free_deferred()
        return group


def _retire(group: Group) -> None:
    """Drop a group's state; its lane stays alive if captured graphs may replay it."""
    _groups.pop((group.name, group.provider), None)
    group.forget()
    if group.lane is not None and group.capture.replayed:
        _held.append(group)  # keeps its lane (and the lane's buffer) alive
    else:
        let_go(group.lane)
        group.lane = None
    let_go(group.workspace)  # (with it, its copy-engine graphs)
    group.workspace = None
    counters.bump()


def _drop_unreplayable() -> None:
    """Free the kept lanes no graph can replay any more: every capture that used them was recorded
    by a graph tree manager of Inductor's, and each of those managers is gone (its graphs with it)."""
    for group in list(_held):
        if group.capture.replays_gone():
            _held.remove(group)
            let_go(group.lane)
            group.lane = None
            counters.bump()


def free_kept_lanes() -> None:
    """Free every graph lane kept for CUDA graphs captured before a ``release``: call it once no
    such graph will replay again (you deleted your own ``torch.cuda.CUDAGraph`` objects, or reset
    Inductor's graphs): a later replay of one would touch freed memory. Call it on every rank
    together (a later ``release`` restarts the kept lanes collectively). Lanes whose graphs were
    all Inductor's are freed without it, once those graphs are gone."""
    with _lock:
        for group in _held:
            let_go(group.lane)
            group.lane = None
        _held.clear()
        counters.bump()


def _sweep() -> None:
    """Drop the state of groups whose object is gone (collected, or no longer resolving by name)."""
    for group in list(_groups.values()):
        pg = group.ref()
        alive = pg is not None
        if alive:
            try:
                alive = _resolve_process_group(group.name) is pg
            except Exception:  # noqa: BLE001 - the name no longer resolves: destroyed
                alive = False
        if not alive:
            _retire(group)
    _drop_unreplayable()


def group_facts(group: Group, device: torch.device, capturing: bool) -> GroupFacts | None:
    """The group's agreed facts; agreed now (collective) on its first call, unless that call is
    inside a CUDA-graph capture, where nothing can be agreed (None: the call runs NCCL, and every
    rank captures alike)."""
    if group.facts is None and not capturing:
        settings = env.current()
        lane = round_up(settings.graph_bytes, ALIGN)
        group.facts = facts_mod.agree(group.pg(), device, group.provider, lane)
        counters.bump()
        why = group.facts.unsupported()
        if why:
            log.warning("commfuse: group %r runs the unfused NCCL ops: %s", group.name, why)
    return group.facts


def workspace(group: Group, data_bytes: int, device: torch.device) -> Workspace:
    """The group's workspace with at least ``data_bytes`` per parity. Collective when it allocates."""
    ws = group.workspace
    if ws is not None and ws.data_bytes >= data_bytes:
        return ws
    with _lock:
        ws = group.workspace
        if ws is not None and ws.data_bytes >= data_bytes:
            return ws
        broken = group.broken or (ws.broken if ws is not None else None)
        if broken:  # no collective allocation (nor a fresh workspace) from a rank that may be out of step
            raise RuntimeError(broken)
        outside_graph_pools(device, _allocate, group, data_bytes, device)
        counters.bump()
        return group.workspace


def _allocate(group: Group, data_bytes: int, device: torch.device) -> None:
    """Collective: a (larger) workspace for ``group``, and its graph lane on first use; its first
    size is at least what compiled graphs planned for the group (``plans.py``)."""
    pg = group.pg()
    ws, facts = group.workspace, group.facts
    size = max(data_bytes, MIN_DATA_BYTES, plans.planned(group.name), 0 if ws is None else 2 * ws.data_bytes)
    # Ranks may disagree (a plan from a graph one rank loaded from cache): agree on the largest.
    agreed = torch.tensor([size], dtype=torch.int64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=pg)
    size = round_up(int(agreed.item()), ALIGN)
    if ws is not None:  # every rank must be done with the old buffer before anyone frees it
        torch.cuda.synchronize(device)
        dist.barrier(group=pg)
        let_go(ws)
    settings = env.current()
    timeout = group.tuning_timeout_ns or int(settings.timeout_s * 1e9)

    def alloc(nbytes):
        if group.provider == "iris":
            return allocate_iris(pg, nbytes, device, settings.iris_heap_bytes)
        return allocate_torch(pg, nbytes, device)

    log.info("allocating a %d MiB symmetric workspace for group %s (%s provider)",
             (HEADER_BYTES + 2 * size) >> 20, group.name, group.provider)
    buf, ptrs, handle = alloc(HEADER_BYTES + 2 * size)
    bases = header(buf, HEADER_BYTES, ptrs, FLAG_BYTES)
    buf[HEADER_BYTES:].zero_()  # no stale bytes can pass for a split-K LL word (fused_split_k.py)
    if group.lane is None:  # with the first workspace, so it exists before any capture
        lbuf, lptrs, lhandle = alloc(GRAPH_FLAG_BYTES + 2 * facts.lane_bytes)
        group.lane = GraphLane(group.name, group.rank, group.world, lbuf,
                               header(lbuf, GRAPH_FLAG_BYTES, lptrs, GRAPH_FLAG_BYTES), facts.lane_bytes,
                               min(facts.sms, 256), err=group.err, timeout_ns=timeout, _keepalive=lhandle)
    torch.cuda.synchronize(device)
    dist.barrier(group=pg)  # no peer may signal before every rank zeroed its flags
    group.workspace = Workspace(group.name, group.rank, group.world, buf, bases, size, max_programs=facts.sms,
                                err=group.err, timeout_ns=timeout, _keepalive=handle)


def all_groups() -> list[Group]:
    return list(_groups.values())


def _restart_kept_lane(group: Group) -> None:
    """Collective: a lane that captured graphs replay is kept past ``release``; its epochs start
    over on every rank, and its error word is cleared, so graphs captured before pair up again
    and a later timeout in them raises again (``errors.check_held``). Every rank holds such a lane
    alike (ranks capture alike); a group whose process group is gone is left as it is."""
    pg = group.pg()
    if group.lane is None or not group.capture.replayed or pg is None or group.world <= 1:
        return
    try:
        alive = _resolve_process_group(group.name) is pg
    except Exception:  # noqa: BLE001 - destroyed: no collective is possible on it
        alive = False
    if alive:
        group.lane.restart(pg)
        group.err.zero_()
        group.broken = None
        capture.restarted(group)


def release(group_name: str | None = None) -> None:
    """Free the symmetric memory of one group (``group_name``) or of every group, and forget their
    state (tests, teardown, recovery after a timeout; the next call allocates anew, collectively).
    Call it on every rank together. Graph lanes that captured CUDA graphs may still replay are kept
    (until those graphs are gone, or ``free_kept_lanes``), their epochs restarted together: replays
    after this touch no freed memory and pair with the peers' replays."""
    with _lock:
        # graph owners that are garbage now are gone on every rank alike before the restarts below,
        # which are collective: a lane one rank frees here and its peer keeps would pair no restart
        gc.collect()
        _sweep()
        # in the same order on every rank (the restarts are collective): the lanes kept by earlier
        # releases (a timeout in an old graph's replay may have left them out of step), then the
        # groups now dropped, by name
        order = (lambda g: (g.name, g.provider))
        for group in sorted(_held, key=order):
            if group_name is None or group.name == group_name:
                _restart_kept_lane(group)
        for group in sorted(_groups.values(), key=order):
            if group_name is None or group.name == group_name:
                _restart_kept_lane(group)
                _retire(group)
        counters.bump()
    free_deferred()  # (nothing may have been retired now, yet an earlier capture deferred frees)


def release_all() -> None:
    """``release()`` of every group: what to call on every rank after a timeout error."""
    release()


def memory() -> list[dict]:
    """Per group: the symmetric bytes this rank holds for it (workspace, graph lane), the CUDA
    graphs its copy-engine calls keep (how many, and the bytes of their memory pools), and its
    members. Two meshes over the same ranks are two groups and pay twice."""
    rows = []
    for group in all_groups():
        ws, lane = group.workspace, group.lane
        rows.append(dict(group=group.name, ranks=list(group.members), workspace_bytes=ws.nbytes if ws else 0,
                         lane_bytes=lane.nbytes if lane else 0, ce_graphs=len(ws.graphs) if ws else 0,
                         ce_graph_bytes=ws.graph_bytes() if ws else 0,
                         data_bytes_per_parity=ws.data_bytes if ws else 0))
    rows.append(dict(group="(lanes of dropped groups, kept for their CUDA graphs)", ranks=[], workspace_bytes=0,
                     lane_bytes=sum(g.lane.nbytes for g in _held), ce_graphs=0, ce_graph_bytes=0,
                     data_bytes_per_parity=0))
    return rows


def decisions() -> list[tuple]:
    """The latest decision per call of every group: (call, group, path, source, reason), for the
    report (``report.Report.calls``)."""
    return [(call, group.name, *decision) for group in all_groups() for call, decision in group.decisions.items()]


def clear_decisions() -> None:
    for group in all_groups():
        group.decisions.clear()


def held() -> list[Group]:
    """Dropped groups whose graph lanes captured graphs may still replay."""
    return _held
