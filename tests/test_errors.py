"""``runtime/errors.py``: the error word a kernel writes, and the errors it becomes.
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.distributed as dist

import commfuse
from commfuse import env
from commfuse.kernels.codes import ERR_MISMATCH, flag_value
from commfuse.runtime import errors, groups, policy
from commfuse.runtime import workspace as wsmod
from commfuse.runtime.facts import GroupFacts
from commfuse.runtime.paths import REGISTRY
from commfuse.runtime.paths.base import Call
from helpers import group_name

BF16 = torch.bfloat16
AR, AG, RS = "mm_all_reduce", "all_gather_mm", "mm_reduce_scatter"


def _call(op, m, k, n, dtype=BF16, world=2, rows_dim=0, slabs=None):
    """A call as the entry builds it (``slabs``: 1 along the rows, else unknown unless given)."""
    if slabs is None:
        slabs = 1 if rows_dim == 0 else 0
    return Call(op, m, k, n, dtype, world, rows_dim=rows_dim, slabs=slabs)


def choose(op, m, k, n, dtype=BF16, world=2, rows_dim=0, slabs=None, *, forced=None, capturing=False,
           lane_bytes=0, facts=None):
    """The path name ``policy.choose`` gives on a simulated H200 group of ``world`` ranks."""
    call = _call(op, m, k, n, dtype, world, rows_dim, slabs)
    return policy.choose(call, facts or GroupFacts.simulated(world), capturing=capturing, lane_bytes=lane_bytes,
                         forced=forced).name


def rules(op, m, k, n, dtype=BF16, world=2, rows_dim=0, slabs=None) -> str:
    """What the rules alone pick (what a forced path that cannot take a call falls back to)."""
    return policy.rules_choice(_call(op, m, k, n, dtype, world, rows_dim, slabs), GroupFacts.simulated(world)).name


def supports(op, name, m, k, n, dtype=BF16, world=2, **kw):
    return REGISTRY[(op, name)].supports(_call(op, m, k, n, dtype, world, **kw), GroupFacts.simulated(world))


@pytest.fixture(autouse=True)
def _quiet_policy(monkeypatch):
    """Each test sees the policy's once-per-reason warnings afresh."""
    monkeypatch.setattr(policy, "_warned", set())


def _workspace(data_bytes=1 << 12, name="0", **kw):
    """A workspace over plain CPU memory (group "0" is the fake WORLD when one is initialised)."""
    buf = torch.zeros(wsmod.HEADER_BYTES + 2 * data_bytes, dtype=torch.uint8)
    return wsmod.Workspace(name, 0, 2, buf, torch.zeros(2, dtype=torch.int64), data_bytes, **kw)


@pytest.fixture
def fresh_groups(world2):
    """No group state from earlier tests, and none left behind."""
    groups.release_all()
    yield
    groups.release_all()


def test_timeout_error_names_group_op_and_global_ranks(fresh_groups):
    """A kernel that timed out wrote ``[1, op, rank, peer, call count]`` into its group's error word; the
    group's next call raises, naming the group, the op, the global ranks, the call and the bound,
    once; the word stays set (later waits of the group end at once) and the group refuses calls
    until ``release_all``, which starts it afresh with a clear word."""
    name = group_name()
    group = groups.get(name)
    group.workspace = _workspace(name=name, err=group.err, timeout_ns=2 * 10**9)
    assert group.workspace.err is group.err  # the kernels write the group's word
    group.err[:5] = torch.tensor([1, 1, 0, 1, 7], dtype=torch.int32)  # what a timed-out kernel writes
    shard, b = torch.randn(4, 6), torch.randn(6, 5)
    with pytest.raises(RuntimeError, match=r"commfuse\.mm_all_reduce: on group '0', rank 0 timed out after 2 s "
                                           r"waiting for rank 1 \(group ranks 0 and 1\) in call 7 of the group "
                                           r"\(noticed when all_gather_mm"):
        torch.ops.commfuse.all_gather_mm(shard, b, None, 0, 2, name, True)
    assert int(group.err[0]) == 1  # sticky: the group's later waits see it and end at once
    commfuse.check_errors()  # raised once: nothing new
    with pytest.raises(RuntimeError, match=r"mm_all_reduce: on group '0', rank 0 timed out.*refuses further calls"
                                           r".*release_all"):
        torch.ops.commfuse.all_gather_mm(shard, b, None, 0, 2, name, True)
    with pytest.raises(RuntimeError, match="refuses further calls"):
        group.workspace.next_epoch()
    commfuse.release_all()
    out, _ = torch.ops.commfuse.all_gather_mm(shard, b, None, 0, 2, name, True)  # a new start
    assert out.shape == (8, 5) and groups.get(name) is not group and int(groups.get(name).err[0]) == 0


def test_the_error_names_global_ranks_of_a_subgroup(world2):
    """Group ranks 0 and 1 of a group of global ranks 4 and 6 are named 4 and 6."""
    group = groups.Group("tp", weakref.ref(dist.group.WORLD), (4, 6), 0, 2, "torch", wsmod.error_word())
    group.workspace = _workspace(name="tp", err=group.err, timeout_ns=3 * 10**9)
    group.err[:4] = torch.tensor([1, 3, 0, 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"commfuse\.mm_reduce_scatter: on group 'tp', rank 4 timed out after 3 s "
                                           r"waiting for rank 6 \(group ranks 0 and 1\)"):
        errors.check(group)
    assert group.broken and group.workspace.broken == group.broken


def test_a_mismatch_names_both_calls_and_stops_the_group(world2):
    """A wait that met its peer at the same call count under another pairing tag wrote
    ``[ERR_MISMATCH, op, rank, peer, count, my tag, its tag]``: the error says the ranks paired
    different calls (not a timeout), names both global ranks, the count and both tags, and the
    group refuses further calls as after a timeout."""
    group = groups.Group("tp", weakref.ref(dist.group.WORLD), (4, 6), 1, 2, "torch", wsmod.error_word())
    group.workspace = _workspace(name="tp", err=group.err, timeout_ns=3 * 10**9)
    group.err[:7] = torch.tensor([ERR_MISMATCH, 1, 1, 0, 12, 301, 77], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"commfuse\.mm_all_reduce: on group 'tp', call 12 of the group on rank 6 "
                                           r"\(tag 301\) met a different call on rank 4 \(tag 77; group ranks 1 "
                                           r"and 0\).*skipped, added or reordered") as info:
        errors.check(group)
    assert "timed out" not in str(info.value)
    assert group.broken and group.workspace.broken == group.broken


def test_a_timeout_stops_only_its_own_group(fresh_groups, monkeypatch):
    """A peer slower than the bound may pair its waits with this rank's later calls on that group:
    after a timeout the group's workspace refuses calls, and so does a regrown one (allocation is
    collective); another group, with its own error word, goes on."""
    sub = dist.new_group([0, 1])
    tp, sp = groups.get(group_name()), groups.get(sub.group_name)
    assert tp.err is not sp.err
    for g in (tp, sp):
        g.workspace = _workspace(1024, name=g.name, err=g.err)
    tp.err[:4] = torch.tensor([1, 3, 0, 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"mm_reduce_scatter: on group '0', rank 0 timed out"):
        commfuse.check_errors()
    with pytest.raises(RuntimeError, match=r"mm_reduce_scatter: on group '0', rank 0 timed out.*refuses further calls"):
        tp.workspace.next_epoch()
    with pytest.raises(RuntimeError, match="refuses further calls"):
        groups.workspace(tp, 1 << 20, torch.device("cpu"))  # no collective allocation from it
    assert sp.workspace.next_epoch() == (flag_value(1), 1) and not sp.broken
    assert groups.workspace(sp, 1024, torch.device("cpu")) is sp.workspace
    a, b = torch.randn(4, 6), torch.randn(6, 5)
    torch.ops.commfuse.mm_all_reduce(a, b, None, sub.group_name)  # the other group's calls run
    with pytest.raises(RuntimeError, match="refuses further calls"):
        torch.ops.commfuse.mm_all_reduce(a, b, None, group_name())
    dist.destroy_process_group(sub)


def test_timeout_bound_fits_the_kernels_nanoseconds():
    with env.override(timeout_s="1e9") as settings:
        assert int(settings.timeout_s * 1e9) == 10**18 < 2**63
    with pytest.raises(ValueError, match=r"COMMFUSE_TIMEOUT_S='1e11' must be at most 1e\+09"):
        with env.override(timeout_s="1e11"):
            pass
