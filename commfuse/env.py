"""The ``COMMFUSE_*`` settings read from the environment, through one parser per kind.

A switch set to ``true`` where only ``1`` was understood, or a size written ``1MiB``, must not be
read as the default without a word: a safety check left off (``COMMFUSE_VERIFY``) or a rewrite
left on (``COMMFUSE_MERGE_SUMS``) changes what a user believes runs. So every reader here raises a
``ValueError`` naming the variable for a value it does not understand; unset or empty means the
default. ``validate()`` checks every setting at once, when a backend is built and at compile
time, so a bad value fails there and not in the middle of a collective call; it also warns,
once per name, about a ``COMMFUSE_*`` variable that no setting reads (a misspelling would
otherwise leave the default in force without a word).
"""

from __future__ import annotations

import difflib
import math
import os
import warnings

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


def _raw(name: str) -> str:
    return os.environ.get(name, "").strip()


def flag(name: str, default: bool) -> bool:
    """A switch: 1 / true / on / yes or 0 / false / off / no (any case)."""
    value = _raw(name).lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"commfuse: {name}={os.environ[name]!r} is not a switch; use 1/true/on/yes or "
                     "0/false/off/no")


def integer(name: str, default: int | None, minimum: int | None = None) -> int | None:
    """A whole number (``1048576``, not ``1MiB``), at least ``minimum`` when one is given."""
    value = _raw(name)
    if not value:
        return default
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"commfuse: {name}={value!r} is not a whole number") from None
    if minimum is not None and number < minimum:
        raise ValueError(f"commfuse: {name}={number} must be at least {minimum}")
    return number


def number(name: str, default: float | None, minimum: float | None = None,
           positive: bool = False, maximum: float | None = None) -> float | None:
    """A finite number, at least ``minimum`` (or above 0 with ``positive``) and at most ``maximum``
    when asked."""
    value = _raw(name)
    if not value:
        return default
    try:
        x = float(value)
    except ValueError:
        raise ValueError(f"commfuse: {name}={value!r} is not a number") from None
    if not math.isfinite(x):
        raise ValueError(f"commfuse: {name}={value!r} must be a finite number")
    if minimum is not None and x < minimum:
        raise ValueError(f"commfuse: {name}={value} must be at least {minimum}")
    if positive and x <= 0:
        raise ValueError(f"commfuse: {name}={value} must be above 0")
    if maximum is not None and x > maximum:
        raise ValueError(f"commfuse: {name}={value} must be at most {maximum:g}")
    return x


#: Every switch and number the package reads, with how ``validate`` checks its syntax (the
#: readers also check ranges and defaults where they read them).
SWITCHES = ("COMMFUSE_MERGE_SUMS", "COMMFUSE_VERIFY", "COMMFUSE_FAST_LAUNCH", "COMMFUSE_CE_GRAPHS",
            "COMMFUSE_FUSED_TICKETS", "COMMFUSE_FUSED_TMA_PUSH", "COMMFUSE_GRAPH_SPLIT_K",
            "COMMFUSE_RS_PULL", "COMMFUSE_SLAB_OVERLAP", "COMMFUSE_BENCH_OVERLAP", "COMMFUSE_BENCH_IRIS",
            "COMMFUSE_SPLIT_K_LL")
INTEGERS = {"COMMFUSE_LAUNCH_BOUND_BYTES": 0, "COMMFUSE_GRAPH_BYTES": 1, "COMMFUSE_IRIS_HEAP_BYTES": 1,
            "COMMFUSE_SPLIT_K": 1, "COMMFUSE_RS_CHUNKS": 1, "COMMFUSE_CE_CHUNKS": 1,
            "COMMFUSE_CE_LAST_ROWS": 0, "COMMFUSE_CE_MIN_K": 0, "COMMFUSE_AG_PUSHERS": 1,
            "COMMFUSE_AG_CE_CHUNKS": 1}
NUMBERS = {"COMMFUSE_TIMEOUT_S": dict(positive=True, maximum=1e9), "COMMFUSE_FUSED_STAGGER_US": dict(minimum=0),
           "COMMFUSE_AR_COPY_LAG": dict(minimum=0)}


#: The settings that name a value or a form, each checked by its own reader (``_choices``).
CHOICES = ("COMMFUSE_LOG", "COMMFUSE_ALGO", "COMMFUSE_SYMM_PROVIDER", "COMMFUSE_TILE_CONFIG", "COMMFUSE_AG_PUSH",
           "COMMFUSE_AG_LOCAL", "COMMFUSE_CE_STREAMS", "COMMFUSE_CE_TAIL", "COMMFUSE_OVERLAP")
#: Free text: the commit the benchmarks record when git is unavailable.
TEXTS = ("COMMFUSE_COMMIT",)
#: Every ``COMMFUSE_*`` name the package reads; any other set in the environment is reported as
#: unknown (``validate``).
KNOWN = (*SWITCHES, *INTEGERS, *NUMBERS, *CHOICES, *TEXTS)

#: What ``COMMFUSE_LOG`` takes (``report.configure_logging``): a switch, or a level by name.
LOG_ON = _TRUE + ("info", "debug")
LOG_LEVELS = LOG_ON + _FALSE


def _choices() -> None:
    """The settings that take a name or a form (``validate`` calls each one's own reader)."""
    from .kernels import dispatch, symm

    level = os.environ.get("COMMFUSE_LOG", "").strip().lower()
    if level and level not in LOG_LEVELS:
        raise ValueError(f"commfuse: COMMFUSE_LOG={level!r} is not one of {LOG_LEVELS}")
    symm.provider_name()
    dispatch.tile_config_override()
    dispatch.split_k_ll()
    dispatch.gather_push(0)
    dispatch.gather_local_source()
    dispatch.ce_streams()
    dispatch.ce_tail()
    dispatch.overlap_config(1)
    dispatch._forced(())


_warned: set[str] = set()


def warn_unknown() -> None:
    """Warn once per name about a ``COMMFUSE_*`` variable no setting reads, naming close known ones."""
    for name in sorted(os.environ):
        if not name.startswith("COMMFUSE_") or name in KNOWN or name in _warned:
            continue
        _warned.add(name)
        close = difflib.get_close_matches(name, KNOWN, n=3, cutoff=0.75)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        warnings.warn(f"commfuse: {name} is not a commfuse setting and is ignored{hint}", UserWarning,
                      stacklevel=3)


def validate() -> None:
    """Raise on the first setting of ``SWITCHES``, ``INTEGERS``, ``NUMBERS`` or the named choices
    that does not parse or is out of range (what ``commfuse.backend`` and the graph pass call);
    warn about unknown names."""
    warn_unknown()
    for name in SWITCHES:
        flag(name, False)
    for name, minimum in INTEGERS.items():
        integer(name, None, minimum)
    for name, limits in NUMBERS.items():
        number(name, None, **limits)
    _choices()
