"""``fused``: ``mm_reduce_scatter`` as the fused tile kernel's reduce-scatter form
(``kernels/fused_all_reduce.py`` with ``SCATTER``): rank o owns the tiles of its share of the rows.

    unfused:   [ GEMM ---------------------- ][ reduce_scatter ---- ]
    this path: [ peers' shares' tiles, each pushed to its owner as it finishes ][ own share's
                 tiles, adding the pushed partials in their epilogue ]

Nothing is pushed back (each rank keeps only its share), so every program multiplies.
``scaled_mm_reduce_scatter`` and ``rowwise_scaled_mm_reduce_scatter`` run it on FP8 operands, as
``ar_fused.py`` says.
"""

from __future__ import annotations


from ...kernels.sizes import fused_all_reduce
from .base import Call, Path
from .ar_fused import FusedConfig, fused_bytes, fused_support, tile_config


class FusedReduceScatter(Path):
    name = "fused"

    def __init__(self, op: str = "mm_reduce_scatter", fp8: bool = False):
        self.op, self.fp8 = op, fp8

    def supports(self, call: Call, facts) -> str | None:
        return fused_support(call, facts, True, self.fp8)

    def workspace_bytes(self, call: Call) -> int:
        return fused_bytes(call, scatter=True)

    def config(self, call: Call, facts, variant=None) -> FusedConfig:
        return FusedConfig(tile_config(call, True, self.fp8), fused_all_reduce.Options())


FUSED = FusedReduceScatter()
SCALED_FUSED = FusedReduceScatter("scaled_mm_reduce_scatter", fp8=True)
ROWWISE_FUSED = FusedReduceScatter("rowwise_scaled_mm_reduce_scatter", fp8=True)
