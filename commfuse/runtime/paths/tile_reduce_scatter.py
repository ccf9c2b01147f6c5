"""``fused``: ``mm_reduce_scatter`` as the fused tile kernel's reduce-scatter form
(``kernels/fused_all_reduce.py`` with ``SCATTER``): rank o owns the tiles of its share of the rows.

    unfused:   [ GEMM ---------------------- ][ reduce_scatter ---- ]
    this path: [ peers' shares' tiles, each pushed to its owner as it finishes ][ own share's
                 tiles, adding the pushed partials in their epilogue ]

Nothing is pushed back (each rank keeps only its share), so every program multiplies.
"""

from __future__ import annotations

import torch

from ...kernels import fused_all_reduce
from .base import Call, Context, Path
from .tile_all_reduce import FusedConfig, fused_bytes, fused_support, run_fused, tile_config


class TileReduceScatter(Path):
    op = "mm_reduce_scatter"
    name = "fused"

    def supports(self, call: Call, facts) -> str | None:
        return fused_support(call, facts, scatter=True)

    def workspace_bytes(self, call: Call) -> int:
        return fused_bytes(call, scatter=True)

    def config(self, call: Call, facts, variant=None) -> FusedConfig:
        return FusedConfig(tile_config(call, True), fused_all_reduce.Options())

    def run(self, ctx: Context, args) -> torch.Tensor:
        a, b = args.a, args.b
        out = torch.empty(_scattered(args), dtype=a.dtype, device=a.device)  # before the epoch
        return run_fused(ctx, a, b, args.bias, out, self.op, True, ctx.config or self.config(ctx.call, ctx.facts))


def _scattered(args) -> list:
    shape = list(args.shape)
    shape[args.scatter_dim] //= args.world_size
    return shape


FUSED = TileReduceScatter()
