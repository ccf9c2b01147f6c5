"""The ``add_rms_norm`` pattern and its op, ``mm_all_reduce_add_rms_norm``: the op's reference is
the unfused chain in both roundings; the pattern fuses the bundled model's and transformers'
Llama's chains where a backend names it, and none by default; the chain stays with Inductor,
with its reason, where the op cannot gain (one rank, another GPU, CUDA graphs, a training forward).

Fake process groups (this process is rank 0, the all-reduce the identity), so eager is the
reference of every compiled result here."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import commfuse
from commfuse import env
from commfuse.demo import transformer as demo
from commfuse.demo.transformer import RMSNorm
from commfuse.patterns import add_rms_norm
from commfuse.patterns.common import Skip
from commfuse.runtime import policy
from commfuse.runtime.facts import GroupFacts
from commfuse.runtime.paths import ar_norm
from commfuse.runtime.spec import Call
from helpers import calls, compile_code, group_name, init_fake_pg

OP, AR, C10D_AR = "commfuse.mm_all_reduce_add_rms_norm", "commfuse.mm_all_reduce", "_c10d_functional.all_reduce"
NORM = "mm_all_reduce_add_rms_norm"
BF16 = torch.bfloat16


def opted_in(**kw):
    return commfuse.backend(min_mnk=0, patterns=[*commfuse.DEFAULT_PATTERNS, "add_rms_norm"], **kw)


def llama_norm(h, w, eps):
    """transformers' LlamaRMSNorm: normalised in fp32, cast, then times the weight."""
    x = h.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return w * x.to(h.dtype)


def fp32_chain(a, b, residual, w, eps):
    """The unfused chain in fp32 (one rank's partial: the fake group's sum)."""
    h = residual.float() + (a.float() @ b.float()).view(residual.shape)
    return h, h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.float()


# ---- the op and its reference ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("hidden", [33, 999])
@pytest.mark.parametrize("weight_last", [True, False], ids=["llama", "rms_norm"])
def test_the_op_is_the_unfused_chain_in_its_rounding(world2, dtype, hidden, weight_last):
    """Against fp32 of the chain (both outputs), and against the models' own norm applied to the
    op's ``h``: LlamaRMSNorm's rounding or F.rms_norm's, bit for bit on the CPU."""
    torch.manual_seed(hidden)
    eps = 1e-5
    a, b = torch.randn(2 * 7, 24, dtype=dtype), torch.randn(24, hidden, dtype=dtype) / 5
    residual, w = torch.randn(2, 7, hidden, dtype=dtype), (1 + 0.2 * torch.randn(hidden)).to(dtype)
    with torch.no_grad():
        h, n = torch.ops.commfuse.mm_all_reduce_add_rms_norm(a, b, None, residual, w, eps, weight_last, group_name())
    assert h.shape == n.shape == residual.shape and h.dtype == n.dtype == dtype
    want_h, want_n = fp32_chain(a, b, residual, w, eps)
    tol = 1e-2 if dtype == BF16 else 1e-5
    for got, want in ((h, want_h), (n, want_n)):
        assert ((got.float() - want).norm() / want.norm()).item() < tol
    model = llama_norm(h, w, eps) if weight_last else F.rms_norm(h, (hidden,), w, eps)
    torch.testing.assert_close(n, model, rtol=0, atol=0 if dtype == BF16 else 1e-6)
    if dtype == BF16:  # the two roundings differ: the op keeps the one it was given
        other = F.rms_norm(h, (hidden,), w, eps) if weight_last else llama_norm(h, w, eps)
        assert not torch.equal(n, other)


def test_the_op_checks_its_operands(world2):
    a, b, w = torch.randn(4, 8), torch.randn(8, 16), torch.ones(16)
    with pytest.raises(RuntimeError, match="residual .* is not a view of the 4x16 product"):
        torch.ops.commfuse.mm_all_reduce_add_rms_norm(a, b, None, torch.randn(4, 15), w, 1e-6, True, group_name())
    with pytest.raises(RuntimeError, match="residual and weight must be torch.float32"):
        torch.ops.commfuse.mm_all_reduce_add_rms_norm(a, b, None, torch.randn(4, 16), w.to(BF16), 1e-6, True,
                                                      group_name())


# ---- the run-time's choice -----------------------------------------------------------------------

@pytest.mark.parametrize("arch, rows, hidden, capturing, want", [
    ("sm_90", 1024, 4096, False, "one_shot"),
    ("sm_90", 1024, 8192, False, "one_shot"),
    ("sm_90", 1024, 8193, False, "nccl"),  # past the kernel's rows
    ("sm_90", 16, 4096, True, "graph"),  # in a capture: the graph lane (128 KiB of its 4 MiB)
    ("sm_90", 1024, 4096, True, "nccl"),  # 8 MiB: past the lane
    ("sm_90", 16, 8193, True, "nccl"),  # past the kernel's rows, in a capture too
    ("sm_100", 1024, 4096, False, "nccl"),  # measured on sm_90 only
    ("sm_100", 16, 4096, True, "nccl"),
])
def test_a_call_takes_the_norm_epilogue_on_sm90_where_its_rows_fit(arch, rows, hidden, capturing, want):
    facts = GroupFacts.simulated(2) if arch == "sm_90" else GroupFacts.simulated(2, arch=arch, name="B200", sms=148)
    decision = policy.choose(Call(NORM, rows, 2048, hidden, BF16, 2), facts, capturing=capturing, quiet=True)
    assert decision.name == want, decision
    if want == "nccl" and not capturing:
        assert "one_shot path cannot take the call" in decision.reason, decision
    if want == "nccl" and capturing:  # the lane's own reason
        assert decision.reason == ar_norm.GRAPH.supports(Call(NORM, rows, 2048, hidden, BF16, 2), facts), decision
    one = policy.choose(Call(NORM, 1024, 2048, hidden, BF16, 1), GroupFacts.simulated(1), quiet=True)
    assert (one.name, one.source) == ("nccl", "unsupported")


# ---- the pattern ------------------------------------------------------------------------------------

def _chain(form: str, hidden: int = 48):
    def f(a, b, residual, w):
        h = residual + funcol.all_reduce((a @ b).view(residual.shape), "sum", dist.group.WORLD)
        n = llama_norm(h, w, 1e-6) if form == "llama" else F.rms_norm(h, (hidden,), w, 1e-5)
        return h, n
    return f


def _operands(dtype=BF16, hidden=48):
    return (torch.randn(16, 32, dtype=dtype), torch.randn(32, hidden, dtype=dtype),
            torch.randn(2, 8, hidden, dtype=dtype), torch.randn(hidden, dtype=dtype))


@pytest.mark.parametrize("form", ["llama", "rms_norm"])
@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=["bf16", "fp32"])
def test_the_chain_fuses_when_asked_for_and_equals_eager(world, form, dtype, fused_nodes):
    """At two ranks, the one measured; past two the opted-in chain stays with Inductor (a one-shot
    reads every peer's rows) and ``mm_all_reduce`` takes the product."""
    f, args = _chain(form), _operands(dtype)
    with torch.no_grad():
        out, code = compile_code(f, *args, backend=opted_in())
        want = f(*args)
    if world != 2:
        assert [op for op, _ in fused_nodes] == ["mm_all_reduce"] and calls(code, OP) == 0
        (skip,) = [r for r in commfuse.report().skipped if r.pattern == "add_rms_norm"]
        assert f"measured at 2 ranks only: at {world} the chain stays with Inductor" in skip.reason
        torch.testing.assert_close(out, want)  # Inductor's norm kernel: its own order of sums
        return
    assert calls(code, OP) == 1 and C10D_AR not in code and calls(code, AR) == 0, code
    ((op, plain),) = fused_nodes
    assert op == NORM and plain[-2:] == (form == "llama" and dtype == BF16, group_name())
    assert plain[0] == pytest.approx(1e-6 if form == "llama" else 1e-5)
    for got, ref in zip(out, want):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    (rec,) = commfuse.report().fused
    assert rec.pattern == "add_rms_norm" and rec.shape == (16, 32, 48)


def test_by_default_the_chain_stays_with_inductor(world2, fused_nodes):
    f, args = _chain("llama"), _operands()
    with torch.no_grad():
        _, code = compile_code(f, *args)
    assert [op for op, _ in fused_nodes] == ["mm_all_reduce"] and calls(code, OP) == 0
    assert all(r.pattern != "add_rms_norm" for r in commfuse.report())  # no entry per collective


def test_a_reduced_sum_without_a_norm_after_it_is_left_to_mm_all_reduce(world2, fused_nodes):
    def f(a, b, residual):
        return residual + funcol.all_reduce((a @ b).view(residual.shape), "sum", dist.group.WORLD)

    a, b, residual, _ = _operands()
    with torch.no_grad():
        compile_code(f, a, b, residual, backend=opted_in())
    assert [op for op, _ in fused_nodes] == ["mm_all_reduce"]
    (skip,) = commfuse.report().skipped
    assert skip.pattern == "add_rms_norm" and "not followed by an RMSNorm" in skip.reason


def _skip_reason(f, args, backend, train=False):
    ctx = torch.enable_grad() if train else torch.no_grad()
    with ctx:
        compile_code(f, *args, backend=backend)
    return [r.reason for r in commfuse.report().skipped if r.pattern == "add_rms_norm"]


def test_the_chain_stays_with_inductor_at_one_rank_under_graphs_and_past_the_kernels_rows():
    init_fake_pg(1)
    try:
        (why,) = _skip_reason(_chain("llama"), _operands(), opted_in())
        assert why.startswith("one rank")
    finally:
        init_fake_pg(2)
    commfuse.clear_report()
    torch._dynamo.reset()
    # under CUDA graphs a call past the graph lane: a capture would run the chain op by op
    with torch._inductor.config.patch({"triton.cudagraphs": True}), env.override(graph_bytes=1024):
        (why,) = _skip_reason(_chain("llama"), _operands(), opted_in())
    assert why.startswith("under CUDA graphs, 1536 bytes is past the graph lane's COMMFUSE_GRAPH_BYTES (1024)"), why
    commfuse.clear_report()
    torch._dynamo.reset()
    with torch._inductor.config.patch({"triton.cudagraphs": True}):  # within the lane: its graph path
        assert _skip_reason(_chain("llama"), _operands(), opted_in()) == []
    assert [r.pattern for r in commfuse.report().fused] == ["add_rms_norm"]
    commfuse.clear_report()
    torch._dynamo.reset()
    (why,) = _skip_reason(_chain("rms_norm", 8200), _operands(hidden=8200), opted_in())
    assert "hidden size 8200 is past the norm epilogue's 8192" in why


def test_the_gate_reads_the_gpu_and_the_rules(monkeypatch):
    """On a GPU: sm_90 fuses what the settings ask for, another architecture or ROCm does not; a
    row of the GPU's rules table would make it fuse unasked (none is shipped yet)."""
    call = Call(NORM, 64, 128, 4096, BF16, 2)
    cuda = torch.device("cuda", 0)
    asked = commfuse.Settings.build(patterns=["add_rms_norm"])
    for facts, why in ((GroupFacts.simulated(2, arch="sm_100"), "measured on sm_90 only, not sm_100"),
                       (GroupFacts.simulated(2, arch="gfx942", rocm=True), "ROCm")):
        monkeypatch.setattr(add_rms_norm, "local_facts", lambda *a, facts=facts, **k: facts)
        with pytest.raises(Skip, match=why):
            add_rms_norm._gated(cuda, call, asked)
    monkeypatch.setattr(add_rms_norm, "local_facts", lambda *a, **k: GroupFacts.simulated(2))
    add_rms_norm._gated(cuda, call, asked)
    with pytest.raises(Skip, match="opt-in and no rule"):
        add_rms_norm._gated(cuda, call, commfuse.Settings())
    monkeypatch.setattr(policy, "ruled", lambda call, facts: True)
    add_rms_norm._gated(cuda, call, commfuse.Settings())


def test_a_training_forward_keeps_its_norm_for_the_backward(world2, fused_nodes):
    """The forward saves the norm's rsqrt for the backward: that chain is not the op's to take."""
    model = RMSNorm(48, 1e-5)

    def f(a, b, residual):
        h = residual + funcol.all_reduce((a @ b).view(residual.shape), "sum", dist.group.WORLD)
        return h, model(h)

    a, b, residual, _ = _operands(torch.float32)
    reasons = _skip_reason(f, (a, b, residual), opted_in(), train=True)
    assert any("rsqrt has 2 users" in r for r in reasons), reasons
    assert NORM not in [op for op, _ in fused_nodes]


def _bundled(world, layers=2):
    cfg = demo.sized_config(True, layers, world)
    torch.manual_seed(0)
    return demo.parallelize_hooks(demo.Transformer(cfg).eval()), torch.randn(2, 16, cfg.dim)


@pytest.mark.slow
def test_the_bundled_stack_fuses_every_add_and_norm_after_a_row_parallel_linear(world2, fused_nodes):
    """Two layers: wo -> ffn_norm and w2 -> the next attention_norm fuse (3 chains); the last
    w2's sum has no norm after it and takes mm_all_reduce."""
    model, x = _bundled(world2)
    with torch.no_grad():
        out, code = compile_code(model, x, backend=opted_in())
        want = model(x)
    assert calls(code, OP) == 3 and calls(code, AR) == 1 and C10D_AR not in code, code
    torch.testing.assert_close(out, want)
    fused = {r.module for r in commfuse.report().fused if r.pattern == "add_rms_norm"}
    assert fused == {"layers.0.attention.wo", "layers.0.feed_forward.w2", "layers.1.attention.wo"}


@pytest.mark.slow
def test_the_bundled_stack_by_default_and_in_bf16(world2, fused_nodes):
    model, x = _bundled(world2, layers=1)
    with torch.no_grad():
        _, code = compile_code(model, x)
        assert calls(code, OP) == 0 and calls(code, AR) == 2
        torch._dynamo.reset()
        model, x = model.to(BF16), x.to(BF16)
        out, code = compile_code(model, x, backend=opted_in())
        assert calls(code, OP) == 1 and calls(code, AR) == 1
        # (Inductor's kernels elsewhere in the block round otherwise than eager's)
        torch.testing.assert_close(out, model(x), rtol=2e-2, atol=2e-2)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_transformers_llama_split_by_its_own_plan_fuses_both_chains_of_a_layer(world2, fused_nodes):
    """o_proj -> post_attention_layernorm and down_proj -> the final norm, through DTensor."""
    from commfuse.demo import hf_llama

    cfg = demo.Config(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128)
    model = hf_llama.parallelize_by_own_plan(hf_llama.build(cfg, "cpu", BF16).eval(),
                                             init_device_mesh("cpu", (world2,)))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        out, code = compile_code(lambda i: model(i).logits, ids, backend=opted_in())
    assert calls(code, OP) == 2 and C10D_AR not in code, code
    assert [op for op, _ in fused_nodes] == [NORM, NORM]
    assert [plain[-2] for _, plain in fused_nodes] == [True, True]  # LlamaRMSNorm's rounding
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)



def test_a_view_that_changes_the_rows_is_left_to_mm_all_reduce(world2, fused_nodes):
    """The norm over the last dimension of a view of the product ([16, 48] as [16, 6, 8]) does
    not normalise the product's rows: skipped with its reason (it failed the compile before)."""
    def f(a, b, residual, w):
        h = residual + funcol.all_reduce((a @ b).view(16, 6, 8), "sum", dist.group.WORLD)
        return h, llama_norm(h, w, 1e-6)

    a, b = torch.randn(16, 32, dtype=BF16), torch.randn(32, 48, dtype=BF16)
    args = (a, b, torch.randn(16, 6, 8, dtype=BF16), torch.randn(8, dtype=BF16))
    with torch.no_grad():
        out, _ = compile_code(f, *args, backend=opted_in())
        want = f(*args)
    assert [op for op, _ in fused_nodes] == ["mm_all_reduce"]
    (skip,) = [r for r in commfuse.report().skipped if r.pattern == "add_rms_norm"]
    assert "a view changes the product's last dimension" in skip.reason
    torch.testing.assert_close(out, want)


def test_a_strided_residual_gives_the_compiled_graph_its_contiguous_outputs(world2, fused_nodes):
    """A transposed residual: the op's outputs are contiguous as its fake says (the reference
    gave ``h`` the residual's strides, which the compiled graph's stride check refused)."""
    def f(a, b, residual_t, w):
        h = residual_t.t() + funcol.all_reduce(a @ b, "sum", dist.group.WORLD)
        return h, llama_norm(h, w, 1e-6)

    a, b = torch.randn(16, 32, dtype=BF16), torch.randn(32, 48, dtype=BF16)
    args = (a, b, torch.randn(48, 16, dtype=BF16), torch.randn(48, dtype=BF16))
    with torch.no_grad():
        out, code = compile_code(f, *args, backend=opted_in())
        want = f(*args)
    assert calls(code, OP) == 1 and [op for op, _ in fused_nodes] == [NORM]
    for got, ref in zip(out, want):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


# ---- the sequence-parallel form: a reduce-scatter in the all-reduce's place ----------------------

SP_OP, RS = "commfuse.mm_reduce_scatter_add_rms_norm", "commfuse.mm_reduce_scatter"
SP_NORM = "mm_reduce_scatter_add_rms_norm"


@pytest.mark.parametrize("weight_last", [True, False], ids=["llama", "rms_norm"])
def test_the_sequence_parallel_op_is_the_unfused_chain_on_this_ranks_share(world2, weight_last):
    """A batch of sequences scattered along the sequence: this rank's share (the fake group's rank 0
    keeps block 0 of each sequence) plus the residual, then the norm; against fp32 of the chain."""
    torch.manual_seed(3)
    eps, hidden = 1e-5, 33
    a, b = torch.randn(2 * 8, 24, dtype=BF16), torch.randn(24, hidden, dtype=BF16) / 5
    residual, w = torch.randn(2, 4, hidden, dtype=BF16), (1 + 0.2 * torch.randn(hidden)).to(BF16)
    with torch.no_grad():
        h, n = torch.ops.commfuse.mm_reduce_scatter_add_rms_norm(a, b, None, residual, w, eps, weight_last,
                                                                 [2, 8, hidden], 1, 2, group_name())
    assert h.shape == n.shape == residual.shape and h.is_contiguous() and n.is_contiguous()
    share = (a.float() @ b.float()).view(2, 8, hidden)[:, :4]
    want_h = residual.float() + share
    want_n = want_h * torch.rsqrt(want_h.pow(2).mean(-1, keepdim=True) + eps) * w.float()
    for got, want in ((h, want_h), (n, want_n)):
        assert ((got.float() - want).norm() / want.norm()).item() < 1e-2
    model = llama_norm(h, w, eps) if weight_last else F.rms_norm(h, (hidden,), w, eps)
    torch.testing.assert_close(n, model, rtol=0, atol=0)


def test_the_sequence_parallel_op_checks_its_residual_is_the_share(world2):
    a, b, w = torch.randn(8, 4), torch.randn(4, 16), torch.ones(16)
    with pytest.raises(RuntimeError, match=r"residual \(8, 16\) is not a view of the 8x16 product's share of 2"):
        torch.ops.commfuse.mm_reduce_scatter_add_rms_norm(a, b, None, torch.randn(8, 16), w, 1e-6, True, [8, 16], 0,
                                                          2, group_name())
    with pytest.raises(RuntimeError, match=r"residual \(2, 2, 16\) is not shaped as this rank's share \[4, 16\]"):
        torch.ops.commfuse.mm_reduce_scatter_add_rms_norm(a, b, None, torch.randn(2, 2, 16), w, 1e-6, True, [8, 16], 0,
                                                          2, group_name())


@pytest.mark.parametrize("arch, capturing, hidden, want", [
    ("sm_90", False, 4096, "pull"), ("sm_90", False, 8193, "nccl"), ("sm_90", True, 4096, "nccl"),
    ("sm_100", False, 4096, "nccl")])
def test_a_sequence_parallel_call_takes_the_pull_on_sm90_outside_captures(arch, capturing, hidden, want):
    facts = GroupFacts.simulated(2) if arch == "sm_90" else GroupFacts.simulated(2, arch=arch, name="B200", sms=148)
    decision = policy.choose(Call(SP_NORM, 1024, 2048, hidden, BF16, 2), facts, capturing=capturing, quiet=True)
    assert decision.name == want, decision


def _sp_chain(form: str, hidden: int = 48):
    """A row-parallel linear's reduce-scatter (``form``: along dim 0 of [S, B, H]; along the
    sequence of [B, S, H] as DTensor writes it; torchtitan's permuted copy), then the residual
    add and LlamaRMSNorm."""
    def f(x, w_out, residual, w):
        y = F.linear(x, w_out)
        if form == "dim0":
            share = funcol.reduce_scatter_tensor(y, "sum", 0, dist.group.WORLD)
        elif form == "dtensor":
            share = funcol.reduce_scatter_tensor(y, "sum", 1, dist.group.WORLD)
        else:  # torchtitan: the sequence to the front, a contiguous copy, scattered, permuted back
            share = funcol.reduce_scatter_tensor(y.permute(1, 0, 2).contiguous(), "sum", 0,
                                                 dist.group.WORLD).permute(1, 0, 2)
        h = residual + share
        return h, llama_norm(h, w, 1e-6)
    return f


def _sp_operands(form: str, dtype=BF16, hidden=48):
    x = torch.randn(16, 2, 32, dtype=dtype) if form == "dim0" else torch.randn(2, 16, 32, dtype=dtype)
    share = (8, 2, hidden) if form == "dim0" else (2, 8, hidden)
    return x, torch.randn(hidden, 32, dtype=dtype), torch.randn(*share, dtype=dtype), torch.randn(hidden, dtype=dtype)


@pytest.mark.parametrize("form", ["dim0", "dtensor", "permuted"])
def test_the_sequence_parallel_chain_fuses_when_asked_for_and_equals_eager(world2, form, fused_nodes):
    f, args = _sp_chain(form), _sp_operands(form)
    with torch.no_grad():
        out, code = compile_code(f, *args, backend=opted_in())
        want = f(*args)
    assert calls(code, SP_OP) == 1 and calls(code, RS) == 0 and "reduce_scatter_tensor" not in code, code
    assert "aten.permute" not in code and "aten.cat" not in code, code
    ((op, plain),) = fused_nodes
    assert op == SP_NORM and plain[-1] == group_name()
    for got, ref in zip(out, want):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    (rec,) = commfuse.report().fused
    assert rec.pattern == "add_rms_norm" and rec.shape == (32, 32, 48)


def test_by_default_and_under_graphs_the_sequence_parallel_chain_stays_with_inductor(world2, fused_nodes):
    f, args = _sp_chain("permuted"), _sp_operands("permuted")
    with torch.no_grad():
        _, code = compile_code(f, *args)
    assert [op for op, _ in fused_nodes] == ["mm_reduce_scatter"] and calls(code, SP_OP) == 0
    commfuse.clear_report()
    torch._dynamo.reset()
    fused_nodes.clear()
    with torch._inductor.config.patch({"triton.cudagraphs": True}):
        (why,) = _skip_reason(f, args, opted_in())
    assert why.startswith("under CUDA graphs the sequence-parallel form has no capturable path"), why
    assert [op for op, _ in fused_nodes] == ["mm_reduce_scatter"]


def test_a_sequence_parallel_share_read_by_more_than_the_add_is_left_to_mm_reduce_scatter(world2, fused_nodes):
    def f(x, w_out, residual, w):
        share = funcol.reduce_scatter_tensor(F.linear(x, w_out), "sum", 1, dist.group.WORLD)
        h = residual + share
        return h, llama_norm(h, w, 1e-6), share * 2

    args = _sp_operands("dtensor")
    with torch.no_grad():
        out, _ = compile_code(f, *args, backend=opted_in())
        want = f(*args)
    assert [op for op, _ in fused_nodes] == ["mm_reduce_scatter"]
    (skip,) = [r for r in commfuse.report().skipped if r.pattern == "add_rms_norm"]
    assert "not read by one residual add alone" in skip.reason
    torch.testing.assert_close(out, want)
