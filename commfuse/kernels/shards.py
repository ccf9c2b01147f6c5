"""Whether every rank of a group calls an op with operands of the same sizes.

One dimension of a tensor-parallel product is a rank's own: K of an all-reduced or reduce-scattered
product, N of an all-gathered one, which uneven sharding sizes per rank (33 in-features on 2
ranks: 17 and 16). The collective is still well formed, but a dispatch that read that size could
send the ranks down different paths, whose protocols would not pair (a hang, or a sum of mismatched
data). So the first call of a (group, op, size) learns, by one small all-reduce over the group,
whether every rank has that size, and keeps the answer; where the sizes differ, every rank takes
the unfused NCCL path. Inside a CUDA-graph capture nothing can be learned: a size no eager call
has seen counts as unlike there (every rank made the same calls before, so all decide alike).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from ..report import log

#: (group, op, size) -> whether every rank had that size; cleared when full (ranks make the same
#: calls, so every rank clears it at the same call).
_known: dict[tuple, bool] = {}
LIMIT = 4096

#: Agreements learned by a collective since import (tests check the first call pays one, later
#: calls none).
LEARNED = 0


def alike(group_name: str, op: str, size: int, device: torch.device) -> bool:
    """Whether every rank of ``group_name`` calls ``op`` with this rank-local ``size``."""
    key = (group_name, op, size)
    known = _known.get(key)
    if known is not None:
        return known
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False  # not kept: an eager call learns it
    global LEARNED
    group = _resolve_process_group(group_name)
    both = torch.tensor([size, -size], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)  # [largest, -smallest]
    largest, smallest = (int(x) for x in both.tolist())
    known = largest == -smallest
    LEARNED += 1
    if not known:
        log.warning("commfuse.%s: the ranks of group %r have operands of different sizes (%d to %d: "
                    "an unevenly sharded dimension); these calls run the unfused NCCL path",
                    op, group_name, -smallest, largest)
    if len(_known) >= LIMIT:
        _known.clear()
    _known[key] = known
    return known
