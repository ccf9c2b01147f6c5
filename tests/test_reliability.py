"""Reliability cases that need no GPU: dynamic shapes, TP sub-groups of a 2-D mesh, odd inputs."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import commfuse
from helpers import calls, compile_code, init_fake_pg, spawn


@pytest.mark.parametrize("mark, sizes", [
    ("mark_dynamic", (2, 7, 16, 100, 1000, 4096)),  # Dynamo specialises M = 1 on its own
    ("mark_unbacked", (1, 2, 3, 100, 16384)),  # symbolic for 0 and 1 too
])
def test_dynamic_token_dimension_compiles_once(world2, mark, sizes):
    """One graph serves every M, with the default size thresholds (M is unknown at compile
    time), and equals the uncompiled function (the ops' CPU path is the unfused one)."""
    g = dist.group.WORLD
    w1, w2 = torch.randn(64, 32), torch.randn(32, 64)

    def f(x, w1, w2):
        h = F.linear(funcol.all_gather_tensor(x, 0, g), w1)
        return (funcol.all_reduce(F.linear(torch.relu(h), w2), "sum", g),
                funcol.reduce_scatter_tensor(F.linear(h, w2), "sum", 0, g))

    compiled = torch.compile(f, backend=commfuse.backend())
    counters.clear()
    for m in sizes:
        x = torch.randn(m, 32)
        getattr(torch._dynamo.decorators, mark)(x, 0)
        got, want = compiled(x, w1, w2), f(x, w1, w2)
        for g_, w_ in zip(got, want):
            torch.testing.assert_close(g_, w_, rtol=1e-4, atol=1e-4)
        assert got[0].shape == (2 * m, 32) and got[1].shape == (m, 32)
    assert counters["stats"]["unique_graphs"] == 1
    assert len(commfuse.report().fused) == 3  # the three patterns, compiled once
    assert all(not isinstance(r.shape[0], int) for r in commfuse.report().fused)  # M stayed symbolic


@pytest.mark.parametrize("dp, tp", [(2, 2), (1, 2), (2, 1), (4, 2), (2, 4)])
def test_tp_subgroup_of_a_2d_mesh(dp, tp):
    """TP x DP meshes on fake ranks (2 GPUs as 1x2 and 2x1; 4; 8): fused ops name the TP group,
    not WORLD; a TP group of one rank has nothing to exchange and nothing fuses."""
    from torch._inductor.utils import run_and_get_code
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    init_fake_pg(dp * tp)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
    ref = copy.deepcopy(mlp)
    mlp = parallelize_module(mlp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    compiled = torch.compile(mlp, backend=commfuse.backend(min_mnk=0))
    x = torch.randn(4, 16, 64, requires_grad=True)
    out = {}
    _, codes = run_and_get_code(lambda: out.setdefault("y", compiled(x)).sum().backward())
    code = "\n".join(codes)
    fused = commfuse.report().fused
    if tp == 1:
        assert not fused and calls(code, "commfuse.mm_all_reduce") == 0
        torch.testing.assert_close(out["y"], ref(x))  # one rank: the fake group's sums are exact
        return
    tp_name = mesh["tp"].get_group().group_name
    assert (tp_name != dist.group.WORLD.group_name) == (dp > 1)
    assert len(fused) == 2 and {r.group for r in fused} == {tp_name}
    assert calls(code, "commfuse.mm_all_reduce") == 2 and f"'{tp_name}', " in code


def test_two_tp_groups_in_one_graph():
    """Two different groups in one graph: each fused op carries its own group's name."""
    init_fake_pg(4)
    ga, gb = dist.new_group([0, 1]), dist.new_group([0, 2])
    a, b, w = torch.randn(64, 32), torch.randn(64, 32), torch.randn(32, 48)

    def f(a, b, w):
        return funcol.all_reduce(a @ w, "sum", ga) + funcol.all_reduce(b @ w, "sum", gb)

    _, code = compile_code(f, a, b, w)
    assert calls(code, "commfuse.mm_all_reduce") == 2
    assert {r.group for r in commfuse.report().fused} == {ga.group_name, gb.group_name}


def test_zero_row_input(world2):
    x, w = torch.randn(0, 32), torch.randn(32, 24)
    out, code = compile_code(lambda x, w: funcol.all_reduce(x @ w, "sum", dist.group.WORLD), x, w)
    assert out.shape == (0, 24)
    assert calls(code, "commfuse.mm_all_reduce") == 1  # fused; at run time an empty output takes NCCL


def test_integer_matmul_stays_unfused(world2):
    a, w = torch.randint(-5, 5, (64, 32)), torch.randint(-5, 5, (32, 48))
    out, code = compile_code(lambda a, w: funcol.all_reduce(a @ w, "sum", dist.group.WORLD), a, w)
    assert calls(code, "commfuse.mm_all_reduce") == 0
    assert "torch.int64 is not fp16, bf16 or fp32" in commfuse.report()[0].reason
    torch.testing.assert_close(out, a @ w)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8])
def test_fp8_and_integer_matmuls_are_left_unfused_with_the_reason(dtype):
    """fp8 (which CPUs cannot multiply, so the guard is checked on a traced node) and int8."""
    import torch.fx as fx

    from commfuse.config import Settings
    from commfuse.patterns.common import Skip, check_fusable

    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    a.meta["val"] = torch.empty(4096, 4096, dtype=dtype, device="meta")
    b.meta["val"] = torch.empty(4096, 4096, dtype=dtype, device="meta")
    mm = g.call_function(torch.ops.aten.mm.default, (a, b))
    with pytest.raises(Skip, match=rf"dtype {dtype} is not fp16, bf16 or fp32"):
        check_fusable(mm, a, b, None, Settings(min_mnk=0, launch_bound_bytes=0))


def test_transposed_operands_fuse_and_match(world2):
    """A transposed view on the left (a weight-gradient-like layout) and a column-major right."""
    at, w = torch.randn(32, 64), torch.randn(48, 32)

    def f(at, w):
        return funcol.all_reduce(at.t() @ w.t(), "sum", dist.group.WORLD)

    out, code = compile_code(f, at, w)
    assert calls(code, "commfuse.mm_all_reduce") == 1
    torch.testing.assert_close(out, at.t() @ w.t())


def test_one_row_input(world2):
    x, w = torch.randn(1, 1, 32), torch.randn(24, 32)
    out, code = compile_code(lambda x, w: funcol.all_reduce(F.linear(x, w), "sum", dist.group.WORLD), x, w)
    assert calls(code, "commfuse.mm_all_reduce") == 1
    torch.testing.assert_close(out, F.linear(x, w))


def _verify_worker(rank: int, init_file: str) -> None:
    import torch.distributed as dist

    from commfuse import env
    from commfuse.runtime import verify

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    group = dist.group.WORLD.group_name
    os.environ["COMMFUSE_VERIFY"] = "1"
    env.reload()  # settings are read once
    b = torch.randn(8, 6)
    a = torch.randn(4 + rank, 8)  # rank 1 has one row more: a bug in the caller
    with pytest.raises(RuntimeError, match=r"mm_all_reduce: ranks of group .* disagree about call 0 of the group: "
                       rf"rank {rank} and rank {1 - rank} differ \(rows: {4 + rank} here, {5 - rank} there\)"):
        torch.ops.commfuse.mm_all_reduce(a, b, None, group)
    out = torch.ops.commfuse.mm_all_reduce(a[:4], b, None, group)  # agreeing calls go through
    assert out.shape == (4, 6)
    # an unevenly sharded K (9 and 8) is no disagreement: the product and its sum are well formed
    out = torch.ops.commfuse.mm_all_reduce(torch.randn(4, 9 - rank), torch.randn(9 - rank, 6), None, group)
    assert out.shape == (4, 6)
    calls = []
    real = verify.dist.all_gather_object
    verify.dist.all_gather_object = lambda *args, **kw: calls.append(1) or real(*args, **kw)
    os.environ["COMMFUSE_VERIFY"] = "0"
    env.reload()
    torch.ops.commfuse.mm_all_reduce(a[:4], b, None, group)
    assert not calls  # off by default: no extra collective per call
    dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_that_disagree_about_a_shape_get_a_clear_error():
    """With COMMFUSE_VERIFY=1 a call whose shapes differ between ranks raises on every rank,
    naming both ranks and the shapes, instead of exchanging mismatched data."""
    import tempfile


    with tempfile.TemporaryDirectory() as tmp:
        spawn(_verify_worker, args=(os.path.join(tmp, "rendezvous"),), nprocs=2)


def _skip_worker(rank: int, init_file: str) -> None:
    import datetime

    import torch.distributed as dist

    from commfuse import env
    from commfuse.runtime import groups

    torch._inductor.config.fx_graph_cache = False
    # a check that let the skipped call pass leaves rank 0 waiting in the next check: fail in seconds
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    group = dist.group.WORLD
    name = group.group_name
    torch.manual_seed(rank)
    x, ws = torch.randn(8, 32), [torch.randn(32, 32) for _ in range(3)]
    with env.override(verify=True):
        # compiled: one rank's program skips the middle call of three (its graph has two); the
        # graph pass numbers the calls from the graph's calls, so no two calls of the two
        # programs meet with one site and every rank raises at the first call, not after a wrong sum
        def three(x, w0, w1, w2):
            for w in (w0, w1, w2):
                x = funcol.all_reduce(x @ w, "sum", group)
            return x

        def two(x, w0, w1, w2):
            for w in (w0, w2):
                x = funcol.all_reduce(x @ w, "sum", group)
            return x

        torch._dynamo.reset()
        step = torch.compile(three if rank == 0 else two, backend=commfuse.backend(min_mnk=0), fullgraph=True)
        with pytest.raises(RuntimeError, match=r"disagree about call 0 of the group: .*\(site: \d+ here, \d+ there; "
                           r"site \d+ is forward#\d+ mm_all_reduce_default"):
            step(x, *ws)
        groups.release(name)

        # hand-written calls from three sites, alike in every size; rank 1 skips the second
        sites = (11, 12, 13) if rank == 0 else (11, 13)
        torch.ops.commfuse.mm_all_reduce(x, ws[0], None, name, sites[0])
        with pytest.raises(RuntimeError, match=r"disagree about call 1 of the group: rank \d and rank \d differ "
                           rf"\(site: {sites[1]} here, {13 if rank == 0 else 12} there\)"):
            torch.ops.commfuse.mm_all_reduce(x, ws[1], None, name, sites[1])
        groups.release(name)  # every rank together: the counts start over

        # the same program on both ranks, sharded unevenly (K of 17 and 16): the sites are alike
        # (shapes are not part of them) and every call passes
        k = 17 if rank == 0 else 16
        torch._dynamo.reset()
        step = torch.compile(lambda x, w0, w1: funcol.all_reduce(funcol.all_reduce(x @ w0, "sum", group)[:, :k] @ w1,
                                                                "sum", group),
                             backend=commfuse.backend(min_mnk=0), fullgraph=True)
        out = step(torch.randn(8, k), torch.randn(k, 32), torch.randn(k, 32))
        assert out.shape == (8, 32) and groups.get(name).calls == 2
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_skipped_call_among_alike_calls_is_an_error_on_every_rank():
    """With COMMFUSE_VERIFY=1, a rank that skips one of three calls alike in every size raises on
    every rank at the first call after the skipped one, naming the call sites (hand-written
    calls pass theirs; the graph pass numbers compiled ones), instead of a wrong sum on both ranks
    and a check that waits for a call the peer never makes."""
    import tempfile


    with tempfile.TemporaryDirectory() as tmp:
        spawn(_skip_worker, args=(os.path.join(tmp, "rendezvous"),), nprocs=2)


def _capturing_backend(backend):
    """``backend`` that also keeps what it returned (the callable Dynamo runs)."""
    returned = []

    def compile_graph(gm, example_inputs, **kw):
        returned.append(backend(gm, example_inputs, **kw))
        return returned[-1]

    return compile_graph, returned


def test_a_failure_reported_during_a_run_raises_at_the_end_of_that_run(world2, monkeypatch):
    """A CUDA-graph replay has no host step: a wait that times out in it only writes its group's
    error word while the replay runs. The callable the backend returns reads the words of its
    graph's groups after each run (no synchronisation), so the run during which the word was
    written raises, naming the group, the op, the global ranks and the call; later runs refuse
    until ``release_all``. Here the CPU op writes the word after its own entry checks, as a
    replayed kernel would."""
    from commfuse.runtime import groups, reference

    g = dist.group.WORLD
    commfuse.release_all()

    def f(x, w):
        return funcol.all_reduce(x @ w, "sum", g)

    compiled = torch.compile(f, backend=commfuse.backend(min_mnk=0), fullgraph=True)
    x, w = torch.randn(4, 8), torch.randn(8, 16)
    torch.testing.assert_close(compiled(x, w), f(x, w))  # a clean run returns
    real = reference.mm_all_reduce

    def replayed_kernel_times_out(a, b, bias, group_name):
        out = real(a, b, bias, group_name)
        groups.get(group_name).err[:5] = torch.tensor([1, 1, 0, 1, 3], dtype=torch.int32)
        return out

    monkeypatch.setattr(reference, "mm_all_reduce", replayed_kernel_times_out)
    with pytest.raises(RuntimeError, match=r"commfuse\.mm_all_reduce: on group '0', rank 0 timed out .* waiting for "
                                           r"rank 1 \(group ranks 0 and 1\) in call 3 of the group \(noticed when "
                                           r"a compiled graph of commfuse ops"):
        compiled(x, w)
    monkeypatch.setattr(reference, "mm_all_reduce", real)
    with pytest.raises(RuntimeError, match="refuses further calls"):
        compiled(x, w)
    commfuse.release_all()
    torch.testing.assert_close(compiled(x, w), f(x, w))


def test_a_failure_in_a_backward_graph_raises_at_the_next_forward_run(world2, monkeypatch):
    """Autograd runs the backward graph with no wrapper of the backend's around it: the forward
    graph's callable also reads the words of the groups its backward graph calls (noted when
    autograd compiled it), so a wait that timed out in a backward replay raises at the next
    forward run."""
    from commfuse.runtime import groups, reference

    g = dist.group.WORLD
    commfuse.release_all()

    class ColwiseGrad(torch.autograd.Function):  # identity forward, all_reduce backward
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, grad):
            return funcol.all_reduce(grad, "sum", g)

    def f(x, w):
        return F.linear(ColwiseGrad.apply(x), w)

    compiled = torch.compile(f, backend=commfuse.backend(min_mnk=0), fullgraph=True)
    x, w = torch.randn(8, 32, requires_grad=True), torch.randn(24, 32, requires_grad=True)
    compiled(x, w).sum().backward()  # compiles both graphs: the backward's all-reduce fuses
    assert [r.graph.startswith("backward") for r in commfuse.report().fused] == [True]
    real = reference.mm_all_reduce

    def replayed_kernel_times_out(a, b, bias, group_name):
        out = real(a, b, bias, group_name)
        groups.get(group_name).err[:5] = torch.tensor([1, 1, 1, 0, 9], dtype=torch.int32)
        return out

    monkeypatch.setattr(reference, "mm_all_reduce", replayed_kernel_times_out)
    compiled(x, w).sum().backward()  # the word is written in the backward graph's run
    monkeypatch.setattr(reference, "mm_all_reduce", real)
    with pytest.raises(RuntimeError, match=r"commfuse\.mm_all_reduce: on group '0', rank 1 timed out .* waiting for "
                                           r"rank 0 .* in call 9 of the group"):
        compiled(x, w)
    commfuse.release_all()


def test_the_returned_callable_keeps_inductors_convention_and_no_inputs(world2):
    """Wrapped only where the pass fused (or a backward graph may follow): Inductor's attributes
    (its ``_boxed_call`` flag among them) are kept, a boxed call's list reaches Inductor's callable
    as given (which empties it), and no input outlives the run through the wrapper."""
    import gc
    import weakref

    from commfuse.runtime import errors

    g = dist.group.WORLD
    compile_graph, returned = _capturing_backend(commfuse.backend(min_mnk=0))
    with torch.no_grad():
        torch.compile(lambda x, w: torch.relu(x @ w), backend=compile_graph, fullgraph=True)(
            torch.randn(4, 8), torch.randn(8, 16))
    assert not hasattr(returned[-1], "commfuse_watch")  # nothing fused, no backward: Inductor's own

    compiled = torch.compile(lambda x, w: funcol.all_reduce(x @ w, "sum", g), backend=compile_graph,
                             fullgraph=True)
    x, w = torch.randn(4, 8), torch.randn(8, 16)
    compiled(x, w)
    run = returned[-1]
    assert run.commfuse_watch.names == {g.group_name}
    assert getattr(run, "_boxed_call", None) == getattr(run.__wrapped__, "_boxed_call", None)
    kept = weakref.ref(x)
    out = compiled(x, w)
    del x, out
    gc.collect()
    assert kept() is None

    got = []

    def boxed(args):
        got.append(args)
        args.clear()  # Inductor frees the inputs as it goes
        return ("out",)

    boxed._boxed_call = True
    watched = errors.watch_runs(boxed, errors.Watch())
    args = [torch.randn(2)]
    assert watched._boxed_call is True and watched(args) == ("out",)
    assert got[0] is args and args == []
