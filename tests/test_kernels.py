"""``kernels/``: what every kernel keeps off its specialisation key (epochs, slots, ranks).
"""

from __future__ import annotations


import pytest
import torch

from commfuse.kernels import fused_all_gather, fused_all_reduce, fused_split_k
from commfuse.runtime import policy
from commfuse.runtime.facts import GroupFacts
from commfuse.runtime.paths import REGISTRY
from commfuse.runtime.paths.base import Call

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


def test_exchange_kernels_do_not_specialise_on_epochs_or_slots():
    """An epoch divisible by 16 would otherwise compile and load a new kernel variant mid-run."""
    from commfuse.kernels import exchange

    for kernel in (exchange.one_shot_kernel, exchange.two_shot_kernel, exchange.pull_gather_kernel,
                   exchange.reduce_scatter_kernel, exchange.barrier_kernel,
                   fused_all_reduce.gemm_all_reduce_kernel, fused_split_k.split_k_all_reduce_kernel):
        names = [kernel.arg_names[i] if isinstance(i, int) else i for i in kernel.do_not_specialize]
        assert "epoch" in names, kernel.fn.__name__
    assert "slot" in [exchange.barrier_kernel.arg_names[i] if isinstance(i, int) else i
                      for i in exchange.barrier_kernel.do_not_specialize]


def test_no_kernel_specialises_on_the_rank():
    """Every rank runs one binary: ranks emulated on one GPU never load a kernel while another
    rank's spins waiting for it (a module load waits for the running kernels)."""
    from commfuse.kernels import exchange

    for kernel in (exchange.one_shot_kernel, exchange.staged_one_shot_kernel, exchange.two_shot_kernel,
                   exchange.pull_gather_kernel, exchange.reduce_scatter_kernel, exchange.barrier_kernel,
                   fused_all_reduce.gemm_all_reduce_kernel, fused_split_k.split_k_all_reduce_kernel,
                   fused_all_gather.all_gather_gemm_kernel):
        assert "rank" in kernel.arg_names
        assert "rank" in [kernel.arg_names[i] if isinstance(i, int) else i for i in kernel.do_not_specialize], \
            kernel.fn.__name__
