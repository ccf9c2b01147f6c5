"""``mm_all_reduce_add_rms_norm``'s one-shot path (``runtime/running/ar_norm.py``: cuBLAS into the
workspace, then the norm epilogue kernel), its graph-lane path under capture, and the
sequence-parallel form's (``mm_reduce_scatter_add_rms_norm``, ``runtime/running/rs_norm.py``) at 2,
4 and 8 ranks emulated on one GPU, as
``test_gpu_one_device.py`` emulates them: every rank's call on its own stream, the outputs poisoned
with NaN, ``h`` and ``n`` compared with an fp32 reference of the unfused chain (every rank's
partial summed, the residual added, the norm and the weight) and ``n`` with the models' own norm
applied to the path's ``h`` (both roundings). Hidden sizes that fill no power of two, rows from 1
to 8192. Runs in one process:

    pytest -m gpu tests/gpu/test_gpu_norm_epilogue.py
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from commfuse.runtime import errors
from commfuse.runtime.facts import local_facts
from commfuse.runtime.paths import ar_norm, rs_norm
from commfuse.runtime.paths.base import Context
from commfuse.runtime.running import ar_norm as ar_norm_run
from commfuse.runtime.running import rs_norm as rs_norm_run
from commfuse.runtime.spec import MM_ALL_REDUCE_ADD_RMS_NORM, MM_REDUCE_SCATTER_ADD_RMS_NORM, Call
from commfuse.tools import emulated

pytestmark = [pytest.mark.gpu, pytest.mark.one_gpu,
              pytest.mark.skipif(int(os.environ.get("WORLD_SIZE", "1")) > 1, reason="runs in one process")]

DT = torch.bfloat16
EPS = 1e-5
CONNECTIONS = int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8"))


class _Rank(emulated.GroupState):
    """One emulated rank as a path's context reads its group: its workspace (large enough, so
    ``paths.common.workspace`` hands it out) and no process group (epochs never restart here)."""

    def __init__(self, ws):
        super().__init__(ws)
        self.streams = None

    def pg(self):
        raise AssertionError("an emulated rank has no process group")


def _operands(world, m, k, n, call):
    torch.manual_seed(world * 7919 + m + n + call)
    a = [torch.randn(m, k, device="cuda", dtype=DT) for _ in range(world)]
    b = [(torch.randn(n, k, device="cuda", dtype=DT) / k ** 0.5).t() for _ in range(world)]
    residual = torch.randn(m, n, device="cuda", dtype=DT)
    weight = (1 + 0.2 * torch.randn(n, device="cuda")).to(DT)
    h = residual.float() + sum(x.float() @ y.float() for x, y in zip(a, b))
    return a, b, residual, weight, h, h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()


def _model_norm(h, weight, weight_last):
    if weight_last:  # LlamaRMSNorm
        x = h.float()
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype)
    return F.rms_norm(h, (h.shape[-1],), weight, EPS)


def _call_or_skip(path, world, m, k, n):
    """The call and this GPU's facts, or a skip where the emulation or the path cannot take it."""
    if world > CONNECTIONS:
        pytest.skip(f"{world} spinning streams need CUDA_DEVICE_MAX_CONNECTIONS >= {world}")
    call = Call(path.op, m, k, n, DT, world)
    facts = local_facts(world)
    why = path.supports(call, facts)
    if why:
        pytest.skip(why)
    return call, facts


def _relerr(got, want):
    assert torch.isfinite(got).all(), "unwritten (NaN-poisoned) or non-finite output"
    return ((got.float() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("m, n", [(1, 4096), (7, 999), (128, 5120), (1000, 4095), (8192, 8191)])
@pytest.mark.parametrize("weight_last", [True, False], ids=["llama", "rms_norm"])
def test_one_shot_norm_path(world, m, n, weight_last):
    k = 256
    call, facts = _call_or_skip(ar_norm.ONE_SHOT, world, m, k, n)
    ranks = [_Rank(w) for w in emulated.group(world, ar_norm.ONE_SHOT.workspace_bytes(call), timeout_s=20.0)]
    streams = [torch.cuda.Stream() for _ in range(world)]
    for c in range(3):  # both parities, and a reused one
        a, b, residual, weight, want_h, want_n = _operands(world, m, k, n, c)
        a[0] @ b[0]  # cuBLAS's kernel loaded before any rank spins
        shape = (m // 2, 2, n) if m % 2 == 0 else (m, n)  # a 3-D residual where the rows split
        # NaN-poisoned outputs: an element the kernel does not write shows
        outs = [(torch.full((m, n), float("nan"), device="cuda", dtype=DT),
                 torch.full((m, n), float("nan"), device="cuda", dtype=DT)) for _ in range(world)]
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
        for r in range(world):
            args = MM_ALL_REDUCE_ADD_RMS_NORM.Args(a[r], b[r], None, residual.view(shape), weight, EPS, weight_last,
                                                   "emulated")
            with torch.cuda.stream(streams[r]):
                ar_norm_run.run_into(ar_norm.ONE_SHOT, Context(call, facts, ranks[r]), args, *outs[r])
        torch.cuda.synchronize()
        errors.check(ranks[0])
        for r, (h, out) in enumerate(outs):
            assert _relerr(h, want_h) < 1e-2, (c, r, "h")
            assert _relerr(out, want_n) < 1e-2, (c, r, "n")
            chain = _model_norm(h, weight, weight_last)
            torch.testing.assert_close(out, chain, rtol=2e-2, atol=2e-2)
            assert (out != chain).float().mean().item() < 0.01, (c, r, "another rounding")
            assert torch.equal(h, outs[0][0]) and torch.equal(out, outs[0][1]), (c, r, "ranks differ")


class _LaneRank(_Rank):
    """An emulated rank whose group has a graph lane (``capture.lane`` reads ``group.lane``)."""

    def __init__(self, ws, lane):
        super().__init__(ws)
        self.lane = lane


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("m, n", [(1, 4096), (16, 4095), (256, 8192)])
def test_graph_norm_path_captured_and_replayed(world, m, n):
    """``mm_all_reduce_add_rms_norm``'s ``graph`` path (the staged exchange + add + norm kernel on
    the group's graph lane): every rank's call captured in a CUDA graph of its own, the graphs
    replayed together three times (both parities, then one reused) with fresh operands copied into
    the captured inputs and the outputs poisoned before each replay; ``h`` and ``n`` against fp32 of
    the unfused chain."""
    from commfuse.runtime import running

    k = 256
    call, facts = _call_or_skip(ar_norm.GRAPH, world, m, k, n)
    lanes = emulated.lanes(world, 1 << 22, timeout_s=20.0)
    ranks = [_LaneRank(w, lanes[r]) for r, w in enumerate(emulated.group(world, 1 << 16, timeout_s=20.0))]
    streams = [torch.cuda.Stream() for _ in range(world)]
    a, b, residual, weight, _, _ = _operands(world, m, k, n, 0)
    args = [MM_ALL_REDUCE_ADD_RMS_NORM.Args(a[r], b[r], None, residual, weight, EPS, True, "emulated")
            for r in range(world)]
    a[0] @ b[0]  # cuBLAS's kernel loaded before any rank spins
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for r in range(world):  # compiled and loaded eagerly first, every rank alike
        with torch.cuda.stream(streams[r]):
            running.run(ar_norm.GRAPH, Context(call, facts, ranks[r]), args[r])
    torch.cuda.synchronize()
    assert int(lanes[0].err[0]) == 0, lanes[0].err  # the lanes' own error word: no wait timed out
    graphs, outs = [], []
    for r in range(world):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=streams[r]):
            outs.append(running.run(ar_norm.GRAPH, Context(call, facts, ranks[r]), args[r]))
        graphs.append(graph)
    for c in range(1, 4):
        fresh = _operands(world, m, k, n, c)
        for r in range(world):
            a[r].copy_(fresh[0][r])
            b[r].copy_(fresh[1][r])
        residual.copy_(fresh[2])
        weight.copy_(fresh[3])
        for h, out in outs:
            h.fill_(float("nan"))
            out.fill_(float("nan"))
        torch.cuda.synchronize()
        for r in range(world):
            with torch.cuda.stream(streams[r]):
                graphs[r].replay()
        torch.cuda.synchronize()
        assert int(lanes[0].err[0]) == 0, (c, lanes[0].err)
        for r, (h, out) in enumerate(outs):
            assert _relerr(h, fresh[4]) < 1e-2, (c, r, "h")
            assert _relerr(out, fresh[5]) < 1e-2, (c, r, "n")


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("slabs, rows, n", [(1, 1, 4096), (1, 7, 999), (2, 64, 5120), (1, 1024, 8191),
                                             (3, 5, 4095)])
def test_sequence_parallel_norm_path(world, slabs, rows, n):
    """``mm_reduce_scatter_add_rms_norm``'s ``pull``: the product ``[slabs, world * rows, n]``
    scattered along dim 1 (dim 0 where ``slabs`` is 1), so each rank's share is ``rows`` rows of each
    slab; every rank's ``h`` and ``n`` (poisoned first) against fp32 of the unfused chain on its
    share, both roundings over the calls."""
    k = 256
    m = slabs * world * rows
    call, facts = _call_or_skip(rs_norm.PULL, world, m, k, n)
    ranks = [_Rank(w) for w in emulated.group(world, rs_norm.PULL.workspace_bytes(call), timeout_s=20.0)]
    streams = [torch.cuda.Stream() for _ in range(world)]
    shape, dim = ([slabs, world * rows, n], 1) if slabs > 1 else ([m, n], 0)
    share = list(shape)
    share[dim] //= world
    for c in range(3):  # both parities, and a reused one
        weight_last = c != 1
        torch.manual_seed(world * 7919 + m + n + c)
        a = [torch.randn(m, k, device="cuda", dtype=DT) for _ in range(world)]
        b = [(torch.randn(n, k, device="cuda", dtype=DT) / k ** 0.5).t() for _ in range(world)]
        residual = [torch.randn(share, device="cuda", dtype=DT) for _ in range(world)]
        weight = (1 + 0.2 * torch.randn(n, device="cuda")).to(DT)
        total = sum(x.float() @ y.float() for x, y in zip(a, b)).view(shape)
        a[0] @ b[0]  # cuBLAS's kernel loaded before any rank spins
        outs = [(torch.full((slabs * rows, n), float("nan"), device="cuda", dtype=DT),
                 torch.full((slabs * rows, n), float("nan"), device="cuda", dtype=DT)) for _ in range(world)]
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
        for r in range(world):
            args = MM_REDUCE_SCATTER_ADD_RMS_NORM.Args(a[r], b[r], None, residual[r], weight, EPS, weight_last, shape,
                                                       dim, world, "emulated")
            with torch.cuda.stream(streams[r]):
                rs_norm_run.run_into(rs_norm.PULL, Context(call, facts, ranks[r]), args, *outs[r])
        torch.cuda.synchronize()
        errors.check(ranks[0])
        for r, (h, out) in enumerate(outs):
            mine = total.chunk(world, dim)[r].reshape(-1, n)
            want_h = residual[r].float().reshape(-1, n) + mine
            want_n = want_h * torch.rsqrt(want_h.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()
            assert _relerr(h, want_h) < 1e-2, (c, r, "h")
            assert _relerr(out, want_n) < 1e-2, (c, r, "n")
            chain = _model_norm(h, weight, weight_last)
            torch.testing.assert_close(out, chain, rtol=2e-2, atol=2e-2)
            assert (out != chain).float().mean().item() < 0.01, (c, r, "another rounding")
