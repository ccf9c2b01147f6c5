"""The ``torch.compile`` backend: Inductor, unchanged, plus the commfuse post-grad pass; where that
pass fused (or a graph from a cache calls commfuse ops), each run of the compiled graph is
followed by a read of its groups' error words (``runtime/errors.py``, ``watch_runs``), so a wait
that timed out in a CUDA-graph replay raises.

``torch.compile(model, backend="commfuse")`` finds this module through the
``torch_dynamo_backends`` entry point, so no import of commfuse is needed. Importing it registers
the ``torch.ops.commfuse`` ops that compiled (and cached) code calls.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .. import env
from ..config import DEFAULT_MIN_MNK, Settings
from ..runtime import errors
from . import alike, cached
from .graph_pass import _FUSED_OPS, _GROUP_ARG, CommfusePass

cached.install()  # a graph the FX graph cache serves brings its decisions back into the report


@functools.lru_cache(1)
def _inductor_option_names() -> frozenset[str]:
    """Every ``torch._inductor.config`` setting by its dotted name (``triton.cudagraphs``): the
    names ``torch.compile(options=...)`` checks Inductor's own options against."""
    from torch._inductor import config

    return frozenset(config.get_config_copy())


def inductor_options(options: Mapping[str, Any] | None, where: str) -> dict[str, Any]:
    """``options`` as Inductor config patches, each name checked, with ``-`` read as ``_`` (as
    ``torch.compile`` does for Inductor). An unknown name raises here, in one line, rather than
    inside Inductor's compile, where it would surface as an ``AttributeError`` deep in a traceback."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(f"commfuse: {where} must be a dict of Inductor settings, got {type(options).__name__}")
    known = _inductor_option_names()
    patches = {}
    for key, value in options.items():
        name = str(key).replace("-", "_")
        if name == "post_grad_custom_post_pass":
            raise ValueError("commfuse: set your own post_grad_custom_post_pass in torch._inductor.config; "
                             "commfuse chains it before its own pass")
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise ValueError(f"commfuse: unknown Inductor option {key!r} in {where}{hint}")
        patches[name] = value
    return patches


def mode_options(mode: str | None, where: str) -> dict[str, Any]:
    """The Inductor config patches of a ``torch.compile`` mode (``list_mode_options``); an unknown
    mode raises in one line naming it."""
    if not mode or mode == "default":
        return {}
    from torch._inductor import list_mode_options

    modes = list_mode_options()
    if mode not in modes:
        raise ValueError(f"commfuse: unknown mode {mode!r} in {where}; Inductor's modes: {', '.join(modes)}")
    return dict(list_mode_options(mode))


class _WatchedPass(CommfusePass):
    """The commfuse pass of one compile, which notes the groups its fused ops call in ``watch``
    (the forward graph now, the backward graph when autograd compiles it). Its cache key is the
    pass's: the watch does not change the graph."""

    def __init__(self, settings: Settings, chained: Any, watch: errors.Watch):
        super().__init__(settings, chained=chained)
        self.watch = watch

    def __call__(self, graph: torch.fx.Graph) -> None:
        super().__call__(graph)
        for node in graph.nodes:
            if node.op == "call_function" and node.target in _FUSED_OPS:
                self.watch.names.add(str(node.args[_GROUP_ARG[node.target]]))


def _cache_hits() -> int:
    """Graphs Inductor or AOTAutograd took from their caches so far (the pass does not run for them)."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]


def _note_cached(watch: errors.Watch, graph: Any) -> None:
    """A graph the cache served (the pass did not run: its groups are unknown): watched for every
    group if its code calls a commfuse op (or its code is not there to read), else not at all."""
    code = getattr(graph, "source_code", None)
    if not isinstance(code, str) or cached.calls_commfuse(code):
        watch.every = True


def _watched_inner(gm: torch.fx.GraphModule, example_inputs: Any, *, watch: errors.Watch, **kwargs: Any) -> Any:
    """The inner compile of one graph (the forward now, the backward when autograd first needs
    it, maybe on another thread), hearing of a graph the FX graph cache serves (``_note_cached``)."""
    if not cached.installed():  # hits not seen one by one: any hit watches every group
        hits = _cache_hits()
        compiled = cached.compile_inner(gm, example_inputs, **kwargs)
        watch.every = watch.every or _cache_hits() != hits
        return compiled
    with cached.hits_to(functools.partial(_note_cached, watch)):
        return cached.compile_inner(gm, example_inputs, **kwargs)


def _may_train(example_inputs: list) -> bool:
    """Whether autograd may compile a backward graph later (the pass may then fuse there)."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)


class CommfuseBackend:
    """A configured backend: ``torch.compile(model, backend=commfuse.backend(...))``.

    ``torch.compile`` hands a custom backend its ``mode`` and ``options`` as keywords of each
    call; they are read as for Inductor: the mode's config patches first, then this backend's own
    settings, then ``options``, the most specific, over both.
    """

    def __init__(self, settings: Settings, inductor_config: dict[str, Any] | None = None):
        self.settings = settings
        self.inductor_config = inductor_options(inductor_config, "inductor_config")

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list, *, mode: str | None = None,
                 options: Mapping[str, Any] | None = None) -> Any:
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        # Checked before any compile work, so a misspelt option or setting costs no compile time
        # (``backend="commfuse"`` reaches here without ``commfuse.backend()``'s checks).
        env.validate()
        alike.agree(gm.graph, self.settings)  # before any compile work: ranks that differ would fuse differently
        patches = mode_options(mode, "torch.compile(mode=...)")
        patches.update(self.inductor_config)
        patches.update(inductor_options(options, "torch.compile(options=...)"))
        user_pass = inductor_config.post_grad_custom_post_pass
        if isinstance(user_pass, CommfusePass):  # nested commfuse backends: keep the outer chain
            user_pass = user_pass.chained
        watch = errors.Watch()
        patches["post_grad_custom_post_pass"] = _WatchedPass(self.settings, user_pass, watch)
        hits = _cache_hits()
        # compile_fx applies the patches, and the inner compile, to the lazily compiled backward
        # graph as well; AOTAutograd's cache serves both graphs here, without the inner compile.
        with cached.hits_to(functools.partial(_note_cached, watch)):
            compiled = compile_fx(gm, example_inputs, inner_compile=functools.partial(_watched_inner, watch=watch),
                                  config_patches=patches)
        if not cached.installed() and _cache_hits() != hits:  # hits not seen one by one
            watch.every = True
        if not (watch.names or watch.every or _may_train(example_inputs)):
            return compiled  # no commfuse op in it, and no backward graph to come
        # A wait that times out inside a CUDA-graph replay only writes its group's error word (the
        # replay has no host step): each run reads the words of the graph's groups afterwards.
        return errors.watch_runs(compiled, watch)

    def __repr__(self) -> str:
        return f"CommfuseBackend({self.settings!r})"


def backend(
    *,
    exclude: Iterable[Any] = (),
    patterns: Iterable[str] | None = None,
    min_mnk: int = DEFAULT_MIN_MNK,
    launch_bound_bytes: int | None = None,
    mode: str | None = None,
    inductor_config: dict[str, Any] | None = None,
    tune: str | None = None,
) -> CommfuseBackend:
    """A commfuse backend with settings, for ``torch.compile(model, backend=...)``.

    Args:
        exclude: module classes, module instances, or qualified-name patterns (``fnmatch``, relative
            to the compiled module, e.g. ``"layers.0.*"``) whose matmuls stay unfused.
        patterns: which rewrites run, names from ``commfuse.PATTERNS`` (default:
            ``commfuse.DEFAULT_PATTERNS``, every one but the opt-in ``"add_rms_norm"``; an empty
            list warns: that backend fuses nothing).
        min_mnk: matmuls with M*N*K below this stay unfused (the dimension a rank's shard may size
            differently from its peers', K of an all-reduced or reduce-scattered product, N of an
            all-gathered one, counts as 64: ranks with unevenly sharded layers decide alike).
        launch_bound_bytes: without CUDA graphs, matmuls whose exchanged tensor (the output; an
            all-gather's gathered operand) has at most this many bytes
            stay unfused (launch-bound: the fused op's host cost outweighs its GPU saving); 0 fuses
            them too. Default: ``COMMFUSE_LAUNCH_BOUND_BYTES`` or 1 MiB. With
            ``mode="reduce-overhead"`` they fuse.
        mode: an Inductor mode (what ``torch.compile(mode=...)`` also passes to this backend):
            ``"reduce-overhead"`` runs the graphs as CUDA graphs, where ``mm_all_reduce`` uses the
            graph lane (device-side epochs).
        inductor_config: extra ``torch._inductor.config`` settings for this compile (they win over
            ``mode``'s), by dotted name (``"triton.cudagraphs"``); an unknown name raises here.
        tune: measured dispatch for every commfuse call of this process (as ``COMMFUSE_TUNE``,
            which it overrides): ``"off"`` (the rules), ``"cache"`` (tuned answers kept on this
            machine, never tune), ``"first-use"`` (a call signature without an answer is tuned by
            every rank together at its first call).

    Every argument is checked here by type and value, an error naming it (``tune=True`` is
    refused, not read as ``"cache"``). The ``COMMFUSE_*`` environment settings are checked here
    too, so a malformed one fails when the backend is built, naming the variable, not inside the
    first compile.
    """
    env.validate()
    patterns = _checked_arguments(patterns, mode, tune)
    if tune is not None:
        env.set(tune=tune)
    settings = Settings.build(patterns=patterns, exclude=exclude, min_mnk=min_mnk,
                              launch_bound_bytes=launch_bound_bytes)
    config = mode_options(mode, "commfuse.backend(mode=...)")
    config.update(inductor_options(inductor_config, "commfuse.backend(inductor_config=...)"))
    return CommfuseBackend(settings, config)


def _checked_arguments(patterns: Any, mode: Any, tune: Any) -> tuple[str, ...] | None:
    """``backend()``'s ``patterns``, ``mode`` and ``tune`` checked by type and value, each error
    naming the argument as the caller wrote it (not the ``COMMFUSE_*`` setting ``tune`` sets);
    ``patterns`` as a tuple. An empty ``patterns`` warns: such a backend fuses nothing."""
    import warnings

    from ..config import PATTERNS

    if tune is not None:
        if not isinstance(tune, str):
            raise TypeError(f"commfuse.backend: tune must be a str, one of {', '.join(map(repr, env.TUNE_MODES))}; "
                            f"got {tune!r}")
        if tune.strip().lower() not in env.TUNE_MODES:
            raise ValueError(f"commfuse.backend: tune={tune!r} is not one of {', '.join(map(repr, env.TUNE_MODES))}")
    if mode is not None and not isinstance(mode, str):
        raise TypeError(f"commfuse.backend: mode must be a str (an Inductor mode), got {mode!r}")
    if patterns is None:
        return None
    if isinstance(patterns, str):
        patterns = (patterns,)
    elif not isinstance(patterns, Iterable):
        raise TypeError(f"commfuse.backend: patterns must be a list of pattern names from {list(PATTERNS)}, "
                        f"got {patterns!r}")
    patterns = tuple(patterns)
    wrong = [p for p in patterns if not isinstance(p, str)]
    if wrong:
        raise TypeError(f"commfuse.backend: patterns must name patterns as str, got {wrong[0]!r}; "
                        f"known: {list(PATTERNS)}")
    unknown = [p for p in patterns if p not in PATTERNS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], PATTERNS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"commfuse.backend: patterns has an unknown pattern {unknown[0]!r}{hint} "
                         f"(known: {list(PATTERNS)})")
    if not patterns:
        warnings.warn("commfuse.backend: patterns=[] enables no rewrite: this backend fuses nothing (it is "
                      "Inductor alone); leave patterns out for the default ones", stacklevel=env.user_stacklevel())
    return patterns


#: What ``backend="commfuse"`` resolves to: default settings.
commfuse_backend = CommfuseBackend(Settings())
