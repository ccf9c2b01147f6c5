"""Opt-in check that every rank of a group makes the same commfuse call.

The symmetric-memory paths pair call e on one rank with call e on every peer by counting calls;
ranks that disagree about a call (its shapes, or which call it is: a rank that skipped one) would
exchange mismatched data, as NCCL collectives of different sizes would. With ``COMMFUSE_VERIFY=1``,
or ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (which turns on torch's own collective checks), every call
first all-gathers its signature (op, shapes, dtypes, arguments, and the group's count of the
symmetric calls before it) over the group and raises on every rank, naming the ranks and what
each passed. It costs a small collective per call: a debugging aid, not for production steps.

Calls a CUDA-graph replay makes are not seen by the host, so the count leaves out what a capture
records, and eager calls that meet a peer's replays (the graph lane, the eager twins of captured
NCCL calls) are not checked: the replaying peer would never join the check.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .. import env


_DETAIL = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"  # torch reads it at start too


def enabled() -> bool:
    return _DETAIL or env.current().verify


def describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype}{list(x.shape)}".replace("torch.", "")
    return repr(x)


def same_call(group, op: str, count: int, **args) -> None:
    """Raise on every rank unless every rank of ``group`` (``groups.Group``) called ``op`` with the
    same signature as its ``count``-th symmetric call."""
    mine = {name: describe(value) for name, value in args.items()}
    mine["call"] = str(count)
    every = [None] * group.world
    dist.all_gather_object(every, mine, group=group.pg())
    if all(other == mine for other in every):
        return
    first = next(r for r, other in enumerate(every) if other != mine)
    diff = ", ".join(f"{name}: {mine[name]} here, {every[first].get(name)} there"
                     for name in mine if every[first].get(name) != mine[name])
    raise RuntimeError(
        f"commfuse.{op}: ranks of group {group.name!r} disagree about call {count} of the group: rank "
        f"{group.global_rank(group.rank)} and rank {group.global_rank(first)} differ ({diff}). Every rank "
        "must make the same fused calls, in the same order, with the same shapes, as for any collective.")
