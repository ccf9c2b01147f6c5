"""``ce_overlap``: ``mm_reduce_scatter`` with the peers' shares multiplied first, in row chunks,
each chunk pulled by its owner's copy engines while the next multiplies; this rank's own share
last, adding the pulled partials in its GEMMs' epilogue.

    unfused:   [ mm (all rows) ------------------ ][ reduce_scatter ---- ]
    this path: [ mm: peers' shares, chunk by chunk ][ mm + pulled partials: own share ]
               [ copy engines: each peer pulls its chunks as they land ]   (side stream)

This rank's product is added last and unrounded (``addmm``), which differs from the rank-order
sum of rounded partials by rounding only. With one chunk per share nothing is pulled before the
own share's GEMM could start, so that GEMM runs at once into a buffer while the pulls land, and one
pass sums the shares in rank order. A batch of sequences scattered along the sequence
(``Call.slabs`` > 1) is taken slab by slab, one chunk per slab.
"""

from __future__ import annotations

import dataclasses


from ..workspace import BASES_BYTES, FLAG_BYTES
from .base import Call, Path, copy_engine_support

#: Shares of this many rows and more take 4 row chunks, smaller ones 2; slabs one each.
LARGE_SHARE_ROWS, LARGE_SHARE_CHUNKS, SHARE_CHUNKS = 8192, 4, 2


@dataclasses.dataclass(frozen=True)
class RsOverlapConfig:
    chunks: int  # row chunks per share (per slab)


def chunks(rows: int, world: int, slabs: int = 1, given: int | None = None) -> int:
    """Row chunks per share of ``rows`` rows: one barrier flag slot per chunk, slab and step, at most
    what the flag area holds (0: none fits)."""
    slots = (FLAG_BYTES - BASES_BYTES) // 4 // max(world, 1) // max(world - 1, 1) // max(slabs, 1)
    if slots < 1 or rows < 1:
        return 0
    default = 1 if slabs > 1 else LARGE_SHARE_CHUNKS if rows >= LARGE_SHARE_ROWS else SHARE_CHUNKS
    return max(1, min(given or default, rows, 64, slots))


def _share_rows(call: Call) -> int:
    return call.m // call.world // max(call.slabs, 1)


class CeOverlapReduceScatter(Path):
    op = "mm_reduce_scatter"
    name = "ce_overlap"

    def supports(self, call: Call, facts) -> str | None:
        why = copy_engine_support(call, facts)
        if why is None and chunks(_share_rows(call), call.world, max(call.slabs, 1)) < 1:
            why = "no row chunk fits the workspace's flags"
        return why

    def workspace_bytes(self, call: Call) -> int:
        return call.m * call.n * call.itemsize

    def config(self, call: Call, facts, variant=None) -> RsOverlapConfig:
        return RsOverlapConfig(chunks(_share_rows(call), call.world, max(call.slabs, 1)))


CE_OVERLAP = CeOverlapReduceScatter()
