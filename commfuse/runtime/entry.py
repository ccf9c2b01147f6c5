"""Where a ``torch.ops.commfuse`` call enters the run-time: its group, its checks, its path.

For every call, in order:

1. the group's state (``groups.get``: a re-created group under an old name starts afresh) and
   any timeout its kernels reported since the last call (``errors.check``);
2. what capture changes about the call (``capture.at_call``, asked once): the eager twin of a
   call a CUDA-graph capture sent to NCCL runs NCCL, with nothing before it (a rank re-warming
   its graphs meets its peer's replays, which hold no agreement), and so does every check below
   for a call that takes a replayed graph lane;
3. at the group's first call, and at its first after a setting changed, the ranks compare the
   settings they must set alike (``alike.py``: through the group's store, no collective); then,
   with ``COMMFUSE_VERIFY``, every rank checks it makes the same call, from the same call site
   (``verify.py``);
4. the call's plan, decided once per signature and kept (``Plan``): the group's agreed facts
   (a collective on its first call), whether every rank has the same rank-local size
   (``shards.py``), the path (``policy.py``) and its configuration;
5. the path runs, with the plan's context for the call's site (with ``COMMFUSE_PAIRING_CHECK``
   the site is part of the call's pairing tag: ``Plan.at``).

A plan is kept in its group's state (``groups.Group.plans``), per (op, shapes, dtype, device,
capture state), and dropped whenever what it was decided from changes (``counters.generation``:
facts agreed, a capture recorded, a group re-created, settings changed), so a call whose
signature repeats pays a dictionary lookup for its decisions, not their work. The group's state
also keeps the latest decision per call, which the report shows (``groups.decisions``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .. import env
from ..kernels import launch
from . import alike, capture, counters, errors, groups, policy, running, shards, tuning, verify
from .counters import PATHS, ran
from .facts import GroupFacts
from .paths import REGISTRY
from .paths.base import Context, make_context, pairing_tag
from .spec import Call, OpSpec

#: Plans a group keeps (one per call signature); all dropped when full, as dynamic shapes make new ones.
PLAN_LIMIT = 1024
#: Decisions a group keeps for the report (the latest per call signature), the oldest dropped first.
DECISION_LIMIT = 1024


#: Contexts a plan keeps per call site (``Plan.at``); all dropped when full.
SITE_LIMIT = 256


@dataclasses.dataclass
class Plan:
    call: Call
    decision: policy.Decision
    context: Context
    generation: int
    #: what runs the decided path (``running.runner``)
    run: Any
    #: site -> the context with that site's pairing tag (the plan is kept per signature, and many
    #: sites share one: every layer's o_proj)
    sites: dict = dataclasses.field(default_factory=dict, repr=False)
    #: the op and path's key in ``counters.PATHS`` (what ``counters.ran`` counts)
    counted: str = ""

    def at(self, site: int) -> Context:
        """The context a call from ``site`` runs with: the plan's own, but with the pairing check
        on a tag that names the site too (``base.pairing_tag``), so that calls alike in every size
        but made from different sites of a program do not pair unnoticed."""
        ctx = self.context
        if not site or not ctx.tag:
            return ctx
        sited = self.sites.get(site)
        if sited is None:
            if len(self.sites) >= SITE_LIMIT:
                self.sites.clear()
            sited = self.sites[site] = dataclasses.replace(
                ctx, tag=pairing_tag(self.call, self.decision.path.name, site))
        return sited


#: The run-time must-be-alike settings the kept tuners were made under.
_tuned_under: tuple = env.current().alike(compile=False)


def forget() -> None:
    """Drop every kept plan (the settings changed, or tests), and the tuners if a must-be-alike
    setting changed; the groups' buffers take the wait bound in force.

    A new tuner agrees on its cache with a collective. A must-be-alike setting changed on one rank
    only is an error at the group's next call, before any collective (``alike.agree_at_call``);
    a setting that may differ (logging, the wait bound) changed on one rank must start none, so
    the tuners, and the cache their ranks agreed on, are kept across those changes."""
    global _tuned_under
    for group in groups.all_groups():
        group.plans.clear()
    settings = env.current()
    if settings.alike(compile=False) != _tuned_under:
        _tuned_under = settings.alike(compile=False)
        tuning.forget()
    counters.bump()
    launch.configure(settings.fast_launch)
    bound = int(settings.timeout_s * 1e9)
    for group in groups.all_groups():
        if group.tuning_timeout_ns is None:
            for buf in group.buffers():
                buf.timeout_ns = bound


env.on_change(forget)
launch.configure(env.current().fast_launch)


def _plan(group, op: str, call: Call, own_size: int, device: torch.device, capturing: bool, lane_bytes: int
          ) -> Plan:
    """``lane_bytes``: the group's replayed graph lane's size (``capture.at_call``), else 0. An
    eager call that takes it may meet a peer's replays, which join no check (``_enter``), so
    ``COMMFUSE_VERIFY`` does not make it agree on sizes."""
    meets_replays = call.spec.graph_lane and 0 < call.exchanged_bytes <= lane_bytes
    facts = groups.group_facts(group, device, capturing)
    if facts is None:  # a group's first call inside a capture: nothing can be agreed there
        facts = GroupFacts(group.world, "unknown", "unknown", 0)
        decision = policy.Decision(REGISTRY[(op, "nccl")], None, "capture",
                                   "the group's first call is inside a CUDA-graph capture")
    elif group.world > 1 and facts.unsupported() is None and not shards.alike(
            group, op, own_size, device, capturing, verify.enabled() and not meets_replays):
        decision = policy.Decision(REGISTRY[(op, "nccl")], None, "unsupported",
                                   "the ranks' own sizes differ (an unevenly sharded dimension)")
    else:
        settings = env.current()
        decision = policy.choose(call, facts, capturing=capturing, lane_bytes=lane_bytes, forced=settings.algo,
                                 tuned=lambda: tuning.answer(group, call, facts, device, capturing))
    return Plan(call, decision, make_context(call, facts, group, decision.path, decision.variant), counters.generation,
                running.runner(decision.path), counted=f"{op}:{decision.name}")


def _decide(group, op: str, key: tuple, shapes: tuple, call_of, own_size: int, device: torch.device,
            capturing: bool, lane_bytes: int) -> Plan:
    """The group's kept plan for this signature, or a new one (collectives where it must agree)."""
    plans = group.plans
    plan = plans.get(key)
    if plan is not None and plan.generation == counters.generation:
        return plan
    call = call_of()
    plan = _plan(group, op, call, own_size, device, capturing, lane_bytes)
    if capturing:
        capture.record(group, op, shapes, plan.decision.name)
    # an op whose sizes differ agrees on every call, and so does every call with COMMFUSE_VERIFY
    if op not in group.uneven_ops and not verify.enabled():
        if len(plans) >= PLAN_LIMIT:
            plans.clear()
        plans[key] = plan
    _remember(call, group, plan.decision)
    return plan


def _remember(call: Call, group, decision: policy.Decision) -> None:
    decisions = group.decisions
    sig = call.short()
    decisions.pop(sig, None)
    if len(decisions) >= DECISION_LIMIT:
        decisions.popitem(last=False)
    decisions[sig] = (decision.name, decision.source, decision.reason)


def _enter(op: str, group_name: str, key: tuple, lane_bytes: int, shared, world_size: int = 0, site: int = 0
           ) -> tuple[Any, bool, bool, int]:
    """Steps 1-3: (group, capturing, twin: run NCCL with nothing before it, the group's replayed
    lane bytes). ``lane_bytes``: the bytes the call would take of a graph lane (0: its op has
    none). ``shared()``: what of the call every rank shares (not the rank-local size of an
    unevenly sharded dimension), for ``verify``, which also compares the call's ``site``."""
    group = groups.get(group_name)
    if world_size and world_size != group.world:  # a group re-created under its name with other ranks
        raise RuntimeError(f"commfuse.{op}: the graph's collective spans {world_size} ranks but group "
                           f"{group_name!r} has {group.world}")
    if group.err_host[0]:
        errors.check(group, op)
    if groups._held:
        errors.check_held(op)
    if group.broken:
        raise RuntimeError(group.broken)
    capturing, twin, replayed = capture.at_call(group, op, key)
    if twin:
        return group, capturing, True, replayed
    if not capturing and not 0 < lane_bytes <= replayed:
        if group.settings_of is not env.current():  # first call, or settings changed: agree first
            alike.agree_at_call(group, op)
        if verify.enabled():
            verify.same_call(group, op, group.calls, site=site, **shared())
        group.calls += 1
    return group, capturing, False, replayed


def run(spec: OpSpec, args, site: int = 0):
    """One call of ``spec``'s op on CUDA, ``args`` its argument tuple (``spec.Args``; the op library
    validated them): steps 1-5 of the module docstring. ``site``: the call site (``ops/library.py``)."""
    op = spec.name
    shapes = spec.key(args)
    lane_bytes = spec.lane_bytes(args) if spec.graph_lane else 0
    group, capturing, twin, replayed = _enter(op, args.group_name, shapes, lane_bytes, lambda: spec.shared(args),
                                              spec.world_size(args), site)
    if twin:
        ran(op, "nccl")
        return spec.run_nccl(args)
    device = args[0].device
    key = (op, *shapes, args.bias is not None, device.index, capturing)
    plan = _decide(group, op, key, shapes, lambda: spec.call(args, group.world), spec.own_size(args), device,
                   capturing, replayed)
    PATHS[plan.counted] += 1  # (``counters.ran``: the path the call took)
    return plan.run(plan.decision.path, plan.at(site), args)


def reference_call(spec: OpSpec, args, compute, site: int = 0):
    """A call on a device without symmetric paths (the CPU, gloo, the fake backend): the group's
    call count and ``COMMFUSE_VERIFY`` as on CUDA, then the unfused computation ``compute()``."""
    _enter(spec.name, args.group_name, (), 0, lambda: spec.shared(args), spec.world_size(args), site)
    return compute()


__all__ = ["Plan", "forget", "reference_call", "run"]
