"""``commfuse.report()``: a compile in which the pass saw no candidate says why."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import commfuse
from helpers import init_fake_pg


def _no_collectives(a, w):
    return torch.relu(a @ w)


@pytest.mark.parametrize("world_size, why", [
    (2, "no collectives in this graph"),
    (1, "no collectives in this graph; one rank: nothing to exchange"),
])
def test_a_graph_without_candidates_says_why(world_size, why):
    init_fake_pg(world_size)
    try:
        torch.compile(_no_collectives, backend=commfuse.backend())(torch.randn(8, 8), torch.randn(8, 8))
    finally:
        if world_size == 1:
            dist.destroy_process_group()
    rep = commfuse.report()
    assert not rep and len(rep.notes) == 1 and rep.notes[0].endswith(": " + why)
    assert rep.notes[0].startswith("forward#")
    assert str(rep) == f"commfuse: no candidates\n  note: {rep.notes[0]}"  # not "0 fused, 0 skipped"
    commfuse.clear_report()
    assert not commfuse.report().notes


def test_a_graph_with_other_collectives_only_says_so(world2):
    import torch.distributed._functional_collectives as funcol

    def broadcast(a):
        return funcol.broadcast(a, 0, dist.group.WORLD) + 1

    torch.compile(broadcast, backend=commfuse.backend())(torch.randn(8, 8))
    assert commfuse.report().notes[0].endswith(": no all-reduce, all-gather or reduce-scatter in this graph "
                                               "(only other collectives)")


def test_the_report_says_which_path_each_call_site_takes_and_why():
    """Once calls ran, the report lists the run-time's choice per call site and its source (rules,
    tuner, forced, capture, lane, a group without symmetric paths): the decisions each group's
    state keeps, gone with the group when it is released, and with ``clear_report``."""
    from commfuse.runtime import groups

    init_fake_pg(2)
    groups.release_all()
    name = dist.group.WORLD.group_name
    call = "mm_all_reduce 16x4096x8192 bfloat16 w2"
    groups.get(name).decisions[call] = ("split_k", "rules", "split_k when m <= 128")
    rep = commfuse.report()
    assert rep.calls == [(call, name, "split_k", "rules", "split_k when m <= 128")]
    assert f"{call} on group {name}: split_k (rules: split_k when m <= 128)" in str(rep)
    commfuse.clear_report()
    assert commfuse.report().calls == []
    groups.get(name).decisions[call] = ("nccl", "fallback", "no rule applies")
    groups.release(name)
    assert commfuse.report().calls == []
