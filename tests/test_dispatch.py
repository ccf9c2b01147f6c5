"""The policy's decisions and the run-time's per-group state: the parts of the GPU paths that need
no GPU.

Which path a call takes is ``runtime.policy.choose`` over the group's agreed facts (an H200 group
simulated by ``GroupFacts.simulated``); ``tests/test_policy_golden.py`` checks it against every
recorded answer of the dispatch it replaced at default settings, and these tests keep what that
record does not hold: forcing (``COMMFUSE_ALGO``) and its fallback, capture, the graph lane's
re-warm, the paths' own configurations and workspace sizes, the workspace and group state
(``runtime/workspace.py``, ``runtime/groups.py``) and the error word (``runtime/errors.py``).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import commfuse
from commfuse import env
from commfuse.kernels import fused_all_gather, fused_all_reduce, fused_split_k, tiles
from commfuse.kernels.codes import ERR_MISMATCH, GRAPH_LANE_OP, TAG_MASK, flag_value
from commfuse.runtime import errors, groups, policy
from commfuse.runtime import workspace as wsmod
from commfuse.runtime.facts import GroupFacts
from commfuse.runtime.paths import REGISTRY, base, ce_all_reduce, graph_lane, rs_overlap, split_k
from commfuse.runtime.paths import common, tile_all_gather, tile_all_reduce
from commfuse.runtime.paths.base import Call, Context
from helpers import group_name

BF16 = torch.bfloat16
AR, AG, RS = "mm_all_reduce", "all_gather_mm", "mm_reduce_scatter"


def _call(op, m, k, n, dtype=BF16, world=2, rows_dim=0, slabs=None):
    """A call as the entry builds it (``slabs``: 1 along the rows, else unknown unless given)."""
    if slabs is None:
        slabs = 1 if rows_dim == 0 else 0
    return Call(op, m, k, n, dtype, world, rows_dim=rows_dim, slabs=slabs)


def choose(op, m, k, n, dtype=BF16, world=2, rows_dim=0, slabs=None, *, forced=None, capturing=False,
           lane_bytes=0, facts=None):
    """The path name ``policy.choose`` gives on a simulated H200 group of ``world`` ranks."""
    call = _call(op, m, k, n, dtype, world, rows_dim, slabs)
    return policy.choose(call, facts or GroupFacts.simulated(world), capturing=capturing, lane_bytes=lane_bytes,
                         forced=forced).name


def rules(op, m, k, n, dtype=BF16, world=2, rows_dim=0, slabs=None) -> str:
    """What the rules alone pick (what a forced path that cannot take a call falls back to)."""
    return policy.rules_choice(_call(op, m, k, n, dtype, world, rows_dim, slabs), GroupFacts.simulated(world)).name


def supports(op, name, m, k, n, dtype=BF16, world=2, **kw):
    return REGISTRY[(op, name)].supports(_call(op, m, k, n, dtype, world, **kw), GroupFacts.simulated(world))


@pytest.fixture(autouse=True)
def _quiet_policy(monkeypatch):
    """Each test sees the policy's once-per-reason warnings afresh."""
    monkeypatch.setattr(policy, "_warned", set())


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
    assert "16-byte" in caplog.text and "fp16 and bf16" in caplog.text
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
    assert choose(RS, 4096, 4096, 4096, rows_dim=1, forced="fused") == "symm"
    assert choose(RS, 15, 1024, 776, forced="fused") == "symm"  # rows do not split
    assert choose(RS, 14, 1003, 776, forced="fused") == "symm"  # TMA rows
    assert "split" in supports(RS, "fused", 15, 1024, 776)


def test_fused_all_gather_is_taken_only_where_the_kernel_can_go(monkeypatch):
    assert choose(AG, 2048, 1024, 776, forced="fused") == "fused"
    assert choose(AG, 2, 1024, 776, forced="fused") == "fused"  # one row per rank
    assert choose(AG, 2048, 1024, 776, rows_dim=1, forced="fused") == "symm"
    assert choose(AG, 2048, 1003, 776, forced="fused") == "symm"  # TMA rows
    assert choose(AG, 2048, 1024, 776, torch.float32, forced="fused") == "symm"
    assert supports(AG, "fused", 2048, 1024, 776) is None
    # a tiling whose tiles do not hold whole pushed chunks of rows is refused
    monkeypatch.setattr(tile_all_gather, "tile_config", lambda call: tiles.TileConfig.parse("80x128x64s4w8g8r0o1"))
    assert "not a multiple of 32" in supports(AG, "fused", 2048, 1024, 776)


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
    assert tile_all_reduce.tile_config(_call(RS, 1024, 1024, 1024), True) == small
    assert tile_all_gather.tile_config(_call(AG, 1024, 1024, 1024)) == small
    assert tile_all_reduce.tile_config(_call(AR, 1024, 1024, 1024), False) == tiles.TileConfig(reducers=0)
    assert tile_all_reduce.tile_config(_call(RS, 2048, 2048, 2048), True) == tiles.TileConfig(reducers=0)
    assert tile_all_gather.tile_config(_call(AG, 2048, 2048, 2048)).bn == 128
    assert supports(RS, "fused", 1024, 1024, 1024) is None
    assert supports(AG, "fused", 1024, 1024, 1024) is None
    facts = GroupFacts.simulated(2)
    assert REGISTRY[(RS, "fused")].config(_call(RS, 1024, 1024, 1024), facts).tile == small
    assert REGISTRY[(AG, "fused")].config(_call(AG, 1024, 1024, 1024), facts).tile == small


def test_all_gather_mm_choice():
    # 1024-2048 gathered rows and small outputs: the fused kernel
    assert choose(AG, 2048, 2048, 2048) == "fused"
    assert choose(AG, 1024, 1024, 1024) == "fused"
    assert choose(AG, 2048, 4096, 7168) == "overlap"  # a larger output
    assert choose(AG, 16384, 4096, 7168) == "fused"  # and again from 16384 rows
    assert choose(AG, 16384, 4096, 7168, rows_dim=1, slabs=4) == "symm"
    assert choose(AG, 2048, 2048, 2048, torch.float32) == "symm"  # not fp32
    assert choose(AG, 512, 2048, 2048) == "symm"  # not measured below
    assert choose(AG, 4096, 4096, 4096) == "overlap"
    # GEMM-bound (the gather is a few % of the GEMM): overlapped all the same
    assert choose(AG, 8192, 8192, 28672) == "overlap"
    # ... and only that: the rules have no evidence for the other paths at such N
    assert choose(AG, 2048, 8192, 28672) == "overlap"  # not the fused kernel
    assert choose(AG, 2048, 64, 16384) == "nccl"  # too little work to overlap
    assert choose(AG, 8192, 8192, 28672, rows_dim=1, slabs=4) == "nccl"
    assert choose(AG, 4096, 4096, 4096, rows_dim=1) == "symm"
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
        assert choose(AG, 4096, 4096, 4096, forced=settings.algo) == "overlap"  # not a path of the op
        assert choose(AG, 8192, 8192, 28672, forced=settings.algo) == "overlap"
    with env.override(algo="nccl") as settings:
        assert choose(AG, 4096, 4096, 4096, forced=settings.algo) == "nccl"
    assert env.current().algo is None
    with pytest.raises(ValueError, match="COMMFUSE_ALGO"):
        with env.override(algo="fastest"):
            pass


def _workspace(data_bytes=1 << 12, name="0", **kw):
    """A workspace over plain CPU memory (group "0" is the fake WORLD when one is initialised)."""
    buf = torch.zeros(wsmod.HEADER_BYTES + 2 * data_bytes, dtype=torch.uint8)
    return wsmod.Workspace(name, 0, 2, buf, torch.zeros(2, dtype=torch.int64), data_bytes, **kw)


def test_workspace_epochs_and_parity():
    ws = _workspace()
    # the flag value is the call count above the pairing tag's bits (no tag: the check is off)
    assert [ws.next_epoch() for _ in range(3)] == [(1 << 10, 1), (2 << 10, 0), (3 << 10, 1)]
    assert ws.next_epoch(tag=5) == ((4 << 10) | 5, 0) and ws.epoch == 4
    assert ws.flags.numel() == (wsmod.FLAG_BYTES - wsmod.BASES_BYTES) // 4


def test_workspace_halves_do_not_overlap():
    ws = _workspace()
    a = ws.data(0, (32, 32), torch.float32)
    b = ws.data(1, (32, 32), torch.float32)
    a.fill_(1)
    b.fill_(2)
    assert a.eq(1).all() and b.eq(2).all() and ws.flags.eq(0).all()
    with pytest.raises(RuntimeError, match="too small"):
        ws.data(0, (33, 32), torch.float32)


def test_provider_setting(world2):
    """The provider is a setting read once, and a group's state is kept per provider."""
    torch_group = groups.get(group_name())
    with env.override(symm_provider="iris") as settings:
        assert settings.symm_provider == "iris"
        iris_group = groups.get(group_name())
        assert iris_group.provider == "iris" and iris_group is not torch_group
    assert groups.get(group_name()) is torch_group
    with pytest.raises(ValueError, match="COMMFUSE_SYMM_PROVIDER"):
        with env.override(symm_provider="nvshmem"):
            pass
    groups.release_all()


@pytest.fixture
def fresh_groups(world2):
    """No group state from earlier tests, and none left behind."""
    groups.release_all()
    yield
    groups.release_all()


def test_timeout_error_names_group_op_and_global_ranks(fresh_groups):
    """A kernel that timed out wrote ``[1, op, rank, peer, call count]`` into its group's error word; the
    group's next call raises, naming the group, the op, the global ranks, the call and the bound,
    once; the word stays set (later waits of the group end at once) and the group refuses calls
    until ``release_all``, which starts it afresh with a clear word."""
    name = group_name()
    group = groups.get(name)
    group.workspace = _workspace(name=name, err=group.err, timeout_ns=2 * 10**9)
    assert group.workspace.err is group.err  # the kernels write the group's word
    group.err[:5] = torch.tensor([1, 1, 0, 1, 7], dtype=torch.int32)  # what a timed-out kernel writes
    shard, b = torch.randn(4, 6), torch.randn(6, 5)
    with pytest.raises(RuntimeError, match=r"commfuse\.mm_all_reduce: on group '0', rank 0 timed out after 2 s "
                                           r"waiting for rank 1 \(group ranks 0 and 1\) in call 7 of the group "
                                           r"\(noticed when all_gather_mm"):
        torch.ops.commfuse.all_gather_mm(shard, b, None, 0, 2, name, True)
    assert int(group.err[0]) == 1  # sticky: the group's later waits see it and end at once
    commfuse.check_errors()  # raised once: nothing new
    with pytest.raises(RuntimeError, match=r"mm_all_reduce: on group '0', rank 0 timed out.*refuses further calls"
                                           r".*release_all"):
        torch.ops.commfuse.all_gather_mm(shard, b, None, 0, 2, name, True)
    with pytest.raises(RuntimeError, match="refuses further calls"):
        group.workspace.next_epoch()
    commfuse.release_all()
    out, _ = torch.ops.commfuse.all_gather_mm(shard, b, None, 0, 2, name, True)  # a new start
    assert out.shape == (8, 5) and groups.get(name) is not group and int(groups.get(name).err[0]) == 0


def test_the_error_names_global_ranks_of_a_subgroup(world2):
    """Group ranks 0 and 1 of a group of global ranks 4 and 6 are named 4 and 6."""
    group = groups.Group("tp", weakref.ref(dist.group.WORLD), (4, 6), 0, 2, "torch", wsmod.error_word())
    group.workspace = _workspace(name="tp", err=group.err, timeout_ns=3 * 10**9)
    group.err[:4] = torch.tensor([1, 3, 0, 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"commfuse\.mm_reduce_scatter: on group 'tp', rank 4 timed out after 3 s "
                                           r"waiting for rank 6 \(group ranks 0 and 1\)"):
        errors.check(group)
    assert group.broken and group.workspace.broken == group.broken


def test_a_mismatch_names_both_calls_and_stops_the_group(world2):
    """A wait that met its peer at the same call count under another pairing tag wrote
    ``[ERR_MISMATCH, op, rank, peer, count, my tag, its tag]``: the error says the ranks paired
    different calls (not a timeout), names both global ranks, the count and both tags, and the
    group refuses further calls as after a timeout."""
    group = groups.Group("tp", weakref.ref(dist.group.WORLD), (4, 6), 1, 2, "torch", wsmod.error_word())
    group.workspace = _workspace(name="tp", err=group.err, timeout_ns=3 * 10**9)
    group.err[:7] = torch.tensor([ERR_MISMATCH, 1, 1, 0, 12, 301, 77], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"commfuse\.mm_all_reduce: on group 'tp', call 12 of the group on rank 6 "
                                           r"\(tag 301\) met a different call on rank 4 \(tag 77; group ranks 1 "
                                           r"and 0\).*skipped, added or reordered") as info:
        errors.check(group)
    assert "timed out" not in str(info.value)
    assert group.broken and group.workspace.broken == group.broken


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


def test_a_timeout_stops_only_its_own_group(fresh_groups, monkeypatch):
    """A peer slower than the bound may pair its waits with this rank's later calls on that group:
    after a timeout the group's workspace refuses calls, and so does a regrown one (allocation is
    collective); another group, with its own error word, goes on."""
    sub = dist.new_group([0, 1])
    tp, sp = groups.get(group_name()), groups.get(sub.group_name)
    assert tp.err is not sp.err
    for g in (tp, sp):
        g.workspace = _workspace(1024, name=g.name, err=g.err)
    tp.err[:4] = torch.tensor([1, 3, 0, 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"mm_reduce_scatter: on group '0', rank 0 timed out"):
        commfuse.check_errors()
    with pytest.raises(RuntimeError, match=r"mm_reduce_scatter: on group '0', rank 0 timed out.*refuses further calls"):
        tp.workspace.next_epoch()
    with pytest.raises(RuntimeError, match="refuses further calls"):
        groups.workspace(tp, 1 << 20, torch.device("cpu"))  # no collective allocation from it
    assert sp.workspace.next_epoch() == (flag_value(1), 1) and not sp.broken
    assert groups.workspace(sp, 1024, torch.device("cpu")) is sp.workspace
    a, b = torch.randn(4, 6), torch.randn(6, 5)
    torch.ops.commfuse.mm_all_reduce(a, b, None, sub.group_name)  # the other group's calls run
    with pytest.raises(RuntimeError, match="refuses further calls"):
        torch.ops.commfuse.mm_all_reduce(a, b, None, group_name())
    dist.destroy_process_group(sub)


def test_timeout_bound_fits_the_kernels_nanoseconds():
    with env.override(timeout_s="1e9") as settings:
        assert int(settings.timeout_s * 1e9) == 10**18 < 2**63
    with pytest.raises(ValueError, match=r"COMMFUSE_TIMEOUT_S='1e11' must be at most 1e\+09"):
        with env.override(timeout_s="1e11"):
            pass


def test_mm_reduce_scatter_choice():
    # small calls (1024-2048 rows, at most 2048^2 outputs): the fused kernel
    assert choose(RS, 2048, 2048, 2048) == "fused"
    assert choose(RS, 1024, 1024, 1024) == "fused"
    assert choose(RS, 2048, 4096, 7168) == "ce_overlap"  # a larger output
    assert choose(RS, 512, 2048, 2048) == "symm"  # not measured below
    assert choose(RS, 2048, 2048, 2048, rows_dim=1) == "symm"
    assert choose(RS, 4096, 4096, 4096) == "ce_overlap"
    assert choose(RS, 4096, 4096, 4096, rows_dim=1) == "symm"
    assert choose(RS, 4096, 4096, 4096, world=1) == "nccl"
    assert choose(RS, 16, 16, 16, forced="ce_overlap") == "ce_overlap"
    assert choose(AG, 16, 16, 16, forced="ce_overlap") == "symm"  # not an all-gather path


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


def test_exchange_kernels_do_not_specialise_on_epochs_or_slots():
    """An epoch divisible by 16 would otherwise compile and load a new kernel variant mid-run."""
    from commfuse.kernels import exchange

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
    from commfuse.kernels import exchange

    for kernel in (exchange.one_shot_kernel, exchange.staged_one_shot_kernel, exchange.two_shot_kernel,
                   exchange.pull_gather_kernel, exchange.reduce_scatter_kernel, exchange.barrier_kernel,
                   fused_all_reduce.gemm_all_reduce_kernel, fused_split_k.split_k_all_reduce_kernel,
                   fused_all_gather.all_gather_gemm_kernel):
        assert "rank" in kernel.arg_names
        assert "rank" in [kernel.arg_names[i] if isinstance(i, int) else i for i in kernel.do_not_specialize], \
            kernel.fn.__name__


def test_epochs_restart_collectively_before_the_int32_flags_overflow(world2, monkeypatch):
    ws = _workspace()
    monkeypatch.setattr(wsmod, "EPOCH_LIMIT", 3)
    ws.flags[:8] = 3  # what peers' signals leave behind
    ws.tile_flags[:8] = 3  # and the fused kernel's
    ws.buffer[wsmod.FLAG_BYTES - wsmod.BASES_BYTES:wsmod.FLAG_BYTES] = 7  # stands for the heap bases
    assert [ws.next_epoch()[0] for _ in range(3)] == [flag_value(1), flag_value(2), flag_value(3)]
    assert ws.next_epoch() == (flag_value(1), 1)  # restarted, flags zeroed on every rank (fake group: this one)
    assert ws.flags.eq(0).all() and ws.tile_flags.eq(0).all()
    assert ws.buffer[wsmod.FLAG_BYTES - wsmod.BASES_BYTES:wsmod.FLAG_BYTES].eq(7).all()  # bases kept
    # a path's exchange restarts over the call's group (its process-group object, not its name)
    ws.epoch, ws.flags[:8] = 3, 3
    barriers = []
    real_barrier = dist.barrier
    monkeypatch.setattr(dist, "barrier", lambda group=None, **kw: barriers.append(group) or real_barrier(group=group))
    ctx = Context(_call(AR, 8, 8, 8), GroupFacts.simulated(2), groups.get(group_name()))
    with common.exchange(ctx, ws, AR) as (epoch, parity):
        assert (epoch, parity) == (flag_value(1), 1) and ws.flags.eq(0).all()
    assert barriers == [dist.group.WORLD] * 2


def test_epochs_restart_before_the_split_k_ll_flags_repeat_and_zero_the_data(world2):
    """The LL words' flags hold an epoch's low bits: within one run of epochs no two calls share
    them, and a restart leaves no word of the run before it."""
    assert wsmod.EPOCH_LIMIT < 1 << fused_split_k.LL_EPOCH_BITS
    # the largest flag value, the count above the tag's bits, fits the int32 flags
    assert flag_value(wsmod.EPOCH_LIMIT, TAG_MASK) <= torch.iinfo(torch.int32).max
    ws = _workspace()
    ws.data(0, (64,), torch.uint8).fill_(0xFF)
    ws.data(1, (64,), torch.uint8).fill_(0xFF)
    ws.epoch = wsmod.EPOCH_LIMIT
    assert ws.next_epoch() == (flag_value(1), 1)
    assert ws.buffer[wsmod.HEADER_BYTES:].eq(0).all()


def test_a_failed_call_blocks_the_workspace(world2):
    """Once a call fails after its epoch began, ranks may disagree: refuse, with a remedy."""
    ws = _workspace()
    ctx = Context(_call(AR, 8, 8, 8), GroupFacts.simulated(2), groups.get(group_name()))
    with pytest.raises(MemoryError):
        with common.exchange(ctx, ws, AR):
            raise MemoryError("out of memory")
    with pytest.raises(RuntimeError, match=r"mm_all_reduce: an earlier call on group '0' failed .*release_all"):
        ws.next_epoch()
    groups.release_all()


def test_bias_must_broadcast(world2):
    a, b = torch.randn(8, 4), torch.randn(4, 6)
    for bias in (torch.randn(6), torch.randn(1, 6), torch.randn(8, 6), torch.randn(8, 1)):
        torch.ops.commfuse.mm_all_reduce(a, b, bias, group_name())
    with pytest.raises(RuntimeError, match=r"bias \(5, 6\) does not broadcast to \(8, 6\)"):
        torch.ops.commfuse.mm_all_reduce(a, b, torch.randn(5, 6), group_name())


@pytest.fixture
def fake_allocation(fresh_groups, monkeypatch):
    """Symmetric allocation stood in for by plain CPU buffers (heap bases 1000 * n, 1000 * n + 1),
    recording the thread of each; small minimum sizes."""
    threads, buffers = [], []

    def fake_alloc(pg, nbytes, device):
        threads.append(threading.get_ident())
        buffers.append(torch.zeros(nbytes, dtype=torch.uint8))
        return buffers[-1], [1000 * len(buffers), 1000 * len(buffers) + 1], None

    monkeypatch.setattr(groups, "allocate_torch", fake_alloc)
    monkeypatch.setattr(groups, "MIN_DATA_BYTES", 4096)
    monkeypatch.setattr(groups, "_planned", {})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)

    def group():
        g = groups.get(group_name())
        g.facts = GroupFacts.simulated(2, sms=78, lane_bytes=1 << 16)  # as agreed on its first call
        return g

    return threads, buffers, group


def test_workspace_allocation_runs_off_the_callers_thread(fake_allocation, monkeypatch):
    """A CUDA-graph warm-up sends its thread's allocations to the graph's pool, which captures
    reuse: allocation happens on a helper thread, and the tables live inside the buffers."""
    threads, buffers, group = fake_allocation
    cpu = torch.device("cpu")
    with env.override(timeout_s=2.5):
        g = group()
        ws = groups.workspace(g, 1024, cpu)
        lane = groups.lane(g)
        bounds = (ws.timeout_ns, lane.timeout_ns)
    assert bounds == (2_500_000_000, 2_500_000_000)  # the bound in force
    assert (ws.timeout_ns, lane.timeout_ns) == (600 * 10**9, 600 * 10**9)  # a changed setting reaches them
    assert len(threads) == 2 and threading.get_ident() not in threads  # workspace, then lane
    for holder, buf, ptrs in ((ws, buffers[0], [1000, 1001]), (lane, buffers[1], [2000, 2001])):
        assert holder.heap_bases.tolist() == ptrs
        assert holder.heap_bases.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        assert holder.err is g.err  # the group's word
    assert lane.counter.untyped_storage().data_ptr() == buffers[1].untyped_storage().data_ptr()
    assert lane.counter.eq(0).all() and lane.counter.numel() == wsmod.GRAPH_SLOTS
    assert (ws.data_bytes, ws.max_programs, lane.data_bytes) == (4096, 78, 1 << 16)
    assert groups.workspace(g, 1024, cpu) is ws  # no second allocation
    monkeypatch.setattr(groups, "allocate_torch", lambda *a: (_ for _ in ()).throw(RuntimeError("no memory")))
    with pytest.raises(RuntimeError, match="no memory"):  # the helper thread's error reaches the caller
        groups.workspace(g, 1 << 30, cpu)


def test_workspaces_grow_at_least_twofold_and_start_at_the_planned_size(fake_allocation):
    """A larger call grows the workspace (collectively: every rank waits for the old one's users)
    to at least twice its size, keeping the lane; a compiled graph's plan sizes the group's first
    allocation, so its fused ops need no growth."""
    threads, buffers, group = fake_allocation
    cpu = torch.device("cpu")
    g = group()
    first = groups.workspace(g, 1024, cpu)
    lane = groups.lane(g)
    generation = groups.generation
    grown = groups.workspace(g, 5000, cpu)
    assert grown is not first and grown.data_bytes == 8192 and g.workspace is grown
    assert groups.lane(g) is lane and len(buffers) == 3  # the lane is never regrown
    assert groups.generation > generation  # kept plans (which hold sizes) are decided anew
    assert groups.workspace(g, 20000, cpu).data_bytes == wsmod.round_up(20000, wsmod.ALIGN)
    groups.release_all()
    groups.plan(group_name(), 50000)
    groups.plan(group_name(), 30000)  # the largest plan counts
    assert groups.planned(group_name()) == 50000
    g = group()
    assert groups.workspace(g, 1024, cpu).data_bytes == wsmod.round_up(50000, wsmod.ALIGN)


def test_a_group_re_created_under_its_name_starts_afresh(fresh_groups):
    """torch names groups anew after ``destroy_process_group()``: the same name then resolves to
    another object, whose state (shard answers, capture records, workspace, calls) starts empty;
    a group that went away loses its state at the next ``groups.get`` of any group."""
    name = group_name()
    old = groups.get(name)
    sub = dist.new_group([0, 1])
    gone = groups.get(sub.group_name)
    for g in (old, gone):
        g.facts = GroupFacts.simulated(2)
        g.shard_sizes[(AR, 8)] = True
        g.uneven_ops.add(AG)
        g.captured_nccl.add((AR, ((8, 8), (8, 8), BF16)))
        g.workspace = _workspace(name=g.name, err=g.err)
        g.calls = 5
    assert groups.get(name) is old  # the same object: the same state
    dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    assert group_name() == name  # the name comes back
    generation = groups.generation
    new = groups.get(name)
    assert new is not old and new.pg() is dist.group.WORLD
    assert (new.facts, new.workspace, new.lane, new.calls) == (None, None, None, 0)
    assert not new.shard_sizes and not new.uneven_ops and not new.captured_nccl
    assert new.err is not old.err
    assert old.workspace is None and groups.generation > generation  # the old state is dropped
    # the destroyed subgroup's state went with the sweep of that call
    assert gone.workspace is None
    assert all(g is new for g in groups.all_groups())


def _destroyed_subgroup():
    """(the WORLD group's state, the state of a subgroup with a workspace, now destroyed)."""
    sub = dist.new_group([0, 1])
    gone = groups.get(sub.group_name)
    gone.workspace = _workspace(name=gone.name, err=gone.err)
    world = groups.get(group_name())
    dist.destroy_process_group(sub)
    return world, gone


def test_a_destroyed_subgroup_loses_its_state_within_a_sweep_of_calls(fresh_groups):
    """With no new group made after it, calls on other groups drop it within ``SWEEP_EVERY``."""
    world, gone = _destroyed_subgroup()
    for _ in range(groups.SWEEP_EVERY):
        assert groups.get(group_name()) is world  # the WORLD group's own state stays
    assert gone.workspace is None and gone not in groups.all_groups()


def test_a_destroyed_subgroup_loses_its_state_when_a_group_is_made(fresh_groups):
    world, gone = _destroyed_subgroup()
    assert groups.get(group_name()) is world  # the WORLD group's own state stays
    new_sub = dist.new_group([0, 1])
    assert groups.get(new_sub.group_name) is not gone  # (a new name, or the old one for a new object)
    assert gone.workspace is None and gone not in groups.all_groups()
    dist.destroy_process_group(new_sub)


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


def test_a_graph_lane_timeout_makes_the_lanes_refuse_until_released(fresh_groups):
    name = group_name()
    g = groups.get(name)
    buf = torch.zeros(wsmod.GRAPH_FLAG_BYTES + 2 * 4096, dtype=torch.uint8)
    g.lane = wsmod.GraphLane(name, 0, 2, buf, torch.zeros(2, dtype=torch.int64), 4096, 132, err=g.err)
    g.err[:4] = torch.tensor([1, GRAPH_LANE_OP, 1, 0], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"mm_all_reduce \(graph lane\): on group '0', rank 1 timed out"):
        commfuse.check_errors()
    with pytest.raises(RuntimeError, match="graph lanes of group '0' are out of step.*release_all"):
        groups.lane(g)
    commfuse.release_all()
    assert groups.lane(groups.get(name)) is None


def test_release_restarts_a_kept_lane_so_old_graphs_pair_and_raise_again(fresh_groups, monkeypatch):
    """A lane that captured graphs replay outlives ``release_all``: its epochs start over (every
    rank together) and its error word is cleared, so those replays neither pair stale flags nor
    give up at once with NaN, and their next timeout raises."""
    monkeypatch.setattr(groups, "_held", [])  # (lanes of groups other tests dropped)
    name = group_name()
    g = groups.get(name)
    buf = torch.zeros(wsmod.GRAPH_FLAG_BYTES + 2 * 4096, dtype=torch.uint8)
    g.lane = wsmod.GraphLane(name, 0, 2, buf, torch.zeros(2, dtype=torch.int64), 4096, 132, err=g.err)
    groups.mark_replayed(g)
    g.lane.counter.fill_(14)  # this rank's epochs, ahead of a peer's after a failure
    g.lane.flags.fill_(9)
    g.lane.data(torch.float32).fill_(float("nan"))
    g.err[:4] = torch.tensor([1, GRAPH_LANE_OP, 1, 0], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="graph lane"):
        commfuse.check_errors()
    commfuse.release_all()
    assert g in groups.held() and g.lane is not None  # kept for the graphs
    assert int(g.lane.counter.abs().sum()) == 0 and int(g.lane.flags.abs().sum()) == 0
    assert int(g.lane.data(torch.float32).isnan().sum()) == 0
    assert int(g.err.abs().sum()) == 0 and g.broken is None and g.lane_failure is None
    g.err[:4] = torch.tensor([1, GRAPH_LANE_OP, 1, 0], dtype=torch.int32)  # a replay times out later
    g.lane.counter.fill_(3)
    with pytest.raises(RuntimeError, match="captured before release_all"):
        errors.check_held("mm_all_reduce")
    commfuse.release_all()  # as the error says: the lane kept by the first release starts over too
    assert int(g.lane.counter.abs().sum()) == 0 and int(g.err.abs().sum()) == 0 and g.broken is None
    assert groups.held() == [g]


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
    cfg = tile_all_reduce.tile_config(_call(AR, 8192, 4096, 8192, world=world), False)
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


def test_split_k_counters_sit_between_the_tile_flags_and_the_ticket():
    ws = _workspace()
    flags, counters, ticket = ws.tile_flags, ws.tile_counters, ws.ticket
    base_ptr = ws.buffer.data_ptr()
    assert flags.data_ptr() - base_ptr == wsmod.FLAG_BYTES and flags.numel() == wsmod.TILE_FLAG_SLOTS
    assert counters.data_ptr() >= flags.data_ptr() + 4 * flags.numel()
    assert counters.data_ptr() + 4 * counters.numel() <= ticket.data_ptr()
    assert ticket.data_ptr() + 8 == base_ptr + wsmod.HEADER_BYTES


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
        config = graph_lane.GRAPH.config(call, facts, decision.variant)
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
    assert rs_overlap.chunks(4096, world) == min(2, slots // (world - 1))
    assert rs_overlap.chunks(8192, world) == min(4, slots // (world - 1))  # large shares
    chunks = rs_overlap.chunks(4096, world, given=64)
    assert 1 <= chunks <= 64 and chunks * (world - 1) <= slots
    assert rs_overlap.chunks(3, world, given=64) <= 3  # never more chunks than rows
    call = _call(RS, 4096 * world, 4096, 4096, world=world)
    assert REGISTRY[(RS, "ce_overlap")].config(call, GroupFacts.simulated(world)).chunks == rs_overlap.chunks(4096, world)


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


def test_copy_engine_chunks_are_about_1024_rows():
    assert [len(ce_all_reduce.chunk_rows(m)) for m in (3, 1024, 4096, 8192, 65536)] == [2, 2, 4, 8, 8]
    assert ce_all_reduce.chunk_rows(1) == (1,)  # never more chunks than rows
    assert len(ce_all_reduce.chunk_rows(8192, 3)) == 3
    facts = GroupFacts.simulated(2)
    assert REGISTRY[(AR, "ce_overlap")].config(_call(AR, 4096, 8192, 4096), facts).rows == (1024,) * 4


def test_copy_engine_rows_cover_the_rows_with_a_shorter_last_chunk_on_request():
    rows_of = ce_all_reduce.chunk_rows
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
    assert choose(AG, 8192, 4096, 7168, rows_dim=rows_dim) == "overlap"
    assert choose(RS, 8192, 7168, 4096, rows_dim=rows_dim) == "ce_overlap"
    assert choose(AG, 8192, 4096, 7168, rows_dim=1) == "symm"


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
    assert choose(AG, 8192, 4096, 7168, rows_dim=1) == "symm"
    assert choose(AG, 8192, 4096, 7168, rows_dim=1, slabs=4) == "symm"
    assert choose(RS, 8192, 7168, 4096, rows_dim=1, slabs=4) == "symm"
    assert choose(AG, 8192, 4096, 7168, rows_dim=1, slabs=4, forced="overlap") == "overlap"
    assert choose(AG, 2048, 64, 64, rows_dim=1, slabs=4, forced="overlap") == "overlap"
    assert choose(AG, 8192, 4096, 7168, rows_dim=1, slabs=0, forced="overlap") == "symm"  # too many slabs
    assert choose(RS, 8192, 7168, 4096, rows_dim=1, slabs=4, forced="ce_overlap") == "ce_overlap"
    assert choose(RS, 8192, 7168, 4096, rows_dim=1, slabs=0, forced="ce_overlap") == "symm"
    assert rs_overlap.chunks(1024, 2, slabs=4) == 1
    assert rs_overlap.chunks(8192, 2, slabs=1) == rs_overlap.LARGE_SHARE_CHUNKS
    slots = (wsmod.FLAG_BYTES - wsmod.BASES_BYTES) // 4 // 64 // 63
    assert rs_overlap.chunks(4096, 64, slabs=slots) == 1
    assert rs_overlap.chunks(4096, 64, slabs=slots + 1) == 0  # not one chunk per slab fits
    assert "no row chunk fits" in supports(RS, "ce_overlap", 4096 * 64 * (slots + 1), 64, 64, world=64,
                                           rows_dim=1, slabs=slots + 1)


def test_the_fused_kernels_stagger():
    """The fused all-reduce's programs start their first tiles over 25 µs (calls of more than one
    wave of tiles) or 15 µs (one wave); the reduce-scatter's start together."""
    facts = GroupFacts.simulated(2)
    ar = REGISTRY[(AR, "fused")].config(_call(AR, 8192, 2048, 4096), facts)
    assert ar.options.stagger_ns == (25_000, 15_000) and ar.options.tickets
    rs = REGISTRY[(RS, "fused")].config(_call(RS, 16384, 2048, 4096), facts)
    assert rs.options.stagger_ns == (0, 0)


def test_release_keeps_lanes_that_captured_graphs_replay_and_reads_their_errors(fresh_groups, monkeypatch):
    """``release_all()`` after a timeout under CUDA graphs: the captured graphs still hold the
    lane's addresses, so the lane is kept (never freed while the process runs) and its error word
    still read: a replay after the release that times out raises at the next check instead of
    touching freed memory or passing unseen; a group whose lane no graph captured frees it."""
    monkeypatch.setattr(groups, "_held", [])  # (lanes of groups other tests dropped)
    name = group_name()
    group = groups.get(name)
    lane_buf = torch.zeros(wsmod.GRAPH_FLAG_BYTES + 2 * 4096, dtype=torch.uint8)
    group.lane = wsmod.GraphLane(name, 0, 2, lane_buf, torch.zeros(2, dtype=torch.int64), 4096, 8, err=group.err)
    group.workspace = _workspace(name=name, err=group.err)
    groups.mark_replayed(group)
    sub = dist.new_group([0, 1])
    other = groups.get(sub.group_name)
    other.lane = wsmod.GraphLane(sub.group_name, 0, 2, torch.zeros(wsmod.GRAPH_FLAG_BYTES + 64, dtype=torch.uint8),
                                 torch.zeros(2, dtype=torch.int64), 32, 8, err=other.err)
    commfuse.release_all()
    assert groups.held() == [group] and group.lane is not None and group.workspace is None
    assert other.lane is None  # no graph captured it: freed
    held_row = [r for r in groups.memory() if r["ranks"] == []][0]
    assert held_row["lane_bytes"] == lane_buf.numel()
    group.err[:5] = torch.tensor([1, 4, 0, 1, 3], dtype=torch.int32)  # a replay of an old graph timed out
    with pytest.raises(RuntimeError, match=r"graph lane.*on group '0'.*call 3.*captured before release_all"):
        torch.ops.commfuse.mm_all_reduce(torch.randn(4, 6), torch.randn(6, 5), None, name)


def test_memory_lists_each_groups_symmetric_bytes(fresh_groups):
    name = group_name()
    group = groups.get(name)
    group.workspace = _workspace(data_bytes=1 << 12, name=name, err=group.err)
    row = [r for r in groups.memory() if r["group"] == name][0]
    assert row["workspace_bytes"] == wsmod.HEADER_BYTES + 2 * (1 << 12)
    assert row["data_bytes_per_parity"] == 1 << 12 and row["ranks"] == [0, 1]
    assert row["ce_graphs"] == 0 and row["ce_graph_bytes"] == 0

    class Graph:  # a copy-engine call's CUDA graph, its pool measured at capture
        commfuse_bytes = 40 << 20

    group.workspace.graphs.update({"a": Graph(), "b": Graph()})
    row = [r for r in groups.memory() if r["group"] == name][0]
    assert row["ce_graphs"] == 2 and row["ce_graph_bytes"] == 80 << 20
    groups.release(name)
    assert not [r for r in groups.memory() if r["group"] == name]


def test_what_is_let_go_of_while_capturing_is_freed_after_the_capture(fresh_groups, monkeypatch):
    """Freeing a symmetric buffer synchronises the device, which a CUDA-graph capture forbids. A
    sweep of destroyed groups (at a group's creation, or every ``SWEEP_EVERY`` calls) and a
    ``release`` may come inside a capture: what they drop waits until the first call outside it."""
    import gc

    world, gone = _destroyed_subgroup()
    swept = weakref.ref(gone.workspace)
    monkeypatch.setattr(groups, "_capturing", lambda: True)
    new_sub = dist.new_group([0, 1])
    groups.get(new_sub.group_name)  # a group is made: the sweep drops the destroyed one's state
    assert gone.workspace is None and gone not in groups.all_groups()
    name = group_name()
    world.workspace = _workspace(name=name, err=world.err)
    released = weakref.ref(world.workspace)
    groups.release(name)
    assert world.workspace is None and world not in groups.all_groups()
    gc.collect()
    assert swept() is not None and released() is not None  # still capturing: not freed
    groups.get(new_sub.group_name)  # a call while the capture goes on frees nothing either
    gc.collect()
    assert swept() is not None and released() is not None
    monkeypatch.setattr(groups, "_capturing", lambda: False)
    groups.get(new_sub.group_name)  # the first call after the capture frees them
    gc.collect()
    assert swept() is None and released() is None
    dist.destroy_process_group(new_sub)


@pytest.mark.parametrize("where", ["after_run", "check_errors", "release"])
def test_what_a_capture_let_go_of_is_freed_in_a_loop_of_replays_only(fresh_groups, monkeypatch, where):
    """Under ``mode="reduce-overhead"`` every step after the recording may be a replay: no eager
    call reaches ``groups.get``. What the recording let go of is freed after the next run of a
    compiled graph (``errors.after_run``), at ``check_errors`` and at ``release``."""
    import gc

    class Buffer:  # a workspace dropped while a capture was recording
        pass

    name = group_name()
    groups.get(name)
    monkeypatch.setattr(groups, "_capturing", lambda: True)
    dropped = Buffer()
    gone = weakref.ref(dropped)
    groups.let_go(dropped)
    del dropped
    errors.after_run(errors.Watch())  # still inside the capture: kept
    gc.collect()
    assert gone() is not None
    monkeypatch.setattr(groups, "_capturing", lambda: False)
    if where == "after_run":
        watch = errors.Watch()
        watch.names.add(name)
        errors.after_run(watch)
    elif where == "check_errors":
        errors.check_errors()
    else:
        groups.release("no such group")
    gc.collect()
    assert gone() is None and not groups._deferred


def _lane_of(group, data_bytes=4096):
    buf = torch.zeros(wsmod.GRAPH_FLAG_BYTES + 2 * data_bytes, dtype=torch.uint8)
    return wsmod.GraphLane(group.name, 0, 2, buf, torch.zeros(2, dtype=torch.int64), data_bytes, 8, err=group.err)


def test_a_kept_lane_is_freed_once_the_graphs_that_captured_it_are_gone(fresh_groups, monkeypatch):
    """A lane that captured graphs may replay is kept past ``release_all``, but not for ever: once
    every owner of those graphs (Inductor's graph tree managers) is gone, no replay can reach it,
    and the next sweep or release frees it."""
    import gc

    monkeypatch.setattr(groups, "_held", [])  # (lanes of groups other tests dropped)

    class TreeManager:  # what records Inductor's CUDA graphs (``reduce-overhead``)
        pass

    manager = TreeManager()
    recording = weakref.ref(manager)
    monkeypatch.setattr(groups, "_capture_owner", lambda: recording())
    group = groups.get(group_name())
    group.lane = _lane_of(group)
    groups.mark_replayed(group)  # two captured calls of one recording
    groups.mark_replayed(group)
    assert len(group.graph_owners) == 1
    lane = weakref.ref(group.lane)
    commfuse.release_all()
    assert groups.held() == [group] and lane() is not None  # its graphs may replay
    commfuse.release_all()
    assert groups.held() == [group] and lane() is not None
    del manager  # the graphs went (torch._dynamo.reset(), the compiled model collected)
    commfuse.release_all()
    gc.collect()
    assert groups.held() == [] and lane() is None
    held_row = [r for r in groups.memory() if r["ranks"] == []][0]
    assert held_row["lane_bytes"] == 0


def test_a_lane_a_graph_of_unknown_owner_captured_is_kept_until_told(fresh_groups, monkeypatch):
    """A capture commfuse cannot trace to an owner (the user's own ``torch.cuda.graph``) keeps the
    lane until ``free_kept_lanes()`` says no such graph replays any more."""
    import gc

    monkeypatch.setattr(groups, "_held", [])
    monkeypatch.setattr(groups, "_capture_owner", lambda: None)
    group = groups.get(group_name())
    group.lane = _lane_of(group)
    groups.mark_replayed(group)
    lane = weakref.ref(group.lane)
    commfuse.release_all()
    commfuse.release_all()
    gc.collect()
    assert groups.held() == [group] and lane() is not None
    groups.free_kept_lanes()
    gc.collect()
    assert groups.held() == [] and lane() is None
