"""Opt-in check that every rank of a group makes the same commfuse call.

The symmetric-memory paths pair call e on one rank with call e on every peer by counting calls;
ranks that disagree about a call (its shapes, or which call it is: a rank that skipped one) would
exchange mismatched data, as NCCL collectives of different sizes would. With ``COMMFUSE_VERIFY=1``,
or ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (which turns on torch's own collective checks), every call
first all-gathers its signature (op, the sizes every rank shares, dtypes, arguments, the call site
and the group's count of the symmetric calls before it) over the group and raises on every rank,
naming the ranks and what each passed. It costs a small collective per call: a debugging aid, not
for production steps.

The call site (``site``, ``ops/library.py``) is what tells apart calls that look alike: a rank
that skipped one of three same-shaped calls meets its peer's next call with the same shapes and
count, but from another site, so both raise at the first call after the skipped one. The graph
pass numbers every fused call (the same numbers on every rank for the same program); a
hand-written call without a site (0) is told apart by its shapes and count only. The rank-local
size of an unevenly sharded layer (K of an all-reduced product) is not compared: it may differ
between ranks (``shards.py`` agrees on it and runs NCCL where it differs).

Calls a CUDA-graph replay makes are not seen by the host, so the count leaves out what a capture
records, and eager calls that meet a peer's replays (the graph lane, the eager twins of captured
NCCL calls) are not checked: the replaying peer would never join the check.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .. import env
from . import plans


_DETAIL = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"  # torch reads it at start too


def enabled() -> bool:
    return _DETAIL or env.current().verify


def describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype}{list(x.shape)}".replace("torch.", "")
    return repr(x)


def same_call(group, op: str, count: int, site: int = 0, **args) -> None:
    """Raise on every rank unless every rank of ``group`` (``groups.Group``) called ``op`` from the
    same ``site`` with the same signature as its ``count``-th symmetric call."""
    mine = {name: describe(value) for name, value in args.items()}
    mine["site"] = str(site)
    mine["call"] = str(count)
    every = [None] * group.world
    # (``where`` rides along for the message only: it is this process's words)
    dist.all_gather_object(every, dict(mine, where=plans.site_name(site)), group=group.pg())
    signatures = [{name: value for name, value in other.items() if name != "where"} for other in every]
    if all(other == mine for other in signatures):
        return
    first = next(r for r, other in enumerate(signatures) if other != mine)
    theirs, where = signatures[first], every[first].get("where")
    diff = ", ".join(f"{name}: {mine[name]} here, {theirs.get(name)} there"
                     for name in mine if theirs.get(name) != mine[name])
    if mine["site"] != theirs.get("site"):
        known = [f"site {s} is {w}" for s, w in ((mine["site"], plans.site_name(site)), (theirs.get("site"), where)) if w]
        diff += "".join(f"; {k}" for k in known)
    raise RuntimeError(
        f"commfuse.{op}: ranks of group {group.name!r} disagree about call {count} of the group: rank "
        f"{group.global_rank(group.rank)} and rank {group.global_rank(first)} differ ({diff}). Every rank "
        "must make the same fused calls, in the same order, with the same shapes, as for any collective "
        "(a rank that skipped a call shows here as another site).")
