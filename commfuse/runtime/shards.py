"""Whether every rank of a group calls an op with operands of the same sizes.

One dimension of a tensor-parallel product is a rank's own: K of an all-reduced or reduce-scattered
product, N of an all-gathered one, which uneven sharding sizes per rank (33 in-features on 2
ranks: 17 and 16). The collective is still well formed, but a path that read that size could
differ between the ranks, and their protocols would not pair (a hang, or a sum of mismatched
data). So the first call of a (group, op, size) learns, by one small all-reduce over the group,
whether every rank has that size, and keeps the answer; where the sizes differ, every rank takes
the unfused NCCL path. Inside a CUDA-graph capture nothing can be learned: a size no eager call
has seen counts as unlike there (every rank made the same calls before, so all decide alike).

What a rank keeps is keyed by its own size, and two layers can share a size on one rank but not
on another (in-features 33 and 32 on 2 ranks: rank 1 has 16 for both). A kept answer can then let
one rank skip the agreement that its peer enters. So once an agreement finds sizes that differ
(which every rank learns from the same call), every later call of that op on the group agrees
anew, a small collective per call in such models only. A model whose even layer comes first
cannot be protected this way without such a collective on every call (what rank 1 sees at the
two layers is the same): ``COMMFUSE_VERIFY=1`` agrees on every call from the start.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger("commfuse")

#: Answers a group keeps; its table is cleared when full (its ranks make the same calls on it, so
#: every one clears at the same call).
LIMIT = 4096

#: Agreements learned by a collective since import (tests check the first call pays one, later
#: calls none).
LEARNED = 0


def alike(group, op: str, size: int, device: torch.device, capturing: bool, verify: bool) -> bool:
    """Whether every rank of ``group`` (``groups.Group``) calls ``op`` with this rank-local
    ``size``. ``verify``: agree on every call (``COMMFUSE_VERIFY``)."""
    known = group.shard_sizes
    uneven = op in group.uneven_ops
    answer = known.get((op, size))
    if capturing:
        # nothing can be agreed here: an unknown size, or any of an op whose sizes differed, runs
        # NCCL on every rank (what eager calls learned before, every rank learned alike)
        return bool(answer) and not uneven
    if answer is not None and not uneven and not verify:
        return answer
    global LEARNED
    both = torch.tensor([size, -size], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group.pg())  # [largest, -smallest]
    largest, smallest = (int(x) for x in both.tolist())
    answer = largest == -smallest
    LEARNED += 1
    if not answer and op not in group.uneven_ops:
        group.uneven_ops.add(op)
        log.warning("commfuse.%s: the ranks of group %r have operands of different sizes (%d to %d: "
                    "an unevenly sharded dimension); these calls run the unfused NCCL path, and every "
                    "later %s call on this group first agrees on its sizes (a small collective)",
                    op, group.name, -smallest, largest, op)
    if len(known) >= LIMIT:
        known.clear()
    known[(op, size)] = answer
    return answer
