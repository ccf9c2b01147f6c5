"""``fused``: ``mm_reduce_scatter`` as the fused tile kernel's reduce-scatter form
(``kernels/fused_all_reduce.py`` with ``SCATTER``): rank o owns the tiles of its share of the rows.

    unfused:   [ GEMM ---------------------- ][ reduce_scatter ---- ]
    this path: [ peers' shares' tiles, each pushed to its owner as it finishes ][ own share's
                 tiles, adding the pushed partials in their epilogue ]

Nothing is pushed back (each rank keeps only its share), so every program multiplies.
"""

from __future__ import annotations


from ...kernels.sizes import fused_all_reduce
from .base import Call, Path
from .ar_fused import FusedConfig, fused_bytes, fused_support, tile_config


class FusedReduceScatter(Path):
    op = "mm_reduce_scatter"
    name = "fused"

    def supports(self, call: Call, facts) -> str | None:
        return fused_support(call, facts, scatter=True)

    def workspace_bytes(self, call: Call) -> int:
        return fused_bytes(call, scatter=True)

    def config(self, call: Call, facts, variant=None) -> FusedConfig:
        return FusedConfig(tile_config(call, True), fused_all_reduce.Options())


FUSED = FusedReduceScatter()
