"""Opt-in check that every rank of a group makes the same commfuse call.

The symmetric-memory paths pair call e on one rank with call e on every peer by counting calls;
ranks that disagree about a call's shapes would exchange mismatched data (as NCCL collectives of
different sizes would). With ``COMMFUSE_VERIFY=1``, or ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (which
turns on torch's own collective checks), every call first all-gathers its signature (op, shapes,
dtypes, arguments) over the group and raises on every rank, naming the ranks and what each
passed. It costs a small collective per call: a debugging aid, not for production steps.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from .. import env


def enabled() -> bool:
    return (env.flag("COMMFUSE_VERIFY", False)
            or os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL")


def _describe(x):
    if isinstance(x, torch.Tensor):
        return f"{x.dtype}{list(x.shape)}".replace("torch.", "")
    return repr(x)


def same_call(op: str, group_name: str, **args) -> None:
    """Raise unless every rank of ``group_name`` called ``op`` with the same signature."""
    if not enabled() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return
    group = _resolve_process_group(group_name)
    mine = {name: _describe(value) for name, value in args.items()}
    every = [None] * group.size()
    dist.all_gather_object(every, mine, group=group)
    if all(other == mine for other in every):
        return
    rank = group.rank()
    first = next(r for r, other in enumerate(every) if other != mine)
    diff = ", ".join(f"{name}: {mine[name]} here, {every[first][name]} there"
                     for name in mine if every[first].get(name) != mine[name])
    raise RuntimeError(
        f"commfuse.{op}: ranks of group {group_name!r} disagree about the call: rank {rank} and "
        f"rank {first} differ ({diff}). Every rank must make the same fused calls with the same "
        "shapes, as for any collective.")
