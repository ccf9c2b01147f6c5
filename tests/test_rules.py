"""The rules data and the capability gates, on the CPU with GPUs simulated (``GroupFacts``).

The policy must read its choices from the data (a changed rule changes the answer), fall back to
the next rule where a path cannot run on a GPU (no TMA, no peer views), and run the unfused ops
with one reason wherever a group cannot run symmetric paths at all: ROCm, no peer access, ranks on
two hosts, mixed GPUs, one rank. Nothing here may raise on hardware the paths do not support.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from commfuse.runtime import policy, rules
from commfuse.runtime.facts import GroupFacts
from commfuse.runtime.paths import REGISTRY, by_op, names
from commfuse.runtime.paths.base import OPS, Call

BF16 = torch.bfloat16


def _call(op, m, k, n, world=2, dtype=BF16, **extra):
    return Call(op, m, k, n, dtype, world, **extra)


def test_every_rules_file_parses_and_names_known_paths():
    for path in sorted(rules.RULES_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        for table in rules.parse(data, path.name):
            for op, rule_list in table.ops.items():
                base = op.split("@")[0]
                assert base in OPS, (path.name, op)
                for rule in rule_list:
                    assert (base, rule.path) in REGISTRY, (path.name, op, rule.path)
                    for entry in rule.evidence:
                        assert "@" in entry and entry.split("@")[1], f"{path.name}: evidence {entry!r} is not path@commit"


def test_sm90_world2_is_measured_and_larger_worlds_are_marked_unmeasured():
    two, eight = rules.table("sm_90", 2), rules.table("sm_90", 8)
    assert two.measured and "H200" in two.measured
    assert eight.measured is None and "not yet measured" in eight.note
    assert rules.table("sm_90", 4) is eight


def test_malformed_rules_are_refused_with_their_place():
    bad = {"arch": "x", "tables": [{"world": [2], "ops": {"mm_all_reduce": [{"path": "fused", "when": {"m": 5}}]}}]}
    with pytest.raises(ValueError, match="m needs"):
        rules.parse(bad)
    no_tail = {"arch": "x", "tables": [{"world": [2], "ops": {"mm_all_reduce": [{"path": "fused", "when": {"m": [1, 2]}}]}}]}
    with pytest.raises(ValueError, match="must end with a rule without"):
        rules.parse(no_tail)
    unknown = {"arch": "x", "tables": [{"world": [2], "ops": {"mm_all_reduce": [{"path": "fused", "when": {"q": [1, 2]}}, {"path": "nccl"}]}}]}
    with pytest.raises(ValueError, match="unknown condition 'q'"):
        rules.parse(unknown)


def test_the_choice_comes_from_the_data(monkeypatch):
    facts = GroupFacts.simulated(2)
    call = _call("mm_all_reduce", 4096, 4096, 8192)
    assert policy.choose(call, facts).name == "fused"
    edited = {"arch": "sm_90", "tables": [{"world": [2], "measured": "test", "ops": {
        "mm_all_reduce": [{"path": "two_shot", "when": {"m": [4096, 4096]}}, {"path": "one_shot"}]}}]}
    monkeypatch.setattr(rules, "load", lambda arch: tuple(rules.parse(edited)))
    assert policy.choose(call, facts).name == "two_shot"
    assert policy.choose(_call("mm_all_reduce", 4097, 4096, 8192), facts).name == "one_shot"
    # an op the table leaves out runs NCCL
    assert policy.choose(_call("all_gather_mm", 4096, 4096, 4096), facts).name == "nccl"


def test_a_part_specific_table_wins_over_the_architecture(monkeypatch):
    data = {"arch": "sm_90", "tables": [
        {"world": [2], "parts": ["NVIDIA H100 PCIe"], "ops": {"mm_all_reduce": [{"path": "nccl"}]}},
        {"world": [2], "ops": {"mm_all_reduce": [{"path": "one_shot"}]}}]}
    monkeypatch.setattr(rules, "load", lambda arch: tuple(rules.parse(data)))
    call = _call("mm_all_reduce", 64, 4096, 4096)
    assert policy.choose(call, GroupFacts.simulated(2, name="NVIDIA H100 PCIe")).name == "nccl"
    assert policy.choose(call, GroupFacts.simulated(2, name="NVIDIA H200")).name == "one_shot"


# Capability gates: what each kind of GPU and group runs for a few representative calls.
SHAPES = [("mm_all_reduce", 16, 4096, 8192), ("mm_all_reduce", 4096, 4096, 8192), ("mm_all_reduce", 8192, 14336, 8192),
          ("all_gather_mm", 2048, 2048, 2048), ("all_gather_mm", 16384, 4096, 7168),
          ("mm_reduce_scatter", 1024, 1024, 1024), ("mm_reduce_scatter", 16384, 4096, 7168)]


#: What the conservative default table gives at 2 ranks (the paths that won on every shape they were
#: timed on): the split-K kernel for few rows where the GPU has TMA, else cuBLAS + one-shot; the
#: symmetric pull for the other two ops.
DEFAULT_AT_2 = {("mm_all_reduce", 16): "split_k", ("mm_all_reduce", 4096): "one_shot",
                ("mm_all_reduce", 8192): "one_shot", ("all_gather_mm", 2048): "pull",
                ("all_gather_mm", 16384): "pull", ("mm_reduce_scatter", 1024): "pull",
                ("mm_reduce_scatter", 16384): "pull"}


@pytest.mark.parametrize("op,m,k,n", SHAPES)
def test_sm80_steps_aside_from_tile_kernels(op, m, k, n):
    """An A100 has no TMA: the tile kernels (fused, split-K) are never chosen, not even forced; with
    no sm_80 table the conservative default applies, the next rule where a path cannot run."""
    facts = GroupFacts.simulated(2, arch="sm_80", name="NVIDIA A100-SXM4-80GB", sms=108)
    call = _call(op, m, k, n)
    for name in ("fused", "split_k"):
        if (op, name) in REGISTRY:
            assert "TMA" in REGISTRY[(op, name)].supports(call, facts)
    want = DEFAULT_AT_2[(op, m)]
    want = "one_shot" if want == "split_k" else want  # no TMA: the next rule
    assert policy.choose(call, facts).name == want
    assert policy.choose(call, facts, forced="fused").name == want  # forcing falls back, never fails
    assert policy.choose(_call(op, m, k, n, world=4), GroupFacts.simulated(4, arch="sm_80", sms=108)).name == "nccl"


@pytest.mark.parametrize("op,m,k,n", SHAPES)
def test_sm100_without_a_table_runs_the_documented_default(op, m, k, n):
    facts = GroupFacts.simulated(2, arch="sm_100", name="NVIDIA B200", sms=148)
    assert rules.table("sm_100", 2).arch == "default"
    assert policy.choose(_call(op, m, k, n), facts).name == DEFAULT_AT_2[(op, m)]
    # nothing measured at more ranks there: NCCL
    assert policy.choose(_call(op, m, k, n, world=8), GroupFacts.simulated(8, arch="sm_100", sms=148)).name == "nccl"


@pytest.mark.parametrize("facts,why", [
    (GroupFacts.simulated(2, peer_access=False), "cannot access"),
    (GroupFacts.simulated(2, peers_visible=False), "CUDA_VISIBLE_DEVICES"),
    (GroupFacts.simulated(2, one_host=False), "more than one host"),
    (GroupFacts.simulated(2, arch="gfx942", name="AMD Instinct MI300X", sms=304, rocm=True), "ROCm"),
    (GroupFacts.simulated(2, arch="mixed"), "differ"),
    (GroupFacts.simulated(1), "one rank"),
], ids=["no-peer-access", "hidden-peers", "two-hosts", "rocm", "mixed", "one-rank"])
def test_groups_that_cannot_run_symmetric_paths_run_nccl_with_one_logged_reason(facts, why, caplog):
    policy._warned.clear()
    with caplog.at_level(logging.WARNING, logger="commfuse"):
        for op, m, k, n in SHAPES * 3:
            d = policy.choose(_call(op, m, k, n, world=facts.world), facts, forced="fused")
            assert d.name == "nccl" and why in d.reason
            for path in by_op(op):
                if path.symmetric:
                    assert path.supports(_call(op, m, k, n, world=facts.world), facts)
    lines = [r.getMessage() for r in caplog.records if why in r.getMessage()]
    assert len(lines) == len({s[0] for s in SHAPES}), lines  # once per op and reason, not per call


def test_iris_provider_has_no_copy_engine_paths():
    facts = GroupFacts.simulated(2, provider="iris")
    call = _call("mm_all_reduce", 8192, 14336, 8192)
    assert "per-peer views" in REGISTRY[("mm_all_reduce", "ce_overlap")].supports(call, facts)
    assert policy.choose(call, facts).name != "ce_overlap"  # the next rule that applies
    rs = _call("mm_reduce_scatter", 16384, 4096, 7168)
    assert policy.choose(rs, facts).name == "fused"


def test_capture_takes_only_paths_a_capture_can_run():
    facts = GroupFacts.simulated(2)
    for op, m, k, n in SHAPES:
        d = policy.choose(_call(op, m, k, n), facts, capturing=True)
        assert d.path.capture, (op, d.name)
    small = policy.choose(_call("mm_all_reduce", 16, 4096, 8192), facts, capturing=True)
    assert small.name == "graph" and small.variant == {"split_k": True}
    big = policy.choose(_call("mm_all_reduce", 8192, 4096, 8192), facts, capturing=True)
    assert big.name == "nccl" and "COMMFUSE_GRAPH_BYTES" in big.reason
    assert all(p.capture for p in policy.candidates(_call("mm_all_reduce", 16, 4096, 8192), facts, capturing=True))


def test_candidates_always_include_nccl_and_only_supported_paths():
    for facts in (GroupFacts.simulated(2), GroupFacts.simulated(4, arch="sm_80", sms=108)):
        for op, m, k, n in SHAPES:
            call = _call(op, m, k, n, world=facts.world)
            cands = policy.candidates(call, facts)
            assert cands[0].name == "nccl"
            assert all(p.supports(call, facts) is None for p in cands)


def test_registry_names_match_what_commfuse_algo_takes():
    from commfuse import env

    assert set(names()) == set(env.ALGOS)


def test_tuning_plans_the_workspace_of_every_candidate_at_the_bucket_top():
    """With tuning at first use, the graph pass plans what the largest candidate of the call's M
    bucket needs, so tuning new buckets does not grow the workspace mid-run."""
    facts = GroupFacts.simulated(2)
    call = _call("mm_all_reduce", 3000, 4096, 8192)
    plain = policy.workspace_bytes(call, facts)
    tuned = policy.workspace_bytes(call, facts, tuning=True)
    top = _call("mm_all_reduce", 4096, 4096, 8192)
    assert tuned == max(p.workspace_bytes(top) for p in policy.candidates(top, facts)) and tuned >= plain
    assert tuned > plain  # the fused kernel's slabs at 4096 rows exceed the one-shot's 3000-row partial


def test_gpus_are_named_by_uuid_not_index(monkeypatch):
    """With per-rank ``CUDA_VISIBLE_DEVICES`` every rank's GPU is index 0: the facts name a GPU by
    its UUID (else its PCI location), so one GPU has one name in every process and two GPUs two."""
    import types

    from commfuse.runtime import facts as facts_mod

    props = {0: types.SimpleNamespace(uuid="GPU-aaaa"), 1: types.SimpleNamespace(uuid="GPU-bbbb"),
             2: types.SimpleNamespace(uuid="GPU-aaaa"),
             3: types.SimpleNamespace(uuid="", pci_domain_id=0, pci_bus_id=0x19, pci_device_id=0),
             4: types.SimpleNamespace(uuid="", pci_domain_id=0, pci_bus_id=0x3b, pci_device_id=0)}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    ids = [facts_mod._gpu_id(i) for i in range(5)]
    assert ids[0] == ids[2] != ids[1]  # the same GPU seen at two indices; another GPU
    assert ids[3] != ids[4] and len({ids[0], ids[1], ids[3]}) == 3
