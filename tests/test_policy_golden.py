"""The policy with the ``sm_90`` rules reproduces the dispatch it replaced, call for call.

``tests/data/dispatch_golden.json`` holds the answers of the hand-written dispatch for 103,788
calls (each op; M from 1 to 32768; the ops benchmark's K and N and odd ones; fp16, bf16, fp32;
world 2, 4 and 8; the graph lane's size and the capture state; default settings on an H200 of
one host with peer access and TMA, the torch provider), recorded before it was replaced (its
header names the script and commit). For every call the policy must pick the same path and plan
the same workspace, and the graph lane must run the split-K kernel exactly where it did.

One planned difference: a call that runs NCCL plans no symmetric workspace (the dispatch planned
its partial's bytes, up to 1.4 GB for calls past the 1 GiB bound that then ran NCCL).

When the ``sm_90`` table is regenerated from new measurements, its answers may change: the test
then keeps checking the policy against the table's data (``test_rules.py``), and this file stays
the refactor's proof.
"""

from __future__ import annotations

import collections
import json
import pathlib

import pytest
import torch

from commfuse.env import ALGO_ALIASES
from commfuse.runtime import policy
from commfuse.runtime.facts import GroupFacts
from commfuse.runtime.paths import REGISTRY
from commfuse.runtime.paths.base import Call

GOLDEN = pathlib.Path(__file__).parent / "data" / "dispatch_golden.json"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _calls(doc):
    """Each recorded call: (op, m, k, n, dtype, world, inputs, answer, planned bytes or None,
    graph_split_k, its config) (the layout the header describes)."""
    for op, m, k, n, dtype, world, answers, plans, gsk, gsk_cfg in doc["rows"]:
        planned = {tuple(p): b for p, b in zip(doc["plans"][op], plans)}
        for variant, path in zip(doc["variants"][op], answers):
            inputs = dict(zip(doc["variant_fields"][op], variant))
            plan = None if inputs["capture"] else planned[tuple(inputs[f] for f in doc["plan_fields"][op])]
            path = ALGO_ALIASES.get(path, path)  # recorded under the paths' former names
            yield doc["ops"][op], m, k, n, DTYPES[dtype], world, inputs, path, plan, gsk, gsk_cfg


@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN.read_text())


def test_the_record_is_what_the_header_says(golden):
    assert golden["recorded_at_commit"].startswith("9de2b30")
    assert sum(1 for _ in _calls(golden)) == 103_788


def test_policy_reproduces_every_recorded_call(golden):
    facts = {w: GroupFacts.simulated(w) for w in (2, 4, 8)}  # an H200 group: one host, peer access, TMA
    mismatches = collections.Counter()
    examples = []
    checked = 0
    for op, m, k, n, dtype, world, inputs, answer, planned, gsk, gsk_cfg in _calls(golden):
        extra = {}
        if op != "mm_all_reduce":
            extra = dict(rows_dim=inputs["dim"], slabs=inputs["slabs"])
        call = Call(op, m, k, n, dtype, world, **extra)
        decision = policy.choose(call, facts[world], capturing=inputs["capture"],
                                 lane_bytes=inputs.get("lane_bytes", 0))
        got = decision.name
        if got != answer:
            mismatches[(op, "path", answer, got)] += 1
            examples.append((call.short(), inputs, answer, got))
        if got == "graph":  # the lane's kernel: split-K exactly where the dispatch ran it
            config = REGISTRY[(op, "graph")].config(call, facts[world], decision.variant)
            if (config is not None) != bool(gsk) or (config is not None and str(config) != gsk_cfg):
                mismatches[(op, "graph split-K", str(gsk_cfg), str(config))] += 1
        if planned is not None:
            # the planner sized calls without their slabs (0: unknown)
            plan_call = Call(op, m, k, n, dtype, world,
                             **({} if op == "mm_all_reduce" else dict(rows_dim=inputs["dim"],
                                                                     slabs=1 if inputs["dim"] == 0 else 0)))
            plan_path = policy.choose(plan_call, facts[world])
            want = 0 if plan_path.name == "nccl" else planned
            got_bytes = plan_path.path.workspace_bytes(plan_call)
            if got_bytes != want:
                mismatches[(op, "workspace", plan_path.name)] += 1
                examples.append((plan_call.short(), "workspace", want, got_bytes))
        checked += 1
    assert checked == 103_788
    assert not mismatches, f"{sum(mismatches.values())} mismatches: {mismatches.most_common(10)}; e.g. {examples[:10]}"
