"""FP8 tensor parallelism, tensor-wise scales: each ``_scaled_mm`` form becomes its FP8 op with its
arguments kept, each unsupported form stays unfused with its reason, the ops' fakes and unfused
computation, and the run-time's one decision for them.

Fake process groups (one process; rank 0's collectives are identities there, so the fused graph
must equal eager); real ranks are in ``test_fp8_gloo.py``.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import commfuse
from helpers import compile_code, fp8, group_name

E4M3, E5M2, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
AR, AG, RS = "scaled_mm_all_reduce", "all_gather_scaled_mm", "scaled_mm_reduce_scatter"




def weight(k, n, dtype=E4M3):
    """A ``[k, n]`` FP8 right operand, column-major as ``_scaled_mm`` takes it."""
    return fp8(n, k, dtype=dtype).t()


def scale():
    return torch.rand(()) + 0.5


def _ar(t):
    return funcol.all_reduce(t, "sum", dist.group.WORLD)


def _skipped(op: str) -> list[str]:
    return [r.reason for r in commfuse.report() if r.pattern == op and not r.fused]


# ---- _scaled_mm -> all_reduce ----------------------------------------------------------------------

@pytest.mark.parametrize("out_dtype, bias, fast", [(BF16, False, True), (BF16, True, False),
                                                    (torch.float32, False, False)],
                         ids=["bf16-fast", "bf16-bias", "fp32"])
def test_scaled_mm_all_reduce_2d(world2, fused_nodes, out_dtype, bias, fast):
    a, b, sa, sb = fp8(64, 32), weight(32, 48), scale(), scale()
    c = torch.randn(48).to(out_dtype) if bias else None

    def f(a, b, sa, sb, c):
        return _ar(torch._scaled_mm(a, b, sa, sb, bias=c, out_dtype=out_dtype, use_fast_accum=fast)) * 2

    out, code = compile_code(f, a, b, sa, sb, c)
    assert "all_reduce" not in code.replace(AR, "")
    assert fused_nodes == [(AR, (out_dtype, fast, group_name()))]
    (rec,) = commfuse.report().fused
    assert (rec.pattern, rec.shape, rec.dtype) == (AR, (64, 32, 48), f"float8_e4m3fn->{str(out_dtype)[6:]}")
    torch.testing.assert_close(out, f(a, b, sa, sb, c))


def test_patterns_without_fp8_leave_scaled_matmuls_to_inductor(world2, fused_nodes):
    """``backend(patterns=...)`` without ``fp8``: the FP8 product and its all-reduce stay as they
    are, with the reason in the report, while a bf16 matmul beside it still fuses."""
    a, b, sa, sb = fp8(64, 32), weight(32, 48), scale(), scale()
    x, w = torch.randn(64, 32, dtype=BF16), torch.randn(32, 48, dtype=BF16)

    def f(a, b, sa, sb, x, w):
        return _ar(torch._scaled_mm(a, b, sa, sb, out_dtype=BF16)) + _ar(x @ w)

    patterns = [p for p in commfuse.DEFAULT_PATTERNS if p != "fp8"]
    out, code = compile_code(f, a, b, sa, sb, x, w, backend=commfuse.backend(min_mnk=0, patterns=patterns))
    assert [op for op, _ in fused_nodes] == ["mm_all_reduce"]
    (skipped,) = [r for r in commfuse.report().skipped if "fp8" in r.reason]
    assert skipped.reason == "pattern fp8 (the _scaled_mm forms) is disabled in this backend's settings"
    torch.testing.assert_close(out, f(a, b, sa, sb, x, w))


def test_scaled_mm_all_reduce_reshape_form(world2, fused_nodes):
    """A 3-D activation: reshape -> _scaled_mm -> reshape -> all_reduce (torchao's Float8Linear)."""
    x, b, sa, sb = fp8(4, 16, 32), weight(32, 48), scale(), scale()

    def f(x, b, sa, sb):
        y = torch._scaled_mm(x.reshape(-1, 32), b, sa, sb, out_dtype=BF16)
        return _ar(y.reshape(4, 16, 48)) + 1

    out, _ = compile_code(f, x, b, sa, sb)
    assert [op for op, _ in fused_nodes] == [AR] and out.shape == (4, 16, 48)
    torch.testing.assert_close(out, f(x, b, sa, sb))


@pytest.mark.parametrize("case, reason", [
    ("fp32_bias", "fp32 output and a bias"),
    ("fp8_out", "out_dtype None"),
    ("v2", "_scaled_mm_v2"),
])
def test_unsupported_forms_stay_unfused_with_their_reason(world2, fused_nodes, case, reason):
    a, b = fp8(64, 32), weight(32, 48)
    one = torch.ones(())

    def f(a, b):
        if case == "fp32_bias":  # (row-wise scales fuse: test_fp8_rowwise.py)
            y = torch._scaled_mm(a, b, one, one, bias=torch.ones(48), out_dtype=torch.float32)
        elif case == "fp8_out":
            y = torch._scaled_mm(a, b, one, one)  # an FP8 product, all-reduced in FP8
        else:
            from torch.nn.functional import ScalingType, scaled_mm

            y = scaled_mm(a, b, one, ScalingType.TensorWise, one, ScalingType.TensorWise, output_dtype=BF16)
        return _ar(y)

    compile_code(f, a, b)
    assert fused_nodes == []
    skipped = [r.reason for r in commfuse.report() if not r.fused]
    assert len(skipped) == 1 and reason in skipped[0], commfuse.report()


# ---- _scaled_mm -> reduce_scatter ------------------------------------------------------------------

@pytest.mark.parametrize("shape, dim", [((32, 32), 0), ((2, 16, 32), 1)], ids=["2d-dim0", "3d-dim1"])
def test_scaled_mm_reduce_scatter(world2, fused_nodes, shape, dim):
    """Along dim 0, and along the sequence of [B, S, D] (DTensor's split/cat: torchao's
    Float8RowwiseParallel with a sequence-sharded output)."""
    x, b, sa, sb, c = fp8(*shape), weight(32, 24), scale(), scale(), torch.randn(24).to(BF16)

    def f(x, b, sa, sb, c):
        y = torch._scaled_mm(x.reshape(-1, 32), b, sa, sb, bias=c, out_dtype=BF16, use_fast_accum=True)
        return funcol.reduce_scatter_tensor(y.reshape(*shape[:-1], 24), "sum", dim, dist.group.WORLD)

    out, _ = compile_code(f, x, b, sa, sb, c)
    assert fused_nodes == [(RS, (BF16, True, [*shape[:-1], 24], dim, 2, group_name()))]
    torch.testing.assert_close(out, f(x, b, sa, sb, c))


# ---- all_gather(fp8 shard) -> _scaled_mm ---------------------------------------------------------

def _gather_bytes(x, world):
    """DTensor's gather of an FP8 sequence shard along dim 1: the cat on the bytes."""
    g = funcol.all_gather_tensor(x, 0, dist.group.WORLD)
    pieces = torch.split(g, g.shape[0] // world)
    return torch.cat([p.view(torch.uint8) for p in pieces], 1).view(x.dtype)


@pytest.mark.parametrize("form", ["dim0", "bytes-dim1"])
def test_all_gather_scaled_mm(world2, fused_nodes, form):
    x, b, sa, sb = fp8(2, 8, 32, dtype=E5M2), weight(32, 24), scale(), scale()

    def f(x, b, sa, sb):
        g = funcol.all_gather_tensor(x, 0, dist.group.WORLD) if form == "dim0" else _gather_bytes(x, 2)
        y = torch._scaled_mm(g.reshape(-1, 32), b, sa, sb, out_dtype=BF16)
        return y.reshape(*g.shape[:-1], 24)

    out, code = compile_code(f, x, b, sa, sb)
    assert "all_gather_into_tensor" not in code
    assert fused_nodes == [(AG, (BF16, False, 0 if form == "dim0" else 1, 2, group_name(), False))]
    assert commfuse.report().fused[0].dtype == "float8_e5m2->bfloat16"
    torch.testing.assert_close(out, f(x, b, sa, sb))


# ---- the FP8-weight inference model ----------------------------------------------------------------

def test_fp8_weight_model_row_parallel_fuses(world2, fused_nodes):
    """``demo.fp8.Fp8Linear`` (FP8 weights, activations quantised per call) behind gpt-fast's hooks:
    each row-parallel linear becomes one ``scaled_mm_all_reduce``, its bias kept."""
    from commfuse.demo import fp8 as demo_fp8

    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 48).to(BF16)
    lin.register_forward_hook(lambda m, i, out: _ar(out))
    model = demo_fp8.quantize_linears(torch.nn.Sequential(lin))
    x = torch.randn(4, 16, 32, dtype=BF16)
    with torch.no_grad():
        out, _ = compile_code(model, x)
        assert fused_nodes == [(AR, (BF16, False, group_name()))]
        torch.testing.assert_close(out, model(x))


# ---- the ops ---------------------------------------------------------------------------------------

def _op_args(op, world):
    sa, sb, c = scale(), scale(), torch.randn(7).to(BF16)
    if op == AR:
        return (fp8(5, 24), weight(24, 7), sa, sb, c, BF16, False, group_name())
    if op == AG:
        return (fp8(2, 3, 24), weight(24, 7), sa, sb, c, BF16, True, 1, world, group_name(), True)
    return (fp8(4, 24), weight(24, 7), sa, sb, None, torch.float32, False, [2, 2, 7], 1, world, group_name())


@pytest.mark.parametrize("op", [AR, AG, RS])
def test_opcheck_and_unfused_computation(world2, op):
    """The fakes state the real outputs' shapes, dtypes and strides; on the fake group (rank 0's
    collectives are identities, its all-gather repeats) the op is ``_scaled_mm`` of its operands,
    within an fp32 reference's tolerance of the scaled product."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _op_args(op, 2)
    target = getattr(torch.ops.commfuse, op).default
    # (opcheck's schema and autograd checks do arithmetic FP8 tensors do not have on the CPU)
    torch.library.opcheck(target, args, test_utils=("test_faketensor",))
    out = target(*args)
    with FakeTensorMode() as mode:
        fake = target(*[mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in args])
    for r, f in zip(out if op == AG else [out], fake if op == AG else [fake]):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)
    a, b, sa, sb, bias, out_dtype = args[:6]
    if op == AG:
        out, gathered = out
        a = torch.cat([a, a], 1)
        assert gathered.dtype == E4M3 and torch.equal(gathered.view(torch.uint8), a.view(torch.uint8))
    a2 = a.reshape(-1, 24)
    want = (a2.float() * sa) @ (b.float() * sb) + (0 if bias is None else bias.float())
    if op == RS:  # dim 1 of [2, 2, 7]: rank 0's share is the first row of each pair
        want = want.reshape(2, 2, 7)[:, :1]
    assert out.dtype == out_dtype
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("bad, message", [
    (lambda a: (a.float(),), "must be float8_e4m3fn or float8_e5m2"),
    (lambda a: (a, None, torch.ones(5, 1)), "scale_a must be one float32 (a tensor-wise scale)"),
])
def test_errors_name_the_op(world2, bad, message):
    args = list(_op_args(AR, 2))
    changed = bad(args[0])
    args[0] = changed[0]
    if len(changed) > 2:
        args[2] = changed[2]
    with pytest.raises(RuntimeError, match="commfuse.scaled_mm_all_reduce") as info:
        torch.ops.commfuse.scaled_mm_all_reduce(*args)
    assert message in str(info.value)


# ---- torchao float8 training with its TP plan ------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_torchao_float8_tp_fuses_forward_and_backward(world2, sequence_parallel):
    """torchao 0.18's ``Float8Linear`` (tensor-wise scales) split by ``Float8ColwiseParallel`` /
    ``Float8RowwiseParallel``: every matmul next to a collective fuses, forward and backward (the
    all-gathers take the FP8 shards, e4m3 activations forward and e5m2 gradients backward); the
    scales' amax all-reduces (max) stay with their reason."""
    pytest.importorskip("torchao")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from commfuse.demo import fp8 as demo_fp8

    styles = demo_fp8.tp_styles()
    model = torch.nn.Sequential(torch.nn.Linear(64, 128, bias=False), torch.nn.ReLU(),
                                torch.nn.Linear(128, 64, bias=False)).to(BF16)
    demo_fp8.float8_training(model)
    if sequence_parallel:
        plan = {"0": styles["colwise"](input_layouts=Shard(1)), "2": styles["rowwise"](output_layouts=Shard(1))}
    else:
        plan = {"0": styles["colwise"](), "2": styles["rowwise"]()}
    parallelize_module(model, init_device_mesh("cpu", (2,)), plan)
    x = torch.randn(2, 16 if sequence_parallel else 32, 64, dtype=BF16, requires_grad=True)
    compile_code(model, x, train=True)
    rep = commfuse.report()
    fused = sorted((r.graph.split("#")[0], r.pattern, r.dtype) for r in rep.fused)
    if sequence_parallel:
        assert fused == [("backward", AG, "float8_e5m2->bfloat16"), ("backward", RS, "float8_e5m2->bfloat16"),
                         ("forward", AG, "float8_e4m3fn->bfloat16"), ("forward", RS, "float8_e4m3fn->bfloat16")], rep
    else:
        assert fused == [("backward", AR, "float8_e5m2->bfloat16"), ("forward", AR, "float8_e4m3fn->bfloat16")], rep
    assert {r.reason for r in rep.skipped} == {"reduce op 'max' is not sum"}, rep
