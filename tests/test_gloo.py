"""Real ranks on the CPU (gloo, 2 processes): compiled commfuse output and gradients equal eager and
an fp64 reference built from every rank's inputs, for each pattern form, forward and backward."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp
import torch.nn.functional as F

WORLD = 2


def _gather_all(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(out, t.contiguous())
    return out


def _check(name, got, want, rtol=1e-5):
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert err < rtol, f"{name}: relative error {err:.2e} (rank {dist.get_rank()})"


def _compare(name, fn, inputs, reference):
    """Compiled vs eager (values and grads) and vs the fp64 reference of the values."""
    import commfuse

    eager_in = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    comp_in = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    eager = fn(*eager_in)
    commfuse.clear_report()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=commfuse.backend(min_mnk=0), fullgraph=True)(*comp_in)
    _check(f"{name} vs eager", compiled, eager)
    _check(f"{name} vs fp64 reference", compiled, reference)
    if any(t.requires_grad for t in inputs):
        grad = torch.randn_like(eager)
        eager.backward(grad)
        compiled.backward(grad)
        for i, (e, c) in enumerate(zip(eager_in, comp_in)):
            if e.requires_grad:
                _check(f"{name} grad of input {i}", c.grad, e.grad)
    fused = commfuse.report().fused
    assert fused, f"{name}: nothing fused\n{commfuse.report()}"
    return fused


def _worker(rank: int, init_file: str) -> None:
    import commfuse

    torch._inductor.config.fx_graph_cache = False
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    group = dist.group.WORLD
    torch.manual_seed(100 + rank)  # every rank holds different data

    # mm -> all_reduce, 2-D and 3-D, with and without bias; forward and backward.
    for shape in [(64, 32), (4, 16, 32)]:
        for bias in (False, True):
            x = torch.randn(*shape, requires_grad=True)
            w = torch.randn(24, 32, requires_grad=True)
            b = torch.randn(24, requires_grad=True) if bias else None
            fn = lambda x, w, b=None: funcol.all_reduce(F.linear(x, w, b), "sum", group)
            partial = F.linear(x.double(), w.double(), None if b is None else b.double())
            reference = sum(_gather_all(partial))
            args = [x, w] + ([b] if bias else [])
            fused = _compare(f"mm_all_reduce {shape} bias={bias}", fn, args, reference)
            assert any(r.pattern == "mm_all_reduce" for r in fused)

    # all_gather -> matmul along dim 0 (sequence-first) and dim 1 (DTensor's batch-first layout).
    for gather_dim, shape in [(0, (16, 32)), (0, (8, 4, 32)), (1, (2, 8, 32))]:
        x = torch.randn(*shape, requires_grad=True)
        w = torch.randn(24, 32, requires_grad=True)
        fn = lambda x, w: F.linear(funcol.all_gather_tensor(x, gather_dim, group), w)
        reference = F.linear(torch.cat(_gather_all(x.detach().double()), dim=gather_dim), w.detach().double())
        fused = _compare(f"all_gather_mm dim={gather_dim} {shape}", fn, [x, w], reference)
        assert any(r.pattern == "all_gather_mm" for r in fused)

    # matmul -> reduce_scatter along dim 0 (sequence-first) and dim 1 (DTensor's layout).
    for scatter_dim, shape in [(0, (16, 32)), (0, (8, 4, 32)), (1, (2, 8, 32))]:
        x = torch.randn(*shape, requires_grad=True)
        w = torch.randn(24, 32, requires_grad=True)
        fn = lambda x, w: funcol.reduce_scatter_tensor(F.linear(x, w), "sum", scatter_dim, group)
        total = sum(_gather_all(F.linear(x.detach().double(), w.detach().double())))
        reference = total.chunk(WORLD, dim=scatter_dim)[rank]
        fused = _compare(f"mm_reduce_scatter dim={scatter_dim} {shape}", fn, [x, w], reference)
        assert any(r.pattern == "mm_reduce_scatter" for r in fused)

    # merge_sums: all-reduced partials summed (DTensor's q/k/v input gradients), and partials summed
    # then reduce-scattered (the sequence-parallel form): one matmul of the concatenations, reduced once.
    x1, x2 = torch.randn(4, 16, 32, requires_grad=True), torch.randn(4, 16, 8, requires_grad=True)
    w1, w2 = torch.randn(24, 32, requires_grad=True), torch.randn(24, 8, requires_grad=True)
    partial = F.linear(x1.detach().double(), w1.detach().double()) + F.linear(x2.detach().double(), w2.detach().double())
    total = sum(_gather_all(partial))
    fn = lambda x1, w1, x2, w2: (funcol.all_reduce(F.linear(x1, w1), "sum", group)
                                 + funcol.all_reduce(F.linear(x2, w2), "sum", group))
    _compare("merged all-reduces", fn, [x1, w1, x2, w2], total)
    assert [r.reason for r in commfuse.report().merged] == ["merged 2 all-reduced partials (K=32+8)"]
    fn = lambda x1, w1, x2, w2: funcol.reduce_scatter_tensor(F.linear(x1, w1) + F.linear(x2, w2), "sum", 1, group)
    _compare("merged reduce-scatter", fn, [x1, w1, x2, w2], total.chunk(WORLD, dim=1)[rank])
    assert [r.reason for r in commfuse.report().merged] == ["merged 2 partials of one reduction (K=32+8)"]
    dist.destroy_process_group()


@pytest.mark.slow
def test_gloo_two_ranks_match_eager():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(os.path.join(tmp, "rendezvous"),), nprocs=WORLD, join=True)
