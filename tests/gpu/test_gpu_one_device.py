"""Every kernel's cross-rank protocol at 2, 4 and 8 ranks on one GPU, against fp32 references.

Each rank is a workspace on the same GPU (its own buffer; one heap-bases table, so Iris's pointer
translation reaches any rank's buffer), its kernels launched on its own stream with 1/world of
the SMs, so every rank's programs run at once and really wait on each other's flags. What one GPU
cannot show is the link (remote stores here are local) and several processes; the ranks' tile
ownership, flag counts, shares, epochs and parity reuse at 4 and 8 ranks it does, where no
4- or 8-GPU machine was lent. Runs without torchrun (under it, only rank 0 runs these):

    pytest -m gpu tests/gpu/test_gpu_one_device.py
"""

from __future__ import annotations

import os

import pytest
import torch

from commfuse.kernels import (cuda_paths, dispatch, exchange, fused_all_gather, fused_all_reduce, fused_split_k,
                              symm, tiles)
from commfuse.kernels.sync import OP_MM_ALL_REDUCE, check_errors

pytestmark = [pytest.mark.gpu, pytest.mark.one_gpu,
              pytest.mark.skipif(int(os.environ.get("RANK", "0")) > 0, reason="one process runs these")]

WORLDS = [2, 4, 8]
DT = torch.bfloat16


@pytest.fixture(autouse=True)
def _bounded(monkeypatch):
    """A lost flag becomes an error in seconds, not a hang."""
    monkeypatch.setenv("COMMFUSE_TIMEOUT_S", "20")
    yield
    torch.cuda.synchronize()
    check_errors()


class _Views:
    """The torch provider's peer views (``get_buffer``) over the emulated ranks' buffers."""

    def __init__(self, bufs):
        self.bufs = bufs

    def get_buffer(self, peer, sizes, dtype, storage_offset):
        nbytes = torch.Size(sizes).numel() * dtype.itemsize
        start = storage_offset * dtype.itemsize
        return self.bufs[peer][start:start + nbytes].view(dtype).view(sizes)


def _group(world: int, data_bytes: int) -> list:
    programs = torch.cuda.get_device_properties(0).multi_processor_count // world
    bufs = [torch.zeros(symm.HEADER_BYTES + 2 * data_bytes, dtype=torch.uint8, device="cuda")
            for _ in range(world)]
    bases = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device="cuda")
    views = _Views(bufs)
    return [symm.Workspace(f"one-device-{world}", r, world, bufs[r], bases, data_bytes, max_programs=programs,
                           _keepalive=views) for r in range(world)]


def _operands(world, m, k, n, bias, call=0):
    torch.manual_seed(world * 1000 + m + k + n + 7 * call)
    a = [torch.randn(m, k, device="cuda", dtype=DT) for _ in range(world)]
    b = [(torch.randn(n, k, device="cuda", dtype=DT) / k ** 0.5).t() for _ in range(world)]  # W.t()
    c = [torch.randn(n, device="cuda", dtype=DT) if bias else None for _ in range(world)]
    ref = sum(x.float() @ y.float() for x, y in zip(a, b))
    if bias:
        ref = ref + sum(t.float() for t in c)
    return a, b, c, ref


def _relerr(got, want):
    assert torch.isfinite(got).all(), "unwritten (NaN-poisoned) or non-finite output"
    return ((got.float() - want).norm() / want.norm()).item()


def _each_rank(ws, streams, fn):
    """``fn(rank, epoch, parity)`` for every rank, each on its own stream, in one epoch."""
    for r, s in enumerate(streams):
        epoch, parity = ws[r].next_epoch()
        with torch.cuda.stream(s):
            fn(r, epoch, parity)


def _streams(world):
    main = torch.cuda.current_stream()
    streams = [torch.cuda.Stream() for _ in range(world)]
    for s in streams:
        s.wait_stream(main)  # the operands were made on the main stream
    return streams


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("scatter", [False, True], ids=["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("reducers", [0, 16])
def test_fused_all_reduce_kernel(world, scatter, reducers):
    """Three calls back to back (both parities, then the first again), outputs poisoned."""
    if scatter and reducers:
        pytest.skip("the reduce-scatter form has no reducers")
    m, k, n = (1024 if scatter else 1000), 512, 776
    cfg = tiles.TileConfig.parse(f"128x256x64s3w8g8r{reducers}o1")
    ws = _group(world, fused_all_reduce.data_elems(m, n, world, cfg, scatter) * DT.itemsize)
    streams = _streams(world)
    for call in range(3):
        a, b, c, ref = _operands(world, m, k, n, bias=call == 1, call=call)
        share = m // world
        outs = [torch.full((share if scatter else m, n), float("nan"), device="cuda", dtype=DT)
                for _ in range(world)]
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
        launches = [fused_all_reduce.prepare(ws[r], a[r], b[r], c[r], outs[r], cfg, scatter) for r in range(world)]
        _each_rank(ws, streams, lambda r, epoch, parity: launches[r](epoch, parity))
        torch.cuda.synchronize()
        check_errors()
        for r in range(world):
            want = ref[r * share:(r + 1) * share] if scatter else ref
            assert _relerr(outs[r], want) < 1e-2, (call, r)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("algo", ["one_shot", "two_shot"])
def test_exchange_all_reduce(world, algo):
    m, n = 1000, 776
    ws = _group(world, m * n * DT.itemsize)
    streams = _streams(world)
    for call in range(3):
        torch.manual_seed(call)
        parts = [torch.randn(m, n, device="cuda", dtype=DT) for _ in range(world)]
        ref = sum(p.float() for p in parts)
        outs = [torch.full((m, n), float("nan"), device="cuda", dtype=DT) for _ in range(world)]
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())

        def run(r, epoch, parity):
            partial = ws[r].data(parity, (m, n), DT)
            partial.copy_(parts[r])
            exchange.all_reduce(ws[r], partial, outs[r], epoch, algo, OP_MM_ALL_REDUCE)

        _each_rank(ws, streams, run)
        torch.cuda.synchronize()
        for r in range(world):
            assert _relerr(outs[r], ref) < 1e-2, (call, r)


@pytest.mark.parametrize("world", WORLDS)
def test_copy_engine_overlap(world, monkeypatch):
    """The chunked cuBLAS + copy-engine all-reduce (``cuda_paths._copy_engine_overlapped``): a
    barrier per chunk, the peers' rows pulled by the copy engines, summed in rank order."""
    m, k, n = 4096, 256, 512  # four 1024-row chunks
    ws = _group(world, m * n * DT.itemsize)
    sides = [torch.cuda.Stream() for _ in range(world)]
    streams = _streams(world)
    # The local ops once alone first: CUDA loads a kernel at its first launch, after the running
    # ones finish; with every rank's host in this one thread, rank 0's first add would wait for
    # its barrier, which waits for rank 1's, which this thread has not launched yet.
    a, b, c, _ = _operands(world, 1024, k, n, bias=True)
    for bias in (None, c[0]):
        cuda_paths._matmul_into(a[0], b[0], bias, torch.empty(1024, n, device="cuda", dtype=DT))
    chunk = torch.randn(1024, n, device="cuda", dtype=DT)
    cuda_paths._sum_rank_order([chunk] * world, torch.empty_like(chunk))
    torch.cuda.synchronize()
    for call in range(3):
        a, b, c, ref = _operands(world, m, k, n, bias=call == 1, call=call)
        outs = [torch.full((m, n), float("nan"), device="cuda", dtype=DT) for _ in range(world)]
        recvs = [torch.full((world - 1, m, n), float("nan"), device="cuda", dtype=DT) for _ in range(world)]
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())

        def run(r, epoch, parity):
            monkeypatch.setattr(cuda_paths, "_side_stream", lambda device: sides[r])
            partial = ws[r].data(parity, (m, n), DT)
            peers = [ws[r].peer_data(p, parity, (m, n), DT) for p in range(world)]
            cuda_paths._copy_engine_overlapped(ws[r], a[r], b[r], c[r], partial, outs[r], recvs[r], peers, epoch)

        _each_rank(ws, streams, run)
        torch.cuda.synchronize()
        for r in range(world):
            assert _relerr(outs[r], ref) < 1e-2, (call, r)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("m", [1, 16, 64])
def test_split_k_kernel(world, m):
    k, n = 2048, 1024
    programs = torch.cuda.get_device_properties(0).multi_processor_count // world
    cfg = fused_split_k.config(m, k, n, programs)
    ws = _group(world, fused_split_k.data_bytes(m, n, world, cfg, DT))
    streams = _streams(world)
    for call in range(3):
        a, b, c, ref = _operands(world, m, k, n, bias=call == 1, call=call)
        outs = [torch.full((m, n), float("nan"), device="cuda", dtype=DT) for _ in range(world)]
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
        launches = [fused_split_k.prepare(ws[r], a[r], b[r], c[r], outs[r], cfg) for r in range(world)]
        _each_rank(ws, streams, lambda r, epoch, parity: launches[r](epoch, parity))
        torch.cuda.synchronize()
        for r in range(world):
            assert _relerr(outs[r], ref) < 1e-2, (call, r)


@pytest.mark.parametrize("world", WORLDS)
def test_fused_all_gather_kernel(world):
    rows, k, n = 256, 512, 776  # each rank's rows
    cfg = dispatch.gather_tile_config(world * rows, k, n)
    ws = _group(world, fused_all_gather.data_elems(rows, k, world) * DT.itemsize)
    streams = _streams(world)
    for call in range(3):
        torch.manual_seed(call)
        shards = [torch.randn(rows, k, device="cuda", dtype=DT) for _ in range(world)]
        b = (torch.randn(n, k, device="cuda", dtype=DT) / k ** 0.5).t()
        full = torch.cat(shards)
        ref = full.float() @ b.float()
        outs = [torch.full((world * rows, n), float("nan"), device="cuda", dtype=DT) for _ in range(world)]
        gathered = [torch.full((world * rows, k), float("nan"), device="cuda", dtype=DT) for _ in range(world)]
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
        launches = [fused_all_gather.prepare(ws[r], shards[r], b, None, gathered[r], outs[r], cfg)
                    for r in range(world)]
        _each_rank(ws, streams, lambda r, epoch, parity: launches[r](epoch, parity))
        torch.cuda.synchronize()
        for r in range(world):
            assert torch.equal(gathered[r], full), (call, r)
            assert _relerr(outs[r], ref) < 1e-2, (call, r)
