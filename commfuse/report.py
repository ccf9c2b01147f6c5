"""Every candidate the graph pass looked at, fused or skipped with its reason.

Users' first complaint about fusion passes is that they silently do not fire, so each decision is
logged under the ``commfuse`` logger and kept as data: ``commfuse.report()`` after a compile.
Set ``COMMFUSE_LOG=1`` (or ``debug``) in the environment to print decisions to stderr; it is read
when commfuse is imported and again whenever the graph pass runs (0, off, false or no: quiet).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os

log = logging.getLogger("commfuse")

_MAX_RECORDS = 10_000
_records: collections.deque["MatchRecord"] = collections.deque(maxlen=_MAX_RECORDS)


def configure_logging() -> None:
    """``COMMFUSE_LOG``: a stderr handler on the ``commfuse`` logger at INFO (DEBUG for ``debug``),
    added once; unset, 0, off, false or no leave the logger as it is."""
    level = os.environ.get("COMMFUSE_LOG", "").strip().lower()
    if not level or level in ("0", "off", "false", "no"):
        return
    log.setLevel(logging.DEBUG if level == "debug" else logging.INFO)
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[commfuse] %(message)s"))
        log.addHandler(handler)


configure_logging()


@dataclasses.dataclass(frozen=True)
class MatchRecord:
    pattern: str  # "merge_sums" | "mm_all_reduce" | "all_gather_mm" | "mm_reduce_scatter"
    graph: str  # "forward" | "backward" and the graph's number in this process
    collective: str  # name of the collective node
    matmul: str | None  # name of the matmul node, when one was found
    fused: bool
    reason: str  # why it was skipped; "fused" otherwise
    shape: tuple | None = None  # (M, K, N) of the matmul
    dtype: str | None = None
    group: str | None = None
    module: str | None = None  # qualified name of the module the matmul came from

    @property
    def merge(self) -> bool:
        """A sum of matmuls made one matmul (``merge_sums``), not a fusion."""
        return self.pattern == "merge_sums"

    def line(self) -> str:
        what = "MERGED " if self.merge else "FUSED  " if self.fused else "skipped"
        shape = "x".join(str(s) for s in self.shape) if self.shape else "-"
        where = f" in {self.module}" if self.module else ""
        tail = f": {self.reason}" if self.merge or not self.fused else ""
        return (
            f"{what} {self.pattern:<17} {self.graph:<12} {self.collective}<-{self.matmul or '?'}"
            f" MKN={shape} {self.dtype or ''} group={self.group}{where}{tail}"
        )


class Report(list):
    """A list of :class:`MatchRecord`; ``print(report)`` gives one line per candidate."""

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
        reasons = collections.Counter(r.reason for r in self.skipped)
        merged = f", {len(self.merged)} sums merged" if self.merged else ""
        lines = [f"commfuse: {len(self.fused)} fused, {len(self.skipped)} skipped{merged}"]
        lines += [f"  {n} x {reason}" for reason, n in reasons.most_common()]
        return "\n".join(lines)

    def __str__(self) -> str:
        return "\n".join([r.line() for r in self] + [self.summary()])


def record(rec: MatchRecord) -> None:
    _records.append(rec)
    log.info("%s", rec.line())


def report() -> Report:
    """Decisions from every graph the pass has rewritten in this process (newest last).

    Graphs served from Inductor's FX graph cache skip the pass and add nothing here; ``python -m
    commfuse explain`` and ``torch._inductor.config.fx_graph_cache = False`` show every decision.
    """
    return Report(_records)


def clear_report() -> None:
    _records.clear()
