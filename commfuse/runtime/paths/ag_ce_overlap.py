"""``ce_overlap``: ``all_gather_mm`` as the local shard's rows multiplied at once while the copy
engines (no SMs) pull the peers' shards on a side stream, then the peers' rows multiplied.

    unfused:   [ all_gather ----- ][ mm (all rows) ------------- ]
    this path: [ mm (own rows) ---][ mm (peers' rows) ---------- ]
               [ copy engines: pull the peers' shards ]             (side stream)

The shard is first copied into the workspace, where the peers pull it, and the local GEMM reads that
copy. A batch of sequences gathered along the sequence (``Call.slabs`` > 1) runs slab by slab, one GEMM and one
copy per rank's block of each slab.
"""

from __future__ import annotations


from .ag_pull import shard_bytes
from .base import Call, Path, copy_engine_support


class CeOverlapAllGather(Path):
    op = "all_gather_mm"
    name = "ce_overlap"

    def supports(self, call: Call, facts) -> str | None:
        return copy_engine_support(call, facts)

    def workspace_bytes(self, call: Call) -> int:
        return shard_bytes(call)


CE_OVERLAP = CeOverlapAllGather()
