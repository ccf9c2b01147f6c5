"""Every ``COMMFUSE_*`` setting, parsed once into one typed object.

``current()`` reads the environment the first time it is asked and keeps the result: a call does
not parse strings. Each setting is declared once in ``SETTINGS`` (its name, kind, default and what
it does); ``docs/settings.md`` lists the same table and a test keeps the two alike.

A value that does not parse (a switch set to ``maybe``, a size written ``1MiB``) is never read as
the default without a word: a safety check left off or a rewrite left on changes what a user
believes runs. ``validate()``, which ``commfuse.backend(...)`` calls, raises one ``ValueError``
naming the variable; it also warns once about a ``COMMFUSE_*`` name that is no setting (a
misspelling, with the closest names) and about a removed setting that is still set.

``override(**values)`` sets values for a block of code (tools and tests that change settings
between calls) and drops what the run-time kept per call signature, which was decided under the
settings before; ``reload()`` reads the environment again.

Each setting has a scope (``SCOPES``): ``alike`` (every rank of a group must set it alike; the
ranks compare them, ``runtime/alike.py``), ``local`` (may differ between ranks) or ``live`` (may
differ and change mid-run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")
PREFIX = "COMMFUSE_"


@dataclasses.dataclass(frozen=True)
class Setting:
    """One ``COMMFUSE_*`` variable. ``kind``: ``switch``, ``int``, ``float``, ``choice`` or ``text``.

    ``scope``: whether the ranks of a group may set it differently (``SCOPES``); every setting
    has one (a test fails on a setting without). ``paths``: the tuner's cache is keyed by it (it
    changes which path a tuned call takes); ``compile``: it changes what the graph pass does (its
    cache key), so it acts when a graph is compiled, not at a call."""

    name: str
    kind: str
    default: Any
    doc: str
    choices: tuple = ()
    #: Former values still taken, each read as the value it names now.
    aliases: tuple = ()  # (former, now) pairs
    minimum: float | None = None
    maximum: float | None = None
    paths: bool = False
    compile: bool = False
    scope: str | None = None
    unlike: str = ""  # what happens when ranks set it differently (docs/settings.md)

    @property
    def field(self) -> str:
        return self.name[len(PREFIX):].lower()

    def parse(self, raw: str | None) -> Any:
        """The typed value of ``raw`` (unset or empty: the default); ``ValueError`` naming the
        variable for anything else that does not parse or is out of range."""
        value = (raw or "").strip()
        if not value:
            return self.default
        if self.kind == "switch":
            if value.lower() in _TRUE:
                return True
            if value.lower() in _FALSE:
                return False
            raise ValueError(f"commfuse: {self.name}={raw!r} is not a switch; use 1/true/on/yes or 0/false/off/no")
        if self.kind == "choice":
            low = value.lower()
            low = dict(self.aliases).get(low, low)
            if low not in self.choices:
                raise ValueError(f"commfuse: {self.name}={raw!r} is not one of {', '.join(self.choices)}")
            return low
        if self.kind == "text":
            return value
        try:
            number = int(value) if self.kind == "int" else float(value)
        except ValueError:
            what = "a whole number (bytes as 1048576, not 1MiB)" if self.kind == "int" else "a number"
            raise ValueError(f"commfuse: {self.name}={raw!r} is not {what}") from None
        if not math.isfinite(number):
            raise ValueError(f"commfuse: {self.name}={raw!r} must be a finite number")
        if self.minimum is not None and number < self.minimum:
            raise ValueError(f"commfuse: {self.name}={raw!r} must be at least {self.minimum:g}")
        if self.maximum is not None and number > self.maximum:
            raise ValueError(f"commfuse: {self.name}={raw!r} must be at most {self.maximum:g}")
        return number


#: The names ``COMMFUSE_ALGO`` takes: every path of every op (an op whose paths do not include the
#: forced name keeps its own choice).
ALGOS = ("nccl", "one_shot", "two_shot", "ce_overlap", "graph", "fused", "split_k", "pull")
#: Former path names, still taken (by ``COMMFUSE_ALGO`` and in the rules data) as the paths' names now.
ALGO_ALIASES = {"symm": "pull", "overlap": "ce_overlap"}
LOG_ON = _TRUE + ("info", "debug")
LOG_LEVELS = LOG_ON + _FALSE
TUNE_MODES = ("off", "cache", "first-use")

#: Whether the ranks of a group may set a setting differently, and when:
#: ``alike``: every rank of a group must set it alike. Ranks that differ would take different paths
#: or collectives for one call (a wrong sum or a hang), so the ranks compare their values: those
#: with ``compile`` when a graph is compiled for the group (``runtime/alike.py``), the others at the
#: group's first call and again after any change (``override``); a difference is one error on
#: every rank naming each differing setting and its value per rank. A change made on some ranks
#: only is compared by those ranks alone: they raise after ``COMMFUSE_TIMEOUT_S`` naming it and the
#: ranks that did not compare, which are not told (their next collective waits its own bound).
#: ``local``: may differ between ranks (it changes how this rank does its part, never what it
#: exchanges), fixed for the run.
#: ``live``: may differ between ranks and may change mid-run.
ALIKE, LOCAL, LIVE = "alike", "local", "live"
SCOPES = (ALIKE, LOCAL, LIVE)

_AGREED = ("an error on every rank at the group's first commfuse call (and its first after a change made on every "
           "rank), naming it and each rank's value; changed on some ranks only, an error on those ranks, after "
           "`COMMFUSE_TIMEOUT_S`, naming it and the ranks that did not compare")
_COMPILED = "an error on every rank when a graph is compiled for the group, naming it and each rank's value"

SETTINGS: tuple[Setting, ...] = (
    Setting("COMMFUSE_LOG", "choice", None, "print every fusion decision to stderr: a switch, or `info` / "
            "`debug` (the same as `TORCH_LOGS=commfuse` / `+commfuse`)", choices=LOG_LEVELS, scope=LIVE,
            unlike="each rank logs as it is told"),
    Setting("COMMFUSE_TIMEOUT_S", "float", 600.0, "bound in seconds on every cross-GPU wait; a late peer "
            "becomes an error naming the op, the ranks and the group", minimum=1e-9, maximum=1e9, scope=LIVE,
            unlike="each rank waits its own bound; the first to give up reports the late peer"),
    Setting("COMMFUSE_VERIFY", "switch", False, "before every fused call, check with a small collective that "
            "every rank makes the same call (shapes, dtypes, call site, call count); for debugging", scope=ALIKE,
            unlike=_AGREED + "; compared before any check's collective (`TORCH_DISTRIBUTED_DEBUG=DETAIL` "
            "counts as on)"),
    Setting("COMMFUSE_PAIRING_CHECK", "switch", False, "every symmetric call's flags carry a tag of its op, "
            "shapes (K too), call site and path beside the call count; a rank that meets another call at the same count (a skipped "
            "or reordered call) raises instead of summing it; split-K then exchanges with flags, not LL words",
            paths=True, scope=ALIKE, unlike=_AGREED),
    Setting("COMMFUSE_ALGO", "choice", None, "force one path for every call of the ops that have it "
            "(benchmarks and tests; eager calls that meet replayed CUDA graphs keep the graph lane); the former names "
            "`symm` and `overlap` are read as `pull` and `ce_overlap`",
            choices=ALGOS, aliases=tuple(ALGO_ALIASES.items()), paths=True, scope=ALIKE, unlike=_AGREED),
    Setting("COMMFUSE_SYMM_PROVIDER", "choice", "torch", "where symmetric buffers come from: torch symmetric "
            "memory, or the Iris heap (`iris`: the WORLD group only)", choices=("torch", "iris"), paths=True,
            scope=ALIKE, unlike=_AGREED),
    Setting("COMMFUSE_IRIS_HEAP_BYTES", "int", 4 << 30, "size of the Iris heap with the iris provider",
            minimum=1, scope=ALIKE, unlike=_AGREED),
    Setting("COMMFUSE_GRAPH_BYTES", "int", 4 << 20, "per-parity bytes of each group's graph lane: "
            "`mm_all_reduce` calls (and the opt-in add + RMSNorm chain's) captured in CUDA graphs up to this "
            "output size fuse", minimum=1,
            paths=True, scope=ALIKE, unlike=_AGREED),
    Setting("COMMFUSE_LAUNCH_BOUND_BYTES", "int", 1 << 20, "default of `launch_bound_bytes`: without CUDA "
            "graphs, matmuls exchanging at most this many bytes stay unfused", minimum=0, compile=True,
            scope=ALIKE, unlike=_COMPILED + " (the bound in force: the backend's `launch_bound_bytes` wins)"),
    Setting("COMMFUSE_MERGE_SUMS", "switch", True, "merge sums of reduced matmul partials into one matmul "
            "(the `merge_sums` rewrite)", compile=True, scope=ALIKE, unlike=_COMPILED),
    Setting("COMMFUSE_FAST_LAUNCH", "switch", True, "launch a kernel's repeated specialisations directly, "
            "without Triton's per-launch binding (with Triton 3.6, its TMA descriptors encoded once per address)",
            scope=LOCAL,
            unlike="nothing: the same kernels run with the same arguments"),
    Setting("COMMFUSE_CE_GRAPHS", "switch", True, "replay a copy-engine all-reduce whose operands sit where "
            "an earlier call's did as a CUDA graph (two host operations instead of ~40 launches)", scope=LOCAL,
            unlike="nothing: a replay and an eager call run the same protocol in the same slots"),
    Setting("COMMFUSE_TUNE", "choice", "off", "measured dispatch: `off` (the rules), `cache` (use tuned answers, "
            "never tune), `first-use` (tune a call signature, every rank together, at its first call)",
            choices=TUNE_MODES, scope=ALIKE, unlike=_AGREED),
    Setting("COMMFUSE_CACHE_DIR", "text", "", "where tuned answers are kept (default: the user cache "
            "directory, `~/.cache/commfuse`)", scope=LOCAL,
            unlike="caches whose answers differ are not used: a warning, and the signatures are tuned anew"),
    Setting("COMMFUSE_TUNE_MARGIN", "float", 0.03, "a tuned path replaces the rules' choice only if it is "
            "this fraction faster (part of the tuning cache's key)", minimum=0.0, maximum=0.5, paths=True,
            scope=ALIKE, unlike=_AGREED),
    Setting("COMMFUSE_COMMIT", "text", "", "the commit the benchmarks write into their result records "
            "(default: `git rev-parse HEAD` of the tree; a copy of the tree may carry a stale `.git`)",
            scope=LOCAL, unlike="each rank's records name its own value; only rank 0 writes them"),
)

_SWEEP = ("a path configuration now: the benchmarks pass it (benchmarks/path_sweep.py), no setting "
          "changes it")
_LOST = "deleted: the mode lost on every shape it was measured on (docs/decisions.md)"

#: Settings that no longer exist, and what became of them (a still-set one warns once).
REMOVED: dict[str, str] = {
    "COMMFUSE_TILE_CONFIG": _SWEEP, "COMMFUSE_SPLIT_K": _SWEEP, "COMMFUSE_SPLIT_K_LL": _SWEEP,
    "COMMFUSE_CE_CHUNKS": _SWEEP, "COMMFUSE_CE_LAST_ROWS": _SWEEP, "COMMFUSE_RS_CHUNKS": _SWEEP,
    "COMMFUSE_AG_PUSH": _SWEEP, "COMMFUSE_AG_PUSHERS": _SWEEP, "COMMFUSE_AG_CE_CHUNKS": _SWEEP,
    "COMMFUSE_FUSED_STAGGER_US": _SWEEP, "COMMFUSE_AR_COPY_LAG": _SWEEP, "COMMFUSE_CE_MIN_K": _SWEEP,
    "COMMFUSE_FUSED_TICKETS": _SWEEP, "COMMFUSE_FUSED_TMA_PUSH": _LOST, "COMMFUSE_RS_PULL": _LOST,
    "COMMFUSE_CE_TAIL": _LOST, "COMMFUSE_CE_STREAMS": _LOST, "COMMFUSE_AG_LOCAL": _LOST,
    "COMMFUSE_OVERLAP": _LOST + " (the SM-overlapped all-reduce)",
    "COMMFUSE_SLAB_OVERLAP": "deleted: slab overlaps run only when forced (COMMFUSE_ALGO) or tuned",
    "COMMFUSE_GRAPH_SPLIT_K": "deleted: the graph lane runs the split-K kernel where the rules say so; "
                              "COMMFUSE_ALGO=graph forces the lane",
    "COMMFUSE_BENCH_OVERLAP": "deleted with the SM-overlapped all-reduce",
    "COMMFUSE_BENCH_IRIS": "a flag of the ops benchmark now (--iris)",
}

_BY_NAME = {s.name: s for s in SETTINGS}
_BY_FIELD = {s.field: s for s in SETTINGS}


@dataclasses.dataclass(frozen=True)
class Values:
    """Every setting's typed value; read ``current().timeout_s`` and the like."""

    values: tuple  # (field, value) in SETTINGS order

    def __post_init__(self) -> None:
        # each setting an attribute of its own: the run-time reads several on every call
        for name, value in self.values:
            object.__setattr__(self, name, value)

    def __getattr__(self, field: str) -> Any:  # (only for a name that is not a setting)
        raise AttributeError(f"commfuse settings have no {field!r}")

    def as_dict(self) -> dict[str, Any]:
        return dict(self.values)

    def paths_key(self) -> tuple:
        """The settings that change which path or protocol runs (the tuner's cache key)."""
        return tuple((s.field, getattr(self, s.field)) for s in SETTINGS if s.paths)

    def compile_key(self) -> tuple:
        """The settings that change what the graph pass does (its cache key)."""
        return tuple((s.field, getattr(self, s.field)) for s in SETTINGS if s.compile)

    def alike(self, compile: bool) -> tuple:
        """(name, value) of the settings every rank of a group must set alike that act when a
        graph is compiled (``compile``) or at a call: what the ranks compare (``runtime/alike.py``)."""
        return tuple((s.name, getattr(self, s.field)) for s in SETTINGS if s.scope == ALIKE and s.compile == compile)


_current: Values | None = None
_overrides: list[dict[str, Any]] = []
_on_change: list[Callable[[], None]] = []
_warned: set[str] = set()


def _parse_environment(environ) -> dict[str, Any]:
    return {s.field: s.parse(environ.get(s.name)) for s in SETTINGS}


def current() -> Values:
    """The settings in force (the environment read once, then any ``override``)."""
    global _current
    if _current is None:
        values = _parse_environment(os.environ)
        values.update(_program)
        for layer in _overrides:
            values.update(layer)
        _current = Values(tuple(values.items()))
    return _current


def _changed() -> None:
    global _current
    _current = None
    for callback in list(_on_change):
        callback()


def on_change(callback: Callable[[], None]) -> None:
    """Call ``callback`` whenever the settings change (``override``, ``reload``): the run-time
    drops what it decided per call signature under the old ones."""
    _on_change.append(callback)


def reload() -> Values:
    """Read the environment again (after a test changed it)."""
    _changed()
    return current()


def _layer(values: dict[str, Any]) -> dict[str, Any]:
    layer = {}
    for field, value in values.items():
        setting = _BY_FIELD.get(field)
        if setting is None:
            raise TypeError(f"commfuse: no setting {field!r}; known: {sorted(_BY_FIELD)}")
        if value is None:
            layer[field] = setting.default
        elif isinstance(value, str) or setting.kind == "switch" and not isinstance(value, bool):
            layer[field] = setting.parse(str(value))
        else:
            layer[field] = setting.parse(str(value)) if setting.kind in ("int", "float") else value
    return layer


_program: dict[str, Any] = {}


def set(**values: Any) -> Values:  # noqa: A001 - the verb the API reads best with (env.set)
    """Set settings for the rest of the process, over the environment's values (what
    ``commfuse.backend(tune=...)`` does); checked as ``override`` checks them."""
    _program.update(_layer(values))
    _changed()
    return current()


@contextlib.contextmanager
def override(**values: Any) -> Iterator[Values]:
    """Set settings by field name (``override(algo="fused", timeout_s=5.0)``) inside a block. Each
    value is checked as the environment's would be (a string is parsed; ``None`` is the default).

    A must-be-alike setting (``ALIKE``) changed here is compared again between the ranks of each
    group at the group's next commfuse call (``runtime/alike.py``): make the same override on
    every rank (what tests that force a path between calls do). Made with different values on
    the ranks, it is an error on every rank naming it; made on some ranks only, those ranks wait
    ``COMMFUSE_TIMEOUT_S`` for the others, then raise naming it and the ranks that did not
    compare, and the others, which compared nothing, are not told: their next collective waits
    for its own bound."""
    layer = _layer(values)
    _overrides.append(layer)
    _changed()
    try:
        yield current()
    finally:
        _overrides.remove(layer)
        _changed()


def peek(field: str) -> Any:
    """One setting's value as the environment says now (overrides applied), without refreshing
    the kept values: what import-time readers use (the logger, before any backend is built)."""
    for layer in reversed(_overrides):
        if field in layer:
            return layer[field]
    if field in _program:
        return _program[field]
    return _BY_FIELD[field].parse(os.environ.get(_BY_FIELD[field].name))


def unknown_names(environ=None) -> list[str]:
    """``COMMFUSE_*`` variables set in the environment that are no setting (nor removed)."""
    environ = os.environ if environ is None else environ
    return sorted(n for n in environ if n.startswith(PREFIX) and n not in _BY_NAME and n not in REMOVED)


#: Frames a warning should not point at: commfuse's own, and torch's (the graph pass runs inside
#: ``torch.compile``), so it names the user's line that built the backend or compiled.
_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(m)) + os.sep for m in (__file__,))


def user_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn``, called by the function calling this one, that
    points at the first frame outside commfuse and torch: the user's code."""
    import sys

    roots = _LIBRARY_DIRS + tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                                  for m in (sys.modules.get("torch"),) if m is not None and m.__file__)
    frame, level = sys._getframe(2), 2  # 1: the function that warns
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(roots):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


def validate() -> Values:
    """Parse every setting now (``ValueError`` naming the first bad one) and warn once about an
    unknown or removed ``COMMFUSE_*`` name. ``commfuse.backend(...)`` and the graph pass call it."""
    for name in unknown_names():  # first: a misspelt name may be why another value is wrong
        if name not in _warned:
            _warned.add(name)
            # Only names that do something, compared without the prefix every name shares (with
            # it, COMMFUSE_RS_PUL was "close" to COMMFUSE_LOG).
            fields = [n[len(PREFIX):] for n in _BY_NAME]
            close = [PREFIX + c for c in difflib.get_close_matches(name[len(PREFIX):], fields, n=3)]
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            warnings.warn(f"commfuse: {name} is not a commfuse setting and is ignored{hint}",
                          stacklevel=user_stacklevel())
    for name, fate in REMOVED.items():
        if name in os.environ and name not in _warned:
            _warned.add(name)
            warnings.warn(f"commfuse: {name} no longer exists and is ignored: {fate}", stacklevel=user_stacklevel())
    values = _parse_environment(os.environ)  # raises on the first bad value, named
    values.update(_program)
    if _current is not None and not _overrides and dict(_current.values) != values:
        _changed()  # the environment changed since it was read: take the new values
    return current()


_SCOPE_WORDS = {ALIKE: "must be alike", LOCAL: "may differ", LIVE: "may differ, may change mid-run"}


def describe() -> list[tuple[str, str, str, str, str, str]]:
    """(name, kind, default, what it does, ranks, when the ranks differ) per setting, as
    ``docs/settings.md`` lists them."""
    def shown(s: Setting) -> str:
        if s.default is None:
            return "unset"
        if s.kind == "switch":
            return "on" if s.default else "off"
        return str(s.default)

    return [(s.name, s.kind if s.kind != "choice" else "one of " + ", ".join(s.choices), shown(s), s.doc,
             _SCOPE_WORDS.get(s.scope, "?"), s.unlike) for s in SETTINGS]
