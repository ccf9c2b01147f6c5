"""TP groups that are not simply WORLD, on the 2 GPUs: a 1x2 (DP x TP) mesh fuses over its TP
group with that group's symmetric memory, a 2x1 mesh has nothing to exchange, and two different
groups in one compiled graph each get their own workspace. Results against eager / fp32."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import commfuse
from commfuse import check_errors
from commfuse.runtime import groups
from gpu_util import gather_all, relerr


def _with_workspace() -> set[str]:
    """The names of the groups that hold a symmetric workspace on this rank."""
    return {g.name for g in groups.all_groups() if g.workspace is not None}

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dp, tp", [(1, 2), (2, 1)])
def test_tp_mesh_dimension_fuses_within_its_group(nccl, dp, tp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)  # the same weights on every rank
    mlp = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))
    mlp = mlp.cuda().bfloat16()
    eager = copy.deepcopy(mlp)
    mlp = parallelize_module(mlp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(4, 256, 1024, device="cuda", dtype=torch.bfloat16)
    commfuse.clear_report()
    with torch.no_grad():
        got = torch.compile(mlp, backend=commfuse.backend(launch_bound_bytes=0))(x)
        want = eager(x)
    check_errors()
    fused = commfuse.report().fused
    if tp == 1:
        assert not fused  # one rank per TP group: nothing to exchange
    else:
        tp_name = mesh["tp"].get_group().group_name
        assert [r.group for r in fused] == [tp_name]
        assert tp_name in _with_workspace()
    assert relerr(got, want) < 2e-2


def test_two_groups_in_one_graph_each_use_their_own_workspace(nccl):
    other = dist.new_group([0, 1])  # the same ranks, a different group (and workspace)
    torch.manual_seed(3 + dist.get_rank())
    a = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16) / 512 ** 0.5

    def f(a, b, w):
        return (funcol.all_reduce(a @ w, "sum", dist.group.WORLD)
                + funcol.all_reduce(b @ w, "sum", other))

    commfuse.clear_report()
    got = torch.compile(f, backend=commfuse.backend(launch_bound_bytes=0))(a, b, w)
    check_errors()
    assert {r.group for r in commfuse.report().fused} == {dist.group.WORLD.group_name, other.group_name}
    assert {dist.group.WORLD.group_name, other.group_name} <= _with_workspace()
    want = sum(x.float() @ y.float() for x, y in zip(gather_all(a), gather_all(w)))
    want = want + sum(x.float() @ y.float() for x, y in zip(gather_all(b), gather_all(w)))
    assert relerr(got, want) < 1e-2
