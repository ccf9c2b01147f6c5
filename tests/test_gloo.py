"""Real ranks on the CPU (gloo, 2 processes): compiled commfuse output and gradients equal eager and
an fp64 reference built from every rank's inputs, for each pattern form, forward and backward."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from helpers import spawn

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
    from helpers import gloo_rank

    group = gloo_rank(rank, init_file, WORLD)

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

    # torchtitan's sequence-parallel form: the scattered dim permuted to the front of a contiguous
    # copy, scattered along dim 0, permuted back; once more with the waited tensor also read as it
    # is (a forward saves it for the backward), and with summed partials (merged first).
    x = torch.randn(2, 8, 32, requires_grad=True)
    w = torch.randn(24, 32, requires_grad=True)
    total = sum(_gather_all(F.linear(x.detach().double(), w.detach().double())))

    def scatter(y):
        return funcol.reduce_scatter_tensor(y.permute(1, 0, 2).contiguous(), "sum", 0, group)

    fn = lambda x, w: scatter(F.linear(x, w)).permute(1, 0, 2)  # noqa: E731
    reference = total.chunk(WORLD, dim=1)[rank]
    fused = _compare("mm_reduce_scatter through a permuted copy", fn, [x, w], reference)
    assert sorted(r.pattern for r in fused) == ["all_gather_mm", "mm_reduce_scatter"], commfuse.report()

    def saved(x, w):
        y = scatter(F.linear(x, w))
        return y.permute(1, 0, 2) * y.permute(1, 0, 2).sum()

    fused = _compare("permuted copy, waited tensor saved", saved, [x, w], reference * reference.sum())
    assert "mm_reduce_scatter" in [r.pattern for r in fused], commfuse.report()
    x2, w2 = torch.randn(2, 8, 16, requires_grad=True), torch.randn(24, 16, requires_grad=True)
    total2 = total + sum(_gather_all(F.linear(x2.detach().double(), w2.detach().double())))
    fn = lambda x, w, x2, w2: scatter(F.linear(x, w) + F.linear(x2, w2)).permute(1, 0, 2)  # noqa: E731
    _compare("merged sum through a permuted copy", fn, [x, w, x2, w2], total2.chunk(WORLD, dim=1)[rank])
    assert [r.reason for r in commfuse.report().merged] == ["merged 2 partials of one reduction (K=32+16)"]

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
    _uneven_shards(rank, group)
    _review_forms(rank, group)
    _verify_counts_calls(rank, group)
    _add_rms_norm(rank, group)
    dist.destroy_process_group()


def _add_rms_norm(rank: int, group) -> None:
    """The opt-in add + RMSNorm chain (a real all-reduce here, where the fake group's is the
    identity): ``h`` and ``n`` against fp64 of the chain with both ranks' partials, in bf16's
    LlamaRMSNorm rounding and fp32 (inference: the chain is a forward rewrite)."""
    import commfuse

    def chain(x, w, residual, weight):
        h = residual + funcol.all_reduce(F.linear(x, w), "sum", group)
        hf = h.float()
        return h, weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)

    backend = commfuse.backend(min_mnk=0, patterns=[*commfuse.DEFAULT_PATTERNS, "add_rms_norm"])
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x, w = torch.randn(2, 8, 32).to(dtype), torch.randn(40, 32).to(dtype)
        residual, weight = torch.randn(2, 8, 40).to(dtype), torch.randn(40).to(dtype)
        torch._dynamo.reset()
        commfuse.clear_report()
        with torch.no_grad():
            h, n = torch.compile(chain, backend=backend, fullgraph=True)(x, w, residual, weight)
        want_h = residual.double() + sum(_gather_all(F.linear(x.double(), w.double())))
        want_n = want_h * torch.rsqrt(want_h.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
        _check(f"add_rms_norm h {dtype}", h, want_h, tol)
        _check(f"add_rms_norm n {dtype}", n, want_n, tol)
        assert [r.pattern for r in commfuse.report().fused] == ["add_rms_norm"], commfuse.report()


def _uneven_shards(rank: int, group) -> None:
    """33 in-features on 2 ranks: K is 17 on rank 0 and 16 on rank 1. With a size threshold
    between the ranks' M * N * K, a rule that read K merged (and fused) on one rank only: its one
    all-reduce met the other rank's first, a wrong sum there and a hang on the other. Both ranks
    decide alike now, and the values hold. The run-time check learns the sizes differ."""
    import commfuse
    from commfuse import env
    from commfuse.runtime import groups, shards, verify

    k = 17 if rank == 0 else 16
    x1, x2 = torch.randn(64, k), torch.randn(64, k)
    w1, w2 = torch.randn(48, k), torch.randn(48, k)
    fn = lambda x1, w1, x2, w2: (funcol.all_reduce(F.linear(x1, w1), "sum", group)  # noqa: E731
                                 + funcol.all_reduce(F.linear(x2, w2), "sum", group))
    partial = F.linear(x1.double(), w1.double()) + F.linear(x2.double(), w2.double())
    reference = sum(_gather_all(partial))
    for min_mnk in (64 * 48 * 17, 0):
        commfuse.clear_report()
        torch._dynamo.reset()
        out = torch.compile(fn, backend=commfuse.backend(min_mnk=min_mnk), fullgraph=True)(x1, w1, x2, w2)
        _check(f"uneven K, min_mnk={min_mnk}", out, reference)
        decisions = [(r.pattern, r.fused) for r in commfuse.report()]
        every = [None] * WORLD
        dist.all_gather_object(every, decisions)
        assert every[0] == every[1], every
    cpu, name = torch.device("cpu"), group.group_name

    def fresh():  # every rank together: the group's state (its kept answers) dropped
        groups.release(name)
        return groups.get(name)

    g = fresh()

    def alike(op, size, every_call=False):
        return shards.alike(g, op, size, cpu, False, every_call)

    before = shards.LEARNED
    assert alike("all_gather_mm", 16 * 1024)
    assert alike("all_gather_mm", 16 * 1024)  # kept
    assert shards.LEARNED == before + 1
    assert not alike("mm_all_reduce", k)
    # an even layer whose size rank 1 already met at the uneven one: rank 1 must not answer from
    # what it kept while rank 0 agrees (they would pair the agreement with another collective)
    assert alike("mm_all_reduce", 16)
    assert alike("mm_all_reduce", 16 * 1024)
    assert not alike("mm_all_reduce", k)
    assert shards.LEARNED == before + 5  # once uneven, every call of the op agrees
    assert g.uneven_ops == {"mm_all_reduce"}
    assert alike("all_gather_mm", 16 * 1024)  # other ops keep their answers
    assert shards.LEARNED == before + 5
    # an even layer first: only agreeing on every call (COMMFUSE_VERIFY) can tell the uneven one
    g = fresh()
    with env.override(verify=True):
        assert alike("mm_reduce_scatter", 16, every_call=verify.enabled())
        assert not alike("mm_reduce_scatter", k, every_call=verify.enabled())
    fresh()


def _review_forms(rank: int, group) -> None:
    """Two forms the patterns must get right: an all-gather whose product Inductor turns into
    ``addmm`` with the residual as a per-row bias (the op must check that bias against the
    gathered rows, not the shard's, or it raises), and a reduce-scatter of a cat of only some of a
    split's pieces (matched as the whole tensor, it would give a result of the wrong shape)."""
    import commfuse

    x, w, r = torch.randn(16, 32), torch.randn(24, 32), torch.randn(16 * WORLD, 24)
    fn = lambda x, w, r: F.linear(funcol.all_gather_tensor(x, 0, group), w) + r  # noqa: E731
    reference = F.linear(torch.cat(_gather_all(x.double())), w.double()) + r.double()
    _compare("all_gather_mm + residual (addmm, per-row bias)", fn, [x, w, r], reference)
    y_in, w2 = torch.randn(16, 32), torch.randn(24, 32)

    def subset(y_in, w2):
        pieces = torch.split(y_in @ w2.t(), 4, dim=0)  # four pieces of [4, 24], two reduce-scattered
        return funcol.reduce_scatter_tensor(torch.cat(pieces[:WORLD], 0), "sum", 0, group)

    eager = subset(y_in, w2)
    commfuse.clear_report()
    torch._dynamo.reset()
    compiled = torch.compile(subset, backend=commfuse.backend(min_mnk=0), fullgraph=True)(y_in, w2)
    assert compiled.shape == eager.shape, (compiled.shape, eager.shape)
    _check("reduce_scatter of a cat of some split pieces", compiled, eager)


def _verify_counts_calls(rank: int, group) -> None:
    """COMMFUSE_VERIFY names a call that one rank skipped even where the next call has the same
    shapes: rank 1 runs one all-reduced matmul unfused (its graph did not fuse it), so the two
    all-reduces still pair up and the values hold, but rank 1 made one commfuse call fewer, and on
    GPUs the symmetric paths would pair its next call with rank 0's previous one. The checked call
    differs between the ranks only in the group's call count (``runtime/verify.py``); every rank
    raises, none waits for the other."""
    from commfuse import env
    from commfuse.runtime import groups

    name = group.group_name
    groups.release(name)  # every rank together: the group's call count starts at 0
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    reference = sum(_gather_all(a.double() @ b.double()))
    if rank == 0:
        out = torch.ops.commfuse.mm_all_reduce(a, b, None, name)
    else:  # the call rank 1 skips: its all-reduce, unfused
        out = funcol.all_reduce(a @ b, "sum", group)
    _check("the skipped call's sum", out, reference)
    count = groups.get(name).calls
    assert count == (1 if rank == 0 else 0), count
    with env.override(verify=True):
        try:
            torch.ops.commfuse.mm_all_reduce(a, b, None, name)  # the same shapes on both ranks
        except RuntimeError as exc:
            message = str(exc)
        else:
            raise AssertionError(f"rank {rank}: COMMFUSE_VERIFY let a call that rank 1 skipped pass")
    peer = 1 - count
    assert message.startswith(f"commfuse.mm_all_reduce: ranks of group {name!r} disagree about call {count} "), message
    assert f"(call: {count} here, {peer} there)" in message, message  # the count is all that differs
    groups.release(name)


@pytest.mark.slow
def test_gloo_two_ranks_match_eager():
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_worker, args=(os.path.join(tmp, "rendezvous"),), nprocs=WORLD)
