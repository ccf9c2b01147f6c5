"""FP8 on real ranks (gloo, 2 CPU processes): each FP8 form compiled with commfuse equals the same
graph compiled without it, and both an fp32 reference of the unfused computation (every rank's
dequantised operands, ``_scaled_mm``'s scales, summed in fp32), on fresh random data each time,
with the previous outputs poisoned first (a result that reused a stale buffer would show)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from helpers import spawn

WORLD = 2
E4M3, E5M2, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
#: Per element, |got - want| <= rel * (|want| + the sum of the ranks' |partial|) + 1e-5 against the
#: fp32 reference: a bf16 output rounds each rank's partial and then the sum (half an ulp, 2^-9 of
#: the value, each); an fp32 one differs by the order of accumulation only.
RELATIVE = {BF16: 2 ** -8, torch.float32: 1e-5}


def _gather_all(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(out, t.contiguous())
    return out


def _dequant(x8, scale):
    return x8.float() * scale.float()


def _forms(rank: int, group):
    """(name, fn, make_inputs, fp32 reference of the inputs (and the ranks' summed |partial|), the
    FP8 op it must fuse into, whether the unfused graph runs on gloo)."""
    def scaled(x, b, sa, sb, bias, out_dtype, fast):
        return torch._scaled_mm(x.reshape(-1, x.shape[-1]), b, sa, sb, bias=bias, out_dtype=out_dtype,
                                use_fast_accum=fast)

    def ref_product(x, b, sa, sb, bias):
        y = _dequant(x.reshape(-1, x.shape[-1]), sa) @ _dequant(b, sb)
        return y if bias is None else y + bias.float()

    def inputs(shape, k, n, bias, dtype=E4M3):
        x = torch.randn(*shape, k).to(dtype)
        b = torch.randn(n, k).to(E4M3).t()
        sa, sb = torch.rand(()) + 0.5, torch.rand(()) + 0.5
        return [x, b, sa, sb, torch.randn(n).to(BF16) if bias else None]

    for out_dtype, bias, fast in ((BF16, True, True), (torch.float32, False, False)):
        def ar(x, b, sa, sb, c, out_dtype=out_dtype, fast=fast):
            y = scaled(x, b, sa, sb, c, out_dtype, fast)
            return funcol.all_reduce(y.reshape(*x.shape[:-1], -1), "sum", group)

        def ar_ref(x, b, sa, sb, c):
            partials = _gather_all(ref_product(x, b, sa, sb, c).reshape(*x.shape[:-1], -1))
            return sum(partials), sum(p.abs() for p in partials)

        yield (f"_scaled_mm -> all_reduce {out_dtype} bias={bias} fast={fast}", ar,
               lambda bias=bias: inputs((4, 16), 32, 48, bias), ar_ref, "scaled_mm_all_reduce", True)

    def rs(x, b, sa, sb, c):
        y = scaled(x, b, sa, sb, c, BF16, True).reshape(*x.shape[:-1], -1)
        return funcol.reduce_scatter_tensor(y, "sum", 1, group)

    def rs_ref(x, b, sa, sb, c):
        partials = _gather_all(ref_product(x, b, sa, sb, c).reshape(*x.shape[:-1], -1))
        return (sum(partials).chunk(WORLD, dim=1)[rank], sum(p.abs() for p in partials).chunk(WORLD, dim=1)[rank])

    yield ("_scaled_mm -> reduce_scatter along the sequence", rs, lambda: inputs((2, 16), 32, 24, True), rs_ref,
           "scaled_mm_reduce_scatter", True)

    def ag(x, b, sa, sb, c):
        g = funcol.all_gather_tensor(x, 0, group)  # DTensor's FP8 gather along dim 1: the cat on bytes
        g = torch.cat([p.view(torch.uint8) for p in torch.split(g, x.shape[0])], 1).view(x.dtype)
        return scaled(g, b, sa, sb, c, BF16, False).reshape(*g.shape[:-1], -1)

    def ag_ref(x, b, sa, sb, c):
        everyone = [t.view(x.dtype) for t in _gather_all(x.view(torch.uint8))]
        want = ref_product(torch.cat(everyone, 1), b, sa, sb, c).reshape(x.shape[0], -1, b.shape[1])
        return want, want.abs()

    # gloo gathers no FP8, so the unfused graph cannot run here (the fused op gathers the bytes)
    yield ("all_gather(e5m2 shard) -> _scaled_mm", ag, lambda: inputs((2, 8), 32, 24, False, E5M2), ag_ref,
           "all_gather_scaled_mm", False)


def _worker(rank: int, init_file: str) -> None:
    import commfuse
    from helpers import gloo_rank

    group = gloo_rank(rank, init_file, WORLD)
    for name, fn, make, reference, op, unfused_runs in _forms(rank, group):
        torch._dynamo.reset()
        commfuse.clear_report()
        fused = torch.compile(fn, backend=commfuse.backend(min_mnk=0), fullgraph=True)
        plain = torch.compile(fn, backend="inductor", fullgraph=True) if unfused_runs else None
        previous: list[torch.Tensor] = []
        for _ in range(2):
            for out in previous:
                out.fill_(float("nan"))
            previous.clear()
            args = make()
            got, (want, partials) = fused(*args), reference(*args)
            if plain is not None:
                unfused = plain(*args)
                assert torch.equal(got, unfused), f"{name}: commfuse differs from the unfused graph (rank {rank})"
                previous.append(unfused)
            err = (got.float() - want).abs() - RELATIVE[got.dtype] * (want.abs() + partials)
            assert err.max() <= 1e-5, f"{name}: off the fp32 reference by {err.max():.3g} past the bound (rank {rank})"
            previous.append(got)
        assert [r.pattern for r in commfuse.report().fused] == [op], f"{name}\n{commfuse.report()}"
    dist.destroy_process_group()


@pytest.mark.slow
def test_fp8_forms_on_two_gloo_ranks():
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_worker, args=(os.path.join(tmp, "rendezvous"),), nprocs=WORLD)
