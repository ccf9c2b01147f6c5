"""CUDA graphs: ``mm_all_reduce`` captured once and replayed uses the graph lane, whose epochs live
on the device, and stays correct over 1000 replays mixed with eager calls of both lanes.

Run under ``torchrun --nproc_per_node=2 -m pytest -m gpu tests/gpu``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import commfuse
from commfuse import check_errors, env
from commfuse.kernels import exchange, fused_split_k
from commfuse.runtime import groups
from commfuse.runtime.paths import ar_graph
from gpu_util import gather_all, relerr, run_path, start_over, timed_out

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True, scope="module")
def _lanes_released_after():
    """Captures here mark the group's graph lane replayed, and from then on eager calls that fit
    take the lane (a rank re-warming its graphs must meet its peers there): later files' dispatch
    tests (the split-K default for decode sizes) would see the lane instead. Every rank runs this
    module's tests, so every rank releases together."""
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    commfuse.release_all()


def _reference(a, b):
    return sum(x.float() @ y.float() for x, y in zip(gather_all(a), gather_all(b)))


@pytest.mark.parametrize("k, n, kernel", [(1003, 771, "staged"), (1024, 768, "split_k")])
def test_captured_mm_all_reduce_replays_match_the_reference(nccl, monkeypatch, k, n, kernel):
    """Rows TMA cannot describe take cuBLAS + the staged one-shot in the lane; TMA-ready ones the
    split-K kernel in the lane (its epochs on the device too), as the rules for captured calls say."""
    m = 16
    torch.manual_seed(7 + dist.get_rank())
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    torch.ops.commfuse.mm_all_reduce(a, b, None, nccl.group_name)  # eager: creates the lanes
    launched = []
    real, real_prepare = exchange.staged_all_reduce, fused_split_k.prepare
    monkeypatch.setattr(exchange, "staged_all_reduce",
                        lambda *x, **kw: launched.append("staged") or real(*x, **kw))
    monkeypatch.setattr(fused_split_k, "prepare", lambda *x, **kw: launched.append(
        "split_k" if kw.get("lane") else "eager split_k") or real_prepare(*x, **kw))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.ops.commfuse.mm_all_reduce(a, b, None, nccl.group_name)  # warm-up (not captured: host epochs)
        launched.clear()
        with torch.cuda.graph(graph, stream=stream):
            out = torch.ops.commfuse.mm_all_reduce(a, b, None, nccl.group_name)
    torch.cuda.current_stream().wait_stream(stream)
    assert launched == [kernel], "the capture did not take the graph lane's expected kernel"
    other = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16) / 512 ** 0.5
    big = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16)  # 8 MiB out: past the lane
    w_big = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16) / 512 ** 0.5
    for i in range(1000):
        a.copy_(torch.randn_like(a))  # fresh data every replay
        graph.replay()
        if i % 7 == 3:  # eager calls of the host-epoch workspace in between (calls that fit the lane take it)
            with env.override(algo="one_shot"):
                got = torch.ops.commfuse.mm_all_reduce(big, w_big, None, nccl.group_name)
            if i % 100 == 3:
                assert relerr(got, _reference(big, w_big)) < 1e-2
        if i % 11 == 5:  # and eager calls of the graph lane itself (its split-K kernel: 64 x 256)
            with env.override(algo="graph"):
                got = torch.ops.commfuse.mm_all_reduce(other, w, None, nccl.group_name)
            if i % 55 == 5:
                assert relerr(got, _reference(other, w)) < 1e-2, f"eager lane call at replay {i}"
        if i % 100 == 99:
            check_errors()
            assert relerr(out, _reference(a, b)) < 1e-2, f"replay {i}"
    check_errors()


def test_reduce_overhead_compile_matches_eager(nccl):
    """``commfuse.backend(mode="reduce-overhead")`` on a DTensor TP MLP: fused, graph-replayed,
    equal to eager on fresh inputs for 50 steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))
    mlp = parallelize_module(mlp.cuda().bfloat16(), init_device_mesh("cuda", (2,)),
                             {"0": ColwiseParallel(), "2": RowwiseParallel()})
    commfuse.clear_report()
    compiled = torch.compile(mlp, backend=commfuse.backend(mode="reduce-overhead"))
    torch.manual_seed(1)  # the same inputs on both ranks (the MLP's input is replicated)
    with torch.no_grad():
        for step in range(50):
            x = torch.randn(4, 8, 1024, device="cuda", dtype=torch.bfloat16)
            torch.compiler.cudagraph_mark_step_begin()
            got = compiled(x).clone()
            assert relerr(got, mlp(x)) < 1e-2, f"step {step}"
    check_errors()
    assert len(commfuse.report().fused) == 1


@pytest.mark.parametrize("split_k", [True, False], ids=["split_k", "staged"])
def test_late_peer_in_the_graph_lane_poisons_the_output(nccl, monkeypatch, settings, split_k):
    """No host code runs between replays to raise: a graph-lane call whose peer never comes
    leaves NaN in its output and the error word set (the lane's split-K kernel, as a rule's
    ``{"split_k": true}`` asks, and cuBLAS + the staged one-shot, the path without one). The
    group then refuses calls, and its lane stays out of step until ``release_all``."""
    settings(timeout_s=1)
    start_over()  # a lane allocated now waits at most 1 s
    a = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    kernels = []
    real_prepare = fused_split_k.prepare
    monkeypatch.setattr(fused_split_k, "prepare", lambda *x, **kw: kernels.append(kw.get("lane"))
                        or real_prepare(*x, **kw))

    def call():
        return run_path("mm_all_reduce", "graph", a, b, None, nccl.group_name, config=lambda c, facts: (
            ar_graph.GRAPH.config(c, facts, {"split_k": True}) if split_k else None))

    call()
    check_errors()
    assert kernels == ([True] if split_k else []), "the lane's kernel for this configuration"
    dist.barrier()
    if dist.get_rank() == 0:
        out = call()
        torch.cuda.synchronize()
        assert torch.isnan(out).all()
        with pytest.raises(RuntimeError, match=timed_out("mm_all_reduce (graph lane)", nccl.group_name)):
            check_errors()
        with pytest.raises(RuntimeError, match="refuses further calls: call commfuse.release_all"):  # sticky
            torch.ops.commfuse.mm_all_reduce(a, b, None, nccl.group_name)
        with pytest.raises(RuntimeError, match=r"the graph lanes of group .* are out of step"):
            call()
    start_over()  # the lanes' epochs now differ between ranks: start over


def test_first_call_inside_a_graph_warm_up_and_two_graphed_models(nccl):
    """The group's first symmetric call happens inside a CUDA-graph warm-up (allocations there come
    from the graph's private pool, which later captures reuse): the lanes' tables must not live
    there. Two graphed models then alternate, each equal to eager."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    start_over()
    assert groups.get(nccl.group_name).lane is None
    mesh = init_device_mesh("cuda", (2,))
    models = []
    for width in (2048, 4096):
        torch.manual_seed(width)
        mlp = torch.nn.Sequential(torch.nn.Linear(1024, width), torch.nn.GELU(), torch.nn.Linear(width, 1024))
        mlp = parallelize_module(mlp.cuda().bfloat16(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        models.append((mlp, torch.compile(mlp, backend=commfuse.backend(mode="reduce-overhead"))))
    torch.manual_seed(2)
    with torch.no_grad():
        for step in range(40):
            mlp, compiled = models[step % 2]
            x = torch.randn(4, 8, 1024, device="cuda", dtype=torch.bfloat16)
            torch.compiler.cudagraph_mark_step_begin()
            got = compiled(x).clone()
            assert relerr(got, mlp(x)) < 1e-2, f"step {step}"
    check_errors()
    assert groups.get(nccl.group_name).lane is not None
