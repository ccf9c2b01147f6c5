"""FP8 tensor parallelism, row-wise scales: ``all_gather -> row-wise quantise -> _scaled_mm`` becomes
one op that quantises the shard before the gather, and row-wise ``_scaled_mm`` (forward, and the
backward's form with the scales multiplied in after it) fused with its all-reduce or
reduce-scatter; what stays unfused says why; the ops' fakes, checks and the run-time's decision.

Fake process groups (one process; rank 0's collectives are identities there, so the fused graph
must equal eager); real ranks are in ``test_fp8_rowwise_gloo.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import commfuse
from commfuse.runtime import reference
from helpers import compile_code, fp8, group_name

E4M3, E5M2, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
AR, AG, RS = "rowwise_scaled_mm_all_reduce", "all_gather_rowwise_scaled_mm", "rowwise_scaled_mm_reduce_scatter"


def _backend():
    return commfuse.backend(min_mnk=0, launch_bound_bytes=0)


def weight(k, n):
    """A ``[k, n]`` FP8 right operand, column-major as ``_scaled_mm`` takes it."""
    return fp8(n, k).t()


def rows(m):
    return torch.rand(m, 1) + 0.5


def cols(n):
    return torch.rand(1, n) + 0.5


def backward_form(a, b, ra, rb):
    """torchao's row-wise backward product: ``_scaled_mm`` with scales of one (``use_fast_accum``
    off), then the row and column scales multiplied in and the product cast back."""
    one = torch.ones((), dtype=torch.float32)
    return (torch._scaled_mm(a, b, one, one, out_dtype=BF16) * (ra * rb)).to(BF16)


def _skipped() -> list[str]:
    return [r.reason for r in commfuse.report() if not r.fused]


# ---- row-wise _scaled_mm -> all_reduce / reduce_scatter -----------------------------------------

@pytest.mark.parametrize("form", ["forward", "backward"])
def test_rowwise_scaled_mm_all_reduce(world2, fused_nodes, form):
    """Forward: row-wise scales in ``_scaled_mm``; backward: scales of one and the row and column
    scales multiplied in after it. Each rank's partial is scaled before the sum, as unfused."""
    x, b, ra, rb = fp8(4, 16, 32), weight(32, 48), rows(64), cols(48)

    def f(x, b, ra, rb):
        a = x.reshape(-1, 32)
        y = (torch._scaled_mm(a, b, ra, rb, out_dtype=BF16, use_fast_accum=True) if form == "forward"
             else backward_form(a, b, ra, rb))
        return funcol.all_reduce(y.reshape(4, 16, 48), "sum", dist.group.WORLD) + 1

    out, code = compile_code(f, x, b, ra, rb, backend=_backend())
    assert "all_reduce" not in code.replace(AR, "")
    assert fused_nodes == [(AR, (BF16, form == "forward", group_name()))]
    (rec,) = commfuse.report().fused
    assert (rec.pattern, rec.dtype) == (AR, "float8_e4m3fn->bfloat16")
    assert torch.equal(out, f(x, b, ra, rb))


@pytest.mark.parametrize("form", ["forward", "backward"])
def test_rowwise_scaled_mm_reduce_scatter_along_the_sequence(world2, fused_nodes, form):
    """DTensor's split/cat form (a sequence-sharded output), each row-wise form."""
    x, b, ra, rb = fp8(2, 16, 32), weight(32, 24), rows(32), cols(24)

    def f(x, b, ra, rb):
        a = x.reshape(-1, 32)
        y = (torch._scaled_mm(a, b, ra, rb, out_dtype=BF16) if form == "forward" else backward_form(a, b, ra, rb))
        return funcol.reduce_scatter_tensor(y.reshape(2, 16, 24), "sum", 1, dist.group.WORLD)

    out, _ = compile_code(f, x, b, ra, rb, backend=_backend())
    assert fused_nodes == [(RS, (BF16, False, [2, 16, 24], 1, 2, group_name()))]
    assert torch.equal(out, f(x, b, ra, rb))


def test_a_post_scale_that_is_not_row_times_column_stays_unfused(world2, fused_nodes):
    a, b = fp8(64, 32), weight(32, 48)

    def f(a, b, s):
        one = torch.ones((), dtype=torch.float32)
        y = (torch._scaled_mm(a, b, one, one, out_dtype=BF16) * s).to(BF16)
        return funcol.all_reduce(y, "sum", dist.group.WORLD)

    compile_code(f, a, b, torch.rand(64, 48), backend=_backend())
    assert fused_nodes == []
    assert len(_skipped()) == 1 and "not by a row scale times a column scale" in _skipped()[0]


# ---- all_gather -> row-wise quantise -> _scaled_mm -----------------------------------------------

def _gather(x, form):
    """The gathered activation: along dim 0, or along the sequence as DTensor gathers it (split/cat)."""
    g = funcol.all_gather_tensor(x, 0, dist.group.WORLD)
    return g if form == "dim0" else torch.cat(torch.split(g, x.shape[0]), 1)


def _quantised_matmul(g, b, sb, pow2, dtype=E4M3):
    """torchao's row-wise forward on the gathered activation (the same steps as its graph)."""
    q, multiplier = reference.quantise_rows(g, dtype, 1e-12, pow2)
    return torch._scaled_mm(q.reshape(-1, g.shape[-1]), b, multiplier.reshape(-1, 1).reciprocal(), sb,
                            out_dtype=BF16, use_fast_accum=True)


@pytest.mark.parametrize("form, pow2, read", [("dim0", True, False), ("dim1", False, False), ("dim1", True, True)],
                         ids=["dim0-pow2", "dim1", "dim1-pow2-gathered-read"])
def test_all_gather_rowwise_scaled_mm(world2, fused_nodes, form, pow2, read):
    """The bf16 shard is quantised before the gather (the op's arguments name the recipe); when
    the graph still reads the bf16 gathered tensor (training's column-wise quantisation) the op
    returns it, and only then."""
    x, b, sb = torch.randn(2, 8, 32, dtype=BF16), weight(32, 24), cols(24)

    def f(x, b, sb):
        g = _gather(x, form)
        y = _quantised_matmul(g, b, sb, pow2).reshape(*g.shape[:-1], 24)
        return (y, g.float().amax(0)) if read else y

    out, code = compile_code(f, x, b, sb, backend=_backend())
    assert "all_gather_into_tensor" not in code
    assert fused_nodes == [(AG, (BF16, True, E4M3, 1e-12, pow2, 0 if form == "dim0" else 1, 2, group_name(), read))]
    assert commfuse.report().fused[0].pattern == AG
    want = f(x, b, sb)
    for got, expected in zip(out if read else [out], want if read else [want]):
        assert torch.equal(got, expected)


def test_a_quantisation_unlike_torchaos_stays_unfused_with_the_step(world2, fused_nodes):
    x, b, sb = torch.randn(16, 32, dtype=BF16), weight(32, 24), cols(24)

    def f(x, b, sb):
        g = funcol.all_gather_tensor(x, 0, dist.group.WORLD)
        multiplier = (448.0 / g.abs().amax(-1, keepdim=True).float().clamp_min(1e-12))  # no float64 step
        q = (g.float() * multiplier).clamp(-448.0, 448.0).to(E4M3)
        return torch._scaled_mm(q, b, multiplier.reciprocal(), sb, out_dtype=BF16)

    compile_code(f, x, b, sb, backend=_backend())
    assert fused_nodes == []
    (reason,) = _skipped()
    assert reason.startswith("the row-wise quantisation differs from torchao's"), reason


# ---- the ops ---------------------------------------------------------------------------------------

def _op_args(op, world):
    if op == AR:
        return (fp8(5, 24), weight(24, 7), torch.ones(()), torch.ones(()), None, BF16, False, rows(5), cols(7),
                group_name())
    if op == AG:
        return (torch.randn(2, 3, 24, dtype=BF16), weight(24, 7), cols(7), torch.randn(7).to(BF16), BF16, True, E4M3,
                1e-12, True, 1, world, group_name(), True)
    return (fp8(4, 24), weight(24, 7), rows(4), cols(7), None, torch.float32, False, None, None, [2, 2, 7], 1, world,
            group_name())


@pytest.mark.parametrize("op", [AR, AG, RS])
def test_opcheck_and_unfused_computation(world2, op):
    """The fakes state the real outputs' shapes, dtypes and strides; on the fake group the op is
    its unfused composition (for the gather: the shard's rows quantised, gathered, multiplied)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _op_args(op, 2)
    target = getattr(torch.ops.commfuse, op).default
    torch.library.opcheck(target, args, test_utils=("test_faketensor",))
    out = target(*args)
    with FakeTensorMode() as mode:
        fake = target(*[mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in args])
    for r, f in zip(out if op == AG else [out], fake if op == AG else [fake]):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)
    if op == AG:
        shard, b, sb, bias = args[:4]
        gathered = torch.cat([shard, shard], 1)
        assert torch.equal(out[1], gathered)
        q, m = reference.quantise_rows(gathered.reshape(-1, 24), E4M3, 1e-12, True)
        want = torch._scaled_mm(q, b, m.reciprocal(), sb, bias=bias, out_dtype=BF16, use_fast_accum=True)
        assert torch.equal(out[0], want)
    elif op == AR:
        a, b, ra, rb = args[0], args[1], args[7], args[8]
        assert torch.equal(out, backward_form(a, b, ra, rb))
    else:
        a, b, ra, rb = args[:4]
        want = torch._scaled_mm(a, b, ra, rb, out_dtype=torch.float32).reshape(2, 2, 7)[:, :1]
        assert torch.equal(out, want)


def test_the_quantised_rows_of_a_shard_are_the_gathered_rows():
    """Rows are independent: quantising two shards and joining them gives the bits of quantising
    the joined tensor (values and multipliers), power-of-two or not, e4m3 or e5m2."""
    x = torch.randn(2, 16, 32, dtype=BF16) * torch.logspace(-3, 3, 16).reshape(1, 16, 1).to(BF16)
    for dtype in (E4M3, E5M2):
        for pow2 in (True, False):
            whole = reference.quantise_rows(x, dtype, 1e-12, pow2)
            parts = [reference.quantise_rows(p, dtype, 1e-12, pow2) for p in x.chunk(2, 1)]
            assert torch.equal(torch.cat([p[0] for p in parts], 1).view(torch.uint8), whole[0].view(torch.uint8))
            assert torch.equal(torch.cat([p[1] for p in parts], 1), whole[1])


def test_errors_name_the_op(world2):
    args = list(_op_args(AR, 2))
    args[7] = torch.ones(5, 7)  # a row scale that is not [M, 1] but broadcasts: fine; a wrong one is not
    args[8] = None
    with pytest.raises(RuntimeError, match="commfuse.rowwise_scaled_mm_all_reduce: post_scale_a and post_scale_b"):
        torch.ops.commfuse.rowwise_scaled_mm_all_reduce(*args)


# ---- torchao's row-wise recipe under torch's TP plan ------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_torchao_rowwise_tp_fuses(world2, sequence_parallel):
    """torchao 0.18's ``Float8Linear`` with its ``"rowwise"`` recipe, split by torch's
    ``ColwiseParallel`` / ``RowwiseParallel`` (as torchtitan's row-wise plan): every product next
    to a sum fuses forward and backward, the bf16 gather of the forward fuses with its row-wise
    quantisation (returning the bf16 gathered tensor, which the weight gradient's column-wise
    quantisation reads); the backward's gather (its row scales multiplied in after the product)
    and the amax all-reduces (max) stay with their reasons."""
    pytest.importorskip("torchao")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from commfuse.demo import fp8 as demo_fp8

    model = torch.nn.Sequential(torch.nn.Linear(64, 128, bias=False), torch.nn.ReLU(),
                                torch.nn.Linear(128, 64, bias=False)).to(BF16)
    demo_fp8.float8_training(model, recipe="rowwise")
    if sequence_parallel:
        plan = {"0": ColwiseParallel(input_layouts=Shard(1)), "2": RowwiseParallel(output_layouts=Shard(1))}
    else:
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    parallelize_module(model, init_device_mesh("cpu", (2,)), plan)
    x = torch.randn(2, 16 if sequence_parallel else 32, 64, dtype=BF16, requires_grad=True)
    compile_code(model, x, train=True, backend=_backend())
    rep = commfuse.report()
    fused = sorted((r.graph.split("#")[0], r.pattern) for r in rep.fused)
    if sequence_parallel:
        assert fused == [("backward", RS), ("forward", AG), ("forward", RS)], rep
        assert {r.reason.split(":")[0] for r in rep.skipped} == {
            "reduce op 'max' is not sum", "the row-wise quantisation differs from torchao's"}, rep
    else:
        assert fused == [("backward", AR), ("forward", AR)], rep
        assert {r.reason for r in rep.skipped} == {"reduce op 'max' is not sum"}, rep
