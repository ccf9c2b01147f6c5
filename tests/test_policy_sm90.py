"""The policy with the shipped ``sm_90`` rules on a simulated H200 group: forcing
(``COMMFUSE_ALGO``) and its fallback, capture, the graph lane's re-warm, the row layouts. What any
table does is ``test_policy.py``'s; the shipped table's answers over a grid are ``test_rule_answers.py``'s.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from commfuse import env
from commfuse.kernels import fused_all_gather, fused_all_reduce, fused_split_k, tiles
from commfuse.runtime import policy
from commfuse.runtime import workspace as wsmod
from commfuse.runtime.facts import GroupFacts
from commfuse.runtime.paths import base, rs_ce_overlap
from commfuse.runtime.paths import ag_fused, ar_fused

from choosing import (  # noqa: F401  (_quiet_policy: a fixture, found by name)
    BF16, AR, AG, RS, _call, choose, rules, supports, _quiet_policy)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_mm_all_reduce_choice(world):
    assert choose(AR, 16, 4096, 8192, world=1) == "nccl"  # nothing to exchange
    assert choose(AR, 0, 4096, 8192, world=world) == "nccl"
    assert choose(AR, 16, 4096, 8192, world=world) == "split_k"  # decode: few rows
    assert choose(AR, 256, 4096, 8192, world=world) in ("one_shot", "two_shot")  # 4 MiB
    # from 1024 rows, K up to 4096 and more than one wave of 128x256 tiles: fused at 2 ranks
    # (measured there), the symmetric paths elsewhere
    other = "two_shot" if world > 2 else "one_shot"
    assert choose(AR, 1024, 4096, 8192, world=world) == ("fused" if world == 2 else "two_shot")
    assert choose(AR, 2048, 2048, 4096, world=world) == ("fused" if world == 2 else "two_shot")
    assert choose(AR, 1536, 2048, 4096, world=world) == ("fused" if world == 2 else "two_shot")
    assert choose(AR, 1024, 7168, 4096, world=world) == other
    assert choose(AR, 1023, 2048, 8192, world=world) == other
    # ... one wave (2^22 outputs) or less: cuBLAS + one-shot
    assert choose(AR, 1024, 2048, 4096, world=world) == other
    assert choose(AR, 2048, 1024, 2048, world=world) == other
    # many rows and a small K: the exchange is large against the GEMM, the fused kernel hides it
    assert choose(AR, 4096, 2048, 4096, world=world) == "fused"
    assert choose(AR, 8192, 2048, 4096, world=world) == "fused"
    # from 8192 rows and K = 4096 the copy engines at 2 ranks (their barriers off the pulls' stream)
    assert choose(AR, 8192, 4096, 8192, world=world) == ("ce_overlap" if world == 2 else "fused")
    # GEMM-bound (K >= 7168, M >= 4096): at 2 ranks the copy engines move the partials, no SMs
    assert choose(AR, 8192, 7168, 4096, world=world) == ("ce_overlap" if world == 2 else "fused")
    # K larger than M: the GEMM dominates and the reducers' SMs cost more than the exchange they hide
    assert choose(AR, 4096, 7168, 4096, world=world) == ("ce_overlap" if world == 2 else "two_shot")
    # more than one wave of tiles at K above 4096: fused, its programs' start staggered
    assert choose(AR, 2048, 7168, 4096, world=world) == ("fused" if world == 2 else "two_shot")
    assert choose(AR, 1024, 14336, 8192, world=world) == ("fused" if world == 2 else "two_shot")
    # fp32, and rows TMA cannot describe, keep the cuBLAS paths
    assert choose(AR, 8192, 4096, 8192, torch.float32, world) != "fused"
    assert choose(AR, 8192, 4095, 8192, world=world) != "fused"
    # elsewhere the copy-engine overlap lost inside models (launch-bound steps): taken when forced
    assert choose(AR, 8192, 4096, 8192, world=world, forced="ce_overlap") == "ce_overlap"
    assert choose(AR, 1 << 16, 4096, 16384, world=world) == "nccl"  # 2 GiB: past the cap


def test_forced_fused_falls_back_to_the_rules_where_the_tile_kernel_cannot_go(caplog):
    """A forced path that cannot take a call runs what the rules pick for it (logged once), not a
    fixed stand-in; a group that cannot run symmetric paths runs NCCL."""
    assert choose(AR, 7, 1024, 776, forced="fused") == "fused"  # small, but it can
    with caplog.at_level("WARNING", logger="commfuse"):
        # rows not 16-byte multiples; fp32: the rules' choice (cuBLAS + one-shot here)
        assert choose(AR, 7, 1003, 771, forced="fused") == rules(AR, 7, 1003, 771) == "one_shot"
        assert choose(AR, 7, 1003, 771, forced="fused") == "one_shot"
        assert choose(AR, 7, 1024, 776, torch.float32, forced="fused") == rules(AR, 7, 1024, 776, torch.float32)
    assert caplog.text.count("COMMFUSE_ALGO=fused cannot take this call") == 2  # once per reason
    assert "16-byte" in caplog.text and "fp16, bf16 and FP8" in caplog.text
    assert choose(AR, 7, 1024, 776, world=1, forced="fused") == "nccl"
    assert supports(AR, "fused", 4096, 0, 776) == "an empty dimension"
    assert choose(AR, 4096, 0, 776) != "fused"  # K = 0: torch returns the bias
    # 16384 tiles x 17 flags each is more than the tile-flag area holds
    assert "tile flags" in supports(AR, "fused", 1 << 15, 1024, 1 << 14, world=16)
    assert supports(AR, "fused", 1 << 15, 1024, 1 << 14, world=8) is None
    assert choose(AR, 1 << 15, 1024, 1 << 14, world=16, forced="fused") == rules(AR, 1 << 15, 1024, 1 << 14, world=16)


def test_fused_reduce_scatter_is_taken_from_16384_rows_above_2_ranks_or_when_forced():
    assert choose(RS, 4096, 4096, 4096, world=4) != "fused"  # it loses there
    assert choose(RS, 16384, 4096, 7168, world=4) == "fused"
    assert choose(RS, 16384, 4096, 7168, world=2) == "ce_overlap"  # 4 chunks win at 2
    assert choose(RS, 16384, 64, 64, world=2) == "fused"  # no overlap for so little work
    assert choose(RS, 16384, 4096, 7168, world=4, rows_dim=1) != "fused"
    assert choose(RS, 16384, 4096, 7168, torch.float32, 4) != "fused"
    assert choose(RS, 4096, 4096, 4096, forced="fused") == "fused"
    assert choose(RS, 14, 1024, 776, forced="fused") == "fused"
    # where the tile kernel cannot go, the rules' choice: the symmetric pull for all of these
    assert choose(RS, 4096, 4096, 4096, rows_dim=1, forced="fused") == "pull"
    assert choose(RS, 15, 1024, 776, forced="fused") == "pull"  # rows do not split
    assert choose(RS, 14, 1003, 776, forced="fused") == "pull"  # TMA rows
    assert "split" in supports(RS, "fused", 15, 1024, 776)


def test_fused_all_gather_is_taken_only_where_the_kernel_can_go(monkeypatch):
    assert choose(AG, 2048, 1024, 776, forced="fused") == "fused"
    assert choose(AG, 2, 1024, 776, forced="fused") == "fused"  # one row per rank
    assert choose(AG, 2048, 1024, 776, rows_dim=1, forced="fused") == "pull"
    assert choose(AG, 2048, 1003, 776, forced="fused") == "pull"  # TMA rows
    assert choose(AG, 2048, 1024, 776, torch.float32, forced="fused") == "pull"
    assert supports(AG, "fused", 2048, 1024, 776) is None
    # a tiling whose tiles do not hold whole pushed chunks of rows is refused
    monkeypatch.setattr(ag_fused, "tile_config", lambda call, fp8=False: tiles.TileConfig.parse("80x128x64s4w8g8r0o1"))
    assert "not a multiple of 32" in supports(AG, "fused", 2048, 1024, 776)


def test_all_gather_mm_choice():
    # 1024-2048 gathered rows and small outputs: the fused kernel
    assert choose(AG, 2048, 2048, 2048) == "fused"
    assert choose(AG, 1024, 1024, 1024) == "fused"
    assert choose(AG, 2048, 4096, 7168) == "ce_overlap"  # a larger output
    assert choose(AG, 16384, 4096, 7168) == "fused"  # and again from 16384 rows
    assert choose(AG, 16384, 4096, 7168, rows_dim=1, slabs=4) == "pull"
    assert choose(AG, 2048, 2048, 2048, torch.float32) == "pull"  # not fp32
    assert choose(AG, 512, 2048, 2048) == "pull"  # not measured below
    assert choose(AG, 4096, 4096, 4096) == "ce_overlap"
    # GEMM-bound (the gather is a few % of the GEMM): overlapped all the same
    assert choose(AG, 8192, 8192, 28672) == "ce_overlap"
    # ... and only that: the rules have no evidence for the other paths at such N
    assert choose(AG, 2048, 8192, 28672) == "ce_overlap"  # not the fused kernel
    assert choose(AG, 2048, 64, 16384) == "nccl"  # too little work to overlap
    assert choose(AG, 8192, 8192, 28672, rows_dim=1, slabs=4) == "nccl"
    assert choose(AG, 4096, 4096, 4096, rows_dim=1) == "pull"
    assert choose(AG, 1 << 20, 8192, 1024) == "nccl"


def test_choice_depends_on_shape_only(monkeypatch):
    """Same inputs, same answer on every rank: the policy reads no rank-local state (the rank,
    the device), so ranks that call with the same sizes enter the same collective."""
    shapes = [(m, k, n) for m in (16, 128, 1024, 4096, 8192) for k, n in ((2048, 4096), (7168, 4096), (14336, 8192))]

    def answers():
        return [choose(op, m, k, n) for op in (AR, AG, RS) for m, k, n in shapes]

    first = answers()
    assert len(set(first)) > 2  # the shapes do steer it
    for rank in (1, 3):
        monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, rank=rank, **k: rank)
        monkeypatch.setattr(torch.cuda, "current_device", lambda rank=rank: rank)
        assert answers() == first, rank


def test_forced_algorithm():
    """``COMMFUSE_ALGO`` (read once: ``env.override``) forces the path of every op that has it."""
    with env.override(algo="two_shot") as settings:
        assert settings.algo == "two_shot"
        assert choose(AR, 16, 16, 16, forced=settings.algo) == "two_shot"
        assert choose(AG, 4096, 4096, 4096, forced=settings.algo) == "ce_overlap"  # not a path of the op
        assert choose(AG, 8192, 8192, 28672, forced=settings.algo) == "ce_overlap"
    with env.override(algo="nccl") as settings:
        assert choose(AG, 4096, 4096, 4096, forced=settings.algo) == "nccl"
    assert env.current().algo is None
    with pytest.raises(ValueError, match="COMMFUSE_ALGO"):
        with env.override(algo="fastest"):
            pass


def test_mm_reduce_scatter_choice():
    # small calls (1024-2048 rows, at most 2048^2 outputs): the fused kernel
    assert choose(RS, 2048, 2048, 2048) == "fused"
    assert choose(RS, 1024, 1024, 1024) == "fused"
    assert choose(RS, 2048, 4096, 7168) == "ce_overlap"  # a larger output
    assert choose(RS, 512, 2048, 2048) == "pull"  # not measured below
    assert choose(RS, 2048, 2048, 2048, rows_dim=1) == "pull"
    assert choose(RS, 4096, 4096, 4096) == "ce_overlap"
    assert choose(RS, 4096, 4096, 4096, rows_dim=1) == "pull"
    assert choose(RS, 4096, 4096, 4096, world=1) == "nccl"
    assert choose(RS, 16, 16, 16, forced="ce_overlap") == "ce_overlap"
    assert choose(AG, 16, 16, 16, forced="ce_overlap") == "ce_overlap"  # one name: every op's copy-engine overlap
    assert choose(AG, 16, 16, 16, forced="split_k") == "pull"  # not an all-gather path


def test_cuda_graph_capture_takes_the_graph_lane_or_nccl(caplog):
    """Host epochs are state a graph replay would not advance: inside a capture, mm_all_reduce
    takes the graph lane (device epochs) when the output fits it, else NCCL; the others NCCL,
    forced or not."""
    facts = GroupFacts.simulated(2, lane_bytes=1 << 20)  # COMMFUSE_GRAPH_BYTES, agreed by the group

    def captured(op, m, k, n, world=2, forced=None):
        return choose(op, m, k, n, world=world, capturing=True, forced=forced,
                      facts=dataclasses.replace(facts, world=world))

    assert captured(AR, 64, 4096, 8192) == "graph"  # exactly 1 MiB
    assert captured(AR, 64, 4096, 8192, world=1) == "nccl"
    with caplog.at_level("WARNING", logger="commfuse"):
        assert captured(AR, 65, 4096, 8192) == "nccl"
        assert captured(AG, 4096, 4096, 4096) == "nccl"
        assert captured(RS, 4096, 4096, 4096) == "nccl"
    assert "COMMFUSE_GRAPH_BYTES" in caplog.text and "no graph-lane path" in caplog.text
    assert captured(AR, 16, 16, 16, forced="one_shot") == "graph"  # a forced host-epoch path must not run
    assert captured(RS, 4096, 4096, 4096, forced="ce_overlap") == "nccl"


def test_eager_calls_join_the_graph_lane_once_graphs_replay_it():
    """A rank that re-warms its CUDA graphs (eager) while its peer replays them must use the same
    lane: once captured graphs use it, eager calls that fit it take it too, forced or not (the
    captures took the lane whatever was forced)."""
    assert choose(AR, 16, 4096, 8192) == "split_k"
    assert choose(AR, 16, 4096, 8192, lane_bytes=1 << 22) == "graph"
    assert choose(AR, 512, 4096, 8192, lane_bytes=1 << 22) == "one_shot"  # 8 MiB
    assert choose(AR, 16, 4096, 8192, world=1, lane_bytes=1 << 22) == "nccl"
    assert choose(AR, 16, 4096, 8192, lane_bytes=1 << 22, forced="one_shot") == "graph"
    assert choose(AR, 16, 4096, 8192, capturing=True, forced="one_shot") == "graph"
    assert choose(AR, 512, 4096, 8192, lane_bytes=1 << 22, forced="two_shot") == "two_shot"  # past the lane
    # where the rules send captures to NCCL (other GPUs' table) a tuned capture may take the lane:
    # an eager re-warm that fits it must take it too, whatever the eager answer
    b200 = GroupFacts.simulated(2, arch="sm_100", name="NVIDIA B200", sms=148)
    assert policy.rules_choice(_call(AR, 16, 4096, 8192, BF16, 2, 0, None), b200, capture=True).name == "nccl"
    assert choose(AR, 16, 4096, 8192, lane_bytes=1 << 22, facts=b200) == "graph"


@pytest.mark.parametrize("world", [4, 8])
def test_fused_kernels_at_4_and_8_ranks(world):
    """The fused kernels' rules are per shape, so 4 and 8 ranks take them where 2 do; their
    world-dependent sizes (shares, slabs, chunk flags, workspace) follow the world size (the
    rules for 4 and 8 ranks are carried over from 2, not measured there)."""
    facts = GroupFacts.simulated(world)
    assert choose(AR, 8192, 4096, 8192, world=world) == "fused"
    assert choose(AG, 2048, 4096, 2048, world=world) == "fused"
    assert choose(AG, 16384, 4096, 7168, world=world) == "fused"
    assert choose(RS, 16384, 4096, 7168, world=world) == "fused"
    assert choose(RS, 2048, 4096, 2048, world=world) == "fused"
    assert "split" in supports(AG, "fused", 2049, 4096, 7168, world=world)
    # all-gather: every rank's rows in the workspace, one flag per 32-row chunk of every rank
    assert policy.workspace_bytes(_call(AG, 2048, 4096, 2048, world=world), facts) == 2048 * 4096 * 2
    assert fused_all_gather.chunk_flag_slots(2048 // world, world) == 2 * world * (2048 // world // 32)
    assert fused_all_gather.ce_flag_base(2048 // world, world) == world * (2048 // world // 32)
    assert policy.workspace_bytes(_call(AG, 4096, 4096, 7168, world=world), facts) == 4096 // world * 4096 * 2
    # all-reduce: world slabs of the owned tiles (rounded up to whole slabs) and the result area
    cfg = ar_fused.tile_config(_call(AR, 8192, 4096, 8192, world=world), False)
    n_tiles = fused_all_reduce.num_tiles(8192, 8192, world, cfg)
    slabs = world * -(-n_tiles // world)
    assert fused_all_reduce.data_elems(8192, 8192, world, cfg) == (slabs + n_tiles) * cfg.bm * cfg.bn
    assert policy.workspace_bytes(_call(AR, 8192, 4096, 8192, world=world), facts) == (slabs + n_tiles) * cfg.bm * cfg.bn * 2
    # reduce-scatter: each rank's share of the rows tiled separately; no result area
    per = -(-(16384 // world) // cfg.bm) * -(-7168 // cfg.bn)
    assert fused_all_reduce.num_tiles(16384, 7168, world, cfg, scatter=True) == world * per
    assert policy.workspace_bytes(_call(RS, 16384, 4096, 7168, world=world), facts) == \
        world * per * cfg.bm * cfg.bn * 2


@pytest.mark.parametrize("world", [2, 4, 8])
def test_split_k_takes_few_rows_where_its_kernel_can_go(world):
    """The few-rows kernel up to 128 rows and 2^19 output elements (per shape, the same at every
    world size); forced beyond that up to its own row limit, and never where TMA cannot describe
    the rows (a forced call it cannot take runs the rules' choice)."""
    for m in (1, 4, 32, 64, 128):
        assert choose(AR, m, 7168, 4096, world=world) == "split_k"
    assert choose(AR, 64, 14336, 8192, world=world) == "split_k"
    assert choose(AR, 64, 4096, 16384, world=world) != "split_k"  # a larger output
    assert choose(AR, 128, 2048, 8192, world=world) != "split_k"
    # 65-128 rows from K = 4096: the 128 x 64 blocks take outputs up to 2^20 too
    assert choose(AR, 128, 4096, 8192, world=world) == "split_k"
    assert choose(AR, 128, 14336, 8192, world=world) == "split_k"
    assert choose(AR, 128, 4096, 16384, world=world) != "split_k"
    assert choose(AR, 129, 2048, 1024, world=world) != "split_k"
    assert choose(AR, 4, 7168, 4096, torch.float32, world) != "split_k"
    assert choose(AR, 200, 7168, 4096, world=world, forced="split_k") == "split_k"
    too_many = fused_split_k.MAX_ROWS + 1
    assert choose(AR, too_many, 7168, 4096, world=world, forced="split_k") == rules(
        AR, too_many, 7168, 4096, world=world) != "split_k"
    assert choose(AR, 4, 7167, 4096, world=world, forced="split_k") == "one_shot"  # rows not 16-byte multiples
    assert "rows" in supports(AR, "split_k", too_many, 7168, 4096, world=world)


def test_gemm_bound_all_reduces_take_the_copy_engines():
    """Large-M, large-K all-reduces on 2 ranks take the copy-engine overlap (no SMs taken from
    the GEMM), from K = 7168 (4096 from 8192 rows); never at other world sizes (untimed)."""
    assert choose(AR, 8192, 7168, 4096) == "ce_overlap"
    assert choose(AR, 4096, 14336, 8192) == "ce_overlap"
    assert choose(AR, 8192, 4096, 8192) == "ce_overlap"  # from 8192 rows, K >= 4096
    assert choose(AR, 8192, 3072, 4096) == "fused"
    assert choose(AR, 4096, 4096, 8192) == "fused"  # 4096 rows: from K = 7168 only
    assert choose(AR, 8192, 2048, 4096) == "fused"  # comm-bound: the fused kernel
    assert choose(AR, 2048, 14336, 8192) == "fused"  # too few rows: the SM kernel
    assert choose(AR, 8192, 7168, 4096, world=4) == "fused"  # carried over to 4 ranks
    assert choose(AR, 8192, 7168, 4096, forced="one_shot") == "one_shot"  # a forced path still wins


def test_collectives_along_a_dim_with_only_ones_before_it_split_rows():
    """A sequence-parallel [1, S, H] gathered or scattered along S moves the same row blocks as a
    collective along dim 0, so the row-splitting paths (overlap, fused) take it."""
    assert base.rows_dim((1, 4, 6), 1) == 0
    assert base.rows_dim((1, 1, 3, 6), 2) == 0
    assert base.rows_dim([1, 4096, 4096], 1) == 0
    assert base.rows_dim((2, 4, 6), 1) == 1  # two batch rows: each rank's rows are two blocks
    assert base.rows_dim([-1, 4, 7], 1) == 1  # unknown leading size
    assert base.rows_dim((5, 6), 0) == 0
    rows_dim = base.rows_dim((1, 4096, 4096), 1)
    assert choose(AG, 8192, 4096, 7168, rows_dim=rows_dim) == "ce_overlap"
    assert choose(RS, 8192, 7168, 4096, rows_dim=rows_dim) == "ce_overlap"
    assert choose(AG, 8192, 4096, 7168, rows_dim=1) == "pull"


def test_row_slabs_of_batched_sequence_collectives():
    """A [B, S, H] gathered or scattered along S cuts every rank's rows into B slabs: the
    copy-engine overlaps take them slab by slab only when forced (or tuned), up to MAX_ROW_SLABS;
    the reduce-scatter in one chunk per slab; its chunks per slab fit the flag area."""
    assert base.row_slabs((4, 1024, 4096), 0) == 1
    assert base.row_slabs((4, 1024, 4096), 1) == 4
    assert base.row_slabs((2, 3, 5, 8), 2) == 6
    assert base.row_slabs((base.MAX_ROW_SLABS + 1, 8, 8), 1) == 0
    assert base.row_slabs([-1, 8, 8], 1) == 0  # unknown
    # along dim 1 with a batch: the symmetric pull by default (slab by slab lost inside the model)
    assert choose(AG, 8192, 4096, 7168, rows_dim=1) == "pull"
    assert choose(AG, 8192, 4096, 7168, rows_dim=1, slabs=4) == "pull"
    assert choose(RS, 8192, 7168, 4096, rows_dim=1, slabs=4) == "pull"
    assert choose(AG, 8192, 4096, 7168, rows_dim=1, slabs=4, forced="ce_overlap") == "ce_overlap"
    assert choose(AG, 2048, 64, 64, rows_dim=1, slabs=4, forced="ce_overlap") == "ce_overlap"
    assert choose(AG, 8192, 4096, 7168, rows_dim=1, slabs=0, forced="ce_overlap") == "pull"  # too many slabs
    assert choose(RS, 8192, 7168, 4096, rows_dim=1, slabs=4, forced="ce_overlap") == "ce_overlap"
    assert choose(RS, 8192, 7168, 4096, rows_dim=1, slabs=0, forced="ce_overlap") == "pull"
    assert rs_ce_overlap.chunks(1024, 2, slabs=4) == 1
    assert rs_ce_overlap.chunks(8192, 2, slabs=1) == rs_ce_overlap.LARGE_SHARE_CHUNKS
    slots = (wsmod.FLAG_BYTES - wsmod.BASES_BYTES) // 4 // 64 // 63
    assert rs_ce_overlap.chunks(4096, 64, slabs=slots) == 1
    assert rs_ce_overlap.chunks(4096, 64, slabs=slots + 1) == 0  # not one chunk per slab fits
    assert "no row chunk fits" in supports(RS, "ce_overlap", 4096 * 64 * (slots + 1), 64, 64, world=64,
                                           rows_dim=1, slabs=slots + 1)
