"""Every candidate the graph pass looked at, fused or skipped with its reason.

Users' first complaint about fusion passes is that they silently do not fire, so each decision is
logged under the ``commfuse`` logger and kept as data: ``commfuse.report()`` after a compile.
``TORCH_LOGS=commfuse`` prints the decisions to stderr through torch's logging (``+commfuse``:
also the debug lines); ``COMMFUSE_LOG=1`` (or ``info``, or ``debug``) does the same through a
handler of commfuse's own, read when commfuse is imported and again whenever the graph pass runs
(0, off, false or no: quiet).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator

import torch

from . import env
from .runtime import groups

log = logging.getLogger("commfuse")

_MAX_RECORDS = 10_000
_records: collections.deque["MatchRecord"] = collections.deque(maxlen=_MAX_RECORDS)
#: What a graph's records cannot say: why a graph had no candidate, an exclude pattern that
#: matched no module of a graph.
_notes: collections.deque[str] = collections.deque(maxlen=1_000)


def _register_with_torch_logs() -> None:
    """Make ``commfuse`` a named log of torch's logging, as torch's own components are, so
    ``torch._logging`` resets and re-reads keep it and list it.

    torch reads ``TORCH_LOGS`` when it is imported, before commfuse can register: a name it
    does not know it takes for a module and, where one imports by that name, enables that
    logger, so ``TORCH_LOGS=commfuse`` works whichever is imported first. ``register_log`` is
    internal API (the same signature from torch 2.1 to 2.13), hence the guard: without it only
    the registration is lost, not ``TORCH_LOGS``.
    """
    internal = getattr(torch._logging, "_internal", None)
    register = getattr(internal, "register_log", None)
    registry = getattr(internal, "log_registry", None)
    if register is None or registry is None or not hasattr(registry, "is_log"):
        return
    if not registry.is_log("commfuse"):
        register("commfuse", "commfuse")


def _named_in_torch_logs() -> bool:
    """``TORCH_LOGS`` names commfuse (``commfuse``, ``+commfuse``, ``-commfuse``)."""
    names = os.environ.get("TORCH_LOGS", "").replace(" ", "").split(",")
    return any(name.lstrip("+-") == "commfuse" for name in names)


def configure_logging() -> None:
    """``COMMFUSE_LOG``, an alias of ``TORCH_LOGS=commfuse`` (``debug``: ``+commfuse``): a stderr
    handler on the ``commfuse`` logger at INFO (DEBUG for ``debug``), added once.

    Unset or a false word leave the logger as it is; so does a value it does not know: it must not
    switch logging on at import, and ``env.validate`` (``commfuse.backend()``, the graph pass)
    raises naming it. Where ``TORCH_LOGS`` names commfuse, torch's level and handler win (one
    line per record, not two).
    """
    try:
        level = env.peek("log") or ""
    except ValueError:  # a bad setting: logging stays off here, and env.validate names it
        return
    if level not in env.LOG_ON or _named_in_torch_logs():
        return
    log.setLevel(logging.DEBUG if level == "debug" else logging.INFO)
    own = [h for h in log.handlers if h.get_name() == _HANDLER]
    if _torch_handler(log):  # torch._logging set the logger up since (set_logs): it writes the records
        for handler in own:
            log.removeHandler(handler)
    elif not log.handlers:
        handler = logging.StreamHandler()
        handler.set_name(_HANDLER)
        handler.setFormatter(logging.Formatter("[commfuse] %(message)s"))
        log.addHandler(handler)


_HANDLER = "commfuse: COMMFUSE_LOG"


def _torch_handler(logger: logging.Logger) -> bool:
    is_torch = getattr(getattr(torch._logging, "_internal", None), "_is_torch_handler", None)
    return is_torch is not None and any(is_torch(h) for h in logger.handlers)


_register_with_torch_logs()
configure_logging()


#: How a record or note read back from the FX graph cache says so.
CACHED_MARK = "[from the FX graph cache]"
#: How the note of a cached graph whose decisions were not kept begins (what its code calls follows).
CACHED_WITHOUT_DECISIONS = "a graph from the FX graph cache"


@dataclasses.dataclass(frozen=True)
class MatchRecord:
    pattern: str  # "merge_sums", a pattern (config.PATTERNS), or the FP8 op a pattern makes ("scaled_mm_all_reduce", ...)
    graph: str  # "forward" | "backward" and the graph's number in this process
    collective: str  # name of the collective node
    matmul: str | None  # name of the matmul node, when one was found
    fused: bool
    reason: str  # why it was skipped; "fused" otherwise
    shape: tuple | None = None  # (M, K, N) of the matmul
    dtype: str | None = None
    group: str | None = None
    module: str | None = None  # qualified name of the module the matmul came from
    #: Read back with a graph Inductor's FX graph cache served: decided when that graph was
    #: compiled (maybe by another process), not by a pass run in this one.
    cached: bool = False

    @property
    def merge(self) -> bool:
        """A sum of matmuls made one matmul (``merge_sums``), not a fusion."""
        return self.pattern == "merge_sums"

    def line(self) -> str:
        what = "MERGED " if self.merge else "FUSED  " if self.fused else "skipped"
        shape = "x".join(str(s) for s in self.shape) if self.shape else "-"
        where = f" in {self.module}" if self.module else ""
        tail = f": {self.reason}" if self.merge or not self.fused else ""
        cached = f" {CACHED_MARK}" if self.cached else ""
        return (
            f"{what} {self.pattern:<17} {self.graph:<12} {self.collective}<-{self.matmul or '?'}"
            f" MKN={shape} {self.dtype or ''} group={self.group}{where}{tail}{cached}"
        )


class Report(list):
    """A list of :class:`MatchRecord`; ``print(report)`` gives one line per candidate, the counts,
    then ``notes``: what the records cannot say (a graph without candidates and why, an exclude
    pattern that matched no module of a graph)."""

    def __init__(self, records=(), notes=(), calls=()):
        super().__init__(records)
        self.notes: list[str] = list(notes)
        #: What the run-time chose per call site of this process: (call, group, path, source,
        #: reason); source is where the choice came from: the rules, the tuner, a forced setting,
        #: a capture, the graph lane, or a group that cannot run symmetric paths.
        self.calls: list[tuple] = list(calls)

    @property
    def fused(self) -> list[MatchRecord]:
        return [r for r in self if r.fused and not r.merge]

    @property
    def merged(self) -> list[MatchRecord]:
        return [r for r in self if r.merge]

    @property
    def skipped(self) -> list[MatchRecord]:
        return [r for r in self if not r.fused]

    def summary(self) -> str:
        if not self and self.notes:  # "0 fused, 0 skipped" would not say why
            kept = not any(n.startswith(CACHED_WITHOUT_DECISIONS) for n in self.notes)
            lines = ["commfuse: no candidates" if kept else "commfuse: no decisions kept for the cached graphs"]
        else:
            reasons = collections.Counter(r.reason for r in self.skipped)
            merged = f", {len(self.merged)} sums merged" if self.merged else ""
            n_cached = sum(r.cached for r in self)
            cached = (f" ({n_cached} of them from the FX graph cache, decided when the graph was compiled)"
                      if n_cached else "")
            lines = [f"commfuse: {len(self.fused)} fused, {len(self.skipped)} skipped{merged}{cached}"]
            lines += [f"  {n} x {reason}" for reason, n in reasons.most_common()]
        return "\n".join(lines + [f"  note: {note}" for note in self.notes])

    def __str__(self) -> str:
        lines = [r.line() for r in self] + [self.summary()]
        if self.calls:
            lines.append("run time, per call site (path, and where the choice came from):")
            lines += [f"  {call} on group {group}: {path} ({source}: {reason})"
                      for call, group, path, source, reason in self.calls]
        return "\n".join(lines)


#: Open ``capture()`` blocks, each the records and notes made inside it.
_captures: list["Captured"] = []


@dataclasses.dataclass
class Captured:
    records: list[MatchRecord] = dataclasses.field(default_factory=list)
    notes: list[tuple[str, int]] = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def capture() -> Iterator[Captured]:
    """The records and notes the pass makes inside the block (what one graph's compile decided)."""
    got = Captured()
    _captures.append(got)
    try:
        yield got
    finally:
        _captures.remove(got)


def record(rec: MatchRecord) -> None:
    _records.append(rec)
    for got in _captures:
        got.records.append(rec)
    log.info("%s", rec.line())


def note(text: str, level: int = logging.INFO) -> None:
    """Keep ``text`` for ``Report.notes`` and log it."""
    _notes.append(text)
    for got in _captures:
        got.notes.append((text, level))
    log.log(level, "%s", text)


def replay(records: list[MatchRecord], notes: list[tuple[str, int]]) -> None:
    """Keep and log a cached graph's decisions as a compile would, each marked as from the cache
    (``capture`` blocks do not take them: they are not this process's decisions)."""
    for rec in records:
        rec = dataclasses.replace(rec, cached=True)
        _records.append(rec)
        log.info("%s", rec.line())
    for text, level in notes:
        text = f"{text} {CACHED_MARK}"
        _notes.append(text)
        log.log(level, "%s", text)


def report() -> Report:
    """Decisions from every graph the pass has rewritten in this process (newest last), and the
    run-time's path per call site so far (``Report.calls``: the decisions each group's state
    keeps, ``runtime/groups.py``; a released group's are gone with it).

    A graph served from Inductor's FX graph cache skips the pass: its decisions, kept beside the
    cache entry when it was compiled, are read back and marked ``cached``
    (``inductor_plugin/cached.py``).
    """
    return Report(_records, _notes, groups.decisions())


def clear_report() -> None:
    """Forget every record, note and run-time call site so far."""
    _records.clear()
    _notes.clear()
    groups.clear_decisions()
