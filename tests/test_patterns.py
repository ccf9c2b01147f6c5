"""Each pattern form is rewritten in compiled code, and each skip case stays unfused with its reason.

Fake process groups of 2, 4 and 8 ranks; the generated code is read back with run_and_get_code.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

import commfuse
from helpers import calls, compile_code

AR, AG = "commfuse.mm_all_reduce", "commfuse.all_gather_mm"
C10D_AR, C10D_AG = "_c10d_functional.all_reduce", "_c10d_functional.all_gather_into_tensor"


def _ar(t):
    return funcol.all_reduce(t, "sum", dist.group.WORLD)


def _ag(t, dim=0):
    return funcol.all_gather_tensor(t, dim, dist.group.WORLD)


def _only(pattern: str):
    recs = [r for r in commfuse.report() if r.pattern == pattern]
    assert len(recs) == 1, commfuse.report()
    return recs[0]


def assert_fused(code: str, op: str, collective: str, n: int = 1) -> None:
    assert calls(code, op) == n, code
    assert collective not in code, code


# ---- matmul -> all_reduce ------------------------------------------------------------------------

@pytest.mark.parametrize("bias", [False, True], ids=["mm", "addmm"])
def test_mm_all_reduce_2d(world, bias):
    a, w = torch.randn(64, 32), torch.randn(32, 48)
    b = torch.randn(48) if bias else None

    def f(a, w, b):
        return _ar(torch.addmm(b, a, w) if b is not None else a @ w) * 2

    out, code = compile_code(f, a, w, b)
    assert_fused(code, AR, C10D_AR)
    rec = _only("mm_all_reduce")
    assert rec.fused and rec.shape == (64, 32, 48) and rec.dtype == "float32"
    # The fake group's all_reduce is the identity on rank 0, so eager is the reference here too.
    torch.testing.assert_close(out, f(a, w, b))


@pytest.mark.parametrize("bias", [False, True])
def test_mm_all_reduce_3d_linear(world, bias):
    """F.linear on a 3-D input: reshape -> mm(x, permute(W)) -> reshape -> all_reduce."""
    x, w = torch.randn(4, 16, 32), torch.randn(24, 32)
    b = torch.randn(24) if bias else None

    def f(x, w, b):
        return _ar(F.linear(x, w, b)) + 1

    out, code = compile_code(f, x, w, b)
    assert_fused(code, AR, C10D_AR)
    assert out.shape == (4, 16, 24)
    torch.testing.assert_close(out, f(x, w, b))


def test_mm_all_reduce_in_place_form(world2):
    """``all_reduce_`` does not survive functionalization, but a graph that holds it is rewritten."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from commfuse.inductor_plugin import rewrite
    from commfuse.config import Settings

    def f(a, w):
        y = a @ w
        torch.ops._c10d_functional.all_reduce_(y, "sum", dist.group.WORLD.group_name)
        return torch.ops._c10d_functional.wait_tensor(y) * 2

    a, w = torch.randn(64, 32), torch.randn(32, 48)
    gm = make_fx(f, tracing_mode="fake")(a, w)
    assert any(n.target is torch.ops._c10d_functional.all_reduce_.default for n in gm.graph.nodes)
    assert rewrite(gm.graph, Settings(min_mnk=0)) == 1
    gm.recompile()
    targets = {n.target for n in gm.graph.nodes}
    assert torch.ops.commfuse.mm_all_reduce.default in targets
    assert torch.ops._c10d_functional.all_reduce_.default not in targets
    torch.testing.assert_close(gm(a, w), f(a, w))


def test_mm_all_reduce_training_backward(world2):
    """Column-parallel linear: the input gradient (mm in backward) is all-reduced and fuses."""
    x = torch.randn(4, 16, 32, requires_grad=True)
    w = torch.randn(24, 32, requires_grad=True)

    class ColwiseGrad(torch.autograd.Function):  # identity forward, all_reduce backward
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, g):
            return _ar(g)

    def f(x, w):
        return F.linear(ColwiseGrad.apply(x), w)

    _, code = compile_code(f, x, w, train=True)
    assert_fused(code, AR, C10D_AR)
    rec = _only("mm_all_reduce")
    assert rec.graph.startswith("backward") and rec.fused


def test_several_row_parallel_linears(world):
    x = torch.randn(64, 32)
    ws = [torch.randn(32, 32) for _ in range(3)]

    def f(x, w0, w1, w2):
        for w in (w0, w1, w2):
            x = torch.relu(_ar(x @ w))
        return x

    out, code = compile_code(f, x, *ws)
    assert_fused(code, AR, C10D_AR, n=3)
    torch.testing.assert_close(out, f(x, *ws))


@pytest.mark.parametrize(
    "case, reason",
    [
        ("avg", "reduce op 'avg' is not sum"),
        ("partial_used", "has other users"),
        ("fp64", "dtype torch.float64 is not fp16, bf16 or fp32"),
        ("not_matmul", "not mm/addmm"),
        ("addmm_beta", "beta=2"),
    ],
)
def test_mm_all_reduce_skips(world2, case, reason):
    dtype = torch.float64 if case == "fp64" else torch.float32
    a, w, b = torch.randn(64, 32, dtype=dtype), torch.randn(32, 48, dtype=dtype), torch.randn(48, dtype=dtype)

    def f(a, w, b):
        if case == "avg":
            return funcol.all_reduce(a @ w, "avg", dist.group.WORLD)
        if case == "partial_used":
            y = a @ w
            return _ar(y) + y
        if case == "not_matmul":
            return _ar(torch.relu(a @ w))
        if case == "addmm_beta":
            return _ar(torch.addmm(b, a, w, beta=2))
        return _ar(a @ w)

    _, code = compile_code(f, a, w, b)
    assert calls(code, AR) == 0
    assert C10D_AR in code
    rec = _only("mm_all_reduce")
    assert not rec.fused and reason in rec.reason, rec


def test_size_threshold(world2):
    """``min_mnk`` against M * N * ``SHARDED_DIM``: the K a rank's shard has is not read."""
    from commfuse.patterns.common import SHARDED_DIM

    a, w = torch.randn(8, 16), torch.randn(16, 8)

    def f(a, w):
        return _ar(a @ w)

    _, code = compile_code(f, a, w, backend=commfuse.backend(min_mnk=8 * 8 * SHARDED_DIM + 1))
    assert calls(code, AR) == 0
    assert "below the size threshold" in _only("mm_all_reduce").reason
    torch._dynamo.reset()
    commfuse.clear_report()
    _, code = compile_code(f, a, w, backend=commfuse.backend(min_mnk=8 * 8 * SHARDED_DIM))
    assert calls(code, AR) == 1


@pytest.mark.parametrize("pattern", ["mm_all_reduce", "all_gather_mm", "merge_sums"])
def test_rank_local_sizes_do_not_steer_the_rewrite(world2, pattern):
    """Unevenly sharded layers (33 features on 2 ranks: 17 on one, 16 on the other) give each
    rank its own K (all-reduce, merged sums) or N (all-gather). A size rule that read it could
    fuse on one rank and not the other, whose collectives would then not pair (a hang, or a
    wrong sum). Every threshold and launch bound decides alike for both sizes."""
    from commfuse.patterns.common import SHARDED_DIM

    def decisions(local: int, **settings) -> list:
        torch._dynamo.reset()
        commfuse.clear_report()
        if pattern == "all_gather_mm":  # N is the rank's
            args, fn = (torch.randn(16, 32), torch.randn(32, local)), lambda x, w: _ag(x) @ w
        elif pattern == "mm_all_reduce":  # K is the rank's
            args, fn = (torch.randn(16, local), torch.randn(local, 48)), lambda a, w: _ar(a @ w)
        else:
            args = (torch.randn(16, local), torch.randn(local, 48), torch.randn(16, local), torch.randn(local, 48))
            fn = lambda a1, w1, a2, w2: _ar(a1 @ w1) + _ar(a2 @ w2)  # noqa: E731
        compile_code(fn, *args, backend=commfuse.backend(**settings))
        return [(r.pattern, r.fused) for r in commfuse.report()]

    shared = 2 * 16 * 32 if pattern == "all_gather_mm" else 16 * 48  # the exchanged tensor's elements (2 ranks)
    for settings in (dict(min_mnk=shared * 16), dict(min_mnk=shared * 17), dict(min_mnk=shared * SHARDED_DIM),
                     dict(min_mnk=shared * SHARDED_DIM + 1), dict(min_mnk=0, launch_bound_bytes=shared * 4),
                     dict(min_mnk=0, launch_bound_bytes=shared * 4 - 1)):
        assert decisions(16, **settings) == decisions(17, **settings), settings
    assert decisions(16, min_mnk=shared * SHARDED_DIM) != decisions(16, min_mnk=shared * SHARDED_DIM + 1)


def _sites(code: str, op: str) -> list[int]:
    """The call site (the last argument) of each call of ``op`` in the generated code."""
    call = f"torch.ops.{op}.default("
    return [int(line.split(call)[1].rsplit(")", 1)[0].rsplit(",", 1)[1]) for line in code.splitlines() if call in line]


def test_every_fused_call_has_a_call_site_alike_on_every_rank(world2):
    """The graph pass numbers each fused call (the ops' ``site``), which ``COMMFUSE_VERIFY`` and
    the pairing check compare: three calls alike in every size get three sites; compiling the
    program again, or with another rank's K (an uneven shard), gives the same numbers (nothing
    rank-local goes in: no shapes, compile counters or names); a program that skips one of the
    calls shares no site with it, so its calls never pass for the other's. Every op carries one."""
    def program(skip=None):
        def f(x, w0, w1, w2):
            for i, w in enumerate((w0, w1, w2)):
                if i != skip:
                    x = _ar(x @ w)[:, :w0.shape[0]]
            return x
        return f

    def sites(k: int, skip=None) -> list[int]:
        torch._dynamo.reset()
        ws = [torch.randn(k, 48) for _ in range(3)]
        _, code = compile_code(program(skip), torch.randn(8, k), *ws)
        return _sites(code, AR)

    three = sites(16)
    assert len(three) == 3 == len(set(three)) and all(s > 0 for s in three)
    assert sites(16) == three and sites(17) == three
    skipped = sites(16, skip=1)
    assert len(skipped) == 2 and not set(skipped) & set(three)
    torch._dynamo.reset()
    w1, w2 = torch.randn(64, 32), torch.randn(32, 64)

    def f(x, w1, w2):
        h = F.linear(_ag(x), w1)
        return _ar(F.linear(torch.relu(h), w2)), funcol.reduce_scatter_tensor(F.linear(h, w2), "sum", 0,
                                                                              dist.group.WORLD)

    _, code = compile_code(f, torch.randn(8, 32), w1, w2)
    every = [_sites(code, op) for op in (AR, AG, "commfuse.mm_reduce_scatter")]
    assert [len(s) for s in every] == [1, 1, 1] and len({s[0] for s in every}) == 3


def test_call_sites_come_from_the_graphs_code_not_its_module_names(world2):
    """Inductor's FX graph cache key hashes a graph's code, not its nodes' module names: a graph
    loaded from that cache keeps the sites of the program that wrote it. So the same code under
    other module names must get the same sites (ranks whose caches differ then still number alike),
    and the module's name still says where a site is."""
    from commfuse.runtime import plans

    class Block(torch.nn.Module):
        def __init__(self, name: str):
            super().__init__()
            self.name = name
            setattr(self, name, torch.nn.Linear(16, 48, bias=False))

        def forward(self, x):
            return _ar(getattr(self, self.name)(x))

    def sites(name: str) -> list[int]:
        torch._dynamo.reset()
        _, code = compile_code(Block(name), torch.randn(8, 16))
        return _sites(code, AR)

    first = sites("up")
    assert len(first) == 1 and sites("down") == first
    assert plans.site_name(first[0]).endswith(" in down")


def test_launch_bound_sizes_stay_unfused_without_cuda_graphs(world2):
    """Decode-sized outputs: the fused op's host cost exceeds its GPU saving unless the graph runs
    as a CUDA graph, so they fuse only with cudagraphs on (or a bound of 0)."""
    a, w = torch.randn(8, 16), torch.randn(16, 8)  # output 8 x 8 fp32 = 256 bytes

    def f(a, w):
        return _ar(a @ w)

    _, code = compile_code(f, a, w, backend=commfuse.backend(min_mnk=0, launch_bound_bytes=256))
    assert calls(code, AR) == 0
    assert "launch-bound without CUDA graphs" in _only("mm_all_reduce").reason
    for backend in (commfuse.backend(min_mnk=0, launch_bound_bytes=255),
                    commfuse.backend(min_mnk=0, launch_bound_bytes=256,
                                     inductor_config={"triton.cudagraphs": True})):
        torch._dynamo.reset()
        commfuse.clear_report()
        _, code = compile_code(f, a, w, backend=backend)
        assert calls(code, AR) == 1


def test_backend_mode_sets_inductor_options():
    assert commfuse.backend(mode="reduce-overhead").inductor_config == {"triton.cudagraphs": True}
    assert commfuse.backend(mode="reduce-overhead", inductor_config={"triton.cudagraphs": False}) \
        .inductor_config == {"triton.cudagraphs": False}  # explicit settings win
    with pytest.raises(ValueError, match="unknown mode 'fastest'"):
        commfuse.backend(mode="fastest")


def test_pattern_disabled(world2):
    a, w = torch.randn(64, 32), torch.randn(32, 48)
    _, code = compile_code(lambda a, w: _ar(a @ w), a, w,
                           backend=commfuse.backend(min_mnk=0, patterns=["all_gather_mm"]))
    assert calls(code, AR) == 0
    assert "disabled" in _only("mm_all_reduce").reason


# ---- all_gather -> matmul ------------------------------------------------------------------------

def test_all_gather_mm_2d(world):
    shard, w = torch.randn(16, 32), torch.randn(32, 24)

    def f(x, w):
        return _ag(x) @ w

    out, code = compile_code(f, shard, w)
    assert_fused(code, AG, C10D_AG)
    rec = _only("all_gather_mm")
    assert rec.fused and rec.shape == (16 * world, 32, 24)
    assert out.shape == (16 * world, 24)
    torch.testing.assert_close(out, f(shard, w))  # the fake group's all-gather repeats the shard


@pytest.mark.parametrize("bias", [False, True])
def test_all_gather_mm_3d_linear(world, bias):
    """Sequence-first shard [s/world, b, h] -> gather dim 0 -> reshape -> addmm(bias)."""
    shard, w = torch.randn(8, 4, 32), torch.randn(24, 32)
    b = torch.randn(24) if bias else None

    def f(x, w, b):
        return F.linear(_ag(x), w, b)

    out, code = compile_code(f, shard, w, b)
    assert_fused(code, AG, C10D_AG)
    assert out.shape == (8 * world, 4, 24)
    torch.testing.assert_close(out, f(shard, w, b))  # the bias too (the fake all-gather repeats the shard)


def test_all_gather_mm_dtensor_layout_dim1(world):
    """Batch-first shard [b, s/world, h] gathered along dim 1 (split + cat in the graph)."""
    shard, w = torch.randn(2, 8, 32), torch.randn(24, 32)

    def f(x, w):
        return F.linear(_ag(x, dim=1), w)

    out, code = compile_code(f, shard, w)
    assert_fused(code, AG, C10D_AG)
    assert "aten.cat" not in code and out.shape == (2, 8 * world, 24)
    assert f"{AG}.default(arg0_1, " in code and ", 1, " in code  # gather_dim=1
    torch.testing.assert_close(out, f(shard, w))  # the fake all-gather repeats the shard along dim 1


@pytest.mark.parametrize("train", [False, True], ids=["forward", "backward"])
def test_all_gather_mm_through_permuted_copy(world2, train):
    """The mirror image of the permuted reduce-scatter: the shard's dim 1 moved to the front of a
    contiguous copy, gathered along dim 0, permuted back and copied, multiplied. In training the
    backward of the permuted reduce-scatter is this form (without the first copy)."""
    x, w = torch.randn(2, 8, 32, requires_grad=train), torch.randn(24, 32, requires_grad=train)

    def f(x, w):
        if train:
            return _rs_permuted(F.linear(x, w))
        return F.linear(_ag(x.permute(1, 0, 2).contiguous()).permute(1, 0, 2).contiguous(), w)

    out, code = compile_code(f, x, w, train=train)
    assert_fused(code, AG, C10D_AG)
    assert re.search(r"all_gather_mm\.default\((arg0_1|tangents_1), [^\n]*, None, 1, \d, '", code), code
    if not train:
        assert out.shape == (2, 8 * world2, 24)
        torch.testing.assert_close(out, f(x, w))


def test_all_gather_mm_gathered_kept_for_other_users(world2):
    """QKV-style fan-out plus a direct use: the widest matmul fuses, the rest read the gathered."""
    shard = torch.randn(16, 32)
    wq, wk, wv = torch.randn(32, 48), torch.randn(32, 16), torch.randn(32, 16)

    def f(x, wq, wk, wv):
        g = _ag(x)
        return g @ wq, g @ wk, g @ wv, g.sum()

    out, code = compile_code(f, shard, wq, wk, wv)
    assert_fused(code, AG, C10D_AG)
    rec = _only("all_gather_mm")
    assert rec.shape == (32, 32, 48)  # wq: the widest
    assert "True, " in code.split(f"torch.ops.{AG}.default(")[1].split("\n")[0]  # return_gathered, then the site
    for got, want in zip(out, f(shard, wq, wk, wv)):  # the fused product and the gathered tensor's users
        # (the sum: 1024 float32 values, which Inductor's reduction adds in another order than eager's)
        tol = dict(rtol=1e-5, atol=1e-4) if got.dim() == 0 else {}
        torch.testing.assert_close(got, want, **tol)


def test_all_gather_mm_training(world2):
    """Gathered input saved for backward (weight grad) is returned by the fused op."""
    shard = torch.randn(2, 8, 32, requires_grad=True)
    w = torch.randn(24, 32, requires_grad=True)

    def f(x, w):
        return F.linear(_ag(x, dim=1), w)

    _, code = compile_code(f, shard, w, train=True)
    assert calls(code, AG) >= 1
    fused = [r for r in commfuse.report() if r.fused]
    assert fused and fused[0].graph.startswith("forward")


def test_all_gather_skip_right_operand(world2):
    shard, g = torch.randn(16, 32), torch.randn(32, 24)

    def f(x, g):
        return g.t() @ _ag(x)  # gathered is the right operand (a weight-gradient shape)

    _, code = compile_code(f, shard, g)
    assert calls(code, AG) == 0 and C10D_AG in code
    assert "left operand" in _only("all_gather_mm").reason


def test_all_gather_whose_matmul_went_with_the_all_reduce_says_so(world2):
    """all_gather -> mm -> all_reduce: the all-reduce's fusion takes the matmul first; the
    all-gather's record says that, not that no matmul reads the gathered tensor."""
    shard, w = torch.randn(16, 32), torch.randn(32, 48)

    def f(x, w):
        return funcol.all_reduce(_ag(x) @ w, "sum", dist.group.WORLD)

    _, code = compile_code(f, shard, w)
    assert calls(code, "commfuse.mm_all_reduce") == 1 and calls(code, AG) == 0
    assert "already fused with the collective after it" in _only("all_gather_mm").reason


def test_all_gather_skip_fp64(world2):
    shard, w = torch.randn(16, 32, dtype=torch.float64), torch.randn(32, 24, dtype=torch.float64)
    _, code = compile_code(lambda x, w: _ag(x) @ w, shard, w)
    assert calls(code, AG) == 0
    assert "float64" in _only("all_gather_mm").reason


@pytest.fixture
def h200(world2, monkeypatch):
    """The graph pass sizes workspaces from this rank's GPU (``runtime.facts.local_facts``): here
    an H200 as the pass would see it, and no plan kept from an earlier test."""
    from commfuse.inductor_plugin import graph_pass
    from commfuse.runtime import plans
    from commfuse.runtime.facts import GroupFacts

    monkeypatch.setattr(plans, "_planned", {})
    monkeypatch.setattr(graph_pass, "local_facts", lambda world, *args, **kwargs: GroupFacts.simulated(world))
    return GroupFacts.simulated(2)


def _path(facts, op, m, k, n, dtype, **extra) -> str:
    from commfuse.runtime import policy
    from commfuse.runtime.paths.base import Call

    return policy.choose(Call(op, m, k, n, dtype, 2, **extra), facts, quiet=True).name


def _planned() -> dict:
    from commfuse.runtime import plans

    return plans._planned


def test_workspace_plan(h200):
    """The pass sizes the group's symmetric workspace for the graph's largest fused op."""
    x, w1, w2 = torch.randn(64, 32), torch.randn(32, 48), torch.randn(48, 40)
    assert _path(h200, "all_gather_mm", 128, 32, 48, torch.float32) == "pull"
    assert _path(h200, "mm_all_reduce", 128, 48, 40, torch.float32) == "one_shot"
    compile_code(lambda x, w1, w2: _ar(torch.relu(_ag(x) @ w1) @ w2), x, w1, w2)
    assert len(commfuse.report().fused) == 2
    # all_gather_mm's shard: 64x32 fp32 = 8 KiB; mm_all_reduce's output: 128x40 fp32 = 20 KiB
    assert _planned() == {dist.group.WORLD.group_name: 128 * 40 * 4}


def test_workspace_plan_without_a_cuda_gpu(world2, monkeypatch):
    """On this CPU every call runs NCCL (no CUDA GPU): the fused graph plans no symmetric bytes."""
    from commfuse.runtime import plans

    monkeypatch.setattr(plans, "_planned", {})
    x, w = torch.randn(4096, 16, dtype=torch.bfloat16), torch.randn(16, 64, dtype=torch.bfloat16)
    compile_code(lambda x, w: _ar(x @ w), x, w)
    assert len(commfuse.report().fused) == 1
    assert plans.planned(dist.group.WORLD.group_name) == 0


def test_workspace_plan_sizes_for_the_fused_kernel(h200):
    """A call the policy will send to the fused tile kernel needs its slabs and result area
    (about twice the output), planned at compile time rather than grown at the first call."""
    from commfuse.kernels import fused_all_reduce
    from commfuse.runtime.paths import ar_fused

    x, w = torch.randn(4096, 16, dtype=torch.bfloat16), torch.randn(16, 64, dtype=torch.bfloat16)
    assert _path(h200, "mm_all_reduce", 4096, 16, 64, torch.bfloat16) == "fused"
    compile_code(lambda x, w: _ar(x @ w), x, w)
    slabs = fused_all_reduce.data_elems(4096, 64, 2, ar_fused.TILE) * 2
    assert slabs > 4096 * 64 * 2
    assert _planned() == {dist.group.WORLD.group_name: slabs}


def test_workspace_plan_follows_a_forced_fused_path(h200):
    """``COMMFUSE_ALGO=fused`` sends a small call to the fused kernel too: planned for its slabs
    (unforced, the one-shot exchange of the output)."""
    from commfuse import env
    from commfuse.kernels import fused_all_reduce
    from commfuse.runtime.paths import ar_fused

    x, w = torch.randn(256, 16, dtype=torch.bfloat16), torch.randn(16, 64, dtype=torch.bfloat16)
    assert _path(h200, "mm_all_reduce", 256, 16, 64, torch.bfloat16) == "one_shot"
    compile_code(lambda x, w: _ar(x @ w), x, w)
    assert _planned() == {dist.group.WORLD.group_name: 256 * 64 * 2}
    _planned().clear()
    torch._dynamo.reset()
    with env.override(algo="fused"):
        compile_code(lambda x, w: _ar(x @ w), x, w)
    slabs = fused_all_reduce.data_elems(256, 64, 2, ar_fused.TILE) * 2
    assert _planned() == {dist.group.WORLD.group_name: slabs}


def test_workspace_plan_sizes_for_split_k(h200):
    """Few rows take the split-K kernel: planned for its sums and fp32 K slices with the most
    slices any GPU would run, so the H200's own tiling fits."""
    from commfuse.kernels import fused_split_k

    x, w = torch.randn(32, 1024, dtype=torch.bfloat16), torch.randn(1024, 64, dtype=torch.bfloat16)
    assert _path(h200, "mm_all_reduce", 32, 1024, 64, torch.bfloat16) == "split_k"
    compile_code(lambda x, w: _ar(x @ w), x, w)
    planned = _planned()[dist.group.WORLD.group_name]
    on_h200 = fused_split_k.config(32, 1024, 64, h200.sms)
    assert planned >= fused_split_k.data_bytes(32, 64, 2, on_h200, torch.bfloat16) > 32 * 64 * 2


def test_workspace_plan_sizes_for_the_fused_all_gather(h200):
    """The fused all-gather keeps every rank's rows in the workspace, not only this rank's."""
    x, w = torch.randn(1024, 512, dtype=torch.bfloat16), torch.randn(512, 64, dtype=torch.bfloat16)
    assert _path(h200, "all_gather_mm", 2048, 512, 64, torch.bfloat16) == "fused"
    compile_code(lambda x, w: _ag(x) @ w, x, w)
    assert _planned() == {dist.group.WORLD.group_name: 2048 * 512 * 2}


def test_workspace_plan_sizes_for_the_fused_reduce_scatter(h200):
    """From 16384 rows (at 2 ranks where the copy-engine overlap does not apply) the reduce-scatter
    takes the fused kernel, whose slabs the pass plans."""
    from commfuse.kernels import fused_all_reduce
    from commfuse.runtime.paths import ar_fused

    a, w = torch.randn(16384, 64, dtype=torch.bfloat16), torch.randn(64, 64, dtype=torch.bfloat16)
    assert _path(h200, "mm_reduce_scatter", 16384, 64, 64, torch.bfloat16) == "fused"
    compile_code(lambda a, w: _rs(a @ w), a, w)
    slabs = fused_all_reduce.data_elems(16384, 64, 2, ar_fused.SMALL_TILE, scatter=True)
    assert _planned() == {dist.group.WORLD.group_name: slabs * 2}


def test_workspace_plan_of_a_scatter_along_the_sequence(h200):
    """The same rows as a batch of 2 sequences scattered along the sequence (2 slabs of rows per
    rank's share): not the fused kernel's (it scatters whole rows), the pull's partial."""
    a, w = torch.randn(2, 8192, 64, dtype=torch.bfloat16), torch.randn(64, 64, dtype=torch.bfloat16)
    assert _path(h200, "mm_reduce_scatter", 16384, 64, 64, torch.bfloat16, rows_dim=1, slabs=2) == "pull"
    compile_code(lambda a, w: _rs(a @ w, dim=1), a, w)
    assert len(commfuse.report().fused) == 1
    assert _planned() == {dist.group.WORLD.group_name: 16384 * 64 * 2}


def test_workspace_plan_of_a_call_that_runs_nccl(h200):
    """A gather in front of a wide GEMM (N = 16384) runs NCCL on an H200: no symmetric bytes."""
    x, w = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(32, 16384, dtype=torch.bfloat16)
    assert _path(h200, "all_gather_mm", 128, 32, 16384, torch.bfloat16) == "nccl"
    compile_code(lambda x, w: _ag(x) @ w, x, w)
    assert len(commfuse.report().fused) == 1
    assert _planned() == {dist.group.WORLD.group_name: 0}


# ---- matmul -> reduce_scatter --------------------------------------------------------------------

RS, C10D_RS = "commfuse.mm_reduce_scatter", "_c10d_functional.reduce_scatter_tensor"


def _rs(t, dim=0):
    return funcol.reduce_scatter_tensor(t, "sum", dim, dist.group.WORLD)


@pytest.mark.parametrize("bias", [False, True])
def test_mm_reduce_scatter_2d(world, bias):
    a, w = torch.randn(16 * world, 32), torch.randn(32, 24)
    b = torch.randn(24) if bias else None

    def f(a, w, b):
        return _rs(torch.addmm(b, a, w) if b is not None else a @ w)

    out, code = compile_code(f, a, w, b)
    assert_fused(code, RS, C10D_RS)
    rec = _only("mm_reduce_scatter")
    assert rec.fused and rec.shape == (16 * world, 32, 24)
    assert out.shape == (16, 24)
    torch.testing.assert_close(out, f(a, w, b))


def test_mm_reduce_scatter_3d_seq_first(world):
    x, w = torch.randn(8 * world, 2, 32), torch.randn(24, 32)
    out, code = compile_code(lambda x, w: _rs(F.linear(x, w)), x, w)
    assert_fused(code, RS, C10D_RS)
    assert out.shape == (8, 2, 24)


def test_mm_reduce_scatter_dtensor_layout_dim1(world):
    """Batch-first [b, s, h] scattered along the sequence (split + cat in the graph)."""
    x, w = torch.randn(2, 8 * world, 32), torch.randn(24, 32)

    def f(x, w):
        return _rs(F.linear(x, w), dim=1)

    out, code = compile_code(f, x, w)
    assert_fused(code, RS, C10D_RS)
    assert "aten.cat" not in code and out.shape == (2, 8, 24)
    torch.testing.assert_close(out, f(x, w))  # rank 0 of the fake group keeps block 0


def _rs_permuted(y, perm=(1, 0, 2)):
    """torchtitan's sequence-parallel reduce-scatter: the scattered dim moved to the front, a
    contiguous copy scattered along dim 0, the result permuted back."""
    inverse = [perm.index(i) for i in range(len(perm))]
    return _rs(y.permute(*perm).contiguous()).permute(*inverse)


@pytest.mark.parametrize("perm", [(1, 0, 2), (1, 2, 0)], ids=["seq_to_front", "rotated"])
def test_mm_reduce_scatter_through_permuted_copy(world, perm):
    """The copy, the permutes and the collective all go: one fused scatter along dim 1."""
    x, w = torch.randn(2, 8 * world, 32), torch.randn(24, 32)
    if perm == (1, 2, 0):  # dim 2 (N) becomes the middle one; still a scatter along dim 1
        f = lambda x, w: _rs(F.linear(x, w).permute(*perm).contiguous())  # noqa: E731
    else:
        f = lambda x, w: _rs_permuted(F.linear(x, w), perm)  # noqa: E731
    out, code = compile_code(f, x, w)
    assert_fused(code, RS, C10D_RS)
    assert "aten.clone" not in code and "torch.ops.commfuse.mm_reduce_scatter.default(" in code
    assert re.search(r"\[2, \d+, 24\], 1, \d, '", code), code  # the [B, S, N] view, scattered along dim 1
    torch.testing.assert_close(out, f(x, w))


def test_mm_reduce_scatter_through_permuted_copy_saved_for_backward(world2):
    """In training the forward also returns the waited [S/2, B, D] tensor (saved for the backward):
    that reader gets a contiguous permuted copy of the fused result, with the traced strides."""
    x, w = torch.randn(2, 16, 32, requires_grad=True), torch.randn(24, 32, requires_grad=True)

    def f(x, w):
        y = _rs(F.linear(x, w).permute(1, 0, 2).contiguous())
        return y.permute(1, 0, 2) * y.permute(1, 0, 2).sum()  # y itself is saved for the backward

    out, code = compile_code(f, x, w, train=True)
    fwd = [r for r in commfuse.report() if r.pattern == "mm_reduce_scatter" and r.graph.startswith("forward")]
    assert [r.fused for r in fwd] == [True], commfuse.report()
    assert calls(code, RS) == 1 and C10D_RS not in code.split("def call")[1], code
    assert out.shape == (2, 8, 24)


def test_merged_sum_through_permuted_copy(world2):
    """The w1/w3 input gradients of a sequence-parallel backward: summed, permuted, copied,
    reduce-scattered. merge_sums sees through the copy; the merged matmul then fuses."""
    x1, w1, x2, w2 = torch.randn(2, 16, 32), torch.randn(24, 32), torch.randn(2, 16, 16), torch.randn(24, 16)

    def f(x1, w1, x2, w2):
        return _rs_permuted(F.linear(x1, w1) + F.linear(x2, w2))

    out, code = compile_code(f, x1, w1, x2, w2)
    assert_fused(code, RS, C10D_RS)
    (merged,) = commfuse.report().merged
    assert merged.reason == "merged 2 partials of one reduction (K=32+16)"
    assert out.shape == (2, 8, 24)


@pytest.mark.parametrize("case, reason", [("max", "reduce op 'max' is not sum"), ("partial_used", "other users")])
def test_mm_reduce_scatter_skips(world2, case, reason):
    a, w = torch.randn(64, 32), torch.randn(32, 24)

    def f(a, w):
        y = a @ w
        if case == "max":
            return funcol.reduce_scatter_tensor(y, "max", 0, dist.group.WORLD)
        return _rs(y).sum() + y.sum()

    _, code = compile_code(f, a, w)
    assert calls(code, RS) == 0 and C10D_RS in code
    assert reason in _only("mm_reduce_scatter").reason


# ---- graph forms that must stay unfused, not break the compile -----------------------------------

@pytest.mark.parametrize("case, pattern, reason", [
    ("gather_flatten", "all_gather_mm", "left operand"),  # [B,S,K] -> flatten(1) is not a row view
    ("gram", "all_gather_mm", "computed from the gathered tensor"),  # g @ g
    ("weight_from_gathered", "all_gather_mm", "computed from the gathered tensor"),
    ("rs_of_cat_of_inputs", "mm_reduce_scatter", "not mm/addmm"),
    ("rs_view_changes_n", "mm_reduce_scatter", "does not keep the matmul's N"),
])
def test_unusual_forms_stay_unfused_and_correct(world2, case, pattern, reason):
    g = dist.group.WORLD
    x3, x2, w = torch.randn(4, 8, 16), torch.randn(32, 32), torch.randn(32, 32)

    def f(x3, x2, w):
        if case == "gather_flatten":
            return _ag(x3).flatten(1) @ torch.ones(128, 32)
        if case == "gram":
            gathered = _ag(x2[:16])  # [32, 32]
            return gathered @ gathered
        if case == "weight_from_gathered":
            gathered = _ag(x2[:16])
            return gathered @ (gathered.t() @ gathered + w)
        if case == "rs_of_cat_of_inputs":
            return funcol.reduce_scatter_tensor(torch.cat([x2, w]), "sum", 0, g)
        return funcol.reduce_scatter_tensor((x2 @ w).view(8, -1), "sum", 0, g)

    out, code = compile_code(f, x3, x2, w)
    rec = _only(pattern)
    assert not rec.fused and reason in rec.reason, rec
    torch.testing.assert_close(out, f(x3, x2, w))


def test_full_size_2d_bias_fuses(world2):
    a, w, c = torch.randn(64, 32), torch.randn(32, 48), torch.randn(64, 48)

    def f(a, w, c):
        return _ar(torch.addmm(c, a, w))

    out, code = compile_code(f, a, w, c)
    assert calls(code, AR) == 1
    torch.testing.assert_close(out, f(a, w, c))


def test_analysis_errors_leave_the_match_unfused(world2, monkeypatch):
    """An unforeseen failure inside a matcher is recorded and the graph compiles unfused."""
    from commfuse.patterns import mm_all_reduce

    def broken(cls, anchor, settings):
        raise IndexError("unforeseen")

    monkeypatch.setattr(mm_all_reduce.MmAllReduceMatch, "from_anchor", classmethod(broken))
    a, w = torch.randn(64, 32), torch.randn(32, 48)
    out, code = compile_code(lambda a, w: _ar(a @ w), a, w)
    assert calls(code, AR) == 0 and C10D_AR in code
    assert "could not analyse this graph form (IndexError: unforeseen)" in _only("mm_all_reduce").reason


def test_launch_bound_gather_and_scatter_stay_unfused_even_under_cuda_graphs(world2):
    """Inside CUDA graphs only mm_all_reduce has a graph-lane path; the other two would run NCCL,
    so their launch-bound sizes are left to Inductor with or without graphs."""
    x, w = torch.randn(8, 16), torch.randn(16, 8)

    def f(x, w):
        return _ag(x) @ w

    for config in (None, {"triton.cudagraphs": True}):
        torch._dynamo.reset()
        commfuse.clear_report()
        _, code = compile_code(f, x, w, backend=commfuse.backend(min_mnk=0, launch_bound_bytes=1 << 20,
                                                              inductor_config=config))
        assert calls(code, "commfuse.all_gather_mm") == 0
        reason = _only("all_gather_mm").reason
        assert "launch-bound" in reason and ("no graph-lane path" in reason) == bool(config), reason
        assert 'reduce-overhead' not in reason


def test_gemm_bound_all_gather_fuses(world2):
    """A large N (the gather a few % of the GEMM) fuses too: the dispatch overlaps it."""
    shard, w = torch.randn(4, 8), torch.randn(8, 16384)
    out, code = compile_code(lambda x, w: _ag(x) @ w, shard, w)
    assert calls(code, "commfuse.all_gather_mm") == 1 and _only("all_gather_mm").fused
    assert out.shape == (8, 16384)
    torch.testing.assert_close(out, shard.repeat(2, 1) @ w)
