"""The custom ops: schemas, fake implementations (opcheck), validation errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import commfuse  # noqa: F401  (registers the ops)
from helpers import group_name


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_opcheck_mm_all_reduce(world2, bias, dtype):
    a, b = torch.randn(33, 17, dtype=dtype), torch.randn(17, 29, dtype=dtype)
    args = (a, b, torch.randn(29, dtype=dtype) if bias else None, group_name())
    torch.library.opcheck(torch.ops.commfuse.mm_all_reduce.default, args)


@pytest.mark.parametrize("gather_dim, shard_shape", [(0, (5, 24)), (0, (3, 4, 24)), (1, (2, 3, 24))])
@pytest.mark.parametrize("return_gathered", [False, True])
def test_opcheck_all_gather_mm(world, gather_dim, shard_shape, return_gathered):
    shard, b = torch.randn(shard_shape), torch.randn(24, 7)
    args = (shard, b, torch.randn(7), gather_dim, world, group_name(), return_gathered)
    torch.library.opcheck(torch.ops.commfuse.all_gather_mm.default, args)


def test_fake_matches_real_layout(world2):
    """Fake and real outputs agree on shape, dtype and strides (Inductor trusts the fake)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    shard, b = torch.randn(2, 3, 24), torch.randn(24, 7).t().contiguous().t()  # b column-major
    real = torch.ops.commfuse.all_gather_mm(shard, b, None, 1, 2, group_name(), True)
    with FakeTensorMode() as mode:
        fake = torch.ops.commfuse.all_gather_mm(mode.from_tensor(shard), mode.from_tensor(b), None, 1, 2, group_name(), True)
    for r, f in zip(real, fake):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)
    assert real[0].shape == (2 * 6, 7) and real[1].shape == (2, 6, 24)

    a = torch.randn(8, 5).t()  # a transposed (non-contiguous) left operand
    real = torch.ops.commfuse.mm_all_reduce(a, torch.randn(8, 3), None, group_name())
    with FakeTensorMode() as mode:
        fake = torch.ops.commfuse.mm_all_reduce(mode.from_tensor(a), mode.from_tensor(torch.randn(8, 3)), None, group_name())
    assert (real.shape, real.stride()) == (fake.shape, fake.stride()) == ((5, 3), (3, 1))


def test_reference_semantics(world2):
    """On the fake group rank 0's collectives are identities: the ops reduce to their matmuls."""
    a, b, bias = torch.randn(6, 4), torch.randn(4, 5), torch.randn(5)
    torch.testing.assert_close(torch.ops.commfuse.mm_all_reduce(a, b, bias, group_name()), torch.addmm(bias, a, b))
    shard = torch.randn(3, 4)
    out, gathered = torch.ops.commfuse.all_gather_mm(shard, b, None, 0, 2, group_name(), True)
    torch.testing.assert_close(gathered, shard.repeat(2, 1))  # the fake group's all-gather repeats it
    torch.testing.assert_close(out, shard.repeat(2, 1) @ b)
    rows_bias = torch.randn(6, 5)  # a bias per gathered row (Inductor's addmm of a residual)
    out, _ = torch.ops.commfuse.all_gather_mm(shard, b, rows_bias, 0, 2, group_name(), False)
    torch.testing.assert_close(out, shard.repeat(2, 1) @ b + rows_bias)
    with pytest.raises(RuntimeError, match=r"bias \(3, 5\) does not broadcast to \(6, 5\)"):
        torch.ops.commfuse.all_gather_mm(shard, b, torch.randn(3, 5), 0, 2, group_name(), False)


@pytest.mark.parametrize("call, message", [
    (lambda g: torch.ops.commfuse.mm_all_reduce(torch.randn(4, 3), torch.randn(4, 3), None, g), "inner dimensions"),
    (lambda g: torch.ops.commfuse.mm_all_reduce(torch.randn(4, 3), torch.randn(3, 2, dtype=torch.float16), None, g), "a is torch.float32 but b is torch.float16"),
    (lambda g: torch.ops.commfuse.mm_all_reduce(torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64), None, g), "not one of fp16, bf16, fp32"),
    (lambda g: torch.ops.commfuse.mm_all_reduce(torch.randn(4, 3), torch.randn(3, 2), None, "no-such-group"), "cannot resolve process group 'no-such-group'"),
    (lambda g: torch.ops.commfuse.all_gather_mm(torch.randn(4, 3), torch.randn(3, 2), None, 0, 4, g, False), "collective spans 4 ranks but group"),
    (lambda g: torch.ops.commfuse.all_gather_mm(torch.randn(4, 3), torch.randn(3, 2), None, 1, 2, g, False), "gather_dim 1 must name a leading dimension"),
])
def test_errors_name_the_op(world2, call, message):
    with pytest.raises(RuntimeError, match="commfuse") as info:
        call(group_name())
    assert message in str(info.value)


def test_group_is_resolved_at_run_time():
    """A sub-group's name routes the op to that group, not WORLD."""
    from helpers import init_fake_pg

    init_fake_pg(4)
    sub = dist.new_group([0, 1])
    out, gathered = torch.ops.commfuse.all_gather_mm(torch.randn(3, 4), torch.randn(4, 2), None, 0, 2, sub.group_name, True)
    assert gathered.shape == (6, 4)
    with pytest.raises(RuntimeError, match="collective spans 4 ranks but group"):
        torch.ops.commfuse.all_gather_mm(torch.randn(3, 4), torch.randn(4, 2), None, 0, 4, sub.group_name, True)


@pytest.mark.parametrize("shape, scatter_dim", [([8, 6], 0), ([4, 2, 6], 0), ([2, 4, 6], 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_opcheck_mm_reduce_scatter(world2, shape, scatter_dim, bias):
    m = shape[0] * (shape[1] if len(shape) == 3 else 1)
    args = (torch.randn(m, 5), torch.randn(5, 6), torch.randn(6) if bias else None, shape, scatter_dim, 2, group_name())
    torch.library.opcheck(torch.ops.commfuse.mm_reduce_scatter.default, args)


def test_mm_reduce_scatter_reference_on_rank0(world2):
    """On the fake group reduce_scatter returns rank 0's block: share 0 of the local product."""
    a, b = torch.randn(2 * 8, 5), torch.randn(5, 6)
    out = torch.ops.commfuse.mm_reduce_scatter(a, b, None, [2, 8, 6], 1, 2, group_name())
    assert out.shape == (2, 4, 6)
    torch.testing.assert_close(out, (a @ b).view(2, 8, 6)[:, :4])


@pytest.mark.parametrize("shape, scatter_dim, message", [
    ([8, 7], 0, "is not a view of"),
    ([3, 6], 0, "does not split into 2 shares"),
    ([8, 6], 1, "must name a leading dimension"),
])
def test_mm_reduce_scatter_errors(world2, shape, scatter_dim, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.commfuse.mm_reduce_scatter(torch.randn(shape[0], 5), torch.randn(5, 6), None, shape, scatter_dim, 2, group_name())


def test_mm_reduce_scatter_dynamic_dim_as_minus_one(world2):
    a, b = torch.randn(2 * 8, 5), torch.randn(5, 6)
    out = torch.ops.commfuse.mm_reduce_scatter(a, b, None, [2, -1, 6], 1, 2, group_name())
    assert out.shape == (2, 4, 6)
    torch.library.opcheck(torch.ops.commfuse.mm_reduce_scatter.default, (a, b, None, [-1, 8, 6], 1, 2, group_name()))
    with pytest.raises(RuntimeError, match="more than one -1"):
        torch.ops.commfuse.mm_reduce_scatter(a, b, None, [-1, -1, 6], 1, 2, group_name())
    # a -1 beside a 0 divided by zero; another negative size named no op
    with pytest.raises(RuntimeError, match="commfuse.mm_reduce_scatter: shape .* a -1 beside a 0"):
        torch.ops.commfuse.mm_reduce_scatter(a, b, None, [0, -1, 6], 1, 2, group_name())
    with pytest.raises(RuntimeError, match="commfuse.mm_reduce_scatter: shape .* negative size"):
        torch.ops.commfuse.mm_reduce_scatter(a, b, None, [-2, -8, 6], 1, 2, group_name())


def test_eager_calls_that_autograd_would_record_are_refused(world2):
    """The ops have no gradient formula: an eager call with inputs that require grad raises rather
    than give them no gradient; under no_grad it runs; the ops are tagged pt2-compliant."""
    a, b = torch.randn(6, 4, requires_grad=True), torch.randn(4, 5)
    with pytest.raises(RuntimeError, match="mm_all_reduce has no gradient formula"):
        torch.ops.commfuse.mm_all_reduce(a, b, None, group_name())
    with pytest.raises(RuntimeError, match="all_gather_mm has no gradient formula"):
        torch.ops.commfuse.all_gather_mm(torch.randn(3, 4), b.requires_grad_(), None, 0, 2, group_name(), False)
    with torch.no_grad():
        torch.testing.assert_close(torch.ops.commfuse.mm_all_reduce(a, b, None, group_name()), a @ b)
    for op in (torch.ops.commfuse.mm_all_reduce, torch.ops.commfuse.all_gather_mm,
               torch.ops.commfuse.mm_reduce_scatter):
        assert torch.Tag.pt2_compliant_tag in op.default.tags


def test_bias_must_broadcast(world2):
    a, b = torch.randn(8, 4), torch.randn(4, 6)
    for bias in (torch.randn(6), torch.randn(1, 6), torch.randn(8, 6), torch.randn(8, 1)):
        torch.ops.commfuse.mm_all_reduce(a, b, bias, group_name())
    with pytest.raises(RuntimeError, match=r"bias \(5, 6\) does not broadcast to \(8, 6\)"):
        torch.ops.commfuse.mm_all_reduce(a, b, torch.randn(5, 6), group_name())
