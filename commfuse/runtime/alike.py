"""Settings that every rank of a group must set alike, compared through the group's store.

A setting that decides which path or collective a call takes (``env.ALIKE``) and differs between
ranks gives two ranks different protocols for one call: a sum read before the peer wrote it, or a
collective only one rank joins. No collective of commfuse's can compare them safely, since which
collective a rank issues is what differs. So each rank writes its values into the process group's
key-value store and reads its peers' (a store read, bounded by ``COMMFUSE_TIMEOUT_S``), and every
rank raises the same error, naming each differing setting and every rank's value:

* at a group's first commfuse call outside a capture, and at its first after a must-be-alike
  setting changed (``env.override``, ``env.reload``): the run-time settings (``agree_at_call``,
  before ``COMMFUSE_VERIFY``'s check and the group's facts; on the CPU's reference path too);
* when Dynamo hands the backend a graph that uses a group: the settings that decide *whether* a
  call fuses (the launch bound, merge sums, the backend's ``min_mnk``, ``patterns``, ``exclude``),
  which act at compile time, so a rank that fuses a call and a peer that leaves it to NCCL never
  both reach commfuse (``agree_compiled``). Only the backend compares them: it is called on every
  rank for every graph, where Inductor's caches may skip the graph pass on some ranks only.

A rank that waits in vain for its peers (a change made on some ranks only) names, in its error,
the settings it changed since the ranks last agreed.

The fake test backend has no peers to compare with: nothing is compared there.
"""

from __future__ import annotations

import datetime
import json
import weakref
from typing import Any

import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_process_group_store, _resolve_process_group

from .. import env
from . import verify
from .groups import _members

_PREFIX = "commfuse/alike"


def _shown(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


def _comparable(pg) -> bool:
    """A group whose ranks are processes with a store to meet in."""
    if pg is None or pg.size() < 2:
        return False
    try:
        return dist.get_backend(pg) != "fake"
    except Exception:  # noqa: BLE001 - a group torch does not know the backend of: nothing to compare with
        return False


def changes(before: dict[str, Any] | None, mine: dict[str, Any]) -> str:
    """What ``mine`` changed since ``before`` (the values the ranks last agreed on), as the error
    of a rank whose peers did not compare shows it: ``COMMFUSE_ALGO (unset -> one_shot)``."""
    if before is None:
        return ""
    names = sorted(set(before) | set(mine))
    return ", ".join(f"{name} ({_shown(before.get(name))} -> {_shown(mine.get(name))})"
                     for name in names if before.get(name) != mine.get(name))


def compare(pg, where: str, mine: dict[str, Any], what: str, changed: str = "") -> None:
    """Write ``mine`` under ``where`` in ``pg``'s store and read every rank's; raise on every rank,
    in the same words, if any value differs, or if a rank did not write within the wait bound
    (``changed``: what this rank changed since the ranks last agreed, for that error)."""
    store = _get_process_group_store(pg)
    rank, world, ranks = pg.rank(), pg.size(), _members(pg)
    prefix = f"{_PREFIX}/{pg.group_name}/{where}/"
    store.set(prefix + str(rank), json.dumps(mine, sort_keys=True))
    keys = [prefix + str(r) for r in range(world)]
    bound = env.current().timeout_s
    try:
        store.wait(keys, datetime.timedelta(seconds=bound))
    except Exception as exc:  # noqa: BLE001 - the store's timeout error: say who is missing
        missing = [ranks[r] for r, key in enumerate(keys) if not store.check([key])]
        why = (f"this rank changed {changed} since the ranks last agreed: a must-be-alike setting "
               "changed on some ranks only (env.override, env.reload) must be changed on every rank"
               if changed else "every rank of the group must reach this point together")
        raise RuntimeError(
            f"{what}: rank {ranks[rank]} of group {pg.group_name!r} waited {bound:g} s "
            f"(COMMFUSE_TIMEOUT_S) for rank(s) {missing} to publish their settings ({type(exc).__name__}); "
            f"{why}") from None
    every = [json.loads(store.get(key)) for key in keys]
    names = sorted({name for values in every for name in values})
    differ = [name for name in names if any(values.get(name) != every[0].get(name) for values in every)]
    if differ:
        shown = "; ".join(f"{name} (" + ", ".join(f"rank {ranks[r]}: {_shown(values.get(name))}"
                                                  for r, values in enumerate(every)) + ")" for name in differ)
        raise RuntimeError(
            f"{what}: the ranks of group {pg.group_name!r} differ in settings that must be alike: "
            f"{shown}. Set them alike on every rank (docs/settings.md).")


def runtime_settings() -> dict[str, Any]:
    """This rank's must-be-alike settings that act at a call (``COMMFUSE_VERIFY`` as in force:
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` turns it on)."""
    mine = dict(env.current().alike(compile=False))
    mine["COMMFUSE_VERIFY"] = verify.enabled()
    return mine


#: group name -> [the process group, comparisons of run-time settings so far, the settings its ranks
#: agreed on]: kept per process group, not per ``groups.Group``, which ``groups.release`` drops
#: (the settings stay agreed: a rank's first call after a release compares nothing) and of which
#: a group has one per provider
_calls: dict[str, list] = {}


def _count(table: dict, pg, *fresh) -> list:
    entry = table.get(pg.group_name)
    if entry is None or entry[0]() is not pg:  # a group re-created under its name starts afresh
        entry = table[pg.group_name] = [weakref.ref(pg), *fresh]
    return entry


def agree_at_call(group, op: str) -> None:
    """Every rank of ``group`` (``groups.Group``) together: compare the run-time settings at the
    process group's first call and again whenever they change. Called outside captures, before
    any collective of the call (``entry._enter``); ``group.settings_of`` keeps the settings
    object it checked, so a call under the same object returns at once."""
    values = env.current()
    pg = group.pg()
    if _comparable(pg):
        mine = runtime_settings()
        entry = _count(_calls, pg, 0, None)
        if mine != entry[2]:
            entry[1] += 1  # a failed comparison counts too: every rank moves on alike
            compare(pg, f"call/{entry[1] - 1}", mine, f"commfuse.{op}", changes(entry[2], mine))
            entry[2] = mine
    group.settings_of = values


#: group name -> [the process group, the compile-time settings its ranks agreed on (as text),
#: comparisons so far, the settings of the last agreement]
_compiled: dict[str, list] = {}


def _compiled_entry(group_name: str) -> list | None:
    try:
        pg = _resolve_process_group(group_name)
    except Exception:  # noqa: BLE001 - a name that does not resolve is the graph pass's to report
        return None
    if not _comparable(pg):
        return None
    return _count(_compiled, pg, set(), 0, None)


def agree_compiled(group_name: str, mine: dict[str, Any]) -> None:
    """Every rank of the group together, when Dynamo hands the backend a graph that uses it:
    compare the settings that decide whether a call fuses. Settings the ranks agreed on once are
    not compared again; new ones are compared as the group's n-th comparison with each peer's n-th
    (every rank's backend is handed the same graphs in the same order, whatever Inductor's caches
    hold, and a comparison that failed counts too, so a later one never reads a peer's earlier
    values)."""
    entry = _compiled_entry(group_name)
    if entry is None:
        return
    text = json.dumps(mine, sort_keys=True)
    if text in entry[1]:
        return
    entry[2] += 1
    compare(entry[0](), f"compile/{entry[2] - 1}", mine, "commfuse: compiling a graph", changes(entry[3], mine))
    entry[1].add(text)
    entry[3] = mine


def compiled_agreed(group_name: str, mine: dict[str, Any]) -> bool:
    """Whether the ranks of the group agreed on ``mine`` (or have no peers to compare with): read
    here only, never a wait."""
    entry = _compiled_entry(group_name)
    return entry is None or json.dumps(mine, sort_keys=True) in entry[1]
