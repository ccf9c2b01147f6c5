"""The post-grad pass that rewrites matched matmul/collective pairs into ``torch.ops.commfuse`` ops.

It runs as Inductor's ``post_grad_custom_post_pass`` (after Inductor's own patterns and
``_micro_pipeline_tp``), on the functional post-grad graphs of forward and backward. It decides
from shapes, dtypes, groups and module metadata only, never rank-local state, so every rank
compiles the same graph; of the shapes, only the sizes every rank shares (a shard's K or N may
differ between ranks where a layer is sharded unevenly: ``patterns.common.SHARDED_DIM``).

Each fused call gets a call site (``number_sites``): a number, the same on every rank for the same
program, that ``COMMFUSE_VERIFY`` and the pairing check compare, so a rank that skipped a call is
found even where the calls around it look alike.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import pathlib
import zlib
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.distributed.distributed_c10d import _resolve_process_group

try:  # torch >= 2.12 has a common base for graph and scheduler passes
    from torch._inductor.custom_graph_pass import CustomPassBase
except ImportError:  # torch 2.11
    CustomPassBase = CustomGraphPass
from torch._inductor.pattern_matcher import stable_topological_sort

from .. import env, ops, patterns  # noqa: F401  (ops: registers torch.ops.commfuse before any rewrite)
from ..config import Settings
from . import alike
from ..exclusion import any_instance_excluded, module_stack, unmatched_names
from ..patterns import merge_sums
from ..runtime import plans, policy, rules
from ..runtime.facts import local_facts
from ..runtime.spec import SPECS, Call
from ..patterns.common import SCALED_MM, Skip, graph_label, is_call, is_rowwise, mnk, matmul_operands, val
from ..patterns.common import arg as read_arg
from ..report import MatchRecord, configure_logging, log, note, record

_graph_numbers = itertools.count()
#: Each fused op's node target and its spec (``runtime/spec.py``).
_SPECS = {getattr(torch.ops.commfuse, spec.name).default: spec for spec in SPECS.values()}
_FUSED_OPS = tuple(_SPECS)
#: Where each fused op takes its group name, and its call site (its last argument).
_GROUP_ARG = {target: [a.name for a in spec.args].index("group_name") for target, spec in _SPECS.items()}
_SITE_ARG = {target: len(spec.args) for target, spec in _SPECS.items()}


@functools.lru_cache(1)
def _source_hash() -> str:
    """Hash of every source and rules file of the package: any change to the pass, or to the rules
    that size its workspaces, invalidates the cache."""
    root = pathlib.Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    digest.update(rules.data_hash().encode())
    return digest.hexdigest()


def _describe(pattern, label: str, anchor: fx.Node, mm: fx.Node | None, fused: bool, reason: str) -> MatchRecord:
    """The record of one candidate of ``pattern`` (a module of ``patterns/``); an FP8 candidate (a
    ``_scaled_mm``) is named by its FP8 op and its dtype reads ``operand->output``."""
    shape = dtype = module = None
    name = pattern.NAME
    if is_call(mm, (SCALED_MM,)):  # (a pattern without an FP8 form names it by its own name)
        name = getattr(pattern, "ROWWISE_NAME" if is_rowwise(mm) else "FP8_NAME", name)
    if mm is not None:
        try:
            a, b, _ = matmul_operands(mm)
            shape, dtype = mnk(a, b), str(val(a).dtype).replace("torch.", "")
            if name != pattern.NAME:
                dtype += "->" + str(read_arg(mm, 6, "out_dtype", None) or val(a).dtype).replace("torch.", "")
        except Skip:
            pass
        stack = module_stack(mm)
        module = stack[-1][0] if stack else None
    group = anchor.kwargs.get("group_name", anchor.args[-1])  # the last argument of every anchor
    return MatchRecord(name, label, anchor.name, mm.name if mm is not None else None,
                       fused, reason, shape, dtype, str(group), module)


def _describe_merge(label: str, merged) -> MatchRecord:
    terms, first = merged.terms, merged.terms[0]
    ks = [t.a.shape[1] for t in terms]
    stacks = [module_stack(t.mm) for t in terms]
    modules = ",".join(s[-1][0] for s in stacks if s) or None
    what = "all-reduced partials" if first.collective is not None else "partials of one reduction"
    return MatchRecord(merge_sums.NAME, label, merged.collective, "+".join(t.names[0] for t in terms), True,
                       f"merged {len(terms)} {what} (K={'+'.join(map(str, ks))})",
                       (first.a.shape[0], sum(ks), first.b.shape[1]), str(first.a.dtype).replace("torch.", ""),
                       merged.group, modules)


def rewrite(graph: fx.Graph, settings: Settings) -> int:
    """Apply every enabled pattern to ``graph``; record each candidate. Returns how many rewrites
    (fusions and merged sums) were made."""
    label = graph_label(graph, next(_graph_numbers))
    env.validate()  # a malformed setting fails here, named, not inside a rewrite or a collective call
    configure_logging()  # COMMFUSE_LOG set after the import
    log.debug("pass on %s: %d nodes", label, len(graph.nodes))
    for pattern, close in unmatched_names(graph.nodes, settings):
        hint = f"close module names: {', '.join(close)}" if close else "names are relative to the compiled module"
        note(f"{label}: exclude pattern {pattern!r} matched no module of this graph ({hint})", logging.WARNING)
    fused = candidates = 0
    if merge_sums.enabled(settings):
        try:
            merges = merge_sums.merge(graph, settings)
        except Exception as exc:  # the graph may be half rewritten: stop with a clear error, not run it
            raise RuntimeError(f"commfuse: merging sums of matmul partials failed in {label} ({type(exc).__name__}: "
                               f"{exc}); COMMFUSE_MERGE_SUMS=0 (or patterns= without 'merge_sums') turns it off"
                               ) from exc
        for merged in merges:
            record(_describe_merge(label, merged))
            fused += 1
            candidates += 1
    for pattern in patterns.ALL:
        # an opt-in pattern the settings do not name: skipped, unless a rules row may ask for it
        # (its match then decides), with no report entry for every collective of the graph
        unasked_opt_in = getattr(pattern, "OPT_IN", False) and pattern.NAME not in settings.patterns
        if unasked_opt_in and not rules.may_ask_for(pattern.NAME):
            continue
        anchors = [n for n in graph.nodes if n.op == "call_function" and n.target in pattern.ANCHORS]
        candidates += len(anchors)
        for anchor in anchors:
            if pattern.NAME not in settings.patterns and not unasked_opt_in:
                reason = f"pattern {pattern.NAME} is disabled in this backend's settings"
                record(_describe(pattern, label, anchor, None, False, reason))
                continue
            try:
                match = pattern.MATCH.from_anchor(anchor, settings)
            except Skip as exc:
                record(_describe(pattern, label, anchor, exc.mm, False, str(exc)))
                continue
            except Exception as exc:  # a graph form the matcher did not foresee: leave it unfused
                log.warning("commfuse: could not analyse %s at %s (%s: %s); left unfused",
                            pattern.NAME, anchor.name, type(exc).__name__, exc)
                reason = f"commfuse could not analyse this graph form ({type(exc).__name__}: {exc})"
                record(_describe(pattern, label, anchor, None, False, reason))
                continue
            if match.scaled is not None and "fp8" not in settings.patterns:
                reason = "pattern fp8 (the _scaled_mm forms) is disabled in this backend's settings"
                record(_describe(pattern, label, anchor, match.mm, False, reason))
                continue
            rec = _describe(pattern, label, anchor, match.mm, True, "fused")
            match.replace(graph)
            record(rec)
            fused += 1
    if not candidates:
        note(f"{label}: {_why_no_candidates(graph)}")
    if fused:
        stable_topological_sort(graph)
        number_sites(graph, label)
        graph.lint()
        for group, nbytes in workspace_plan(graph).items():
            plans.register(group, nbytes)
        alike.warn_unagreed((n.args[_GROUP_ARG[n.target]] for n in graph.nodes
                             if n.op == "call_function" and n.target in _FUSED_OPS), settings, label)
    return fused


def number_sites(graph: fx.Graph, label: str) -> None:
    """Give every fused call of ``graph`` its call site (the ops' ``site`` argument): a hash of
    the graph's kind (forward or backward) and of its fused calls in order (each its op and its
    arguments that are neither tensors, sizes, its group nor its site: whether it adds a bias, the
    gather or scatter dimension, the world size), and of the call's place among them.

    Only what Inductor's FX graph cache key covers goes in (the graph's code), so a graph loaded
    from that cache carries the sites this process would have given it, and ranks whose caches
    hold different graphs still number the same program alike. Module names are not in the key
    (they are node metadata), so they name a site in messages (``plans.name_site``) but never
    feed its number. Nothing rank-local goes in either: no shapes, which an uneven shard makes
    differ, no group or node names, no compile counters. Two calls of one graph get other
    numbers; graphs whose fused calls are alike in op, order and these arguments (the same block
    compiled for several layers, or two modules with the same collectives) share their sites:
    there the call count and the sizes (K in the pairing tag) tell them apart."""
    nodes = [n for n in graph.nodes if n.op == "call_function" and n.target in _FUSED_OPS]
    kind = label.split("#")[0]  # forward or backward (the number is this process's count)
    calls = ";".join(_site_part(n) for n in nodes)
    for i, node in enumerate(nodes):
        site = 1 + zlib.crc32(f"{kind}|{calls}|{i}".encode()) % ((1 << 31) - 1)
        at = _SITE_ARG[node.target]
        node.args = (*node.args[:at], site)
        stack = module_stack(node)
        module = stack[-1][0] if stack else ""
        plans.name_site(site, f"{label} {node.name}" + (f" in {module}" if module else ""))


def _site_part(node: fx.Node) -> str:
    """What of a fused call goes into its site: its op, and of its arguments before the site the
    plain flags and dimensions (a tensor, or None in its place, as such; sizes and the group
    left out)."""
    parts = [node.target.__name__.split(".")[0]]
    for i, arg in enumerate(node.args[:_SITE_ARG[node.target]]):
        if i == _GROUP_ARG[node.target]:
            continue
        if isinstance(arg, fx.Node):
            parts.append("t")
        elif arg is None:
            parts.append("-")
        elif isinstance(arg, (bool, int)):
            parts.append(str(arg))
    return " ".join(parts)


def _call(node: fx.Node) -> Call | None:
    """The ``Call`` a fused node will make, from its operands' shapes (its op's spec reads them);
    None while a size is symbolic (the workspace then grows on first use instead)."""
    spec = _SPECS.get(node.target)
    if spec is None:
        return None
    values = [val(x) if isinstance(x, fx.Node) else x for x in node.args[:len(spec.args)]]
    sizes = [s for v in values if isinstance(v, torch.Tensor) for s in v.shape]
    sizes += [s for v in values if isinstance(v, (list, tuple)) for s in v]
    if not all(isinstance(s, int) for s in sizes):
        return None
    args = spec.Args(*values)
    return spec.call(args, _resolve_process_group(args.group_name).size())


#: Namespaces of the collectives a traced graph may hold.
_COLLECTIVES = ("_c10d_functional", "_c10d_functional_autograd", "c10d")


def _why_no_candidates(graph: fx.Graph) -> str:
    """What a graph without any candidate says instead of "0 fused, 0 skipped"."""
    if any(getattr(n.target, "namespace", None) in _COLLECTIVES for n in graph.nodes if n.op == "call_function"):
        return "no all-reduce, all-gather or reduce-scatter in this graph (only other collectives)"
    why = "no collectives in this graph"
    if not dist.is_available() or not dist.is_initialized():
        return why + " (torch.distributed is not initialized)"
    if dist.get_world_size() == 1:
        return why + "; one rank: nothing to exchange"
    return why


def workspace_plan(graph: fx.Graph) -> dict[str, int]:
    """Per process group, the symmetric bytes (per parity) the graph's largest fused op needs, as
    the paths the group's GPU would choose say (``runtime.policy``), from this rank's GPU's facts:
    the allocation agrees on the largest request of every rank itself.
    """
    need: dict[str, int] = {}
    settings = env.current()
    forced, provider, tuning = settings.algo, settings.symm_provider, settings.tune == "first-use"
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _FUSED_OPS:
            continue
        call = _call(node)
        if call is None:
            continue
        group = node.args[_GROUP_ARG[node.target]]
        nbytes = policy.workspace_bytes(call, local_facts(call.world, provider=provider), forced=forced,
                                        tuning=tuning)
        need[group] = max(need.get(group, 0), nbytes)
    return need


class CommfusePass(CustomGraphPass):
    """Inductor post-grad pass: runs ``chained`` (the user's own post pass, if any), then ours."""

    def __init__(self, settings: Settings, chained: Any = None):
        self.settings = settings
        if chained is None:
            self.chained: tuple = ()
        elif isinstance(chained, (list, tuple)):
            self.chained = tuple(chained)
        else:
            self.chained = (chained,)

    def __call__(self, graph: fx.Graph) -> None:
        for user_pass in self.chained:
            user_pass(graph)
        rewrite(graph, self.settings)

    def uuid(self) -> Any:
        """Package sources + settings + the chained passes' ids; None disables caching.

        Exclusions are resolved from node metadata that Inductor's cache key does not hash (module
        names and classes are not in the graph's code), so any exclusion opts out of the cache
        rather than risk reusing a graph fused under other exclusions.
        """
        if self.settings.has_exclusions or any_instance_excluded():
            log.debug("module exclusions are set: FX graph caching is bypassed for commfuse graphs")
            return None
        parts = [_source_hash(), self.settings.key(), torch.__version__]
        for user_pass in self.chained:
            if not isinstance(user_pass, CustomPassBase):
                return None
            uid = user_pass.uuid()
            if uid is None:
                return None
            parts.append(repr(uid))
        return hashlib.sha256("|".join(parts).encode()).hexdigest()
