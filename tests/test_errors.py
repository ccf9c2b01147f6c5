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
from commfuse.runtime import errors, groups
from commfuse.runtime import workspace as wsmod
from helpers import group_name

from choosing import (  # noqa: F401  (_quiet_policy, fresh_groups: fixtures, found by name)
    _quiet_policy, _workspace, fresh_groups)


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
