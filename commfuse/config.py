"""Settings of one commfuse backend: which patterns run, what is excluded, size threshold."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable
from typing import Any

import torch.nn as nn

from . import env
from .exclusion import exclude as exclude_instance

#: Names of the rewrites, in the order the graph pass applies them. ``merge_sums`` turns a sum of
#: matmul partials that is reduced (or of reduced partials) into one matmul reduced once. ``fp8``
#: is the FP8 (``_scaled_mm``) form of the three op patterns: without it they take bf16/fp16/fp32
#: matmuls only, and FP8 ones stay with Inductor. ``add_rms_norm`` takes a row-parallel matmul's
#: all-reduce together with the residual add and RMSNorm after it (``patterns/add_rms_norm.py``).
PATTERNS = ("merge_sums", "add_rms_norm", "mm_all_reduce", "all_gather_mm", "mm_reduce_scatter", "fp8")
#: The rewrites only a backend that names them runs (``backend(patterns=[...])``): once the add and
#: norm are in the op, Inductor's own fused add + norm kernel is no longer a run-time candidate, so
#: the chain fuses where the user asked for it (or, once measured, where a rule of the GPU's table
#: does).
OPT_IN = ("add_rms_norm",)
#: What a backend runs when ``patterns`` is not given.
DEFAULT_PATTERNS = tuple(p for p in PATTERNS if p not in OPT_IN)

#: Default minimum M*N*K for a fusion: below it the exchange is pure latency and fusing buys nothing
#: (the rank-local dimension counts as ``patterns.common.SHARDED_DIM``).
DEFAULT_MIN_MNK = 1 << 15

#: Modules that are never called, so never on a matmul's module stack: an ``exclude`` entry of
#: one of them excludes its members.
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)

#: How the compile-time comparison names the launch bound in force.
LAUNCH_BOUND = "launch bound (backend(launch_bound_bytes=...), else COMMFUSE_LAUNCH_BOUND_BYTES)"


def default_launch_bound_bytes() -> int:
    """``COMMFUSE_LAUNCH_BOUND_BYTES`` (bytes; 0 fuses every size). Without CUDA graphs, matmuls
    whose exchanged tensor is at most this many bytes stay unfused: they are launch-bound (decode),
    and the fused op's host cost exceeds the few microseconds of GPU time it saves."""
    return env.current().launch_bound_bytes


def merge_sums_allowed() -> bool:
    """``COMMFUSE_MERGE_SUMS=0`` switches the ``merge_sums`` rewrite off (read at compile time)."""
    return env.current().merge_sums


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one configured backend does. Part of the pass's cache key (``key()``)."""

    patterns: tuple[str, ...] = DEFAULT_PATTERNS
    exclude_classes: tuple[type, ...] = ()
    exclude_names: tuple[str, ...] = ()
    min_mnk: int = DEFAULT_MIN_MNK
    launch_bound_bytes: int | None = None  # None: default_launch_bound_bytes() when the pass runs

    def __post_init__(self) -> None:
        unknown = sorted(set(self.patterns) - set(PATTERNS))
        if unknown:
            raise ValueError(f"commfuse: unknown pattern(s) {unknown}; known: {list(PATTERNS)}")
        if self.min_mnk < 0:
            raise ValueError(f"commfuse: min_mnk must be >= 0, got {self.min_mnk}")

    @classmethod
    def build(
        cls,
        *,
        patterns: Iterable[str] | None = None,
        exclude: Iterable[Any] = (),
        min_mnk: int = DEFAULT_MIN_MNK,
        launch_bound_bytes: int | None = None,
    ) -> "Settings":
        """Sort ``exclude`` entries into classes and name patterns; instances are marked in place."""
        classes: list[type] = []
        names: list[str] = []
        if isinstance(exclude, (str, type)) or (isinstance(exclude, nn.Module)
                                                and not isinstance(exclude, _CONTAINERS)):
            exclude = (exclude,)  # one entry, not a sequence of characters
        if isinstance(patterns, str):
            patterns = (patterns,)
        for item in exclude:
            if isinstance(item, type) and issubclass(item, nn.Module):
                classes.append(item)
            elif isinstance(item, str):
                names.append(item)
            elif isinstance(item, _CONTAINERS):  # never on a module stack: its members are
                for member in (item.values() if isinstance(item, nn.ModuleDict) else item):
                    exclude_instance(member)
            elif isinstance(item, nn.Module):
                exclude_instance(item)
            else:
                raise TypeError(
                    "commfuse: exclude entries must be nn.Module subclasses, module instances or "
                    f"qualified-name patterns (str), got {item!r}"
                )
        for name, value in (("min_mnk", min_mnk), ("launch_bound_bytes", launch_bound_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0):
                raise ValueError(f"commfuse.backend: {name} must be a whole number of at least 0, got {value!r}")
        return cls(
            patterns=tuple(DEFAULT_PATTERNS if patterns is None else patterns),
            exclude_classes=tuple(classes),
            exclude_names=tuple(names),
            min_mnk=int(min_mnk),
            launch_bound_bytes=None if launch_bound_bytes is None else int(launch_bound_bytes),
        )

    @property
    def has_exclusions(self) -> bool:
        return bool(self.exclude_classes or self.exclude_names)

    def key(self) -> str:
        """A stable text of every setting that changes what the pass does."""
        classes = sorted(f"{c.__module__}.{c.__qualname__}" for c in self.exclude_classes)
        return repr((self.patterns, classes, sorted(self.exclude_names), self.min_mnk,
                     self.launch_bound(), merge_sums_allowed()))

    def alike(self) -> dict[str, Any]:
        """What every rank of a group must compile with alike: the settings that decide whether a
        call fuses (``runtime/alike.py`` compares them). Excluded module instances are marked on
        the modules themselves and are not among them. The launch bound is the one in force,
        wherever it came from (``launch_bound_bytes`` or ``COMMFUSE_LAUNCH_BOUND_BYTES``), and
        ``patterns`` a set (the pass applies them in its own order): ranks that fuse alike agree."""
        classes = sorted(f"{c.__module__}.{c.__qualname__}" for c in self.exclude_classes)
        return {"COMMFUSE_MERGE_SUMS": merge_sums_allowed(), LAUNCH_BOUND: self.launch_bound(),
                "backend(min_mnk=...)": self.min_mnk, "backend(patterns=...)": sorted(self.patterns),
                "backend(exclude=...)": classes + sorted(self.exclude_names)}

    def launch_bound(self) -> int:
        return default_launch_bound_bytes() if self.launch_bound_bytes is None else self.launch_bound_bytes
