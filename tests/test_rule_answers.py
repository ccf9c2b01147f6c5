"""The shipped rules' answers over a fixed grid of calls, as ``runtime/rule_answers.py`` recorded
them. A new sweep that changes the tables changes this data on purpose: regenerate it with
``python -m commfuse.runtime.rule_answers`` and review the diff."""

from __future__ import annotations

import json

from commfuse.runtime import rule_answers


def test_the_shipped_rules_give_the_recorded_answers():
    recorded = json.loads(rule_answers.ANSWERS.read_text())
    now = rule_answers.answers()
    assert set(now) == set(recorded), "the grid changed: python -m commfuse.runtime.rule_answers"
    changed = {k: (recorded[k], now[k]) for k in recorded if recorded[k] != now[k]}
    assert not changed, (f"{len(changed)} answers differ from rules/answers/shipped.json (e.g. "
                         f"{list(changed.items())[:5]}); if the rules changed on purpose, regenerate it: "
                         "python -m commfuse.runtime.rule_answers")


def test_the_snapshot_covers_every_op_world_and_the_capture_state():
    recorded = json.loads(rule_answers.ANSWERS.read_text())
    for op in ("mm_all_reduce", "all_gather_mm", "mm_reduce_scatter"):
        for world in rule_answers.WORLDS:
            assert any(k.split()[1] == op and f" w{world}" in k for k in recorded)
    assert any(k.endswith(" capture") and v.startswith("graph") for k, v in recorded.items())
    assert any(v.startswith("fused") for v in recorded.values())
