"""The FP8 ops' symmetric paths (decisions.md §20: the graph's own ``_scaled_mm`` into the workspace,
then the exchange kernels; the FP8 shards gathered, then ``_scaled_mm``; the fused tile kernel on
FP8 operands, tensor-wise scales) at 2, 4 and 8 ranks
emulated on one GPU, as ``test_gpu_one_device.py`` emulates them: every rank's call on its own
stream, outputs poisoned with NaN, compared with an fp32 sum of every rank's unfused product (its
own scales) and, for the gather, the FP8 bits of every rank's shard. Needs a GPU whose
``_scaled_mm`` runs (sm_89 or later). Runs in one process:

    pytest -m gpu tests/gpu/test_gpu_fp8_paths.py
"""

from __future__ import annotations

import os

import pytest
import torch

from commfuse.runtime import errors, reference, running
from commfuse.runtime.facts import local_facts
from commfuse.runtime.paths import REGISTRY
from commfuse.runtime.paths.base import Context
from commfuse.runtime.spec import SPECS
from commfuse.tools import emulated

pytestmark = [pytest.mark.gpu, pytest.mark.one_gpu,
              pytest.mark.skipif(int(os.environ.get("WORLD_SIZE", "1")) > 1, reason="runs in one process"),
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                 reason="FP8 _scaled_mm needs sm_89 or later")]

BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn
CONNECTIONS = int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8"))


class _Rank(emulated.GroupState):
    """One emulated rank as a path's context reads its group: its workspace (large enough, so
    ``paths.common.workspace`` hands it out) and no process group (epochs never restart here)."""

    def pg(self):
        raise AssertionError("an emulated rank has no process group")


def _fp8(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(E4M3)


def _relerr(got, want):
    assert torch.isfinite(got).all(), "unwritten (NaN-poisoned) or non-finite output"
    return ((got.float() - want).norm() / want.norm()).item()


def _run_every_rank(op: str, name: str, world: int, args: list, calls: int = 1):
    """Path ``name`` of ``op`` for every rank's ``args``, each rank on its own stream."""
    spec, path = SPECS[op], REGISTRY[(op, name)]
    facts = local_facts(world)
    call = spec.call(args[0], world)
    why = path.supports(call, facts)
    if why:
        pytest.skip(why)
    ranks = [_Rank(w) for w in emulated.group(world, path.workspace_bytes(call), timeout_s=20.0)]
    streams = [torch.cuda.Stream() for _ in range(world)]
    outs = []
    for _ in range(calls):  # both parities
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
        got = []
        for r in range(world):
            with torch.cuda.stream(streams[r]):
                # NaN in the blocks the run's outputs will take (the caching allocator hands a freed
                # block of this stream to its next allocations): an element the path does not write
                # stays NaN
                nan = [torch.full((bytes_ // 4 + 64,), float("nan"), device="cuda") for bytes_ in _out_bytes(call)]
                del nan
                got.append(running.run(path, Context(call, facts, ranks[r]), args[r]))
        torch.cuda.synchronize()
        errors.check(ranks[0])
        outs.append(got)
    return outs


def _out_bytes(call) -> list[int]:
    """The sizes of a call's outputs, largest first: the product (fp32 at most) and, for a gather,
    the gathered shards (bf16 at most)."""
    sizes = [call.m * call.n * 4]
    if "gather" in call.op:
        sizes.append(call.m * call.k * 2)
    return sorted(sizes, reverse=True)


def _skip_past_queues(world):
    if world > CONNECTIONS:
        pytest.skip(f"{world} spinning streams need CUDA_DEVICE_MAX_CONNECTIONS >= {world}")


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("name", ["one_shot", "two_shot", "fused", "split_k"])
@pytest.mark.parametrize("m, k, n, out_dtype, bias", [
    (1, 4096, 4096, BF16, False), (48, 2048, 1040, BF16, True), (1000, 1024, 4096, torch.float32, False),
    (4096, 2048, 4096, BF16, False)])
def test_scaled_mm_all_reduce_paths(world, name, m, k, n, out_dtype, bias):
    _skip_past_queues(world)
    torch.manual_seed(world * 31 + m + n)
    op = "scaled_mm_all_reduce"
    a = [_fp8(m, k) for _ in range(world)]
    b = [_fp8(n, k, scale=k ** -0.5).t() for _ in range(world)]
    sa = [torch.rand((), device="cuda") + 0.5 for _ in range(world)]  # every rank's own scales
    sb = [torch.rand((), device="cuda") + 0.5 for _ in range(world)]
    c = [torch.randn(n, device="cuda", dtype=BF16) if bias else None for _ in range(world)]
    want = sum(reference.scaled_matmul(a[r], b[r], sa[r], sb[r], c[r], out_dtype, False).float() for r in range(world))
    args = [SPECS[op].Args(a[r], b[r], sa[r], sb[r], c[r], out_dtype, False, "emulated") for r in range(world)]
    for got in _run_every_rank(op, name, world, args, calls=3):
        for r, out in enumerate(got):
            assert out.dtype == out_dtype and _relerr(out, want) < 1e-2, r
            assert torch.equal(out, got[0]), (r, "ranks differ")


@pytest.mark.parametrize("world", [2, 8])
@pytest.mark.parametrize("name", ["one_shot", "two_shot", "fused"])
@pytest.mark.parametrize("post", [False, True], ids=["forward", "backward-form"])
def test_rowwise_scaled_mm_all_reduce_paths(world, name, post):
    _skip_past_queues(world)
    m, k, n = 512, 1024, 2048
    torch.manual_seed(world + 7 * post)
    op = "rowwise_scaled_mm_all_reduce"
    a = [_fp8(m, k) for _ in range(world)]
    b = [_fp8(n, k, scale=k ** -0.5).t() for _ in range(world)]
    ones = (torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda"))
    sa = [ones[0] if post else torch.rand(m, 1, device="cuda") + 0.5 for _ in range(world)]
    sb = [ones[1] if post else torch.rand(1, n, device="cuda") + 0.5 for _ in range(world)]
    pa = [torch.rand(m, 1, device="cuda") + 0.5 if post else None for _ in range(world)]
    pb = [torch.rand(1, n, device="cuda") + 0.5 if post else None for _ in range(world)]
    fast = not post  # the backward's form runs with precise accumulation
    want = sum(reference.rowwise_scaled_matmul(a[r], b[r], sa[r], sb[r], None, BF16, fast, pa[r], pb[r]).float()
               for r in range(world))
    args = [SPECS[op].Args(a[r], b[r], sa[r], sb[r], None, BF16, fast, pa[r], pb[r], "emulated") for r in range(world)]
    for got in _run_every_rank(op, name, world, args, calls=2):
        for r, out in enumerate(got):
            assert _relerr(out, want) < 1e-2, r


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("op, name", [("scaled_mm_reduce_scatter", "pull"), ("rowwise_scaled_mm_reduce_scatter", "pull"),
                                      ("scaled_mm_reduce_scatter", "fused"), ("rowwise_scaled_mm_reduce_scatter", "fused")])
@pytest.mark.parametrize("rows, scatter_dim", [(1024, 0), (8, 0), (256, 1)])
def test_scaled_mm_reduce_scatter_paths(world, op, name, rows, scatter_dim):
    _skip_past_queues(world)
    k, n = 2048, 1536
    m = rows * world
    torch.manual_seed(world * 3 + rows + scatter_dim)
    rowwise = op.startswith("rowwise")
    a = [_fp8(m, k) for _ in range(world)]
    b = [_fp8(n, k, scale=k ** -0.5).t() for _ in range(world)]
    sa = [torch.rand((m, 1) if rowwise else (), device="cuda") + 0.5 for _ in range(world)]
    sb = [torch.rand((1, n) if rowwise else (), device="cuda") + 0.5 for _ in range(world)]
    c = [torch.randn(n, device="cuda", dtype=BF16) for _ in range(world)]
    shape = [m, n] if scatter_dim == 0 else [2, m // 2, n]
    product = reference.rowwise_scaled_matmul if rowwise else reference.scaled_matmul
    want = sum(product(a[r], b[r], sa[r], sb[r], c[r], BF16, True).float() for r in range(world)).view(shape)
    extra = (None, None) if rowwise else ()
    args = [SPECS[op].Args(a[r], b[r], sa[r], sb[r], c[r], BF16, True, *extra, shape, scatter_dim, world, "emulated")
            for r in range(world)]
    for got in _run_every_rank(op, name, world, args, calls=2):
        for r, out in enumerate(got):
            assert _relerr(out, want.chunk(world, dim=scatter_dim)[r]) < 1e-2, r


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("rows, gather_dim", [(1, 0), (1000, 0), (256, 1)])
@pytest.mark.parametrize("float8", [E4M3, torch.float8_e5m2])
@pytest.mark.parametrize("name", ["pull", "fused"])
def test_all_gather_scaled_mm_paths(world, rows, gather_dim, float8, name):
    _skip_past_queues(world)
    k, n = 1024, 3072
    torch.manual_seed(world + rows + gather_dim)
    op = "all_gather_scaled_mm"
    shape = (rows, k) if gather_dim == 0 else (2, rows // 2, k)
    shards = [torch.randn(*shape, device="cuda").to(float8) for _ in range(world)]
    b = _fp8(n, k, scale=k ** -0.5).t()
    sa, sb = torch.rand((), device="cuda") + 0.5, torch.rand((), device="cuda") + 0.5
    bias = torch.randn(n, device="cuda", dtype=BF16)
    want_gathered = torch.cat([s.view(torch.uint8) for s in shards], dim=gather_dim)
    want = reference.scaled_matmul(want_gathered.view(float8).reshape(-1, k), b, sa, sb, bias, BF16, True)
    args = [SPECS[op].Args(shards[r], b, sa, sb, bias, BF16, True, gather_dim, world, "emulated", True)
            for r in range(world)]
    for got in _run_every_rank(op, name, world, args, calls=2):
        for r, (out, gathered) in enumerate(got):
            assert torch.equal(gathered.view(torch.uint8), want_gathered), r
            if name == "pull":
                assert torch.equal(out, want), r  # the same product of the same bits
            else:  # the tile kernel's own GEMM
                assert _relerr(out, want.float()) < 1e-2, r


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("rows", [1, 1000])
@pytest.mark.parametrize("gathered", [False, True], ids=["fp8-rows", "bf16-read-after"])
@pytest.mark.parametrize("name", ["pull", "fused"])
def test_all_gather_rowwise_scaled_mm_paths(world, rows, gathered, name):
    """Each rank's rows quantised before the gather and gathered with their multipliers: the same
    product as quantising after a gather (the unfused op's), bit for bit through the pull and
    cuBLAS; the fused kernel's own GEMM within bf16's tolerance."""
    _skip_past_queues(world)
    k, n = 2048, 1024
    torch.manual_seed(world + rows + gathered)
    op = "all_gather_rowwise_scaled_mm"
    shards = [(torch.randn(rows, k, device="cuda") * (r + 1)).to(BF16) for r in range(world)]
    b = _fp8(n, k, scale=k ** -0.5).t()
    sb = torch.rand(1, n, device="cuda") + 0.5
    bias = torch.randn(n, device="cuda", dtype=BF16)
    full = torch.cat(shards)
    q, multiplier = reference.quantise_rows(full, E4M3, 1e-12, True)
    want = reference.scaled_matmul(q, b, multiplier.reciprocal(), sb, bias, BF16, True)
    args = [SPECS[op].Args(shards[r], b, sb, bias, BF16, True, E4M3, 1e-12, True, 0, world, "emulated", gathered)
            for r in range(world)]
    for got in _run_every_rank(op, name, world, args, calls=2):
        for r, (out, got_gathered) in enumerate(got):
            if name == "pull" or gathered:  # (the fused path's bf16-read form is the pull's)
                assert torch.equal(out, want), r
            else:
                assert _relerr(out, want.float()) < 1e-2, r
            if gathered:
                assert torch.equal(got_gathered, full), r
