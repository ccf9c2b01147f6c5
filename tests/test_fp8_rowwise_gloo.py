"""Row-wise FP8 on real ranks (gloo, 2 CPU processes): each form compiled with commfuse equals the
same graph compiled without it, bit for bit (the stated tolerance is none: the FP8 rows and their
scales are the same bits and the same ``_scaled_mm`` runs on them), on fresh random data each
time, with the previous outputs poisoned first (a result that reused a stale buffer would show).
For the gather, the FP8 rows and multipliers each rank quantises before the gather are checked
against the unfused graph's, quantised after it."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from helpers import spawn

WORLD = 2
E4M3, BF16 = torch.float8_e4m3fn, torch.bfloat16


def _forms(group):
    """(name, fn, make_inputs, the op it must fuse into)."""
    from commfuse.runtime import reference

    def gather(x):  # DTensor's gather of a sequence shard: along dim 0, then split/cat along dim 1
        g = funcol.all_gather_tensor(x, 0, group)
        return torch.cat(torch.split(g, x.shape[0]), 1)

    for pow2 in (True, False):
        def ag(x, b, sb, pow2=pow2):
            g = gather(x)
            q, m = reference.quantise_rows(g, E4M3, 1e-12, pow2)
            y = torch._scaled_mm(q.reshape(-1, 32), b, m.reshape(-1, 1).reciprocal(), sb, out_dtype=BF16,
                                 use_fast_accum=True)
            return y.reshape(*g.shape[:-1], -1)

        # activations spread over six decades, so rows get scales far apart
        yield (f"all_gather -> row-wise quantise -> _scaled_mm pow2={pow2}", ag,
               lambda: [torch.randn(2, 8, 32, dtype=BF16) * torch.logspace(-3, 3, 8).reshape(1, 8, 1).to(BF16),
                        torch.randn(24, 32).to(E4M3).t(), torch.rand(1, 24) + 0.5],
               "all_gather_rowwise_scaled_mm")

    def ar(a, b, ra, rb):
        y = torch._scaled_mm(a, b, ra, rb, out_dtype=BF16, use_fast_accum=True)
        return funcol.all_reduce(y, "sum", group)

    yield ("row-wise _scaled_mm -> all_reduce", ar,
           lambda: [torch.randn(64, 32).to(E4M3), torch.randn(48, 32).to(E4M3).t(), torch.rand(64, 1) + 0.5,
                    torch.rand(1, 48) + 0.5], "rowwise_scaled_mm_all_reduce")

    def rs(a, b, ra, rb):
        one = torch.ones((), dtype=torch.float32)
        y = (torch._scaled_mm(a, b, one, one, out_dtype=BF16) * (ra * rb)).to(BF16)
        return funcol.reduce_scatter_tensor(y.reshape(2, 16, 24), "sum", 1, group)

    yield ("backward form _scaled_mm(ones) * scales -> reduce_scatter", rs,
           lambda: [torch.randn(32, 32).to(E4M3), torch.randn(24, 32).to(E4M3).t(), torch.rand(32, 1) + 0.5,
                    torch.rand(1, 24) + 0.5], "rowwise_scaled_mm_reduce_scatter")


def _quantised_alike(group):
    """Each rank's rows quantised before the gather are the unfused graph's, quantised after it."""
    from commfuse.runtime import reference

    def after(x, pow2):
        g = torch.cat(torch.split(funcol.all_gather_tensor(x, 0, group), x.shape[0]), 1)
        return reference.quantise_rows(g, E4M3, 1e-12, pow2)

    compiled = torch.compile(after, backend="inductor", fullgraph=True)
    for pow2 in (True, False):
        x = torch.randn(2, 8, 32, dtype=BF16) * torch.logspace(-3, 3, 8).reshape(1, 8, 1).to(BF16)
        q, m = reference.quantise_rows(x, E4M3, 1e-12, pow2)
        q = reference.all_gather(q, 1, WORLD, group.group_name)
        m = reference.all_gather(m, 1, WORLD, group.group_name)
        want_q, want_m = compiled(x, pow2)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), "FP8 rows differ"
        assert torch.equal(m, want_m), "row multipliers differ"


def _worker(rank: int, init_file: str) -> None:
    import commfuse
    from helpers import gloo_rank

    group = gloo_rank(rank, init_file, WORLD)
    _quantised_alike(group)
    for name, fn, make, op in _forms(group):
        torch._dynamo.reset()
        commfuse.clear_report()
        fused = torch.compile(fn, backend=commfuse.backend(min_mnk=0, launch_bound_bytes=0), fullgraph=True)
        plain = torch.compile(fn, backend="inductor", fullgraph=True)
        previous: list[torch.Tensor] = []
        for _ in range(2):
            for out in previous:
                out.fill_(float("nan"))
            previous.clear()
            args = make()
            got, unfused = fused(*args), plain(*args)
            assert torch.equal(got, unfused), f"{name}: commfuse differs from the unfused graph (rank {rank})"
            previous += [got, unfused]
        assert [r.pattern for r in commfuse.report().fused] == [op], f"{name}\n{commfuse.report()}"
    dist.destroy_process_group()


@pytest.mark.slow
def test_rowwise_fp8_forms_on_two_gloo_ranks():
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_worker, args=(os.path.join(tmp, "rendezvous"),), nprocs=WORLD)
