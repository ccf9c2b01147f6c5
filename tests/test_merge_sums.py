"""``merge_sums``: a sum of matmul partials that is reduced (or of all-reduced partials) becomes one
matmul of the concatenated operands, reduced once; each case it must leave alone stays unmerged.

Fake process groups; the generated code is read back. Numerics with real ranks: ``test_gloo.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import commfuse
from commfuse.demo import transformer as demo
from helpers import calls, compile_code

AR, RS = "commfuse.mm_all_reduce", "commfuse.mm_reduce_scatter"
C10D_AR, C10D_RS = "_c10d_functional.all_reduce", "_c10d_functional.reduce_scatter_tensor"


def _ar(t, group=None):
    return funcol.all_reduce(t, "sum", group or dist.group.WORLD)


def _merges():
    return commfuse.report().merged


def test_all_reduced_partials_become_one_all_reduce(world):
    x1, w1, x2, w2 = torch.randn(64, 32), torch.randn(32, 48), torch.randn(64, 16), torch.randn(16, 48)
    r = torch.randn(64, 48)

    def f(x1, w1, x2, w2, r):  # a residual between the two reduced terms: the sum is reassociated
        return (_ar(x1 @ w1) + r) + _ar(x2 @ w2)

    out, code = compile_code(f, x1, w1, x2, w2, r)
    assert calls(code, AR) == 1 and C10D_AR not in code, code
    (rec,) = _merges()
    assert rec.shape == (64, 48, 48) and rec.reason == "merged 2 all-reduced partials (K=32+16)"
    torch.testing.assert_close(out, f(x1, w1, x2, w2, r))  # the fake group's all_reduce is the identity


def test_three_terms_3d_views(world2):
    xs = [torch.randn(2, 8, k) for k in (32, 8, 8)]
    ws = [torch.randn(24, k) for k in (32, 8, 8)]

    def f(a, b, c, wa, wb, wc):
        return _ar(F.linear(a, wa)) + _ar(F.linear(b, wb)) + _ar(F.linear(c, wc))

    out, code = compile_code(f, *xs, *ws)
    assert calls(code, AR) == 1, code
    assert [r.shape for r in _merges()] == [(16, 48, 24)]
    torch.testing.assert_close(out, f(*xs, *ws))


def test_summed_partials_reduce_scattered_fuse(world2):
    x1, w1, x2, w2 = torch.randn(2, 8, 32), torch.randn(24, 32), torch.randn(2, 8, 16), torch.randn(24, 16)

    def f(x1, w1, x2, w2):
        return funcol.reduce_scatter_tensor(F.linear(x1, w1) + F.linear(x2, w2), "sum", 1, dist.group.WORLD)

    out, code = compile_code(f, x1, w1, x2, w2)
    assert calls(code, RS) == 1 and C10D_RS not in code, code
    (rec,) = _merges()
    assert rec.reason == "merged 2 partials of one reduction (K=32+16)"
    assert out.shape == (2, 4, 24)


@pytest.mark.parametrize("reader", ["mutated", "as_strided", "feeds_another_term", "returned"])
def test_other_readers_of_an_operand_keep_their_values(world2, reader):
    """Only transposes feeding matmuls read an operand's slice of the concatenation: a mutation,
    an ``as_strided`` view, a reader another term is computed from (a cycle) or a returned
    operand keep reading the operand itself."""
    x1, w1, x2, w2 = torch.randn(64, 32), torch.randn(32, 48), torch.randn(64, 32), torch.randn(32, 48)

    def f(x1, w1, x2, w2):
        a1 = x1.relu()
        if reader == "feeds_another_term":
            return _ar(a1 @ w1) + _ar(a1.sigmoid() @ w2)
        y = _ar(a1 @ w1) + _ar(x2 @ w2)
        if reader == "mutated":
            x2.mul_(2)
            return y
        if reader == "as_strided":
            return y, a1.as_strided((64, 16), (32, 2)) * 3
        return y, a1

    args = [x1, w1, x2, w2]
    out, _ = compile_code(f, *[t.clone() for t in args])
    assert _merges(), commfuse.report()
    inputs = [t.clone() for t in args]
    want = f(*inputs)
    for got, ref in zip(out if isinstance(out, tuple) else (out,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(got, ref)
        assert got.stride() == ref.stride()
    if reader == "mutated":  # the caller's tensor is mutated as in eager
        mutated = [t.clone() for t in args]
        compile_code(f, *mutated)
        torch.testing.assert_close(mutated[2], args[2] * 2)


def test_weight_gradient_reads_the_concatenation(world2):
    """A partial's operand also read by another op (its weight gradient in a backward) is written
    once, into the concatenation, and read back as a slice: no second copy, the same values."""
    x1, w1, x2, w2 = torch.randn(64, 32), torch.randn(32, 48), torch.randn(64, 16), torch.randn(16, 48)

    def f(x1, w1, x2, w2):
        a1, a2 = x1.relu(), x2.sigmoid()
        return _ar(a1 @ w1) + _ar(a2 @ w2), a1.t() @ a1, a2.sum(0)

    out, code = compile_code(f, x1, w1, x2, w2)
    assert calls(code, AR) == 1, code
    for got, want in zip(out, f(x1, w1, x2, w2)):
        torch.testing.assert_close(got, want)


def test_left_alone(world2):
    x1, w1, x2, w2 = torch.randn(64, 32), torch.randn(32, 48), torch.randn(64, 16), torch.randn(16, 48)
    b = torch.randn(48)
    sub = dist.new_group([0, 1])

    r = torch.randn(48)

    def twice():
        y = _ar(x1 @ w1)
        return (y + y) + _ar(x2 @ w2)  # y counts twice: merging it once would be wrong

    cases = {
        "control (merges)": lambda: _ar(x1 @ w1) + _ar(x2 @ w2),
        "another group": lambda: _ar(x1 @ w1) + _ar(x2 @ w2, sub),
        "a bias": lambda: _ar(torch.addmm(b, x1, w1)) + _ar(x2 @ w2),
        "a partial read elsewhere": lambda: (lambda p: (_ar(p) + _ar(x2 @ w2), p))(x1 @ w1),
        "a broadcasting add between": lambda: (_ar(x1 @ w1) + r) + _ar(x2 @ w2),
        "a scaled add": lambda: torch.add(_ar(x1 @ w1), _ar(x2 @ w2), alpha=2),
        "a product": lambda: _ar(x1 @ w1) * _ar(x2 @ w2),
        "a term read twice": twice,
    }
    for name, fn in cases.items():
        torch._dynamo.reset()
        commfuse.clear_report()
        out, _ = compile_code(lambda: fn())
        assert [r.pattern for r in commfuse.report()].count("mm_all_reduce") >= 1, commfuse.report()
        assert bool(_merges()) == name.startswith("control"), f"{name}: {commfuse.report()}"
        want = fn()  # the fake group's all_reduce is the identity
        for got, ref in zip(out if isinstance(out, tuple) else (out,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(got, ref, msg=name)


def test_size_guards_apply_to_each_term(world2):
    """A sum whose terms the fusion would leave unfused (size threshold: M * N * ``SHARDED_DIM``)
    is not merged: merging it would only copy the weights."""
    from commfuse.patterns.common import SHARDED_DIM

    x1, w1, x2, w2 = torch.randn(64, 32), torch.randn(32, 48), torch.randn(64, 16), torch.randn(16, 48)
    for min_mnk, merged in ((64 * 48 * SHARDED_DIM + 1, False), (64 * 48 * SHARDED_DIM, True)):
        torch._dynamo.reset()
        commfuse.clear_report()
        compile_code(lambda *t: _ar(t[0] @ t[1]) + _ar(t[2] @ t[3]), x1, w1, x2, w2,
                     backend=commfuse.backend(min_mnk=min_mnk))
        assert bool(_merges()) is merged, (min_mnk, commfuse.report())


def test_fp16_all_reduced_terms_are_not_merged(world2):
    """Form B adds each rank's partials before the reduction: in fp16 partials that cancel across
    ranks can overflow where the reduced terms do not, so fp16 sums keep their all-reduces."""
    x1, w1, x2, w2 = (torch.randn(64, 32, dtype=torch.float16), torch.randn(32, 48, dtype=torch.float16),
                      torch.randn(64, 16, dtype=torch.float16), torch.randn(16, 48, dtype=torch.float16))
    fn = lambda *t: _ar(t[0] @ t[1]) + _ar(t[2] @ t[3])  # noqa: E731
    compile_code(fn, x1, w1, x2, w2)
    assert not _merges(), commfuse.report()
    torch._dynamo.reset()
    commfuse.clear_report()
    compile_code(fn, *(t.to(torch.bfloat16) for t in (x1, w1, x2, w2)))
    assert _merges(), commfuse.report()


def test_summed_partials_all_reduced_once_values(world2):
    """Form A with an all-reduce (the fake group's is the identity, so values can be checked)."""
    x1, w1, x2, w2 = torch.randn(2, 8, 32), torch.randn(24, 32), torch.randn(2, 8, 16), torch.randn(24, 16)

    def f(x1, w1, x2, w2):
        return _ar(F.linear(x1, w1) + F.linear(x2, w2)) * 2

    out, code = compile_code(f, x1, w1, x2, w2)
    assert calls(code, AR) == 1 and C10D_AR not in code, code
    assert [r.reason for r in _merges()] == ["merged 2 partials of one reduction (K=32+16)"]
    torch.testing.assert_close(out, f(x1, w1, x2, w2))


def test_off_switches(world2, monkeypatch):
    x1, w1, x2, w2 = torch.randn(64, 32), torch.randn(32, 48), torch.randn(64, 16), torch.randn(16, 48)

    def f(x1, w1, x2, w2):
        return _ar(x1 @ w1) + _ar(x2 @ w2)

    monkeypatch.setenv("COMMFUSE_MERGE_SUMS", "0")
    _, code = compile_code(f, x1, w1, x2, w2)
    assert calls(code, AR) == 2 and not _merges()
    monkeypatch.delenv("COMMFUSE_MERGE_SUMS")
    torch._dynamo.reset()
    patterns = [p for p in commfuse.DEFAULT_PATTERNS if p != "merge_sums"]
    _, code = compile_code(f, x1, w1, x2, w2, backend=commfuse.backend(min_mnk=0, patterns=patterns))
    assert calls(code, AR) == 2 and not _merges()


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 48, bias=False), nn.Linear(16, 48, bias=False)

    def forward(self, x1, x2):
        return _ar(self.a(x1)) + _ar(self.b(x2))


def test_excluded_module_is_not_merged(world2):
    model = _Two()
    x1, x2 = torch.randn(64, 32), torch.randn(64, 16)
    _, code = compile_code(model, x1, x2, backend=commfuse.backend(min_mnk=0, exclude=["b"]))
    assert not _merges() and calls(code, AR) == 1  # "a" alone fuses; "b" stays NCCL
    assert C10D_AR in code


@pytest.mark.parametrize("sp", [False, True], ids=["dtensor", "sequence_parallel"])
def test_transformer_backward_reduces_each_input_gradient_once(world, sp):
    """q/k/v and w1/w3 input gradients: one fused collective each per layer (unmerged, the
    sequence-parallel sum would stay NCCL: its reduce-scatter reads an add, not a matmul). Two
    layers at 2 ranks (each layer's sums merged on their own, never across layers), one beyond."""
    layers = 2 if world == 2 else 1
    cfg = demo.sized_config(True, layers, world)
    model = demo.parallelize_dtensor(demo.Transformer(cfg), init_device_mesh("cpu", (world,)), sequence_parallel=sp)
    x = torch.randn(2, 32 // world if sp else 32, cfg.dim, requires_grad=True)
    _, code = compile_code(model, x, train=True)
    merged = sorted(len(r.matmul.split("+")) for r in _merges())
    assert merged == [2] * layers + [3] * layers, commfuse.report()
    backward = [r for r in commfuse.report() if r.graph.startswith("backward") and not r.merge]
    assert backward and all(r.fused for r in backward), commfuse.report()
    assert C10D_AR not in code and C10D_RS not in code, code
