"""Which path a call takes: from the call's shapes, the group's agreed facts and the settings.

In order, the first that applies decides:

1. the group cannot run symmetric paths (one rank, ROCm, ranks on two hosts, no peer access,
   mixed GPUs): NCCL, with the reason logged once;
2. inside a CUDA-graph capture: the rules for captured calls (``mm_all_reduce@capture``: the graph
   lane, whose epochs live on the device), else NCCL;
3. a call that fits the group's graph lane once this process replays graphs on it: the lane (a
   rank re-warming its graphs eagerly must meet its peer's replays on the same flags, whatever
   ``COMMFUSE_ALGO`` says);
4. ``COMMFUSE_ALGO`` names a path of the op that supports the call: that path;
5. a tuned answer for the call's signature (``tuning.py``), kept unless it no longer supports it;
6. the first rule of the group's table (``rules.py``) that matches and whose path supports it;
7. the op's default path where it supports the call (``OpSpec.default_path``: an op that is in a
   graph only where the user asked for it; inside a capture, its graph-lane path);
8. NCCL.

What the graph lane changes (its path, the variant it takes, whether a replayed lane takes an
eager call) the capture module answers (``capture.Selection``), asked once per decision.

Every input is the same on every rank (shapes, agreed facts, settings that must be set alike, the
capture state that ranks share by capturing alike), so every rank decides alike.
"""

from __future__ import annotations

import dataclasses
import logging

from . import capture, rules
from .capture import LANES
from .facts import GroupFacts
from .paths import REGISTRY, by_op
from .paths.base import Call, Path
from .paths.common import first_time

log = logging.getLogger("commfuse")

#: Where a decision came from (the report and ``explain`` show it).
SOURCES = ("unsupported", "capture", "forced", "lane", "tuned", "rules", "fallback")


@dataclasses.dataclass(frozen=True)
class Decision:
    path: Path
    variant: dict | None
    source: str  # one of SOURCES
    reason: str = ""  # why NCCL, or the rule that matched
    table: str = ""  # the rules table consulted

    @property
    def name(self) -> str:
        return self.path.name


_warned: set[tuple] = set()


def _once(op: str, reason: str) -> None:
    if first_time(_warned, (op, reason)):
        log.warning("commfuse.%s: this call runs the unfused NCCL path (%s)", op, reason)


def _from_table(table, key: str, call: Call, facts: GroupFacts) -> tuple[rules.Rule | None, Path | None]:
    for rule in (table.rules(key) if table is not None else ()):
        if not rule.matches(call):
            continue
        path = REGISTRY.get((call.op, rule.path))
        if path is None:
            raise ValueError(f"commfuse rules: {table.label()} names a path {rule.path!r} that {call.op} does not have")
        if path.supports_variant(call, facts, rule.variant_dict) is None:
            return rule, path
    return None, None


def rules_choice(call: Call, facts: GroupFacts, capture: bool = False) -> Decision:
    """What the group's rules table picks for ``call`` (no forcing, no lane, no tuning)."""
    table = rules.table(facts.arch, facts.world, facts.name, facts.sms)
    key = f"{call.op}@capture" if capture else call.op
    rule, path = _from_table(table, key, call, facts)
    label = table.label() if table is not None else "no table"
    if path is None:
        reason = f"no rule of {label} applies"
        default = None
        if call.spec.default_path:  # an op the user asked for: its path where it takes the call
            default = LANES.get(call.op) if capture else REGISTRY.get((call.op, call.spec.default_path))
        if default is not None:
            why = default.supports(call, facts)
            if why is None:
                return Decision(default, None, "rules", f"{reason}: the op's default path", label)
            reason = f"{reason}, and the op's {default.name} path cannot take the call ({why})"
        return Decision(REGISTRY[(call.op, "nccl")], None, "fallback", reason, label)
    return Decision(path, rule.variant_dict, "rules", rule.describe(), label)


def ruled(call: Call, facts: GroupFacts) -> bool:
    """Whether a row of the group's rules table (not an op's default path) sends ``call`` to a
    symmetric path: what makes an opt-in pattern fuse without the user asking."""
    table = rules.table(facts.arch, facts.world, facts.name, facts.sms)
    _, path = _from_table(table, call.op, call, facts)
    return path is not None and path.symmetric


def choose(call: Call, facts: GroupFacts, *, capturing: bool = False, lane_bytes: int = 0,
           forced: str | None = None, tuned=None, quiet: bool = False) -> Decision:
    """The path ``call`` takes on a group with ``facts`` (module docstring). ``lane_bytes``: the
    group's graph-lane size once this process replays graphs on it, else 0. ``forced``:
    ``COMMFUSE_ALGO``. ``tuned()``: the tuner's answer for the call's signature, or None; asked
    only where steps 1-4 did not decide (it may tune, collectively). ``quiet``: log nothing (the
    graph pass sizing workspaces)."""
    op = call.op
    once = (lambda *_: None) if quiet else _once
    nccl = REGISTRY[(op, "nccl")]
    why = facts.unsupported()
    if why:
        once(op, why)
        return Decision(nccl, None, "unsupported", why)
    lane = capture.Selection(call, facts, lane_bytes, lambda: rules_choice(call, facts, capture=True))
    if capturing:
        decision = lane.rules
        answer = tuned() if tuned is not None else None
        if answer is not None and answer != decision.name:
            path = REGISTRY.get((op, answer))
            if path is not None and path.capture:
                variant = lane.variant(path)
                if path.supports_variant(call, facts, variant) is None:
                    return Decision(path, variant, "tuned", "tuned on this machine")
        if decision.path is nccl:
            # why the lane cannot take the call (past its bytes; for the add + norm chain, also rows
            # past the kernel's or another GPU), else the rules' reason
            reason = ((lane.path.supports(call, facts) or decision.reason) if lane.path is not None
                      else "no graph-lane path for this op yet")
            once(op, f"in a CUDA-graph capture: {reason}")
            return Decision(nccl, None, "capture", reason, decision.table)
        return dataclasses.replace(decision, source="capture")
    path = lane.replayed()
    if path is not None:
        return Decision(path, lane.variant(path), "lane", "fits the graph lane that captured graphs replay",
                        lane.rules.table)
    if forced:
        path = REGISTRY.get((op, forced))
        if path is not None:
            variant = lane.variant(path)  # the lane's own variant for the shape, as a capture takes it
            why = path.supports_variant(call, facts, variant)
            if why is None:
                return Decision(path, variant, "forced", f"COMMFUSE_ALGO={forced}")
            if not quiet and first_time(_warned, (op, forced, why)):
                log.warning("commfuse.%s: COMMFUSE_ALGO=%s cannot take this call (%s); its default path runs",
                            op, forced, why)
    answer = tuned() if tuned is not None else None
    if answer:
        path = REGISTRY.get((op, answer))
        if path is not None and path.supports(call, facts) is None:
            return Decision(path, lane.variant(path), "tuned", "tuned on this machine")
    decision = rules_choice(call, facts)
    if decision.path is nccl:
        once(op, decision.reason)
    return decision


def candidates(call: Call, facts: GroupFacts, capturing: bool = False) -> list[Path]:
    """The paths that may run ``call`` on this group, in registry order, NCCL first (the tuner's
    candidates: under a capture only those a capture can run)."""
    return [p for p in by_op(call.op)
            if (not capturing or p.capture) and p.supports(call, facts) is None]


def workspace_bytes(call: Call, facts: GroupFacts, forced: str | None = None, tuning: bool = False) -> int:
    """Per-parity symmetric bytes the path ``call`` takes needs (what the graph pass plans). With
    ``tuning`` (signatures tuned at their first use), the most any candidate needs at the largest M
    of the call's bucket, which the tuner times: the workspace then need not grow mid-run."""
    need = choose(call, facts, forced=forced, quiet=True).path.workspace_bytes(call)
    if tuning:
        top = dataclasses.replace(call, m=1 << max(0, call.m - 1).bit_length())
        need = max([need] + [p.workspace_bytes(top) for p in candidates(top, facts)])
    return need
