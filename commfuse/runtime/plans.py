"""What compiled graphs tell the run-time: the symmetric bytes each group's fused ops need, and
where each call site is. The graph pass registers them; the run-time reads them.

This is the one piece of run-time state that compile time writes. It holds no device memory and
makes no collective: a plan only sizes a group's first allocation (so a compiled graph's fused
ops need no growth), which the ranks then agree on (the largest of theirs: a rank whose graph a
cache served may have planned nothing), and a site's name only words messages. Neither decides
a path, so a rank that compiled nothing still decides alike.
"""

from __future__ import annotations

import threading

_planned: dict[str, int] = {}  # group name -> largest per-parity bytes a compiled graph needs
_lock = threading.Lock()

#: site -> where it is in this rank's graphs (the graph pass's words, for messages only: the
#: graph numbers in them are this process's); cleared when full.
_sites: dict[int, str] = {}
SITES_LIMIT = 4096


def register(group_name: str, data_bytes: int) -> None:
    """A compiled graph will need ``data_bytes`` per parity on ``group_name``: the largest
    registered counts."""
    with _lock:
        _planned[group_name] = max(_planned.get(group_name, 0), int(data_bytes))


def planned(group_name: str) -> int:
    """The largest per-parity bytes registered for ``group_name`` (0: none)."""
    return _planned.get(group_name, 0)


def name_site(site: int, where: str) -> None:
    """Remember where ``site`` is, for messages that name it (``verify.same_call``)."""
    if len(_sites) >= SITES_LIMIT:
        _sites.clear()
    _sites[site] = where


def site_name(site: int) -> str | None:
    return _sites.get(site)
