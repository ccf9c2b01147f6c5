"""The pass's decisions for graphs that Inductor's FX graph cache serves.

A cache hit skips the post-grad passes, so without this a warm start would report "0 fused, 0
skipped" about code that holds fused ops. The decisions travel beside the cache entry instead:

* on a miss, ``compile_inner`` (the ``inner_compile`` the backend hands ``compile_fx``) keeps what
  the pass recorded while compiling that graph in ``decisions/<key>.json`` under Inductor's cache
  directory, ``<key>`` the FX graph cache key (``TORCHINDUCTOR_CACHE_DIR``: processes that share
  the cache share these files);
* on a hit, whether Inductor's FX graph cache or AOTAutograd's cache served the graph, the load
  goes through ``FxGraphCache.cache_hit_post_compile``, which ``install()`` wraps: the file of the
  loaded graph's key is read back into the report, each record marked as from the cache. A graph
  without such a file (a remote cache, a removed directory) is re-derived from its code: a note
  counts the commfuse ops the cached code calls. The backend also hears of each hit there
  (``hits_to``), to watch the error words of a loaded graph that calls commfuse ops.

``cache_hit_post_compile`` is internal to Inductor (the same signature in torch 2.11 to 2.13);
where it is missing only the read-back is lost, never the compile.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import os
import re
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ..report import CACHED_WITHOUT_DECISIONS, Captured, MatchRecord, capture, log, replay

#: Bumped when the file's layout changes: an older file is then ignored (re-derived from code).
_FORMAT = 1
_OP_CALL = re.compile(r"torch\.ops\.commfuse\.(\w+)\.default\(")


def _path(key: str) -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), "commfuse", "decisions", f"{key}.json")


def save(key: str, captured: Captured) -> None:
    """Keep one graph's decisions beside its cache entry (written whole, then renamed: a reader in
    another process never sees half a file)."""
    path = _path(key)
    data = dict(format=_FORMAT, records=[dataclasses.asdict(r) for r in captured.records],
                notes=[list(n) for n in captured.notes])
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError as exc:  # the compile stands; only a later hit's report would lack these
        log.debug("commfuse: could not keep the decisions of graph %s (%s)", key, exc)


def load(key: str) -> tuple[list[MatchRecord], list[tuple[str, int]]] | None:
    """The decisions kept for ``key``, or None without a readable file of this format."""
    try:
        with open(_path(key)) as f:
            data = json.load(f)
        if data.get("format") != _FORMAT:
            return None
        records = []
        for fields in data["records"]:
            shape = fields.get("shape")
            records.append(MatchRecord(**{**fields, "shape": tuple(shape) if shape else None}))
        return records, [(str(text), int(level)) for text, level in data["notes"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def from_code(source: str) -> str:
    """A cached graph's fused ops read from its code, as one note (what is left to say without the
    decisions: the skips and their reasons are not in the code)."""
    ops = collections.Counter(_OP_CALL.findall(source or ""))
    if not ops:
        return f"{CACHED_WITHOUT_DECISIONS} calls no commfuse op (its decisions were not kept)"
    found = ", ".join(f"{n} x {op}" for op, n in sorted(ops.items()))
    return f"{CACHED_WITHOUT_DECISIONS} calls {found} (its decisions were not kept, so skips are not listed)"


def calls_commfuse(source: str) -> bool:
    """Whether a graph's generated code calls a commfuse op."""
    return _OP_CALL.search(source) is not None


#: Per thread: who is told of each graph the FX graph cache serves (``hits_to``).
_told = threading.local()


@contextlib.contextmanager
def hits_to(listener: Callable[[Any], None]) -> Iterator[None]:
    """Hand ``listener`` each graph (a ``CompiledFxGraph``) the FX graph cache serves in this
    thread meanwhile, through Inductor's cache or AOTAutograd's."""
    before = getattr(_told, "listener", None)
    _told.listener = listener
    try:
        yield
    finally:
        _told.listener = before


def installed() -> bool:
    """Whether cache hits are seen one by one (``install`` found ``cache_hit_post_compile``)."""
    try:
        from torch._inductor.codecache import FxGraphCache
    except ImportError:
        return False
    hook = FxGraphCache.__dict__.get("cache_hit_post_compile")
    return isinstance(hook, staticmethod) and getattr(hook.__func__, "_commfuse", False)


def on_hit(graph: Any) -> None:
    """Read the decisions of a graph the FX graph cache served back into the report."""
    key = getattr(graph, "_fx_graph_cache_key", None)
    kept = load(key) if key else None
    if kept is not None:
        replay(*kept)
        return
    source = getattr(graph, "source_code", "") or ""
    if "torch.ops.commfuse." in source:  # a commfuse graph: say what its code holds
        replay([], [(from_code(source), logging.INFO)])


def compile_inner(gm, example_inputs, **kwargs):
    """``compile_fx_inner`` that keeps what the pass decided beside the graph's cache entry."""
    from torch._inductor.compile_fx import compile_fx_inner

    with capture() as captured:
        compiled = compile_fx_inner(gm, example_inputs, **kwargs)
    key = getattr(compiled, "_fx_graph_cache_key", None)
    if key and (captured.records or captured.notes):  # the pass ran: a miss (a hit replays instead)
        save(key, captured)
    return compiled


def install() -> None:
    """Wrap ``FxGraphCache.cache_hit_post_compile`` once, so every hit reads its decisions back."""
    try:
        from torch._inductor.codecache import FxGraphCache
    except ImportError:
        return
    original = FxGraphCache.__dict__.get("cache_hit_post_compile")
    if not isinstance(original, staticmethod) or getattr(original.__func__, "_commfuse", False):
        return
    real = original.__func__

    def cache_hit_post_compile(graph, *args, **kwargs):
        result = real(graph, *args, **kwargs)
        listener = getattr(_told, "listener", None)
        if listener is not None:
            listener(graph)
        try:
            on_hit(graph)
        except Exception as exc:  # noqa: BLE001 - the report must never break a load
            log.debug("commfuse: could not read back a cached graph's decisions (%s)", exc)
        return result

    cache_hit_post_compile._commfuse = True
    FxGraphCache.cache_hit_post_compile = staticmethod(cache_hit_post_compile)
