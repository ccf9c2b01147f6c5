"""What the run-time counts, in one place: the calls of each op and path, the copy-engine graphs'
eager, captured and replayed calls, the fused kernels' variants, and the generation of the state
that kept call plans depend on.

The report and the tests read these; the run-time only adds to them. Nothing here is per group
(per-group state lives in ``groups.Group``) and nothing here imports Triton or another commfuse
module, so the compile-time side can import it as any other module.

What must hold: a counter only grows, except through ``ran_instead`` (a chosen path that handed
its call to another: the call is counted once, under the path that ran).
"""

from __future__ import annotations

import collections

#: Real (non-fake) invocations per op since import: compiled code called the op.
CALLS: collections.Counter[str] = collections.Counter()

#: Calls per path that ran (``mm_all_reduce:fused``, ...) since import: which path a call took.
PATHS: collections.Counter[str] = collections.Counter()

#: Copy-engine calls (``ce_graphs.py``) that ran eagerly (first seen), were captured, or replayed.
CE_GRAPHS: collections.Counter[str] = collections.Counter(eager=0, captured=0, replayed=0)

#: Launches of the fused kernels per variant (``fused_all_reduce:inline``, ``fused_all_reduce:tma``,
#: ``fused_all_reduce:pull``, ``fused_all_gather:ce_push``): which variant of a path ran.
KERNELS: collections.Counter[str] = collections.Counter()

#: Bumped whenever state that kept call plans depend on changes (facts agreed, a capture
#: recorded, a group re-created or released, a buffer grown, the settings changed): a plan made
#: under another generation is decided anew (``entry.py``).
generation = 0


def bump() -> None:
    global generation
    generation += 1


def ran(op: str, name: str) -> None:
    PATHS[f"{op}:{name}"] += 1


def ran_instead(op: str, algo: str, instead: str) -> None:
    """``PATHS`` counts the path a call took: ``algo`` was chosen but ``instead`` ran."""
    PATHS[f"{op}:{algo}"] -= 1
    PATHS[f"{op}:{instead}"] += 1


def launched(kernel: str, variants: tuple[str, ...]) -> None:
    """A launch of ``kernel`` that ran ``variants`` (what its ``prepare`` said of the launch)."""
    for variant in variants:
        KERNELS[f"{kernel}:{variant}"] += 1
