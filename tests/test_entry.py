"""The run-time's entry (``runtime/entry.py``), simulated on the CPU: each call's plan and path, the
pairing check's tags, the eager twins of captured calls, ``COMMFUSE_VERIFY`` and the shard-size
agreement, and the call timing that wraps the entry (``tools/call_times.py``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from commfuse import env
from commfuse.kernels import exchange
from commfuse.kernels import fused_split_k
from commfuse.kernels.codes import OP_AR_NORM, count_of, tag_of
from commfuse.runtime import capture, entry, groups, running, shards, verify
from commfuse.runtime import workspace as wsmod
from commfuse.runtime.paths import REGISTRY, base
from commfuse.runtime.paths.base import (Call, MmAllReduceArgs, MAX_ROW_SLABS)
from commfuse.runtime.counters import PATHS
from commfuse.runtime.spec import SPECS

from sim import (  # noqa: F401  (fixtures: pytest finds them by name in this module)
    AR, AG, RS, _Buffers, _Group, _Stream, _all_gather_mm, _mm_all_reduce, _mm_reduce_scatter, _one_thread, sim,
    _changed, _FakeEvent, _inputs, _partial, _ran)


def test_the_pairing_check_tags_every_exchange_with_its_call(sim, monkeypatch):
    """With ``COMMFUSE_PAIRING_CHECK`` every symmetric call's epoch carries the call's tag (what
    every rank shares of it, and its path) below the call count; without it, tag 0. The
    kernels compare the tags (``tests/interpreted_exchange.py``); here, that each op's exchange
    gets its call's, through the entry and its kept plan."""
    seen = []
    for name, at in (("all_reduce", 3), ("gather", 5), ("reduce_scatter", 5)):
        real = getattr(exchange, name)
        monkeypatch.setattr(exchange, name, lambda *a, _real=real, _at=at, **k: (
            seen.append(a[_at]), _real(*a, **k))[1])
    r, world = sim.mine.rank, sim.world
    a, b, _ = _inputs(world, 4 * world, 6, 7, None)

    def calls():
        for p in sim.peers():
            sim.peer_data(p, (4 * world, 7)).copy_(_partial(a[p], b[p], None))
        _mm_all_reduce(a[r], b[r], None, "0")
        for p in sim.peers():
            sim.peer_data(p, (4, 6)).copy_(a[p][:4])
        _all_gather_mm(a[r][:4], b[r], None, 0, world, "0")
        for p in sim.peers():
            sim.peer_data(p, (4 * world, 7)).copy_(_partial(a[p], b[p], None))
        _mm_reduce_scatter(a[r], b[r], None, [4 * world, 7], 0, world, "0")

    with env.override(algo="one_shot", pairing_check=True):
        calls()
        calls()  # the kept plans carry the tag too
    want = [base.pairing_tag(Call(AR, 4 * world, 6, 7, torch.float32, world), "one_shot"),
            base.pairing_tag(Call(AG, 4 * world, 6, 7, torch.float32, world), "pull"),
            base.pairing_tag(Call(RS, 4 * world, 6, 7, torch.float32, world), "pull")]
    assert [tag_of(e) for e in seen] == want * 2 and all(want) and len(set(want)) == 3
    assert [count_of(e) for e in seen] == list(range(1, 7)) and sim.mine.epoch == 6
    seen.clear()
    with env.override(algo="one_shot", pairing_check=False):
        calls()
    assert [tag_of(e) for e in seen] == [0, 0, 0] and [count_of(e) for e in seen] == [7, 8, 9]


def _tags_of_calls(sim, monkeypatch, calls) -> list:
    """(count, tag) of each one-shot exchange the entry makes for ``calls``: (K, site) each, of
    [4 * world, K] @ [K, 7] all-reduced, with the pairing check on."""
    seen = []
    real = sim.all_reduce
    monkeypatch.setattr(exchange, "all_reduce", lambda *a, **k: (seen.append(a[3]), real(*a, **k))[1])
    r, world = sim.mine.rank, sim.world
    with env.override(algo="one_shot", pairing_check=True):
        for k, site in calls:
            a, b, _ = _inputs(world, 4 * world, k, 7, None)
            _mm_all_reduce(a[r], b[r], None, "0", *([site] if site else []))
    return [(count_of(e), tag_of(e)) for e in seen]


def test_the_pairing_tag_names_k(sim, monkeypatch):
    """A decode step's all-reduces share M and N (o_proj, down_proj and the input gradients of a
    TP block): their tags differ by K, so a rank that skipped one meets its peer's next with
    another tag, at the first call after the skipped one (the kernels then raise "met a different
    call": ``tests/interpreted_exchange.py``)."""
    tags = _tags_of_calls(sim, monkeypatch, [(6, 0), (10, 0), (6, 0)])
    assert [c for c, _ in tags] == [1, 2, 3]
    assert tags[0][1] != tags[1][1] and tags[0][1] == tags[2][1]


def test_the_pairing_tag_names_the_call_site(sim, monkeypatch):
    """Three calls alike in every size from three sites of a program (``ops/library.py``): rank 0
    makes all three, rank 1 skips the second. At the second count the two ranks' tags differ,
    where without sites they were one tag. The same site keeps its tag (plans are kept per
    signature, the site's tag per site), and site 0 (a hand-written call) the tag of its sizes."""
    r0 = _tags_of_calls(sim, monkeypatch, [(6, 11), (6, 12), (6, 13), (6, 12)])
    assert len({t for _, t in r0[:3]}) == 3 and r0[3][1] == r0[1][1]
    sim.mine.epoch = 0  # the peer's calls, from the same count
    r1 = _tags_of_calls(sim, monkeypatch, [(6, 11), (6, 13)])
    assert r1[0] == r0[0] and r1[1][0] == r0[1][0] and r1[1][1] != r0[1][1]
    plain = _tags_of_calls(sim, monkeypatch, [(6, 0)])
    call = Call(AR, 4 * sim.world, 6, 7, torch.float32, sim.world)
    assert plain[0][1] == base.pairing_tag(call, "one_shot") and plain[0][1] not in {t for _, t in r0}
    assert r0[0][1] == base.pairing_tag(call, "one_shot", 11)


def test_contexts_carry_the_tag_and_the_configuration_the_check_needs(sim):
    """``make_context``, which the plans and the tuner's measurements both use: with the check on a
    symmetric path's context has the call's tag and split-K's configuration without LL words (so
    the tuner times split-K as it will run); NCCL carries no tag; with the check off, tag 0 and
    the path's own configuration."""
    call = Call(AR, 16, 4096, 1024, torch.bfloat16, sim.world)
    split = REGISTRY[(AR, "split_k")]
    own = split.config(call, sim.facts)
    with env.override(pairing_check=True):
        ctx = base.make_context(call, sim.facts, sim.group, split)
        nccl = base.make_context(call, sim.facts, sim.group, REGISTRY[(AR, "nccl")])
        one_shot = base.make_context(call, sim.facts, sim.group, REGISTRY[(AR, "one_shot")])
    assert ctx.tag == base.pairing_tag(call, "split_k") and ctx.config == dataclasses.replace(own, ll=False)
    assert nccl.tag == 0 and one_shot.tag == base.pairing_tag(call, "one_shot") != ctx.tag
    with env.override(pairing_check=False):
        off = base.make_context(call, sim.facts, sim.group, split)
    assert off.tag == 0 and off.config == own and own.ll is not False


def test_the_pairing_check_takes_split_k_off_ll_words(sim, monkeypatch):
    """LL words have no room for a tag: with the check on, the split-K path exchanges with flags."""
    asked = []
    monkeypatch.setattr(fused_split_k, "prepare", lambda ws, a, b, bias, out, cfg, lane=False, **_: (
        asked.append(cfg.ll), lambda epoch, parity: None)[1])
    a, b = torch.randn(16, 4096, dtype=torch.bfloat16), torch.randn(4096, 1024, dtype=torch.bfloat16)
    call = Call(AR, 16, 4096, 1024, torch.bfloat16, sim.world)
    path = REGISTRY[(AR, "split_k")]
    cfg = path.config(call, sim.facts)
    for check in (False, True):
        with env.override(pairing_check=check):
            running.run(path, base.make_context(call, sim.facts, sim.group, path), MmAllReduceArgs(a, b, None, "0"))
    assert asked == [cfg.ll, False] and cfg.ll is not False


def test_paths_count_the_path_that_ran(sim):
    """A forced overlap that cannot take the call (more row slabs than it handles) runs what the
    rules pick instead, the symmetric pull here, and PATHS (what tests read to know which path
    ran) says so."""
    slabs = MAX_ROW_SLABS + 1
    before = dict(PATHS)
    shards_ = [torch.randn(slabs, 2, 6) for _ in range(sim.world)]
    for p in sim.peers():
        sim.peer_data(p, (slabs, 2, 6)).copy_(shards_[p])
    with env.override(algo="ce_overlap"):
        out, gathered = _all_gather_mm(shards_[sim.mine.rank], torch.randn(6, 5), None, 1, sim.world, "0")
    torch.testing.assert_close(gathered, torch.cat(shards_, dim=1))
    assert PATHS["all_gather_mm:pull"] == before.get("all_gather_mm:pull", 0) + 1
    assert PATHS["all_gather_mm:overlap"] == before.get("all_gather_mm:overlap", 0)
    m, shape = 2 * sim.world * slabs, [slabs, 2 * sim.world, 7]
    a, b, _ = _inputs(sim.world, m, 6, 7, None)
    for p in sim.peers():
        sim.peer_data(p, (m, 7)).copy_(a[p] @ b[p])
    with env.override(algo="ce_overlap"):
        out = _mm_reduce_scatter(a[sim.mine.rank], b[sim.mine.rank], None, shape, 1, sim.world, "0")
    want = sum(a[p] @ b[p] for p in range(sim.world)).view(shape).chunk(sim.world, dim=1)[sim.mine.rank]
    torch.testing.assert_close(out, want)
    assert PATHS["mm_reduce_scatter:pull"] == before.get("mm_reduce_scatter:pull", 0) + 1
    assert PATHS["mm_reduce_scatter:ce_overlap"] == before.get("mm_reduce_scatter:ce_overlap", 0)


def test_forced_copy_engine_paths_with_no_rows_run_the_rules_choice(sim):
    """Zero rows: no symmetric path takes an empty exchange, so a forced copy-engine path runs
    what the rules pick, the unfused computation (counted as such), instead of failing inside the
    exchange, which would break the workspace."""
    r = sim.mine.rank
    a, b, bias = _inputs(sim.world, 0, 6, 7, "1d")
    before = dict(PATHS)
    with env.override(algo="ce_overlap"):
        out = _mm_all_reduce(a[r], b[r], bias[r], "0")
        assert out.shape == (0, 7) and sim.mine.broken is None and sim.mine.epoch == 0
        assert PATHS["mm_all_reduce:nccl"] == before.get("mm_all_reduce:nccl", 0) + 1
        out = _mm_reduce_scatter(a[r], b[r], bias[r], [0, 7], 0, sim.world, "0")
    assert out.shape == (0, 7) and sim.mine.broken is None
    assert PATHS["mm_reduce_scatter:nccl"] == before.get("mm_reduce_scatter:nccl", 0) + 1
    assert PATHS["mm_all_reduce:ce_overlap"] == before.get("mm_all_reduce:ce_overlap", 0)


def test_call_times_key_each_call_by_shapes_and_the_path_taken(sim, monkeypatch):
    """``call_times.record(True)``: each call of an op's entry is timed on the caller's stream,
    keyed by the op, its operands' shapes and layout and the path it took (a forced path that fell
    back counts as the path that ran); nothing is kept while recording is off; ``collect`` empties."""
    from commfuse.tools import call_times

    monkeypatch.setattr(call_times, "_event", _FakeEvent)
    monkeypatch.setattr(call_times, "_timeable", lambda a: True)
    idle = iter([True, False, False, True, False])  # the stream's state at each recorded call
    monkeypatch.setattr(call_times, "_idle", lambda a: next(idle))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    r = sim.mine.rank

    def call(algo, m):
        a, b, bias = _inputs(sim.world, m, 6, 7, None)
        for p in sim.peers():
            sim.peer_data(p, (m, 7)).copy_(_partial(a[p], b[p], bias[p]))
        with env.override(algo=algo):
            _mm_all_reduce(a[r], b[r], bias[r], "0")

    def calls():
        call_times.record(True)
        try:
            call("one_shot", 10)
            call("two_shot", 10)
            call("one_shot", 10)
            call("ce_overlap", 0)  # no rows: no symmetric path takes it, the rules' NCCL runs
            shards_ = [torch.randn(4, 6) for _ in range(sim.world)]
            for p in sim.peers():
                sim.peer_data(p, (4, 6)).copy_(shards_[p])
            b = torch.randn(6, 5)
            with env.override(algo="pull"):  # an entry with a keyword argument
                out, _ = _all_gather_mm(shards_[r], b, None, 0, sim.world, "0", return_gathered=False)
            torch.testing.assert_close(out, torch.cat(shards_) @ b)
        finally:
            call_times.record(False)
        call("one_shot", 10)

    call("one_shot", 10)  # not recording
    calls()
    detail = call_times.collect(detail=True)
    assert {k: [(c.gpu_us, c.idle) for c in v] for k, v in detail.items()} == {
        ("mm_all_reduce", (10, 6), (6, 7), False, "one_shot"): [(1e3, True), (1e3, False)],
        ("mm_all_reduce", (10, 6), (6, 7), False, "two_shot"): [(1e3, False)],
        ("mm_all_reduce", (0, 6), (6, 7), False, "nccl"): [(1e3, True)],
        ("all_gather_mm", (4, 6), (6, 5), False, "pull"): [(1e3, False)]}
    assert all(c.host_us > 0 and 0 <= c.cpu_us <= c.host_us + 1e3 for v in detail.values() for c in v)
    assert next(idle, None) is None  # asked once per recorded call, never while not recording
    monkeypatch.setattr(call_times, "_idle", lambda a: False)
    calls()
    times = call_times.collect()
    assert times == {("mm_all_reduce", (10, 6), (6, 7), False, "one_shot"): [1e3, 1e3],
                     ("mm_all_reduce", (10, 6), (6, 7), False, "two_shot"): [1e3],
                     ("mm_all_reduce", (0, 6), (6, 7), False, "nccl"): [1e3],
                     ("all_gather_mm", (4, 6), (6, 5), False, "pull"): [1e3]}
    assert call_times.collect() == {}


def _capturing(monkeypatch, state: list) -> None:
    """A CUDA-graph capture, as the entry and the graph lane ask for it, while ``state[0]``."""
    monkeypatch.setattr(capture, "_CUDA", True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state[0])


def test_eager_twins_of_calls_captured_to_nccl_run_nccl(sim, monkeypatch):
    """A CUDA-graph capture sends these calls to NCCL. A rank whose graph tree re-warms runs the
    same calls eagerly while its peer replays the NCCL collectives, so once a capture took NCCL for
    an op, group and shapes, eager calls with those run NCCL too; other shapes keep their path."""
    world = sim.world
    shard, b = torch.randn(4, 6), torch.randn(6, 5)
    a, w = torch.randn(2 * world, 6), torch.randn(6, 7)
    capturing = [False]
    _capturing(monkeypatch, capturing)
    checked = []
    monkeypatch.setattr(verify, "same_call", lambda group, op, count, **shared: checked.append((op, count)))

    def run(capture, rows=4):
        capturing[0] = capture
        before = (_ran(AG), _ran(RS))
        _all_gather_mm(shard[:rows], b, None, 0, world, "0")
        _mm_reduce_scatter(a[:rows * world // 2], w, None, [rows * world // 2, 7], 0, world, "0")
        return [_changed(AG, before[0])[0], _changed(RS, before[1])[0]]

    assert run(False) == ["pull", "pull"]  # before any capture
    assert run(True) == ["nccl", "nccl"]  # inside the capture (the sizes were agreed eagerly before)
    group = groups.get("0")
    assert len(group.capture.nccl) == 2
    calls = group.calls
    assert run(False) == ["nccl", "nccl"]  # the re-warming rank meets its peer's replays
    # ... with nothing before them: no size agreement, even of an op whose sizes once differed,
    # no COMMFUSE_VERIFY check, and they are not counted as the group's calls
    group.uneven_ops.update({AG, RS})
    learned = shards.LEARNED
    with env.override(verify=True):
        assert run(False) == ["nccl", "nccl"] and shards.LEARNED == learned
    assert checked == [] and group.calls == calls
    group.uneven_ops.clear()
    assert run(False, rows=2) == ["pull", "pull"]  # shapes no capture took keep their path
    groups.release_all()
    assert groups.get("0") is not group
    assert run(False) == ["pull", "pull"]


def test_a_captured_all_reduce_past_the_lane_makes_its_eager_twins_run_nccl(sim, monkeypatch):
    """A capture whose all-reduce the graph lane cannot take (no lane yet) runs NCCL inside the
    lane path; its eager twin must run NCCL too, not a symmetric path."""
    a, b = torch.randn(8, 6), torch.randn(6, 5)
    capturing = [False]
    _capturing(monkeypatch, capturing)

    def path(capture):
        capturing[0] = capture
        before = _ran(AR)
        _mm_all_reduce(a, b, None, "0")
        return _changed(AR, before)

    assert path(False) == ["one_shot"]  # eagerly (every rank learns the call's sizes)
    assert groups.get("0").lane is None
    assert path(True) == ["nccl"]  # the lane path, which found no lane: NCCL
    assert next(reversed(groups.get("0").decisions.values()))[:2] == ("graph", "capture")
    assert path(False) == ["nccl"]
    groups.release_all()
    assert path(False) == ["one_shot"]  # a new group: nothing captured there


def test_eager_calls_that_fit_a_replayed_lane_take_it_unchecked(sim, monkeypatch):
    """Once captured graphs replay a group's lane, an eager call that fits it (a rank re-warming
    its graphs) takes the lane too, meeting the peer's replays on the same flags, with nothing the
    replaying peer would never join: no ``COMMFUSE_VERIFY`` check, no size agreement (its size was
    agreed by the eager calls before the capture) and no count of the group's calls. A call past
    the lane keeps its path and is checked."""
    staged, checked = [], []
    monkeypatch.setattr(exchange, "staged_all_reduce", lambda lane, src, out, op, tag=0: (
        staged.append(lane), out.copy_(src * sim.world)))
    monkeypatch.setattr(verify, "same_call", lambda group, op, count, **shared: checked.append((op, count)))
    _capturing(monkeypatch, [False])  # (the lane path asks CUDA)
    a, b = torch.randn(8, 6), torch.randn(6, 5)  # 160 bytes: fits; fp32: the staged one-shot, no split-K
    before = _ran(AR)
    _mm_all_reduce(a, b, None, "0")  # the warm-up before a capture: the size agreed
    assert _changed(AR, before) == ["one_shot"]
    group = groups.get("0")
    buf = torch.zeros(wsmod.GRAPH_FLAG_BYTES + 2 * 4096, dtype=torch.uint8)
    group.lane = wsmod.GraphLane("0", sim.mine.rank, sim.world, buf, torch.zeros(sim.world, dtype=torch.int64),
                                 4096, 132, err=group.err)
    capture.mark_replayed(group)  # (what a capture that launched the lane does)
    assert capture.lane_bytes(group) == 4096
    calls, learned = group.calls, shards.LEARNED
    with env.override(verify=True):
        for _ in range(2):
            before = _ran(AR)
            out = _mm_all_reduce(a, b, None, "0")
            assert _changed(AR, before) == ["graph"] and staged[-1] is group.lane
            torch.testing.assert_close(out, (a @ b) * sim.world)
        assert checked == [] and group.calls == calls and shards.LEARNED == learned
        big_a, big_b = torch.randn(40, 6), torch.randn(6, 40)  # 6400 bytes: past the lane
        before = _ran(AR)
        _mm_all_reduce(big_a, big_b, None, "0")
        assert _changed(AR, before) == ["one_shot"] and checked == [(AR, calls)] and group.calls == calls + 1
        assert shards.LEARNED == learned + 1


def test_verify_checks_each_call_with_the_groups_call_count(sim, monkeypatch):
    """With ``COMMFUSE_VERIFY`` every eager call first all-gathers its signature and the group's
    count of calls before it: ranks that disagree (here rank 1, a call behind) raise on every rank,
    naming the group, the call, the global ranks and what differs."""
    skip = [0]  # peers' counts are this many calls behind

    def all_gather_object(every, mine, group=None):
        for p in range(len(every)):
            every[p] = dict(mine, call=str(int(mine["call"]) - skip[0])) if p == 1 and p != sim.mine.rank else mine

    monkeypatch.setattr(verify.dist, "all_gather_object", all_gather_object)
    group = groups.get("0")
    a, b = torch.randn(4, 6), torch.randn(6, 5)
    with env.override(verify=True, algo="one_shot"):
        for count in range(3):
            _mm_all_reduce(a, b, None, "0")
            assert group.calls == count + 1
        skip[0] = 1
        if sim.mine.rank == 1:
            return  # (this rank is the one a call behind: every answer it gets is its own)
        with pytest.raises(RuntimeError, match=r"commfuse\.mm_all_reduce: ranks of group '0' disagree about call 3 "
                                               r"of the group: rank \d and rank 1 differ \(call: 3 here, 2 there\)"):
            _mm_all_reduce(a, b, None, "0")


def test_ranks_whose_own_sizes_differ_run_nccl_and_agree_on_every_later_call(sim, monkeypatch):
    """K of an all-reduced product is a rank's own size (uneven sharding): the group's first call
    of a size agrees on it (one small all-reduce), a call whose ranks' sizes differ runs NCCL on
    every rank, and from then on every call of that op agrees anew; other ops keep their answers."""
    sizes = {}  # own size on this rank -> the largest any rank has

    def all_reduce(tensor, op=None, group=None):
        size = int(tensor[0])
        tensor.copy_(torch.tensor([sizes.get(size, size), -size]))

    monkeypatch.setattr(shards.dist, "all_reduce", all_reduce)
    group = groups.get("0")
    r = sim.mine.rank

    def call(k):
        a, b, _ = _inputs(sim.world, 4, k, 5, None)
        before, learned = _ran(AR), shards.LEARNED
        with env.override(algo="one_shot"):
            _mm_all_reduce(a[r], b[r], None, "0")
        return _changed(AR, before), shards.LEARNED - learned

    assert call(6) == (["one_shot"], 1)
    assert call(6) == (["one_shot"], 0)  # kept: the plan of this signature
    sizes[7] = 8  # a peer has 8 where this rank has 7
    assert call(7) == (["nccl"], 1) and group.uneven_ops == {AR}
    assert call(7) == (["nccl"], 1)  # every later call of the op agrees
    assert call(6) == (["one_shot"], 1)
    assert group.shard_sizes[(AR, 7)] is False and group.shard_sizes[(AR, 6)] is True


def test_verify_agrees_on_the_own_sizes_of_every_call(sim, monkeypatch):
    """An even layer first: only agreeing on every call (``COMMFUSE_VERIFY``) can tell an uneven
    one whose size this rank met before (in-features 33 and 32 on 2 ranks: rank 1 has 16 for
    both), so with it every call agrees, kept plan or not."""
    monkeypatch.setattr(verify.dist, "all_gather_object", lambda every, mine, group=None: every.__setitem__(
        slice(None), [mine] * len(every)))
    r = sim.mine.rank
    a, b, _ = _inputs(sim.world, 4, 6, 5, None)
    with env.override(verify=True, algo="one_shot"):
        learned = shards.LEARNED
        for _ in range(3):
            _mm_all_reduce(a[r], b[r], None, "0")
        assert shards.LEARNED == learned + 3


def test_an_uncaptured_call_asks_the_capture_module_once(sim, monkeypatch):
    """What capture changes about a call (an eager twin, a replayed lane) is answered in one place:
    an uncaptured call whose plan is kept asks the capture module once (``capture.at_call``); one
    whose plan is decided asks it once more, from the policy (``capture.Selection``)."""
    import sys

    from commfuse.runtime import capture

    asked = []
    for name in ("at_call", "capturing", "lane_bytes", "record", "mark_replayed", "lane", "fail", "restarted",
                 "fits_lane", "owner", "Selection"):
        real = getattr(capture, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            if sys._getframe(1).f_globals.get("__name__") != capture.__name__:  # (from outside it)
                asked.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(capture, name, counted)
    a, b = torch.randn(8, 6), torch.randn(6, 5)
    _mm_all_reduce(a, b, None, "0")  # decided: the entry asks, then the policy
    assert asked == ["at_call", "Selection"]
    asked.clear()
    before = _ran(AR)
    _mm_all_reduce(a, b, None, "0")  # kept
    assert asked == ["at_call"] and _changed(AR, before) == ["one_shot"]


def test_releasing_a_group_releases_all_its_state(sim, monkeypatch):
    """A group's plans, tuner, decisions, capture records, shard answers, facts and buffers live in
    its state object: ``release`` drops all of it, and the group's next call starts afresh."""
    monkeypatch.setattr(groups, "_held", [])
    a, b = torch.randn(8, 6), torch.randn(6, 5)
    _mm_all_reduce(a, b, None, "0")
    group = groups.get("0")
    group.workspace = sim.mine
    group.lane = wsmod.GraphLane("0", sim.mine.rank, sim.world, torch.zeros(wsmod.GRAPH_FLAG_BYTES + 64,
                                 dtype=torch.uint8), torch.zeros(sim.world, dtype=torch.int64), 32, 8, err=group.err)
    group.tuner = object()  # (what ``tuning.for_group`` keeps there)
    group.capture.nccl.add((AG, ((4, 6), (6, 5), torch.float32)))
    group.uneven_ops.add(RS)
    assert group.plans and group.decisions and group.shard_sizes and group.facts is not None
    groups.release("0")
    assert (group.workspace, group.lane, group.tuner) == (None, None, None)
    assert not (group.plans or group.decisions or group.capture.nccl or group.shard_sizes or group.uneven_ops)
    assert group not in groups.all_groups() and not groups.decisions()
    fresh = groups.get("0")
    assert fresh is not group and fresh.facts is None and fresh.tuner is None
    assert not (fresh.plans or fresh.decisions or fresh.capture.nccl or fresh.shard_sizes)
    _mm_all_reduce(a, b, None, "0")  # decided anew, on the new state
    assert list(fresh.plans) and [d[0] for d in fresh.decisions.values()] == ["one_shot"]


@pytest.mark.parametrize("op", sorted(SPECS))
def test_every_ops_nccl_path_runs_through_the_entry(sim, op):
    """Every op's unfused computation runs through the same entry as its symmetric paths: its call
    reaches a runner (every registered path has one) and counts the NCCL path."""
    assert set(running.RUNS) == set(REGISTRY.values())
    spec = SPECS[op]
    fp8_shard = op.startswith("all_gather") and "scaled" in op
    call = Call(op, 8 * sim.world, 16, 16, torch.float8_e4m3fn if fp8_shard else torch.bfloat16, sim.world)
    args = spec.inputs(call, "0", lambda *shape: torch.randn(*shape).to(call.dtype))
    before = dict(PATHS)
    with env.override(algo="nccl"):
        out = entry.run(spec, args, 0)
    assert PATHS[f"{op}:nccl"] == before.get(f"{op}:nccl", 0) + 1
    assert (out[0] if isinstance(out, tuple) else out).dtype == torch.bfloat16


def test_the_add_rms_norm_chain_takes_the_graph_lane_in_a_capture(sim, monkeypatch):
    """The opt-in chain's op inside a CUDA-graph capture takes its graph-lane path (no rule row:
    the op's default in a capture is its lane): the staged exchange + add + norm kernel on the
    group's lane. Once graphs replay the lane, an eager call that fits takes it too; a captured
    call the lane cannot hold runs the unfused chain, and so does its eager twin."""
    from commfuse.kernels import norm_epilogue
    from commfuse.runtime import reference
    from commfuse.runtime.spec import MM_ALL_REDUCE_ADD_RMS_NORM as NORM

    world, staged = sim.world, []

    def chain(src, x, weight, h, n, eps, weight_last):  # every rank's partial equal to this one's
        h.copy_(x + src * world)
        n.copy_(reference.rms_norm(h, weight, eps, weight_last))

    monkeypatch.setattr(norm_epilogue, "all_reduce_add_rms_norm", lambda ws, partial, x, weight, h, n, eps, epoch, op,
                        weight_last=True: chain(partial, x, weight, h, n, eps, weight_last))

    def stand_in(lane, src, x, weight, h, n, eps, op_code, weight_last=True, tag=0):
        staged.append((lane, op_code))
        chain(src, x, weight, h, n, eps, weight_last)

    monkeypatch.setattr(norm_epilogue, "staged_add_rms_norm", stand_in)
    capturing = [False]
    _capturing(monkeypatch, capturing)

    def call(rows, capture):
        capturing[0] = capture
        a, b = torch.randn(rows, 6), torch.randn(6, 8)
        residual, weight = torch.randn(rows, 8), torch.randn(8)
        before = _ran(NORM.name)
        h, n = entry.run(NORM, NORM.Args(a, b, None, residual, weight, 1e-6, True, "0"), 0)
        ran = _changed(NORM.name, before)
        # (the fake group's all-reduce, under the unfused chain, returns this rank's partial)
        want_h = residual + (a @ b) * (1 if ran == ["nccl"] else world)
        torch.testing.assert_close(h, want_h)
        torch.testing.assert_close(n, reference.rms_norm(want_h, weight, 1e-6, True))
        return ran

    assert call(8, False) == ["one_shot"]  # eagerly, before any capture: the op's default path
    group = groups.get("0")
    buf = torch.zeros(wsmod.GRAPH_FLAG_BYTES + 2 * 4096, dtype=torch.uint8)
    group.lane = wsmod.GraphLane("0", sim.mine.rank, world, buf, torch.zeros(world, dtype=torch.int64), 4096, 132,
                                 err=group.err)
    assert call(8, True) == ["graph"] and staged == [(group.lane, OP_AR_NORM)]  # 256 bytes: in the lane
    assert next(reversed(group.decisions.values()))[:2] == ("graph", "capture")
    assert call(8, False) == ["graph"] and len(staged) == 2  # the lane replays: its eager twin takes it
    assert call(160, True) == ["nccl"]  # 5120 bytes: past this lane, the unfused chain
    assert call(160, False) == ["nccl"] and len(staged) == 2  # and its eager twin
