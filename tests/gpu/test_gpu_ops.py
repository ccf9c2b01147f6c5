"""The CUDA paths against an fp32 reference of the unfused computation, on fresh random data with
poisoned outputs, 2 ranks over NCCL + symmetric memory.

Run under ``torchrun --nproc_per_node=2 -m pytest -m gpu tests/gpu``; every rank runs the same
tests in the same order (they are collective). Without torchrun or GPUs they skip."""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

import commfuse
from commfuse import check_errors
from commfuse.runtime.paths.ar_ce_overlap import CeConfig, chunk_rows
from commfuse.runtime import counters
from commfuse.runtime.counters import PATHS
from commfuse.runtime.paths.rs_ce_overlap import RsOverlapConfig
from gpu_util import decided, gather_all, poison, relerr, run_path, start_over, timed_out

pytestmark = pytest.mark.gpu


@pytest.fixture(params=["default", "one_shot", "two_shot", "ce_overlap", "graph"])
def algo(request, settings):
    settings(algo=None if request.param == "default" else request.param)
    return request.param


@pytest.fixture(params=["torch", "iris"])
def provider(request, settings):
    settings(symm_provider=request.param)
    return request.param


def _copy_engines_with(provider: str, algo: str) -> None:
    """The copy-engine paths need the torch provider's peer views; under Iris a forced one cannot
    take the call and the rules' choice runs instead, which the default cases cover: such a case
    would only repeat them under another name."""
    if provider == "iris" and algo == "ce_overlap":
        pytest.skip(f"{algo} cannot run under the iris provider (no peer views); the rules' choice has its own cases")


def _ran(op: str, before) -> dict:
    """The calls of ``op`` per path since ``before`` (a copy of ``PATHS``)."""
    return {k: v - before.get(k, 0) for k, v in PATHS.items() if k.startswith(op + ":") and v != before.get(k, 0)}


def _took(op: str, before, algo: str, *args) -> None:
    """The call ran one path: the policy's choice under the settings in force, which is the forced
    path wherever that path takes the call (the copy-engine, one- and two-shot paths take every
    call here; the graph lane only outputs up to its size, beyond which the rules' choice runs)."""
    want = decided(op, *args)
    assert _ran(op, before) == {f"{op}:{want}": 1}
    if algo not in ("default", "graph"):
        assert want == algo


@pytest.mark.parametrize("m", [1, 7, 16, 129, 1000, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_mm_all_reduce(nccl, algo, provider, m, dtype, bias):
    _copy_engines_with(provider, algo)
    k, n = 1003, 771  # not multiples of any tile
    torch.manual_seed(1000 * dist.get_rank() + m)
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(k, n, device="cuda", dtype=dtype) / k ** 0.5
    c = torch.randn(n, device="cuda", dtype=dtype) if bias else None
    poison()
    before = PATHS.copy()
    out = torch.ops.commfuse.mm_all_reduce(a, b, c, nccl.group_name)
    ref = sum(x.float() @ y.float() for x, y in zip(gather_all(a), gather_all(b)))
    if bias:
        ref = ref + sum(t.float() for t in gather_all(c))
    check_errors()
    _took("mm_all_reduce", before, algo, a, b, c, nccl.group_name)
    assert relerr(out, ref) < 1e-2


@pytest.mark.parametrize("gather_dim, shape", [(0, (1, 1003)), (0, (129, 1003)), (0, (7, 3, 1003)), (1, (2, 500, 1003)),
                                               (1, (1, 129, 1003))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ag_algo", ["pull", "ce_overlap"])
def test_all_gather_mm(nccl, provider, gather_dim, shape, dtype, ag_algo, settings):
    _copy_engines_with(provider, ag_algo)
    settings(algo=ag_algo)
    torch.manual_seed(7 + dist.get_rank())
    shard = torch.randn(*shape, device="cuda", dtype=dtype)
    torch.manual_seed(7)
    b = torch.randn(shape[-1], 771, device="cuda", dtype=dtype) / shape[-1] ** 0.5
    poison()
    before = PATHS.copy()
    out, gathered = torch.ops.commfuse.all_gather_mm(shard, b, None, gather_dim, 2, nccl.group_name, True)
    want_gathered = torch.cat(gather_all(shard), dim=gather_dim)
    check_errors()
    _took("all_gather_mm", before, ag_algo, shard, b, None, gather_dim, 2, nccl.group_name, True)
    assert torch.equal(gathered, want_gathered)
    ref = want_gathered.float().reshape(-1, shape[-1]) @ b.float()
    assert relerr(out, ref) < 1e-2


@pytest.mark.parametrize("scatter_dim, shape", [(0, (2, 771)), (0, (14, 771)), (0, (258, 771)), (0, (2000, 771)),
                                                (0, (8, 3, 771)), (1, (2, 500, 771)), (1, (1, 258, 771))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rs_algo", ["pull", "ce_overlap"])
def test_mm_reduce_scatter(nccl, provider, scatter_dim, shape, dtype, rs_algo, settings):
    _copy_engines_with(provider, rs_algo)
    settings(algo=rs_algo)
    k, n = 1003, shape[-1]
    m = shape[0] * (shape[1] if len(shape) == 3 else 1)
    torch.manual_seed(31 + dist.get_rank())
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(k, n, device="cuda", dtype=dtype) / k ** 0.5
    c = torch.randn(n, device="cuda", dtype=dtype)
    poison()
    before = PATHS.copy()
    out = torch.ops.commfuse.mm_reduce_scatter(a, b, c, list(shape), scatter_dim, 2, nccl.group_name)
    total = sum((x.float() @ y.float() + z.float()).view(shape) for x, y, z in zip(gather_all(a), gather_all(b), gather_all(c)))
    check_errors()
    _took("mm_reduce_scatter", before, rs_algo, a, b, c, list(shape), scatter_dim, 2, nccl.group_name)
    assert out.shape == total.chunk(2, dim=scatter_dim)[0].shape
    assert relerr(out, total.chunk(2, dim=scatter_dim)[dist.get_rank()]) < 1e-2


@pytest.mark.parametrize("op, given", [("mm_reduce_scatter", 1), ("mm_reduce_scatter", 4), ("mm_all_reduce", 3)])
def test_overlap_chunks_keep_the_results(nccl, provider, op, given):
    """The copy-engine overlaps' row chunks, as a sweep passes them in the path's configuration
    (``RsOverlapConfig``: chunks of the reduce-scatter's shares; ``CeConfig``: the all-reduce's
    chunks), change the schedule, never the result."""
    _copy_engines_with(provider, "ce_overlap")  # every case runs a copy-engine overlap
    dtype, k, n = torch.bfloat16, 1003, 776
    torch.manual_seed(53 + dist.get_rank())
    a = torch.randn(2000, k, device="cuda", dtype=dtype)
    b = torch.randn(k, n, device="cuda", dtype=dtype) / k ** 0.5
    c = torch.randn(n, device="cuda", dtype=dtype)
    poison()
    ref = sum(x.float() @ y.float() + z.float() for x, y, z in zip(gather_all(a), gather_all(b), gather_all(c)))
    if op == "mm_reduce_scatter":
        out = run_path(op, "ce_overlap", a, b, c, [2000, n], 0, 2, nccl.group_name,
                       config=lambda call, facts: RsOverlapConfig(given))
        ref = ref.chunk(2)[dist.get_rank()]
    else:  # run eagerly: the CUDA-graph form has its own test below
        out = run_path(op, "ce_overlap", a, b, c, nccl.group_name,
                       config=lambda call, facts: CeConfig(chunk_rows(call.m, given), graphs=False))
    check_errors()
    assert relerr(out, ref) < 1e-2
    if op == "mm_all_reduce":  # an all-reduce: every rank holds the same bits
        same = out.clone()
        dist.broadcast(same, 0)
        assert torch.equal(same, out)


def test_copy_engine_calls_replay_as_cuda_graphs(nccl):
    """Copy-engine all-reduces whose operands stay put (refilled in place, as a model's steps
    allocate alike) run eagerly, are captured, then replay their CUDA graphs (``ce_graphs.py``),
    every one right against fp32 on fresh data, the previous output poisoned in place (the next
    call's output takes its block) and every rank holding the same bits. One-shot calls of another
    size (host epochs) run between them; rank 1 turns graphs off for two calls, so a replay on one
    rank meets eager calls on the other."""
    from commfuse import env
    from commfuse.runtime import ce_graphs

    m, k, n, calls = 4096, 512, 1024, 10
    rank = dist.get_rank()
    torch.manual_seed(61 + rank)
    inputs = [(torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
               torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / k ** 0.5,
               torch.randn(n, device="cuda", dtype=torch.bfloat16)) for _ in range(calls)]
    small = [torch.randn(16, 256, device="cuda", dtype=torch.bfloat16) for _ in range(calls)]
    w = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16) / 16
    a, b, c = (torch.empty_like(t) for t in inputs[0])
    saved = torch.empty(calls, m, n, device="cuda", dtype=torch.bfloat16)  # nothing allocated in the loop
    saved_small = torch.empty(calls, 16, 128, device="cuda", dtype=torch.bfloat16)
    before = dict(counters.CE_GRAPHS)
    hows = []  # per call: what this rank's copy-engine call did (nothing counted: graphs off)
    out = None
    for i in range(calls):
        for dst, src in zip((a, b, c), inputs[i]):
            dst.copy_(src)
        if out is not None:
            out.fill_(float("nan"))
            del out
        counted = dict(counters.CE_GRAPHS)
        with env.override(algo="ce_overlap", ce_graphs=not (rank == 1 and i in (6, 7))):
            out = torch.ops.commfuse.mm_all_reduce(a, b, c, nccl.group_name)
        hows.append([how for how in counted if counters.CE_GRAPHS[how] > counted[how]])
        saved[i].copy_(out)
        with env.override(algo="one_shot"):
            saved_small[i].copy_(torch.ops.commfuse.mm_all_reduce(small[i], w, None, nccl.group_name))
    check_errors()
    for i in range(calls):
        ref = sum(x.float() @ y.float() + z.float() for x, y, z in zip(*(gather_all(t) for t in inputs[i])))
        assert relerr(saved[i], ref) < 1e-2, i
        same = saved[i].clone()
        dist.broadcast(same, 0)
        assert torch.equal(same, saved[i]), i
        ref_small = sum(x.float() for x in gather_all(small[i].float() @ w.float()))
        assert relerr(saved_small[i], ref_small) < 1e-2, i
    counts = {how: counters.CE_GRAPHS[how] - before[how] for how in before}
    assert ce_graphs.enabled(), ce_graphs._disabled
    assert counts["captured"] >= 1 and counts["replayed"] >= 2, counts  # addresses repeat from the third call
    if rank == 1:  # graphs off for calls 6 and 7: through the eager path, outside ce_graphs
        assert hows[6] == hows[7] == [], hows
    else:  # while rank 1 ran them eagerly, this rank replayed at least one
        assert ["replayed"] in hows[6:8], hows


def test_compiled_tp_mlp_matches_eager(nccl):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))
    mlp = parallelize_module(mlp.cuda().bfloat16(), init_device_mesh("cuda", (2,)),
                             {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(4, 256, 1024, device="cuda", dtype=torch.bfloat16)
    commfuse.clear_report()
    with torch.no_grad():
        got = torch.compile(mlp, backend="commfuse")(x)
        want = mlp(x)
    check_errors()
    assert len(commfuse.report().fused) == 1
    assert relerr(got, want) < 1e-2


def test_back_to_back_mixed_shapes(nccl):
    """1000 calls of mixed shapes and ops: no hang, and no drift (checked every 100 calls)."""
    gen = torch.Generator().manual_seed(5)  # same shape sequence on every rank
    torch.manual_seed(11 + dist.get_rank())
    shapes = [(1, 512, 1024), (16, 4096, 1024), (300, 1000, 2000), (2048, 1024, 2048)]
    for i in range(1000):
        m, k, n = shapes[int(torch.randint(len(shapes), (1,), generator=gen))]
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        if i % 2:
            out = torch.ops.commfuse.mm_all_reduce(a, b, None, nccl.group_name)
            check = lambda: sum(x.float() @ y.float() for x, y in zip(gather_all(a), gather_all(b)))
        else:
            out, _ = torch.ops.commfuse.all_gather_mm(a, b, None, 0, 2, nccl.group_name, False)
            check = lambda: torch.cat(gather_all(a)).float() @ b.float()
        if i % 100 in (98, 99):
            check_errors()
            assert relerr(out, check()) < 1e-2, f"call {i}: {m}x{k}x{n}"
    check_errors()


def test_skipped_call_times_out_with_a_clear_error(nccl, settings):
    """Rank 1 skips a call: rank 0 raises naming the group, itself and the peer, instead of
    hanging."""
    settings(timeout_s=1, algo="one_shot")
    start_over()  # a workspace allocated now waits at most 1 s
    a = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    torch.ops.commfuse.mm_all_reduce(a, b, None, nccl.group_name)  # both ranks: creates the workspace
    check_errors()
    dist.barrier()
    if dist.get_rank() == 0:
        torch.ops.commfuse.mm_all_reduce(a, b, None, nccl.group_name)
        with pytest.raises(RuntimeError, match=timed_out("mm_all_reduce", nccl.group_name)):
            check_errors()
    start_over()  # epochs now differ between ranks: fresh workspaces (with the default bound)


def test_repeated_calls_launch_directly_and_stay_correct(nccl, settings):
    """The second and later launches of a specialisation go through ``kernels/launch.py``'s
    direct path (nothing turned it off), with every result still right: the fused kernel and
    the one-shot exchange, each called three times on fresh data; the fused kernel's later calls
    through its kept launch (``launch.Bound``)."""
    from commfuse.kernels import exchange, fused_all_reduce, launch

    direct = launch.BOUND_DIRECT
    for algo in ("fused", "one_shot"):
        settings(algo=algo)
        for i in range(3):
            torch.manual_seed(100 * dist.get_rank() + i)
            a = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16) / 16
            poison()
            out = torch.ops.commfuse.mm_all_reduce(a, b, None, nccl.group_name)
            ref = sum(x.float() @ y.float() for x, y in zip(gather_all(a), gather_all(b)))
            check_errors()
            assert relerr(out, ref) < 1e-2
    assert launch.enabled(), launch._disabled
    kernels = {key[0] for key, compiled in launch._compiled.items() if compiled is not False}
    assert {fused_all_reduce.gemm_all_reduce_kernel, exchange.one_shot_kernel} <= kernels
    assert launch.BOUND_DIRECT >= direct + 2  # the fused calls after the first
