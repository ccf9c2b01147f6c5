"""The paths' deciding side (``runtime/paths/``) and the kernels' sizes it reads
(``kernels/sizes/``): configurations, tilings, chunks, pairing tags.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from commfuse.kernels import fused_all_gather, fused_split_k, tiles
from commfuse.kernels.codes import TAG_MASK
from commfuse.runtime import policy
from commfuse.runtime import workspace as wsmod
from commfuse.runtime.facts import GroupFacts
from commfuse.runtime.paths import REGISTRY, ar_ce_overlap, ar_graph, base, rs_ce_overlap, split_k
from commfuse.runtime.paths import ag_fused, ar_fused
from commfuse.runtime.paths.base import Call

from choosing import (  # noqa: F401  (_quiet_policy, fresh_groups: fixtures, found by name)
    BF16, AR, AG, RS, _call, supports, _quiet_policy)


def test_tile_config_parses_and_round_trips():
    cfg = tiles.TileConfig.parse("128x128x64s4w4g8r16o2")
    assert (cfg.bm, cfg.bn, cfg.bk, cfg.stages, cfg.warps, cfg.group_m, cfg.reducers, cfg.per_sm) == \
        (128, 128, 64, 4, 4, 8, 16, 2)
    assert tiles.TileConfig.parse(str(cfg)) == cfg
    assert tiles.TileConfig.parse("128x256x64s3w8g8r16").per_sm == 1
    with pytest.raises(ValueError, match="tile config"):
        tiles.TileConfig.parse("128x256")


def test_all_gather_push_by_shard_size():
    """The fused all-gather's copy engines push shards from 2 MiB (one chunk), its programs push
    smaller ones; a push's chunks are at least 32 rows each."""
    facts = GroupFacts.simulated(2)
    fused = REGISTRY[(AG, "fused")]
    assert fused.config(_call(AG, 2048, 2048, 2048), facts).push == "ce"  # 2048^3 on 2 ranks: 4 MiB shards
    assert fused.config(_call(AG, 1024, 1024, 1024), facts).push == "sm"  # 1024^3: 1 MiB
    assert fused.config(_call(AG, 2048, 2048, 2048), facts).ce_chunks == 1
    assert fused_all_gather.ce_chunks(1024) == 1
    assert fused_all_gather.ce_chunks(1024, 1000) == 1024 // 32  # chunks of at least 32 rows
    assert fused_all_gather.ce_chunks(5, 1000) == 1


def test_small_outputs_take_small_tiles():
    """Up to 2^20 outputs the reduce-scatter and all-gather kernels take 64x128 tiles (more
    waves to overlap); the all-reduce keeps its default; the same answer on every call."""
    small = tiles.TileConfig(bm=64, bn=128, stages=4, warps=4, reducers=0)
    assert ar_fused.tile_config(_call(RS, 1024, 1024, 1024), True) == small
    assert ag_fused.tile_config(_call(AG, 1024, 1024, 1024)) == small
    assert ar_fused.tile_config(_call(AR, 1024, 1024, 1024), False) == tiles.TileConfig(reducers=0)
    assert ar_fused.tile_config(_call(RS, 2048, 2048, 2048), True) == tiles.TileConfig(reducers=0)
    assert ag_fused.tile_config(_call(AG, 2048, 2048, 2048)).bn == 128
    assert supports(RS, "fused", 1024, 1024, 1024) is None
    assert supports(AG, "fused", 1024, 1024, 1024) is None
    facts = GroupFacts.simulated(2)
    assert REGISTRY[(RS, "fused")].config(_call(RS, 1024, 1024, 1024), facts).tile == small
    assert REGISTRY[(AG, "fused")].config(_call(AG, 1024, 1024, 1024), facts).tile == small


def test_pairing_tags_name_what_every_rank_shares():
    """A tag is nonzero and fits its bits; it changes with the op, M, K and N, the dtype, the bias,
    the rows' layout, the path and the call site. K (of mm_all_reduce; N of all_gather_mm) is a
    size an uneven shard may change on one rank, but a symmetric path, the only one that carries
    a tag, runs only where every rank has the same (``shards.py``); it is what tells apart the
    all-reduces of a decode step, which share M and N."""
    call = Call(AR, 64, 4096, 8192, torch.bfloat16, 2)
    tag = base.pairing_tag(call, "one_shot")
    assert 0 < tag <= TAG_MASK and tag == base.pairing_tag(Call(AR, 64, 4096, 8192, torch.bfloat16, 2), "one_shot")
    others = [base.pairing_tag(call, "two_shot"),
              base.pairing_tag(dataclasses.replace(call, m=65), "one_shot"),
              base.pairing_tag(dataclasses.replace(call, n=8193), "one_shot"),
              base.pairing_tag(dataclasses.replace(call, k=2048), "one_shot"),
              base.pairing_tag(dataclasses.replace(call, dtype=torch.float16), "one_shot"),
              base.pairing_tag(dataclasses.replace(call, bias=True), "one_shot"),
              base.pairing_tag(dataclasses.replace(call, op=RS), "one_shot"),
              base.pairing_tag(call, "one_shot", site=7)]
    assert tag not in others and base.pairing_tag(call, "one_shot", site=0) == tag
    gather = Call(AG, 512, 4096, 1024, torch.bfloat16, 2)
    assert base.pairing_tag(dataclasses.replace(gather, n=1000), "fused") != base.pairing_tag(gather, "fused")
    assert base.pairing_tag(dataclasses.replace(gather, k=4000), "fused") != base.pairing_tag(gather, "fused")
    # an 8B-class TP=2 decode step (M=8, hidden 4096): o_proj, down_proj and the q/k/v and w1/w3
    # input gradients all-reduce [8, 4096]; with K their tags differ
    kinds = [Call(AR, 8, k, 4096, torch.bfloat16, 2) for k in (2048, 7168, 3072, 14336)]
    assert len({base.pairing_tag(c, "one_shot") for c in kinds}) == 4
    # tags spread: a thousand calls of one op that differ in M take most of the tag values
    assert len({base.pairing_tag(dataclasses.replace(call, m=m), "one_shot") for m in range(1, 1001)}) > 600


def test_split_k_config_fills_one_wave_of_programs():
    """Blocks just tall enough for the rows; K slices doubled while the units still fit the
    programs once and every slice keeps at least two K steps; the workspace holds the ranks'
    sums and the fp32 slices, and the graph pass plans what the path will use."""
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
    assert fused_split_k.config(16, 7168, 4096, 132, split=8).split == 8  # asked for
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
        facts = GroupFacts.simulated(world)
        planned = policy.workspace_bytes(_call(AR, 16, 7168, 4096, world=world), facts)
        assert planned == split_k.plan_bytes(_call(AR, 16, 7168, 4096, world=world))
        for m in (1, 16, 17, 32, 64, 100, 128, 200):
            for k in (2048, 7168):
                for n in (1024, 2048, 4096, 7168, 8192, 16384):
                    planned = split_k.plan_bytes(_call(AR, m, k, n, world=world))
                    for sms in (66, 78, 108, 114, 132, 144, 264):
                        used = fused_split_k.data_bytes(m, n, world, fused_split_k.config(m, k, n, sms), BF16)
                        assert used <= planned, (m, k, n, world, sms)
                        assert split_k.config(_call(AR, m, k, n, world=world), sms) == \
                            fused_split_k.config(m, k, n, sms)  # what the path runs with


def test_graph_lane_split_k_words_and_choice():
    """The lane's split-K words sit between its flags and its epoch counters; the lane runs the
    split-K kernel where the eager rule would and the lane holds it."""
    buf = torch.zeros(wsmod.GRAPH_FLAG_BYTES + 2 * (4 << 20), dtype=torch.uint8)
    lane = wsmod.GraphLane("0", 0, 2, buf, torch.zeros(2, dtype=torch.int64), 4 << 20, 132)
    assert lane.flags.data_ptr() == buf.data_ptr()
    assert lane.ticket.data_ptr() == lane.flags.data_ptr() + 8 * lane.flags.numel()
    assert lane.tile_counters.data_ptr() == lane.ticket.data_ptr() + 16
    assert lane.tile_counters.data_ptr() + 4 * lane.tile_counters.numel() == lane.counter.data_ptr()
    assert lane.counter.numel() == wsmod.GRAPH_SLOTS

    def lane_split_k(m, k, n, lane_bytes=4 << 20):
        call, facts = _call(AR, m, k, n), GroupFacts.simulated(2, lane_bytes=lane_bytes)
        decision = policy.choose(call, facts, capturing=True)
        config = ar_graph.GRAPH.config(call, facts, decision.variant)
        assert config is None or config == fused_split_k.config(m, k, n, 132)
        return decision.name == "graph" and config is not None

    assert lane_split_k(4, 7168, 4096)  # a decode step's down projection
    assert lane_split_k(128, 2048, 4096)
    assert not lane_split_k(256, 2048, 4096)  # the eager rule says no
    assert not lane_split_k(4, 1003, 4096)  # TMA rows
    assert not lane_split_k(128, 2048, 4096, lane_bytes=1 << 16)  # its data does not fit


@pytest.mark.parametrize("world", [2, 4, 8, 64])
def test_scatter_chunks_fit_the_flag_area(world):
    """One barrier slot per chunk and step must exist before the call's epoch begins."""
    slots = (wsmod.FLAG_BYTES - wsmod.BASES_BYTES) // 4 // world
    assert rs_ce_overlap.chunks(4096, world) == min(2, slots // (world - 1))
    assert rs_ce_overlap.chunks(8192, world) == min(4, slots // (world - 1))  # large shares
    chunks = rs_ce_overlap.chunks(4096, world, given=64)
    assert 1 <= chunks <= 64 and chunks * (world - 1) <= slots
    assert rs_ce_overlap.chunks(3, world, given=64) <= 3  # never more chunks than rows
    call = _call(RS, 4096 * world, 4096, 4096, world=world)
    assert REGISTRY[(RS, "ce_overlap")].config(call, GroupFacts.simulated(world)).chunks == rs_ce_overlap.chunks(4096, world)


def test_copy_engine_chunks_are_about_1024_rows():
    assert [len(ar_ce_overlap.chunk_rows(m)) for m in (3, 1024, 4096, 8192, 65536)] == [2, 2, 4, 8, 8]
    assert ar_ce_overlap.chunk_rows(1) == (1,)  # never more chunks than rows
    assert len(ar_ce_overlap.chunk_rows(8192, 3)) == 3
    facts = GroupFacts.simulated(2)
    assert REGISTRY[(AR, "ce_overlap")].config(_call(AR, 4096, 8192, 4096), facts).rows == (1024,) * 4


def test_copy_engine_rows_cover_the_rows_with_a_shorter_last_chunk_on_request():
    rows_of = ar_ce_overlap.chunk_rows
    assert rows_of(4096) == (1024,) * 4
    assert rows_of(1000) == (500, 500)
    assert rows_of(1) == (1,) and rows_of(0) == ()
    assert rows_of(4096, last=256) == (1280, 1280, 1280, 256)
    assert rows_of(8192, last=256) == (1152,) * 6 + (1024, 256)  # 64-row multiples before it
    assert rows_of(4096, 8, 256) == (576,) * 6 + (384, 256)
    for m in (3, 100, 257, 1000, 4096, 8191):  # every row once, never more chunks than asked
        for last in (1, 64, 256, 4096, 9999, -1):
            rows = rows_of(m, 8, last)
            assert sum(rows) == m and min(rows) > 0 and len(rows) <= 8


def test_the_fused_kernels_stagger():
    """The fused all-reduce's programs start their first tiles over 25 µs (calls of more than one
    wave of tiles) or 15 µs (one wave); the reduce-scatter's start together."""
    facts = GroupFacts.simulated(2)
    ar = REGISTRY[(AR, "fused")].config(_call(AR, 8192, 2048, 4096), facts)
    assert ar.options.stagger_ns == (25_000, 15_000) and ar.options.tickets
    rs = REGISTRY[(RS, "fused")].config(_call(RS, 16384, 2048, 4096), facts)
    assert rs.options.stagger_ns == (0, 0)
