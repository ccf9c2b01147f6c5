"""Dispatch decisions and workspace bookkeeping: the parts of the GPU paths that need no GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from commfuse.kernels import dispatch, symm
from commfuse.kernels.sync import ErrorWord

BF16 = torch.bfloat16


@pytest.mark.parametrize("world", [2, 4, 8])
def test_mm_all_reduce_choice(world, monkeypatch):
    monkeypatch.delenv("COMMFUSE_ALGO", raising=False)
    monkeypatch.delenv("COMMFUSE_CE_MIN_K", raising=False)
    assert dispatch.mm_all_reduce(16, 4096, 8192, BF16, 1) == "nccl"  # nothing to exchange
    assert dispatch.mm_all_reduce(0, 4096, 8192, BF16, world) == "nccl"
    assert dispatch.mm_all_reduce(16, 4096, 8192, BF16, world) == "split_k"  # decode: few rows
    assert dispatch.mm_all_reduce(256, 4096, 8192, BF16, world) in ("one_shot", "two_shot")  # 4 MiB
    # from 1024 rows, K up to 4096 and more than one wave of 128x256 tiles: fused at 2 ranks
    # (measured there), the symmetric paths elsewhere
    assert dispatch.mm_all_reduce(1024, 4096, 8192, BF16, world) == ("fused" if world == 2 else "two_shot")
    assert dispatch.mm_all_reduce(2048, 2048, 4096, BF16, world) == ("fused" if world == 2 else "two_shot")
    assert dispatch.mm_all_reduce(1536, 2048, 4096, BF16, world) == ("fused" if world == 2 else "two_shot")
    assert dispatch.mm_all_reduce(1024, 7168, 4096, BF16, world) == ("one_shot" if world == 2 else "two_shot")
    assert dispatch.mm_all_reduce(1023, 2048, 8192, BF16, world) == ("one_shot" if world == 2 else "two_shot")
    # ... one wave (2^22 outputs) or less: cuBLAS + one-shot
    mid = dispatch.mm_all_reduce(1024, 2048, 4096, BF16, world)
    assert mid == ("one_shot" if world == 2 else "two_shot")
    assert dispatch.mm_all_reduce(2048, 1024, 2048, BF16, world) == ("one_shot" if world == 2 else "two_shot")
    # many rows and a small K: the exchange is large against the GEMM, the fused kernel hides it
    assert dispatch.mm_all_reduce(4096, 2048, 4096, BF16, world) == "fused"
    assert dispatch.mm_all_reduce(8192, 2048, 4096, BF16, world) == "fused"
    # from 8192 rows and K = 4096 the copy engines at 2 ranks (their barriers off the pulls' stream)
    assert dispatch.mm_all_reduce(8192, 4096, 8192, BF16, world) == ("ce_overlap" if world == 2 else "fused")
    # GEMM-bound (K >= 7168, M >= 4096): at 2 ranks the copy engines move the partials, no SMs
    assert dispatch.mm_all_reduce(8192, 7168, 4096, BF16, world) == ("ce_overlap" if world == 2 else "fused")
    # K larger than M: the GEMM dominates and the reducers' SMs cost more than the exchange they hide
    big = dispatch.mm_all_reduce(4096, 7168, 4096, BF16, world)
    assert big == ("ce_overlap" if world == 2 else "two_shot")
    # more than one wave of tiles at K above 4096: fused, its programs' start staggered
    assert dispatch.mm_all_reduce(2048, 7168, 4096, BF16, world) == ("fused" if world == 2 else "two_shot")
    assert dispatch.mm_all_reduce(1024, 14336, 8192, BF16, world) == ("fused" if world == 2 else "two_shot")
    # fp32, and rows TMA cannot describe, keep the cuBLAS paths
    assert dispatch.mm_all_reduce(8192, 4096, 8192, torch.float32, world) != "fused"
    assert dispatch.mm_all_reduce(8192, 4095, 8192, BF16, world) != "fused"
    # elsewhere the copy-engine overlap lost inside models (launch-bound steps): taken when forced
    monkeypatch.setenv("COMMFUSE_ALGO", "ce_overlap")
    assert dispatch.mm_all_reduce(8192, 4096, 8192, BF16, world) == "ce_overlap"
    monkeypatch.delenv("COMMFUSE_ALGO")
    assert dispatch.mm_all_reduce(1 << 16, 4096, 16384, BF16, world) == "nccl"  # 2 GiB: past the cap


def test_forced_fused_falls_back_where_the_tile_kernel_cannot_go(monkeypatch):
    monkeypatch.setenv("COMMFUSE_ALGO", "fused")
    assert dispatch.mm_all_reduce(7, 1024, 776, BF16, 2) == "fused"  # small, but it can
    assert dispatch.mm_all_reduce(7, 1003, 771, BF16, 2) == "one_shot"  # rows not 16-byte multiples
    assert dispatch.mm_all_reduce(7, 1024, 776, torch.float32, 2) == "one_shot"
    assert dispatch.mm_all_reduce(7, 1024, 776, BF16, 1) == "nccl"
    assert dispatch.fused_unsupported(4096, 0, 776, BF16, 2) == "an empty dimension"
    monkeypatch.delenv("COMMFUSE_ALGO")
    assert dispatch.mm_all_reduce(4096, 0, 776, BF16, 2) != "fused"  # K = 0: torch returns the bias
    monkeypatch.setenv("COMMFUSE_ALGO", "fused")
    # 16384 tiles x 17 flags each is more than the tile-flag area holds
    assert "tile flags" in dispatch.fused_unsupported(1 << 15, 1024, 1 << 14, BF16, 16)
    assert dispatch.fused_unsupported(1 << 15, 1024, 1 << 14, BF16, 8) is None


def test_fused_reduce_scatter_is_taken_from_16384_rows_above_2_ranks_or_when_forced(monkeypatch):
    monkeypatch.delenv("COMMFUSE_ALGO", raising=False)
    assert dispatch.mm_reduce_scatter(4096, 4096, 4096, BF16, 4) != "fused"  # it loses there
    assert dispatch.mm_reduce_scatter(16384, 4096, 7168, BF16, 4) == "fused"
    assert dispatch.mm_reduce_scatter(16384, 4096, 7168, BF16, 2) == "ce_overlap"  # 4 chunks win at 2
    assert dispatch.mm_reduce_scatter(16384, 64, 64, BF16, 2) == "fused"  # no overlap for so little work
    assert dispatch.mm_reduce_scatter(16384, 4096, 7168, BF16, 4, scatter_dim=1) != "fused"
    assert dispatch.mm_reduce_scatter(16384, 4096, 7168, torch.float32, 4) != "fused"
    monkeypatch.setenv("COMMFUSE_ALGO", "fused")
    assert dispatch.mm_reduce_scatter(4096, 4096, 4096, BF16, 2) == "fused"
    assert dispatch.mm_reduce_scatter(14, 1024, 776, BF16, 2) == "fused"
    assert dispatch.mm_reduce_scatter(4096, 4096, 4096, BF16, 2, scatter_dim=1) == "symm"
    assert dispatch.mm_reduce_scatter(15, 1024, 776, BF16, 2) == "symm"  # rows do not split
    assert dispatch.mm_reduce_scatter(14, 1003, 776, BF16, 2) == "symm"  # TMA rows
    assert "split" in dispatch.fused_unsupported(15, 1024, 776, BF16, 2, scatter=True)


def test_fused_all_gather_is_taken_only_where_the_kernel_can_go(monkeypatch):
    monkeypatch.setenv("COMMFUSE_ALGO", "fused")
    assert dispatch.all_gather_mm(2048, 1024, 776, BF16, 2) == "fused"
    assert dispatch.all_gather_mm(2, 1024, 776, BF16, 2) == "fused"  # one row per rank
    assert dispatch.all_gather_mm(2048, 1024, 776, BF16, 2, gather_dim=1) == "symm"
    assert dispatch.all_gather_mm(2048, 1003, 776, BF16, 2) == "symm"  # TMA rows
    assert dispatch.all_gather_mm(2048, 1024, 776, torch.float32, 2) == "symm"
    assert dispatch.fused_unsupported(2048, 1024, 776, BF16, 2, gather=True) is None
    monkeypatch.setenv("COMMFUSE_TILE_CONFIG", "80x128x64s4w8g8r0o1")  # not whole pushed chunks
    assert "multiple of 32" in dispatch.fused_unsupported(2048, 1024, 776, BF16, 2, gather=True)


def test_tile_config_parses_and_round_trips(monkeypatch):
    from commfuse.kernels.tiles import TileConfig

    cfg = TileConfig.parse("128x128x64s4w4g8r16o2")
    assert (cfg.bm, cfg.bn, cfg.bk, cfg.stages, cfg.warps, cfg.group_m, cfg.reducers, cfg.per_sm) == \
        (128, 128, 64, 4, 4, 8, 16, 2)
    assert TileConfig.parse(str(cfg)) == cfg
    assert TileConfig.parse("128x256x64s3w8g8r16").per_sm == 1
    with pytest.raises(ValueError, match="tile config"):
        TileConfig.parse("128x256")
    monkeypatch.setenv("COMMFUSE_TILE_CONFIG", "64x128x64s4w4g8r8o1")
    assert dispatch.tile_config(4096, 4096, 4096) == TileConfig(64, 128, 64, 4, 4, 8, 8, 1)


def test_all_gather_push_by_shard_size(monkeypatch):
    """The fused all-gather's copy engines push shards from 2 MiB (one chunk), its programs push
    smaller ones; ``COMMFUSE_AG_PUSH`` forces either and rejects anything else."""
    from commfuse.kernels import fused_all_gather

    monkeypatch.delenv("COMMFUSE_AG_PUSH", raising=False)
    monkeypatch.delenv("COMMFUSE_AG_CE_CHUNKS", raising=False)
    assert dispatch.gather_push(1024 * 2048 * 2) == "ce"  # 2048^3 on 2 ranks
    assert dispatch.gather_push(512 * 1024 * 2) == "sm"  # 1024^3
    assert fused_all_gather.ce_chunks(1024) == 1
    monkeypatch.setenv("COMMFUSE_AG_CE_CHUNKS", "1000")
    assert fused_all_gather.ce_chunks(1024) == 1024 // 32  # chunks of at least 32 rows
    assert fused_all_gather.ce_chunks(5) == 1
    monkeypatch.setenv("COMMFUSE_AG_PUSH", "sm")
    assert dispatch.gather_push(1 << 30) == "sm"
    monkeypatch.setenv("COMMFUSE_AG_PUSH", "dma")
    with pytest.raises(ValueError, match="COMMFUSE_AG_PUSH"):
        dispatch.gather_push(1 << 30)


def test_small_outputs_take_small_tiles(monkeypatch):
    """Up to 2^20 outputs the reduce-scatter and all-gather kernels take 64x128 tiles (more
    waves to overlap); the all-reduce keeps its default; the same answer on every call."""
    from commfuse.kernels.tiles import TileConfig

    monkeypatch.delenv("COMMFUSE_TILE_CONFIG", raising=False)
    small = TileConfig(bm=64, bn=128, stages=4, warps=4, reducers=0)
    assert dispatch.tile_config(1024, 1024, 1024, scatter=True) == small
    assert dispatch.gather_tile_config(1024, 1024, 1024) == small
    assert dispatch.tile_config(1024, 1024, 1024) == TileConfig(reducers=0)  # the all-reduce: inline copies
    assert dispatch.tile_config(2048, 2048, 2048, scatter=True) == TileConfig(reducers=0)
    assert dispatch.gather_tile_config(2048, 2048, 2048).bn == 128
    assert dispatch.fused_unsupported(1024, 1024, 1024, BF16, 2, scatter=True) is None
    assert dispatch.fused_unsupported(1024, 1024, 1024, BF16, 2, gather=True) is None


def test_all_gather_mm_choice(monkeypatch):
    monkeypatch.delenv("COMMFUSE_ALGO", raising=False)
    # 1024-2048 gathered rows and small outputs: the fused kernel (measured 1024^3, 2048^3)
    assert dispatch.all_gather_mm(2048, 2048, 2048, BF16, 2) == "fused"
    assert dispatch.all_gather_mm(1024, 1024, 1024, BF16, 2) == "fused"
    assert dispatch.all_gather_mm(2048, 4096, 7168, BF16, 2) == "overlap"  # a larger output
    assert dispatch.all_gather_mm(16384, 4096, 7168, BF16, 2) == "fused"  # and again from 16384 rows
    assert dispatch.all_gather_mm(16384, 4096, 7168, BF16, 2, gather_dim=1, slabs=4) == "symm"
    assert dispatch.all_gather_mm(2048, 2048, 2048, torch.float32, 2) == "symm"  # not fp32
    assert dispatch.all_gather_mm(512, 2048, 2048, BF16, 2) == "symm"  # not measured below
    assert dispatch.all_gather_mm(4096, 4096, 4096, BF16, 2) == "overlap"
    # GEMM-bound (the gather is a few % of the GEMM): overlapped all the same (1.01-1.03x measured)
    assert dispatch.all_gather_mm(8192, 8192, 28672, BF16, 2) == "overlap"
    # ... and only that: the other paths were never timed at such N
    assert dispatch.all_gather_mm(2048, 8192, 28672, BF16, 2) == "overlap"  # not the fused kernel
    assert dispatch.all_gather_mm(2048, 64, 16384, BF16, 2) == "nccl"  # too little work to overlap
    assert dispatch.all_gather_mm(8192, 8192, 28672, BF16, 2, gather_dim=1, slabs=4) == "nccl"
    assert dispatch.all_gather_mm(4096, 4096, 4096, BF16, 2, gather_dim=1) == "symm"
    assert dispatch.all_gather_mm(1 << 20, 8192, 1024, BF16, 2) == "nccl"


def test_choice_depends_on_shape_only(monkeypatch):
    """Same inputs, same answer on every rank: the dispatch reads no rank-local state (the rank,
    the device), so ranks that call with the same sizes enter the same collective."""
    monkeypatch.delenv("COMMFUSE_ALGO", raising=False)
    shapes = [(m, k, n) for m in (16, 128, 1024, 4096, 8192) for k, n in ((2048, 4096), (7168, 4096), (14336, 8192))]

    def answers():
        return ([dispatch.mm_all_reduce(m, k, n, BF16, 2) for m, k, n in shapes]
                + [dispatch.all_gather_mm(m, k, n, BF16, 2) for m, k, n in shapes]
                + [dispatch.mm_reduce_scatter(m, k, n, BF16, 2) for m, k, n in shapes])

    first = answers()
    assert len(set(first)) > 2  # the shapes do steer it
    for rank in (1, 3):
        monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, rank=rank, **k: rank)
        monkeypatch.setattr(torch.cuda, "current_device", lambda rank=rank: rank)
        assert answers() == first, rank


def test_forced_algorithm(monkeypatch):
    monkeypatch.setenv("COMMFUSE_ALGO", "two_shot")
    assert dispatch.mm_all_reduce(16, 16, 16, BF16, 2) == "two_shot"
    assert dispatch.all_gather_mm(4096, 4096, 4096, BF16, 2) == "overlap"
    assert dispatch.all_gather_mm(8192, 8192, 28672, BF16, 2) == "overlap"  # two_shot is not one of its paths
    monkeypatch.setenv("COMMFUSE_ALGO", "nccl")
    assert dispatch.all_gather_mm(4096, 4096, 4096, BF16, 2) == "nccl"
    monkeypatch.setenv("COMMFUSE_ALGO", "fastest")
    with pytest.raises(ValueError, match="COMMFUSE_ALGO"):
        dispatch.mm_all_reduce(16, 16, 16, BF16, 2)


def test_overlap_config(monkeypatch):
    monkeypatch.delenv("COMMFUSE_OVERLAP", raising=False)
    assert dispatch.overlap_config(4096) == (4, 32)
    monkeypatch.setenv("COMMFUSE_OVERLAP", "8x16")
    assert dispatch.overlap_config(4096) == (8, 16)


def _workspace(data_bytes=1 << 12):
    """A workspace over plain CPU memory (group "0" is the fake WORLD when one is initialised)."""
    buf = torch.zeros(symm.HEADER_BYTES + 2 * data_bytes, dtype=torch.uint8)
    return symm.Workspace("0", 0, 2, buf, torch.zeros(2, dtype=torch.int64), data_bytes)


def test_workspace_epochs_and_parity():
    ws = _workspace()
    assert [ws.next_epoch() for _ in range(3)] == [(1, 1), (2, 0), (3, 1)]
    assert ws.flags.numel() == (symm.FLAG_BYTES - symm.BASES_BYTES) // 4


def test_workspace_halves_do_not_overlap():
    ws = _workspace()
    a = ws.data(0, (32, 32), torch.float32)
    b = ws.data(1, (32, 32), torch.float32)
    a.fill_(1)
    b.fill_(2)
    assert a.eq(1).all() and b.eq(2).all() and ws.flags.eq(0).all()
    with pytest.raises(RuntimeError, match="too small"):
        ws.data(0, (33, 32), torch.float32)


def test_provider_setting(monkeypatch):
    monkeypatch.setenv("COMMFUSE_SYMM_PROVIDER", "iris")
    assert symm.provider_name() == "iris"
    monkeypatch.setenv("COMMFUSE_SYMM_PROVIDER", "nvshmem")
    with pytest.raises(ValueError, match="COMMFUSE_SYMM_PROVIDER"):
        symm.provider_name()


def test_timeout_error_names_op_rank_and_peer(monkeypatch):
    word = torch.tensor([1, 1, 0, 1], dtype=torch.int32)  # what a timed-out kernel writes
    monkeypatch.setattr(ErrorWord, "_word", word)
    monkeypatch.setattr(ErrorWord, "_host", word.numpy())  # shares the memory, as get() sets it up
    monkeypatch.setenv("COMMFUSE_TIMEOUT_S", "2")
    with pytest.raises(RuntimeError, match=r"commfuse.mm_all_reduce: rank 0 timed out after 2 s waiting for rank 1"):
        ErrorWord.check("all_gather_mm")
    ErrorWord.check()  # the word was cleared: the error is raised once


def test_a_timeout_makes_every_workspace_refuse_until_released(monkeypatch):
    """A peer slower than the bound may pair its waits with this rank's later calls: after any
    timeout no workspace of the process may run another call (on any group) until release_all."""
    ws = {name: symm.Workspace(name, 0, 2, torch.zeros(symm.HEADER_BYTES + 2 * 1024, dtype=torch.uint8),
                               torch.zeros(2, dtype=torch.int64), 1024, max_programs=4)
          for name in ("tp", "sp")}
    monkeypatch.setattr(symm, "_workspaces", {(name, "torch"): w for name, w in ws.items()})
    monkeypatch.setattr(symm, "_broken", None)
    word = torch.tensor([1, 3, 0, 1], dtype=torch.int32)
    monkeypatch.setattr(ErrorWord, "_word", word)
    monkeypatch.setattr(ErrorWord, "_host", word.numpy())
    with pytest.raises(RuntimeError, match=r"mm_reduce_scatter: rank 0 timed out"):
        ErrorWord.check("mm_all_reduce")
    for w in ws.values():
        with pytest.raises(RuntimeError, match=r"mm_reduce_scatter: rank 0 timed out.*refuse further calls.*release_all"):
            w.next_epoch()
    # nor may a regrown workspace, or another group's first, start afresh (allocation is collective)
    for name, nbytes in (("tp", 1 << 20), ("dp", 1)):
        with pytest.raises(RuntimeError, match="refuse further calls"):
            symm.workspace(name, nbytes, torch.device("cpu"))


def test_timeout_bound_fits_the_kernels_nanoseconds(monkeypatch):
    from commfuse.kernels import sync

    monkeypatch.setenv("COMMFUSE_TIMEOUT_S", "1e9")
    assert sync.timeout_ns() == 10**18 < 2**63
    monkeypatch.setenv("COMMFUSE_TIMEOUT_S", "1e11")
    with pytest.raises(ValueError, match="COMMFUSE_TIMEOUT_S=1e11 must be at most 1e"):
        sync.timeout_ns()


def test_mm_reduce_scatter_choice(monkeypatch):
    monkeypatch.delenv("COMMFUSE_ALGO", raising=False)
    # small calls (1024-2048 rows, at most 2048^2 outputs): the fused kernel
    assert dispatch.mm_reduce_scatter(2048, 2048, 2048, BF16, 2) == "fused"
    assert dispatch.mm_reduce_scatter(1024, 1024, 1024, BF16, 2) == "fused"
    assert dispatch.mm_reduce_scatter(2048, 4096, 7168, BF16, 2) == "ce_overlap"  # a larger output
    assert dispatch.mm_reduce_scatter(512, 2048, 2048, BF16, 2) == "symm"  # not measured below
    assert dispatch.mm_reduce_scatter(2048, 2048, 2048, BF16, 2, scatter_dim=1) == "symm"
    assert dispatch.mm_reduce_scatter(4096, 4096, 4096, BF16, 2) == "ce_overlap"
    assert dispatch.mm_reduce_scatter(4096, 4096, 4096, BF16, 2, scatter_dim=1) == "symm"
    assert dispatch.mm_reduce_scatter(4096, 4096, 4096, BF16, 1) == "nccl"
    monkeypatch.setenv("COMMFUSE_ALGO", "ce_overlap")
    assert dispatch.mm_reduce_scatter(16, 16, 16, BF16, 2) == "ce_overlap"
    assert dispatch.all_gather_mm(16, 16, 16, BF16, 2) == "symm"  # not an all-gather algorithm


def test_cuda_graph_capture_takes_the_graph_lane_or_nccl(monkeypatch, caplog):
    """Host epochs are state a graph replay would not advance: inside a capture, mm_all_reduce
    takes the graph lane (device epochs) when the output fits it, else NCCL; the others NCCL."""
    monkeypatch.delenv("COMMFUSE_ALGO", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(dispatch, "_warned", set())
    monkeypatch.setenv("COMMFUSE_GRAPH_BYTES", str(1 << 20))
    assert dispatch.mm_all_reduce(64, 4096, 8192, BF16, 2) == "graph"  # exactly 1 MiB
    assert dispatch.mm_all_reduce(64, 4096, 8192, BF16, 1) == "nccl"
    with caplog.at_level("WARNING", logger="commfuse"):
        assert dispatch.mm_all_reduce(65, 4096, 8192, BF16, 2) == "nccl"
        assert dispatch.all_gather_mm(4096, 4096, 4096, BF16, 2) == "nccl"
        assert dispatch.mm_reduce_scatter(4096, 4096, 4096, BF16, 2) == "nccl"
    assert "COMMFUSE_GRAPH_BYTES" in caplog.text and "no graph-lane path" in caplog.text
    monkeypatch.setenv("COMMFUSE_ALGO", "one_shot")  # even a forced host-epoch path must not run in capture
    assert dispatch.mm_all_reduce(16, 16, 16, BF16, 2) == "graph"
    monkeypatch.setenv("COMMFUSE_ALGO", "ce_overlap")
    assert dispatch.mm_reduce_scatter(4096, 4096, 4096, BF16, 2) == "nccl"


def test_exchange_kernels_do_not_specialise_on_epochs_or_slots():
    """An epoch divisible by 16 would otherwise compile and load a new kernel variant mid-run."""
    from commfuse.kernels import exchange

    from commfuse.kernels import fused_all_reduce, fused_split_k

    for kernel in (exchange.one_shot_kernel, exchange.two_shot_kernel, exchange.pull_gather_kernel,
                   exchange.reduce_scatter_kernel, exchange.barrier_kernel,
                   fused_all_reduce.gemm_all_reduce_kernel, fused_split_k.split_k_all_reduce_kernel):
        names = [kernel.arg_names[i] if isinstance(i, int) else i for i in kernel.do_not_specialize]
        assert "epoch" in names, kernel.fn.__name__
    assert "slot" in [exchange.barrier_kernel.arg_names[i] if isinstance(i, int) else i
                      for i in exchange.barrier_kernel.do_not_specialize]


def test_no_kernel_specialises_on_the_rank():
    """Every rank runs one binary: ranks emulated on one GPU never load a kernel while another
    rank's spins waiting for it (a module load waits for the running kernels)."""
    from commfuse.kernels import exchange, fused_all_gather, fused_all_reduce, fused_split_k

    for kernel in (exchange.one_shot_kernel, exchange.staged_one_shot_kernel, exchange.two_shot_kernel,
                   exchange.pull_gather_kernel, exchange.reduce_scatter_kernel, exchange.barrier_kernel,
                   fused_all_reduce.gemm_all_reduce_kernel, fused_split_k.split_k_all_reduce_kernel,
                   fused_all_gather.all_gather_gemm_kernel):
        assert "rank" in kernel.arg_names
        assert "rank" in [kernel.arg_names[i] if isinstance(i, int) else i for i in kernel.do_not_specialize], \
            kernel.fn.__name__


def test_epochs_restart_collectively_before_the_int32_flags_overflow(world2, monkeypatch):
    ws = _workspace()
    monkeypatch.setattr(symm, "EPOCH_LIMIT", 3)
    ws.flags[:8] = 3  # what peers' signals leave behind
    ws.tile_flags[:8] = 3  # and the fused kernel's
    ws.buffer[symm.FLAG_BYTES - symm.BASES_BYTES:symm.FLAG_BYTES] = 7  # stands for the heap bases
    assert [ws.next_epoch()[0] for _ in range(3)] == [1, 2, 3]
    assert ws.next_epoch() == (1, 1)  # restarted, flags zeroed on every rank (fake group: this one)
    assert ws.flags.eq(0).all() and ws.tile_flags.eq(0).all()
    assert ws.buffer[symm.FLAG_BYTES - symm.BASES_BYTES:symm.FLAG_BYTES].eq(7).all()  # bases kept


def test_epochs_restart_before_the_split_k_ll_flags_repeat_and_zero_the_data(world2):
    """The LL words' flags hold an epoch's low bits: within one run of epochs no two calls share
    them, and a restart leaves no word of the run before it."""
    from commfuse.kernels import fused_split_k

    assert symm.EPOCH_LIMIT < 1 << fused_split_k.LL_EPOCH_BITS
    ws = _workspace()
    ws.data(0, (64,), torch.uint8).fill_(0xFF)
    ws.data(1, (64,), torch.uint8).fill_(0xFF)
    ws.epoch = symm.EPOCH_LIMIT
    assert ws.next_epoch() == (1, 1)
    assert ws.buffer[symm.HEADER_BYTES:].eq(0).all()


def test_a_failed_call_blocks_the_workspace(monkeypatch):
    """Once a call fails after its epoch began, ranks may disagree: refuse, with a remedy."""
    from commfuse.kernels.cuda_paths import _exchange

    ws = _workspace()
    with pytest.raises(MemoryError):
        with _exchange(ws, "mm_all_reduce"):
            raise MemoryError("out of memory")
    with pytest.raises(RuntimeError, match=r"mm_all_reduce: an earlier call on group '0' failed .*release_all"):
        ws.next_epoch()


def test_bias_must_broadcast(world2):
    from helpers import group_name

    a, b = torch.randn(8, 4), torch.randn(4, 6)
    for bias in (torch.randn(6), torch.randn(1, 6), torch.randn(8, 6), torch.randn(8, 1)):
        torch.ops.commfuse.mm_all_reduce(a, b, bias, group_name())
    with pytest.raises(RuntimeError, match=r"bias \(5, 6\) does not broadcast to \(8, 6\)"):
        torch.ops.commfuse.mm_all_reduce(a, b, torch.randn(5, 6), group_name())


def test_workspace_allocation_runs_off_the_callers_thread(world2, monkeypatch):
    """A CUDA-graph warm-up sends its thread's allocations to the graph's pool, which captures
    reuse: allocation happens on a helper thread, and the tables live inside the buffers."""
    import threading
    from types import SimpleNamespace

    from helpers import group_name

    threads, buffers = [], []

    def fake_alloc(name, nbytes, device):
        threads.append(threading.get_ident())
        buffers.append(torch.zeros(nbytes, dtype=torch.uint8))
        return buffers[-1], [1000 * len(buffers), 1000 * len(buffers) + 1], None

    monkeypatch.setattr(symm, "_allocate_torch", fake_alloc)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.delenv("COMMFUSE_SYMM_PROVIDER", raising=False)
    symm.release_all()
    try:
        ws = symm.workspace(group_name(), 1024, torch.device("cpu"))
        lane = symm.graph_lane(group_name())
        assert len(threads) == 2 and threading.get_ident() not in threads  # workspace, then lane
        for holder, buf, ptrs in ((ws, buffers[0], [1000, 1001]), (lane, buffers[1], [2000, 2001])):
            assert holder.heap_bases.tolist() == ptrs
            assert holder.heap_bases.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        assert lane.counter.untyped_storage().data_ptr() == buffers[1].untyped_storage().data_ptr()
        assert lane.counter.eq(0).all() and lane.counter.numel() == symm.GRAPH_SLOTS
        assert symm.workspace(group_name(), 1024, torch.device("cpu")) is ws  # no second allocation
        monkeypatch.setattr(symm, "_allocate_torch", lambda *a: (_ for _ in ()).throw(RuntimeError("no memory")))
        with pytest.raises(RuntimeError, match="no memory"):  # the helper thread's error reaches the caller
            symm.workspace(group_name(), 1 << 30, torch.device("cpu"))
    finally:
        symm.release_all()


def test_eager_calls_join_the_graph_lane_once_graphs_replay_it(monkeypatch):
    """A rank that re-warms its CUDA graphs (eager) while its peer replays them must use the same
    lane: once captured graphs use it, eager calls that fit it take it too (forcing still wins)."""
    monkeypatch.delenv("COMMFUSE_ALGO", raising=False)
    assert dispatch.mm_all_reduce(16, 4096, 8192, BF16, 2) == "split_k"
    assert dispatch.mm_all_reduce(16, 4096, 8192, BF16, 2, lane_bytes=1 << 22) == "graph"
    assert dispatch.mm_all_reduce(512, 4096, 8192, BF16, 2, lane_bytes=1 << 22) == "one_shot"  # 8 MiB
    assert dispatch.mm_all_reduce(16, 4096, 8192, BF16, 1, lane_bytes=1 << 22) == "nccl"
    monkeypatch.setenv("COMMFUSE_ALGO", "one_shot")
    assert dispatch.mm_all_reduce(16, 4096, 8192, BF16, 2, lane_bytes=1 << 22) == "one_shot"


def test_a_graph_lane_timeout_makes_the_lanes_refuse_until_released(monkeypatch):
    from commfuse.kernels.sync import GRAPH_LANE_OP

    word = torch.tensor([1, GRAPH_LANE_OP, 1, 0], dtype=torch.int32)
    monkeypatch.setattr(ErrorWord, "_word", word)
    monkeypatch.setattr(ErrorWord, "_host", word.numpy())
    try:
        with pytest.raises(RuntimeError, match=r"mm_all_reduce \(graph lane\): rank 1 timed out"):
            ErrorWord.check()
        with pytest.raises(RuntimeError, match="graph lanes are out of step.*release_all"):
            symm.graph_lane("0")
    finally:
        symm.release_all()
    assert symm.graph_lane("0") is None


@pytest.mark.parametrize("world", [4, 8])
def test_fused_kernels_at_4_and_8_ranks(world, monkeypatch):
    """The fused kernels' rules are per shape, so 4 and 8 ranks take them where 2 do; their
    world-dependent sizes (shares, slabs, chunk flags, workspace) follow the world size (never
    yet timed at 4 or 8 ranks)."""
    from commfuse.kernels import fused_all_gather, fused_all_reduce

    monkeypatch.delenv("COMMFUSE_ALGO", raising=False)
    assert dispatch.mm_all_reduce(8192, 4096, 8192, BF16, world) == "fused"
    assert dispatch.all_gather_mm(2048, 4096, 2048, BF16, world) == "fused"
    assert dispatch.all_gather_mm(16384, 4096, 7168, BF16, world) == "fused"
    assert dispatch.mm_reduce_scatter(16384, 4096, 7168, BF16, world) == "fused"
    assert dispatch.mm_reduce_scatter(2048, 4096, 2048, BF16, world) == "fused"
    assert "split" in dispatch.fused_unsupported(2049, 4096, 7168, BF16, world, gather=True)
    # all-gather: every rank's rows in the workspace, one flag per 32-row chunk of every rank
    assert dispatch.gather_workspace_bytes(2048, 4096, 2048, BF16, world) == 2048 * 4096 * 2
    assert fused_all_gather.chunk_flag_slots(2048 // world, world) == 2 * world * (2048 // world // 32)
    assert fused_all_gather.ce_flag_base(2048 // world, world) == world * (2048 // world // 32)
    assert dispatch.gather_workspace_bytes(4096, 4096, 7168, BF16, world) == 4096 // world * 4096 * 2
    # all-reduce: world slabs of the owned tiles (rounded up to whole slabs) and the result area
    cfg = dispatch.tile_config(8192, 4096, 8192)
    tiles = fused_all_reduce.num_tiles(8192, 8192, world, cfg)
    slabs = world * -(-tiles // world)
    assert fused_all_reduce.data_elems(8192, 8192, world, cfg) == (slabs + tiles) * cfg.bm * cfg.bn
    # reduce-scatter: each rank's share of the rows tiled separately; no result area
    per = -(-(16384 // world) // cfg.bm) * -(-7168 // cfg.bn)
    assert fused_all_reduce.num_tiles(16384, 7168, world, cfg, scatter=True) == world * per
    assert dispatch.scatter_workspace_bytes(16384, 4096, 7168, BF16, world) == \
        world * per * cfg.bm * cfg.bn * 2


@pytest.mark.parametrize("world", [2, 4, 8])
def test_split_k_takes_few_rows_where_its_kernel_can_go(world, monkeypatch):
    """The few-rows kernel up to SPLIT_K_MAX_ROWS rows and SPLIT_K_MAX_ELEMS output elements (per
    shape, the same at every world size); forced beyond that up to its own row limit, and never
    where TMA cannot describe the rows."""
    from commfuse.kernels import fused_split_k

    monkeypatch.delenv("COMMFUSE_ALGO", raising=False)
    for m in (1, 4, 32, 64, dispatch.SPLIT_K_MAX_ROWS):
        assert dispatch.mm_all_reduce(m, 7168, 4096, BF16, world) == "split_k"
    assert dispatch.mm_all_reduce(64, 14336, 8192, BF16, world) == "split_k"
    assert dispatch.mm_all_reduce(64, 4096, 16384, BF16, world) != "split_k"  # a larger output
    assert dispatch.mm_all_reduce(128, 2048, 8192, BF16, world) != "split_k"
    # 65-128 rows from K = 4096: the 128 x 64 blocks take outputs up to 2^20 too
    assert dispatch.mm_all_reduce(128, 4096, 8192, BF16, world) == "split_k"
    assert dispatch.mm_all_reduce(128, 14336, 8192, BF16, world) == "split_k"
    assert dispatch.mm_all_reduce(128, 4096, 16384, BF16, world) != "split_k"
    assert dispatch.mm_all_reduce(dispatch.SPLIT_K_MAX_ROWS + 1, 2048, 1024, BF16, world) != "split_k"
    assert dispatch.mm_all_reduce(4, 7168, 4096, torch.float32, world) != "split_k"
    monkeypatch.setenv("COMMFUSE_ALGO", "split_k")
    assert dispatch.mm_all_reduce(200, 7168, 4096, BF16, world) == "split_k"
    assert dispatch.mm_all_reduce(fused_split_k.MAX_ROWS + 1, 7168, 4096, BF16, world) == "one_shot"
    assert dispatch.mm_all_reduce(4, 7167, 4096, BF16, world) == "one_shot"  # rows not 16-byte multiples
    assert "rows" in dispatch.split_k_unsupported(fused_split_k.MAX_ROWS + 1, 7168, 4096, BF16, world)


def test_split_k_config_fills_one_wave_of_programs():
    """Blocks just tall enough for the rows; K slices doubled while the units still fit the
    programs once and every slice keeps at least two K steps; the workspace holds the ranks'
    sums and the fp32 slices, and the graph pass plans what the dispatch will use."""
    from commfuse.kernels import fused_split_k, tiles

    for m, bm, bn in ((1, 16, 32), (16, 16, 32), (17, 16, 64), (32, 16, 64), (33, 64, 64), (64, 64, 64),
                      (65, 128, 64), (128, 128, 64), (129, 128, 128), (256, 128, 128)):
        assert (fused_split_k.config(m, 4096, 4096, 132).tile.bm, fused_split_k.config(m, 4096, 4096, 132).tile.bn) == (bm, bn)
    # up to 32 rows, 16-row blocks 32 or 64 wide where their count is in (programs / 2, programs]
    for m, n, sms, bn in ((16, 4096, 132, 32), (16, 8192, 132, 64), (16, 7168, 132, 64), (32, 4096, 132, 64),
                          (16, 8192, 264, 32), (16, 2048, 132, None), (32, 8192, 132, None), (16, 16384, 132, None)):
        tile = fused_split_k.config(m, 4096, n, sms).tile
        assert (tile.bm, tile.bn, tile.bk) == ((16, bn, 256) if bn else (16 if m <= 16 else 32, 128, 128)), (m, n, sms)
    assert (fused_split_k.config(128, 2048, 4096, 132).tile.bm, fused_split_k.config(128, 2048, 4096, 132).tile.bn) == (64, 64)
    assert fused_split_k.config(128, 2048, 4096, 132).split == 1  # 128 tiles of 64 x 64 already
    assert fused_split_k.config(128, 7168, 4096, 132).split == 2  # 64 tiles of 128 x 64
    deep = fused_split_k.config(128, 4096, 8192, 132)  # 128 tiles of 128 x 64, 8 stages of 64
    assert (deep.tile.bk, deep.tile.stages, deep.split) == (64, 8, 1)
    assert fused_split_k.config(128, 7168, 4096, 132).tile.bk == 128
    narrow = fused_split_k.config(16, 4096, 8192, 132)  # 16 rows, 8192 columns: 128 blocks, 64 wide
    assert (narrow.tile.bm, narrow.tile.bn, narrow.tile.bk, narrow.split) == (16, 64, 256, 1)
    wide = tiles.TileConfig(bm=16, bn=128, bk=128, stages=4, warps=4, group_m=1, reducers=0)
    cfg = fused_split_k.config(16, 7168, 4096, 132, tile=wide)  # 32 tiles of 128 columns
    assert cfg.split == 4 and 32 * cfg.split <= 132 < 32 * cfg.split * 2
    assert fused_split_k.config(16, 256, 4096, 132, tile=wide).split == 1  # 2 K steps: one slice
    assert fused_split_k.config(16, 512, 4096, 132, tile=wide).split == 2  # 4 steps: two slices of 2
    assert fused_split_k.config(16, 1024, 4096, 132, tile=wide).split == 4  # 8 steps, 128 units
    assert fused_split_k.config(16, 7168, 4096, 132, split=8).split == 8  # forced
    assert fused_split_k.config(16, 14336, 8192, 132).split == 1  # 128 tiles of 16 x 64
    assert fused_split_k.config(16, 14336, 8192, 264).split == 1  # twice the SMs: 256 tiles of 16 x 32
    assert fused_split_k.config(32, 14336, 8192, 132).split == 2  # 64 tiles of 32 x 128
    assert fused_split_k.config(16, 7168, 4096, 132).split == 1  # 128 narrow tiles: no slices
    block = cfg.tile.bm * cfg.tile.bn
    # LL words where each rank pushes at most LL_MAX_PUSHED values to its peers together
    assert cfg.ll is None and fused_split_k.LL_MAX_PUSHED == 1 << 17
    for m, n, world, ll in ((16, 8192, 2, True), (32, 4096, 2, True), (32, 8192, 2, False), (128, 4096, 2, False),
                            (16, 4096, 3, True), (16, 4096, 4, False), (1, 8192, 8, True), (16, 8192, 8, False)):
        assert fused_split_k.uses_ll(cfg, m, n, world, BF16) == ll, (m, n, world)
        assert not fused_split_k.uses_ll(cfg, m, n, world, BF16, lane=True)  # a lane keeps its flags
        assert not fused_split_k.uses_ll(cfg, m, n, world, torch.float32)  # two 16-bit values a word
        assert fused_split_k.uses_ll(dataclasses.replace(cfg, ll=True), m, n, world, BF16)  # asked
        assert not fused_split_k.uses_ll(dataclasses.replace(cfg, ll=False), m, n, world, BF16)
    for world in (2, 4, 8):
        ll = dataclasses.replace(cfg, ll=True)
        sums = world * 32 * block * 4  # LL: a value and half a flag, 4 bytes
        assert fused_split_k.data_bytes(16, 4096, world, ll, BF16) == -(-sums // 256) * 256 + 32 * 4 * block * 4
        plain = world * 32 * block * 2  # in a lane, or asked: the values, 2 bytes
        for args in ((ll, BF16, True), (dataclasses.replace(cfg, ll=False), BF16, False)):
            assert fused_split_k.data_bytes(16, 4096, world, *args) == -(-plain // 256) * 256 + 32 * 4 * block * 4
        assert fused_split_k.data_bytes(16, 4096, world, ll, torch.float32) == world * 32 * block * 4 + 32 * 4 * block * 4
        assert fused_split_k.flag_slots(16, 4096, world, cfg) == 32 * world
        # planned for any SM count: at least what a 132- or 264-SM group's slices use, the same
        # request on every rank whatever its GPU
        planned = dispatch.all_reduce_workspace_bytes(16, 7168, 4096, BF16, world)
        assert planned == dispatch.split_k_workspace_bytes(16, 7168, 4096, BF16, world)
        for m in (1, 16, 17, 32, 64, 100, 128, 200):
            for k in (2048, 7168):
                for n in (1024, 2048, 4096, 7168, 8192, 16384):
                    planned = dispatch.split_k_workspace_bytes(m, k, n, BF16, world)
                    for sms in (66, 78, 108, 114, 132, 144, 264):
                        used = fused_split_k.data_bytes(m, n, world, fused_split_k.config(m, k, n, sms), BF16)
                        assert used <= planned, (m, k, n, world, sms)


def test_split_k_counters_sit_between_the_tile_flags_and_the_ticket():
    ws = _workspace()
    flags, counters, ticket = ws.tile_flags, ws.tile_counters, ws.ticket
    base = ws.buffer.data_ptr()
    assert flags.data_ptr() - base == symm.FLAG_BYTES and flags.numel() == symm.TILE_FLAG_SLOTS
    assert counters.data_ptr() >= flags.data_ptr() + 4 * flags.numel()
    assert counters.data_ptr() + 4 * counters.numel() <= ticket.data_ptr()
    assert ticket.data_ptr() + 8 == base + symm.HEADER_BYTES


def test_graph_lane_split_k_words_and_choice(monkeypatch):
    """The lane's split-K words sit between its flags and its epoch counters; the lane runs the
    split-K kernel where the eager dispatch would and the lane holds it (COMMFUSE_GRAPH_SPLIT_K=0
    keeps cuBLAS + the staged one-shot)."""
    buf = torch.zeros(symm.GRAPH_FLAG_BYTES + 2 * (4 << 20), dtype=torch.uint8)
    lane = symm.GraphLane("0", 0, 2, buf, torch.zeros(2, dtype=torch.int64), 4 << 20, 132)
    base = buf.data_ptr()
    assert lane.flags.data_ptr() == base
    assert lane.ticket.data_ptr() == lane.flags.data_ptr() + 8 * lane.flags.numel()
    assert lane.tile_counters.data_ptr() == lane.ticket.data_ptr() + 16
    assert lane.tile_counters.data_ptr() + 4 * lane.tile_counters.numel() == lane.counter.data_ptr()
    assert lane.counter.numel() == symm.GRAPH_SLOTS
    assert dispatch.graph_split_k(4, 7168, 4096, BF16, lane)  # a decode step's down projection
    assert dispatch.graph_split_k(128, 2048, 4096, BF16, lane)
    assert not dispatch.graph_split_k(256, 2048, 4096, BF16, lane)  # the eager rule says no
    assert not dispatch.graph_split_k(4, 1003, 4096, BF16, lane)  # TMA rows
    small = symm.GraphLane("0", 0, 2, buf, torch.zeros(2, dtype=torch.int64), 1 << 16, 132)
    assert not dispatch.graph_split_k(128, 2048, 4096, BF16, small)  # its data does not fit
    monkeypatch.setenv("COMMFUSE_GRAPH_SPLIT_K", "0")
    assert not dispatch.graph_split_k(4, 7168, 4096, BF16, lane)


@pytest.mark.parametrize("world", [2, 4, 8, 64])
def test_scatter_chunks_fit_the_flag_area(world, monkeypatch):
    """One barrier slot per chunk and step must exist before the call's epoch begins."""
    slots = (symm.FLAG_BYTES - symm.BASES_BYTES) // 4 // world
    monkeypatch.delenv("COMMFUSE_RS_CHUNKS", raising=False)
    assert dispatch.scatter_chunks(4096, world) == min(2, slots // (world - 1))
    assert dispatch.scatter_chunks(8192, world) == min(4, slots // (world - 1))  # large shares
    monkeypatch.setenv("COMMFUSE_RS_CHUNKS", "64")
    chunks = dispatch.scatter_chunks(4096, world)
    assert 1 <= chunks <= 64 and chunks * (world - 1) <= slots
    assert dispatch.scatter_chunks(3, world) <= 3  # never more chunks than rows


def test_gemm_bound_all_reduces_take_the_copy_engines(monkeypatch):
    """Large-M, large-K all-reduces on 2 ranks take the copy-engine overlap (no SMs taken from
    the GEMM), from K = 7168 by default (4096 from 8192 rows); ``COMMFUSE_CE_MIN_K`` moves the
    bound, 0 turns it off;
    never at other world sizes (untimed)."""
    monkeypatch.delenv("COMMFUSE_ALGO", raising=False)
    monkeypatch.setenv("COMMFUSE_CE_MIN_K", "0")
    assert dispatch.mm_all_reduce(8192, 7168, 4096, BF16, 2) == "fused"
    monkeypatch.setenv("COMMFUSE_CE_MIN_K", "8192")
    assert dispatch.mm_all_reduce(8192, 7168, 4096, BF16, 2) == "fused"
    assert dispatch.mm_all_reduce(4096, 14336, 8192, BF16, 2) == "ce_overlap"
    assert dispatch.mm_all_reduce(8192, 4096, 8192, BF16, 2) == "fused"  # the setting holds at 8192 rows too
    monkeypatch.delenv("COMMFUSE_CE_MIN_K")
    assert dispatch.ce_min_k() == dispatch.CE_MIN_K == 7168
    assert dispatch.ce_min_k(8192) == dispatch.CE_WIDE_MIN_K == 4096
    assert dispatch.mm_all_reduce(8192, 7168, 4096, BF16, 2) == "ce_overlap"
    assert dispatch.mm_all_reduce(4096, 14336, 8192, BF16, 2) == "ce_overlap"
    assert dispatch.mm_all_reduce(8192, 4096, 8192, BF16, 2) == "ce_overlap"  # from 8192 rows, K >= 4096
    assert dispatch.mm_all_reduce(8192, 3072, 4096, BF16, 2) == "fused"
    assert dispatch.mm_all_reduce(4096, 4096, 8192, BF16, 2) == "fused"  # 4096 rows: from K = 7168 only
    assert dispatch.mm_all_reduce(8192, 2048, 4096, BF16, 2) == "fused"  # comm-bound: the fused kernel
    assert dispatch.mm_all_reduce(2048, 14336, 8192, BF16, 2) == "fused"  # too few rows: the SM kernel
    assert dispatch.mm_all_reduce(8192, 7168, 4096, BF16, 4) == "fused"  # untimed at 4 ranks
    monkeypatch.setenv("COMMFUSE_ALGO", "one_shot")  # a forced path still wins
    assert dispatch.mm_all_reduce(8192, 7168, 4096, BF16, 2) == "one_shot"


def test_copy_engine_chunks_are_about_1024_rows(monkeypatch):
    monkeypatch.delenv("COMMFUSE_CE_CHUNKS", raising=False)
    assert [dispatch.copy_engine_chunks(m) for m in (3, 1024, 4096, 8192, 65536)] == [2, 2, 4, 8, 8]
    assert dispatch.copy_engine_chunks(1) == 1  # never more chunks than rows
    monkeypatch.setenv("COMMFUSE_CE_CHUNKS", "3")
    assert dispatch.copy_engine_chunks(8192) == 3


def test_copy_engine_rows_cover_the_rows_with_a_shorter_last_chunk_on_request(monkeypatch):
    monkeypatch.delenv("COMMFUSE_CE_CHUNKS", raising=False)
    monkeypatch.delenv("COMMFUSE_CE_LAST_ROWS", raising=False)
    assert dispatch.copy_engine_rows(4096) == (1024,) * 4
    assert dispatch.copy_engine_rows(1000) == (500, 500)
    assert dispatch.copy_engine_rows(1) == (1,) and dispatch.copy_engine_rows(0) == ()
    monkeypatch.setenv("COMMFUSE_CE_LAST_ROWS", "256")
    assert dispatch.copy_engine_rows(4096) == (1280, 1280, 1280, 256)
    assert dispatch.copy_engine_rows(8192) == (1152,) * 6 + (1024, 256)  # 64-row multiples before it
    monkeypatch.setenv("COMMFUSE_CE_CHUNKS", "8")
    assert dispatch.copy_engine_rows(4096) == (576,) * 6 + (384, 256)
    for m in (3, 100, 257, 1000, 4096, 8191):  # every row once, never more chunks than asked
        for last in ("1", "64", "256", "4096", "9999"):
            monkeypatch.setenv("COMMFUSE_CE_LAST_ROWS", last)
            rows = dispatch.copy_engine_rows(m)
            assert sum(rows) == m and min(rows) > 0 and len(rows) <= dispatch.copy_engine_chunks(m)
    monkeypatch.setenv("COMMFUSE_CE_LAST_ROWS", "-1")
    with pytest.raises(ValueError, match="COMMFUSE_CE_LAST_ROWS"):
        dispatch.copy_engine_rows(4096)


def test_collectives_along_a_dim_with_only_ones_before_it_split_rows():
    """A sequence-parallel [1, S, H] gathered or scattered along S moves the same row blocks as a
    collective along dim 0, so the row-splitting paths (overlap, fused) take it."""
    assert dispatch.rows_dim((1, 4, 6), 1) == 0
    assert dispatch.rows_dim((1, 1, 3, 6), 2) == 0
    assert dispatch.rows_dim([1, 4096, 4096], 1) == 0
    assert dispatch.rows_dim((2, 4, 6), 1) == 1  # two batch rows: each rank's rows are two blocks
    assert dispatch.rows_dim([-1, 4, 7], 1) == 1  # unknown leading size
    assert dispatch.rows_dim((5, 6), 0) == 0
    rows_dim = dispatch.rows_dim((1, 4096, 4096), 1)
    assert dispatch.all_gather_mm(8192, 4096, 7168, BF16, 2, rows_dim) == "overlap"
    assert dispatch.mm_reduce_scatter(8192, 7168, 4096, BF16, 2, rows_dim) == "ce_overlap"
    assert dispatch.all_gather_mm(8192, 4096, 7168, BF16, 2, 1) == "symm"


def test_row_slabs_of_batched_sequence_collectives(monkeypatch):
    """A [B, S, H] gathered or scattered along S cuts every rank's rows into B slabs: the
    copy-engine overlaps take them slab by slab when forced, up to MAX_ROW_SLABS (by default only
    with SLAB_OVERLAP, from SLAB_MIN_ROWS-row blocks: it lost inside the model), the
    reduce-scatter in one chunk per slab; its chunks per slab fit the flag area."""
    assert dispatch.row_slabs((4, 1024, 4096), 0) == 1
    assert dispatch.row_slabs((4, 1024, 4096), 1) == 4
    assert dispatch.row_slabs((2, 3, 5, 8), 2) == 6
    assert dispatch.row_slabs((dispatch.MAX_ROW_SLABS + 1, 8, 8), 1) == 0
    assert dispatch.row_slabs([-1, 8, 8], 1) == 0  # unknown
    monkeypatch.delenv("COMMFUSE_ALGO", raising=False)
    # along dim 1 with a batch: the symmetric pull by default (SLAB_OVERLAP: lost inside the model)
    assert dispatch.all_gather_mm(8192, 4096, 7168, BF16, 2, 1) == "symm"
    assert dispatch.all_gather_mm(8192, 4096, 7168, BF16, 2, 1, 4) == "symm"
    assert dispatch.mm_reduce_scatter(8192, 7168, 4096, BF16, 2, 1, 4) == "symm"
    monkeypatch.setenv("COMMFUSE_SLAB_OVERLAP", "1")
    assert dispatch.all_gather_mm(8192, 4096, 7168, BF16, 2, 1, 4) == "overlap"  # 1024-row blocks
    assert dispatch.all_gather_mm(2048, 4096, 7168, BF16, 2, 1, 4) == "symm"  # 256-row blocks
    assert dispatch.all_gather_mm(8192, 4096, 7168, BF16, 2, 1, 0) == "symm"  # too many slabs
    assert dispatch.all_gather_mm(8192, 64, 64, BF16, 2, 1, 4) == "symm"  # too little work
    assert dispatch.mm_reduce_scatter(8192, 7168, 4096, BF16, 2, 1, 4) == "ce_overlap"
    assert dispatch.mm_reduce_scatter(2048, 4096, 7168, BF16, 2, 1, 4) == "symm"
    assert dispatch.mm_reduce_scatter(8192, 7168, 4096, BF16, 2, 1) == "symm"
    monkeypatch.delenv("COMMFUSE_RS_CHUNKS", raising=False)
    assert dispatch.scatter_chunks(1024, 2, slabs=4) == 1
    assert dispatch.scatter_chunks(8192, 2, slabs=1) == dispatch.RS_CHUNKS_LARGE
    slots = (symm.FLAG_BYTES - symm.BASES_BYTES) // 4 // 64 // 63
    assert dispatch.scatter_chunks(4096, 64, slabs=slots) == 1
    assert dispatch.scatter_chunks(4096, 64, slabs=slots + 1) == 0  # not one chunk per slab fits


def test_the_fused_kernels_stagger_setting(monkeypatch):
    from commfuse.kernels import fused_all_reduce

    monkeypatch.delenv("COMMFUSE_FUSED_STAGGER_US", raising=False)
    # by default the all-reduce's programs start over one spread, one wave's over a shorter one
    assert fused_all_reduce.stagger_ns(False, 300, 132) == fused_all_reduce.STAGGER_US * 1000 > 0
    assert fused_all_reduce.stagger_ns(False, 132, 132) == fused_all_reduce.STAGGER_ONE_WAVE_US * 1000 > 0
    assert fused_all_reduce.STAGGER_ONE_WAVE_US < fused_all_reduce.STAGGER_US
    assert fused_all_reduce.stagger_ns(True, 300, 132) == 0  # the reduce-scatter's start together
    monkeypatch.setenv("COMMFUSE_FUSED_STAGGER_US", "0")
    assert fused_all_reduce.stagger_ns(False, 300, 132) == 0
    monkeypatch.setenv("COMMFUSE_FUSED_STAGGER_US", "2.5")
    assert fused_all_reduce.stagger_ns() == fused_all_reduce.stagger_ns(True, 300, 132) == 2500
    for bad in ("-1", "nan", "1e9"):
        monkeypatch.setenv("COMMFUSE_FUSED_STAGGER_US", bad)
        with pytest.raises(ValueError, match="COMMFUSE_FUSED_STAGGER_US"):
            fused_all_reduce.stagger_ns()
