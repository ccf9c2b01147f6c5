"""``runtime/policy.py`` against small synthetic rule tables: what the policy does with any table,
not what today's measured table says (``test_rule_answers.py`` snapshots that)."""

from __future__ import annotations

import pytest
import torch

from commfuse.runtime import policy, rules
from commfuse.runtime.facts import GroupFacts
from commfuse.runtime.spec import Call

BF16, F32 = torch.bfloat16, torch.float32
FACTS = GroupFacts.simulated(2)


@pytest.fixture
def table(monkeypatch):
    """Install ``ops`` as the only table of every architecture at every world size."""
    def install(ops: dict, world=(2, 4, 8)):
        data = {"arch": "test", "tables": [{"world": list(world), "measured": "synthetic", "ops": ops}]}
        monkeypatch.setattr(rules, "load", lambda arch: tuple(rules.parse(data)))
    return install


def ar(m, k=4096, n=4096, dtype=BF16, world=2):
    return Call("mm_all_reduce", m, k, n, dtype, world)


def test_the_first_matching_rule_wins(table):
    table({"mm_all_reduce": [{"path": "one_shot", "when": {"m": [None, 128]}},
                             {"path": "two_shot", "when": {"elems": [None, 1 << 24]}},
                             {"path": "ce_overlap"}]})
    assert policy.choose(ar(64), FACTS).name == "one_shot"
    assert policy.choose(ar(129), FACTS).name == "two_shot"
    assert policy.choose(ar(4097), FACTS).name == "ce_overlap"
    decision = policy.choose(ar(64), FACTS)
    assert decision.source == "rules" and decision.table.startswith("test")


def test_a_rule_whose_path_cannot_take_the_call_passes_to_the_next(table):
    table({"mm_all_reduce": [{"path": "fused"}, {"path": "one_shot"}]})
    assert policy.choose(ar(4096), FACTS).name == "fused"
    assert policy.choose(ar(4096, dtype=F32), FACTS).name == "one_shot"  # the tile kernels take 16-bit
    no_tma = GroupFacts.simulated(2, arch="sm_80", sms=108)
    assert policy.choose(ar(4096), no_tma).name == "one_shot"


@pytest.mark.parametrize("when, hit, miss", [
    ({"k_le_m": True}, ar(4096, k=4096), ar(1024, k=4096)),
    ({"bytes": [None, 1 << 20]}, ar(128, n=4096), ar(256, n=4096)),
    ({"shard_mnk": [1 << 30, None]}, ar(1024, 4096, 4096), ar(64, 4096, 4096)),
])
def test_each_condition_reads_the_call(table, when, hit, miss):
    table({"mm_all_reduce": [{"path": "two_shot", "when": when}, {"path": "one_shot"}]})
    assert policy.choose(hit, FACTS).name == "two_shot"
    assert policy.choose(miss, FACTS).name == "one_shot"


def test_rows_dim_tells_the_row_layouts_apart(table):
    table({"all_gather_mm": [{"path": "ce_overlap", "when": {"rows_dim": 0}}, {"path": "pull"}]})
    rows = Call("all_gather_mm", 4096, 4096, 4096, BF16, 2)
    batch = Call("all_gather_mm", 4096, 4096, 4096, BF16, 2, rows_dim=1, slabs=2)
    assert policy.choose(rows, FACTS).name == "ce_overlap"
    assert policy.choose(batch, FACTS).name == "pull"


def test_an_op_the_table_leaves_out_runs_nccl(table):
    table({"mm_all_reduce": [{"path": "one_shot"}]})
    decision = policy.choose(Call("mm_reduce_scatter", 4096, 4096, 4096, BF16, 2), FACTS)
    assert decision.name == "nccl" and decision.source == "fallback"


def test_captured_calls_read_the_capture_rules(table):
    table({"mm_all_reduce": [{"path": "one_shot"}],
           "mm_all_reduce@capture": [{"path": "graph", "when": {"m": [None, 32]}, "variant": {"split_k": True}},
                                     {"path": "graph"}]})
    small = policy.choose(ar(16), FACTS, capturing=True)
    assert small.name == "graph" and small.source == "capture" and small.variant == {"split_k": True}
    assert policy.choose(ar(256), FACTS, capturing=True).variant is None
    too_big = ar(1 << 15, n=1 << 14)  # past the lane
    assert policy.choose(too_big, FACTS, capturing=True).name == "nccl"
    # an op without capture rules: NCCL in a capture, whatever its eager rules say
    table({"all_gather_mm": [{"path": "pull"}]})
    assert policy.choose(Call("all_gather_mm", 64, 64, 64, BF16, 2), FACTS, capturing=True).name == "nccl"


def test_an_eager_call_that_fits_a_replayed_lane_takes_it(table):
    table({"mm_all_reduce": [{"path": "one_shot"}],
           "mm_all_reduce@capture": [{"path": "graph", "variant": {"split_k": True}}]})
    lane = FACTS.lane_bytes
    decision = policy.choose(ar(16), FACTS, lane_bytes=lane, forced="two_shot", tuned=lambda: "two_shot")
    assert decision.name == "graph" and decision.source == "lane" and decision.variant == {"split_k": True}
    assert policy.choose(ar(16), FACTS).name == "one_shot"  # no replays on the group: the rules


def test_forcing_and_tuning_come_before_the_rules_where_they_can_take_the_call(table):
    table({"mm_all_reduce": [{"path": "one_shot"}]})
    assert policy.choose(ar(4096), FACTS, forced="two_shot").source == "forced"
    assert policy.choose(ar(4096, dtype=F32), FACTS, forced="fused").name == "one_shot"  # cannot: the rules
    tuned = policy.choose(ar(4096), FACTS, tuned=lambda: "ce_overlap")
    assert (tuned.name, tuned.source) == ("ce_overlap", "tuned")
    assert policy.choose(ar(4096, dtype=F32), FACTS, tuned=lambda: "fused").name == "one_shot"
    asked = []
    policy.choose(ar(4096), FACTS, forced="two_shot", tuned=lambda: asked.append(1))
    assert not asked  # a forced path decides first: nothing is tuned


def test_a_group_that_cannot_run_symmetric_paths_runs_nccl_whatever_the_table(table):
    table({"mm_all_reduce": [{"path": "one_shot"}]})
    decision = policy.choose(ar(64), GroupFacts.simulated(2, peer_access=False), forced="one_shot")
    assert (decision.name, decision.source) == ("nccl", "unsupported")


def test_a_rule_naming_a_path_the_op_lacks_is_an_error(table):
    table({"mm_all_reduce": [{"path": "no_such_path"}]})
    with pytest.raises(ValueError, match="no_such_path"):
        policy.choose(ar(64), FACTS)


def test_former_path_names_are_read_as_the_paths_names_now(table):
    """Rules data written with a former name (``symm``, the all-gather's ``overlap``) still reads."""
    table({"all_gather_mm": [{"path": "overlap", "when": {"rows_dim": 0}}, {"path": "symm"}]})
    rows = Call("all_gather_mm", 4096, 4096, 4096, BF16, 2)
    assert policy.choose(rows, FACTS).name == "ce_overlap"
    assert policy.choose(Call("all_gather_mm", 4096, 4096, 4096, BF16, 2, rows_dim=1, slabs=2), FACTS).name == "pull"
