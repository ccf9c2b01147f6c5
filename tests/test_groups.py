"""``runtime/groups.py``: a group's state, its graph lane, release and what is freed when.
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import commfuse
from commfuse.kernels.codes import GRAPH_LANE_OP
from commfuse.runtime import capture, counters, errors, groups
from commfuse.runtime import workspace as wsmod
from commfuse.runtime.facts import GroupFacts
from helpers import group_name

from choosing import (  # noqa: F401  (_quiet_policy, fresh_groups: fixtures, found by name)
    BF16, AR, AG, _quiet_policy, _workspace, fresh_groups)


def test_a_group_re_created_under_its_name_starts_afresh(fresh_groups):
    """torch names groups anew after ``destroy_process_group()``: the same name then resolves to
    another object, whose state (shard answers, capture records, workspace, calls) starts empty;
    a group that went away loses its state at the next ``groups.get`` of any group."""
    name = group_name()
    old = groups.get(name)
    sub = dist.new_group([0, 1])
    gone = groups.get(sub.group_name)
    for g in (old, gone):
        g.facts = GroupFacts.simulated(2)
        g.shard_sizes[(AR, 8)] = True
        g.uneven_ops.add(AG)
        g.capture.nccl.add((AR, ((8, 8), (8, 8), BF16)))
        g.workspace = _workspace(name=g.name, err=g.err)
        g.calls = 5
    assert groups.get(name) is old  # the same object: the same state
    dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    assert group_name() == name  # the name comes back
    generation = counters.generation
    new = groups.get(name)
    assert new is not old and new.pg() is dist.group.WORLD
    assert (new.facts, new.workspace, new.lane, new.calls) == (None, None, None, 0)
    assert not new.shard_sizes and not new.uneven_ops and not new.capture.nccl
    assert new.err is not old.err
    assert old.workspace is None and counters.generation > generation  # the old state is dropped
    # the destroyed subgroup's state went with the sweep of that call
    assert gone.workspace is None
    assert all(g is new for g in groups.all_groups())


def _destroyed_subgroup():
    """(the WORLD group's state, the state of a subgroup with a workspace, now destroyed)."""
    sub = dist.new_group([0, 1])
    gone = groups.get(sub.group_name)
    gone.workspace = _workspace(name=gone.name, err=gone.err)
    world = groups.get(group_name())
    dist.destroy_process_group(sub)
    return world, gone


def test_a_destroyed_subgroup_loses_its_state_within_a_sweep_of_calls(fresh_groups):
    """With no new group made after it, calls on other groups drop it within ``SWEEP_EVERY``."""
    world, gone = _destroyed_subgroup()
    for _ in range(groups.SWEEP_EVERY):
        assert groups.get(group_name()) is world  # the WORLD group's own state stays
    assert gone.workspace is None and gone not in groups.all_groups()


def test_a_destroyed_subgroup_loses_its_state_when_a_group_is_made(fresh_groups):
    world, gone = _destroyed_subgroup()
    assert groups.get(group_name()) is world  # the WORLD group's own state stays
    new_sub = dist.new_group([0, 1])
    assert groups.get(new_sub.group_name) is not gone  # (a new name, or the old one for a new object)
    assert gone.workspace is None and gone not in groups.all_groups()
    dist.destroy_process_group(new_sub)


def test_a_graph_lane_timeout_makes_the_lanes_refuse_until_released(fresh_groups):
    name = group_name()
    g = groups.get(name)
    buf = torch.zeros(wsmod.GRAPH_FLAG_BYTES + 2 * 4096, dtype=torch.uint8)
    g.lane = wsmod.GraphLane(name, 0, 2, buf, torch.zeros(2, dtype=torch.int64), 4096, 132, err=g.err)
    g.err[:4] = torch.tensor([1, GRAPH_LANE_OP, 1, 0], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"mm_all_reduce \(graph lane\): on group '0', rank 1 timed out"):
        commfuse.check_errors()
    with pytest.raises(RuntimeError, match="graph lanes of group '0' are out of step.*release_all"):
        capture.lane(g)
    commfuse.release_all()
    assert capture.lane(groups.get(name)) is None


def test_release_restarts_a_kept_lane_so_old_graphs_pair_and_raise_again(fresh_groups, monkeypatch):
    """A lane that captured graphs replay outlives ``release_all``: its epochs start over (every
    rank together) and its error word is cleared, so those replays neither pair stale flags nor
    give up at once with NaN, and their next timeout raises."""
    monkeypatch.setattr(groups, "_held", [])  # (lanes of groups other tests dropped)
    name = group_name()
    g = groups.get(name)
    buf = torch.zeros(wsmod.GRAPH_FLAG_BYTES + 2 * 4096, dtype=torch.uint8)
    g.lane = wsmod.GraphLane(name, 0, 2, buf, torch.zeros(2, dtype=torch.int64), 4096, 132, err=g.err)
    capture.mark_replayed(g)
    g.lane.counter.fill_(14)  # this rank's epochs, ahead of a peer's after a failure
    g.lane.flags.fill_(9)
    g.lane.data(torch.float32).fill_(float("nan"))
    g.err[:4] = torch.tensor([1, GRAPH_LANE_OP, 1, 0], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="graph lane"):
        commfuse.check_errors()
    commfuse.release_all()
    assert g in groups.held() and g.lane is not None  # kept for the graphs
    assert int(g.lane.counter.abs().sum()) == 0 and int(g.lane.flags.abs().sum()) == 0
    assert int(g.lane.data(torch.float32).isnan().sum()) == 0
    assert int(g.err.abs().sum()) == 0 and g.broken is None and g.capture.failure is None
    g.err[:4] = torch.tensor([1, GRAPH_LANE_OP, 1, 0], dtype=torch.int32)  # a replay times out later
    g.lane.counter.fill_(3)
    with pytest.raises(RuntimeError, match="captured before release_all"):
        errors.check_held("mm_all_reduce")
    commfuse.release_all()  # as the error says: the lane kept by the first release starts over too
    assert int(g.lane.counter.abs().sum()) == 0 and int(g.err.abs().sum()) == 0 and g.broken is None
    assert groups.held() == [g]


def test_release_keeps_lanes_that_captured_graphs_replay_and_reads_their_errors(fresh_groups, monkeypatch):
    """``release_all()`` after a timeout under CUDA graphs: the captured graphs still hold the
    lane's addresses, so the lane is kept (never freed while the process runs) and its error word
    still read: a replay after the release that times out raises at the next check instead of
    touching freed memory or passing unseen; a group whose lane no graph captured frees it."""
    monkeypatch.setattr(groups, "_held", [])  # (lanes of groups other tests dropped)
    name = group_name()
    group = groups.get(name)
    lane_buf = torch.zeros(wsmod.GRAPH_FLAG_BYTES + 2 * 4096, dtype=torch.uint8)
    group.lane = wsmod.GraphLane(name, 0, 2, lane_buf, torch.zeros(2, dtype=torch.int64), 4096, 8, err=group.err)
    group.workspace = _workspace(name=name, err=group.err)
    capture.mark_replayed(group)
    sub = dist.new_group([0, 1])
    other = groups.get(sub.group_name)
    other.lane = wsmod.GraphLane(sub.group_name, 0, 2, torch.zeros(wsmod.GRAPH_FLAG_BYTES + 64, dtype=torch.uint8),
                                 torch.zeros(2, dtype=torch.int64), 32, 8, err=other.err)
    commfuse.release_all()
    assert groups.held() == [group] and group.lane is not None and group.workspace is None
    assert other.lane is None  # no graph captured it: freed
    held_row = [r for r in groups.memory() if r["ranks"] == []][0]
    assert held_row["lane_bytes"] == lane_buf.numel()
    group.err[:5] = torch.tensor([1, 4, 0, 1, 3], dtype=torch.int32)  # a replay of an old graph timed out
    with pytest.raises(RuntimeError, match=r"graph lane.*on group '0'.*call 3.*captured before release_all"):
        torch.ops.commfuse.mm_all_reduce(torch.randn(4, 6), torch.randn(6, 5), None, name)


def test_memory_lists_each_groups_symmetric_bytes(fresh_groups):
    name = group_name()
    group = groups.get(name)
    group.workspace = _workspace(data_bytes=1 << 12, name=name, err=group.err)
    row = [r for r in groups.memory() if r["group"] == name][0]
    assert row["workspace_bytes"] == wsmod.HEADER_BYTES + 2 * (1 << 12)
    assert row["data_bytes_per_parity"] == 1 << 12 and row["ranks"] == [0, 1]
    assert row["ce_graphs"] == 0 and row["ce_graph_bytes"] == 0

    class Graph:  # a copy-engine call's CUDA graph, its pool measured at capture
        commfuse_bytes = 40 << 20

    group.workspace.graphs.update({"a": Graph(), "b": Graph()})
    row = [r for r in groups.memory() if r["group"] == name][0]
    assert row["ce_graphs"] == 2 and row["ce_graph_bytes"] == 80 << 20
    groups.release(name)
    assert not [r for r in groups.memory() if r["group"] == name]


def test_what_is_let_go_of_while_capturing_is_freed_after_the_capture(fresh_groups, monkeypatch):
    """Freeing a symmetric buffer synchronises the device, which a CUDA-graph capture forbids. A
    sweep of destroyed groups (at a group's creation, or every ``SWEEP_EVERY`` calls) and a
    ``release`` may come inside a capture: what they drop waits until the first call outside it."""
    import gc

    world, gone = _destroyed_subgroup()
    swept = weakref.ref(gone.workspace)
    monkeypatch.setattr(capture, "capturing", lambda: True)
    new_sub = dist.new_group([0, 1])
    groups.get(new_sub.group_name)  # a group is made: the sweep drops the destroyed one's state
    assert gone.workspace is None and gone not in groups.all_groups()
    name = group_name()
    world.workspace = _workspace(name=name, err=world.err)
    released = weakref.ref(world.workspace)
    groups.release(name)
    assert world.workspace is None and world not in groups.all_groups()
    gc.collect()
    assert swept() is not None and released() is not None  # still capturing: not freed
    groups.get(new_sub.group_name)  # a call while the capture goes on frees nothing either
    gc.collect()
    assert swept() is not None and released() is not None
    monkeypatch.setattr(capture, "capturing", lambda: False)
    groups.get(new_sub.group_name)  # the first call after the capture frees them
    gc.collect()
    assert swept() is None and released() is None
    dist.destroy_process_group(new_sub)


@pytest.mark.parametrize("where", ["after_run", "check_errors", "release"])
def test_what_a_capture_let_go_of_is_freed_in_a_loop_of_replays_only(fresh_groups, monkeypatch, where):
    """Under ``mode="reduce-overhead"`` every step after the recording may be a replay: no eager
    call reaches ``groups.get``. What the recording let go of is freed after the next run of a
    compiled graph (``errors.after_run``), at ``check_errors`` and at ``release``."""
    import gc

    class Buffer:  # a workspace dropped while a capture was recording
        pass

    name = group_name()
    groups.get(name)
    monkeypatch.setattr(capture, "capturing", lambda: True)
    dropped = Buffer()
    gone = weakref.ref(dropped)
    groups.let_go(dropped)
    del dropped
    errors.after_run(errors.Watch())  # still inside the capture: kept
    gc.collect()
    assert gone() is not None
    monkeypatch.setattr(capture, "capturing", lambda: False)
    if where == "after_run":
        watch = errors.Watch()
        watch.names.add(name)
        errors.after_run(watch)
    elif where == "check_errors":
        errors.check_errors()
    else:
        groups.release("no such group")
    gc.collect()
    assert gone() is None and not groups._deferred

def _lane_of(group, data_bytes=4096):
    buf = torch.zeros(wsmod.GRAPH_FLAG_BYTES + 2 * data_bytes, dtype=torch.uint8)
    return wsmod.GraphLane(group.name, 0, 2, buf, torch.zeros(2, dtype=torch.int64), data_bytes, 8, err=group.err)


def test_a_kept_lane_is_freed_once_the_graphs_that_captured_it_are_gone(fresh_groups, monkeypatch):
    """A lane that captured graphs may replay is kept past ``release_all``, but not for ever: once
    every owner of those graphs (Inductor's graph tree managers) is gone, no replay can reach it,
    and the next sweep or release frees it."""
    import gc

    monkeypatch.setattr(groups, "_held", [])  # (lanes of groups other tests dropped)

    class TreeManager:  # what records Inductor's CUDA graphs (``reduce-overhead``)
        pass

    manager = TreeManager()
    recording = weakref.ref(manager)
    monkeypatch.setattr(capture, "owner", lambda: recording())
    group = groups.get(group_name())
    group.lane = _lane_of(group)
    capture.mark_replayed(group)  # two captured calls of one recording
    capture.mark_replayed(group)
    assert len(group.capture.owners) == 1
    lane = weakref.ref(group.lane)
    commfuse.release_all()
    assert groups.held() == [group] and lane() is not None  # its graphs may replay
    commfuse.release_all()
    assert groups.held() == [group] and lane() is not None
    del manager  # the graphs went (torch._dynamo.reset(), the compiled model collected)
    commfuse.release_all()
    gc.collect()
    assert groups.held() == [] and lane() is None
    held_row = [r for r in groups.memory() if r["ranks"] == []][0]
    assert held_row["lane_bytes"] == 0


def test_a_lane_a_graph_of_unknown_owner_captured_is_kept_until_told(fresh_groups, monkeypatch):
    """A capture commfuse cannot trace to an owner (the user's own ``torch.cuda.graph``) keeps the
    lane until ``free_kept_lanes()`` says no such graph replays any more."""
    import gc

    monkeypatch.setattr(groups, "_held", [])
    monkeypatch.setattr(capture, "owner", lambda: None)
    group = groups.get(group_name())
    group.lane = _lane_of(group)
    capture.mark_replayed(group)
    lane = weakref.ref(group.lane)
    commfuse.release_all()
    commfuse.release_all()
    gc.collect()
    assert groups.held() == [group] and lane() is not None
    groups.free_kept_lanes()
    gc.collect()
    assert groups.held() == [] and lane() is None
