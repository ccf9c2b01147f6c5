"""``fused``: ``mm_all_reduce`` in one persistent Triton kernel (``kernels/fused_all_reduce.py``)
that reduces each finished tile while later tiles still multiply.

    unfused:   [ GEMM ------------------------- ][ all_reduce ----- ]
    this path: [ GEMM tiles: peers' tiles first, pushed to their owners; own tiles last, the pushed
                 partials added in their epilogue and the sum pushed back ][ last copies ]

Every rank multiplies the peers' tiles first and its own last, so by the time it multiplies a tile
it owns, the peers pushed their partials of that tile long ago; every byte crossing the links is a
store. The programs start their first tiles spread over ``stagger_us`` so their pushes do not
leave at once (a one-wave call spreads less: the spread delays its end as much as its start).

``scaled_mm_all_reduce`` (FP8 operands, tensor-wise scales) runs the same kernel on FP8 tensor
cores: each tile's accumulator is multiplied by this rank's scales before it is pushed or summed,
so the partials exchanged are the output dtype's, as the unfused graph's are. So does
``rowwise_scaled_mm_all_reduce``, a scale per row and per column; in the backward's form (unit
scales in ``_scaled_mm``, the row and column scales multiplied in after it, the product rounded
in between) the kernel multiplies by the scales' products in fp32 and rounds once.
"""

from __future__ import annotations

import dataclasses


from ...kernels.sizes import fused_all_reduce
from ...kernels.sizes.tiles import TileConfig
from ..workspace import TILE_FLAG_SLOTS
from .base import SYMM_MAX_BYTES, Call, Path, symmetric_support, tile_support

#: The default tiling: 128 x 256 tiles, no reducer programs (the multiplying programs copy the
#: pushed sums inline, in the ticket order).
TILE = TileConfig(reducers=0)
#: Start spread of the programs' first tiles, µs: calls of more than one wave of tiles, one wave.
STAGGER_US = (25, 15)
#: Reduce-scatter outputs up to this many elements take 64 x 128 tiles: 128 x 256 ones would be
#: too few to overlap anything.
SMALL_ELEMS = 1 << 20
SMALL_TILE = TileConfig(bm=64, bn=128, stages=4, warps=4, reducers=0)


@dataclasses.dataclass(frozen=True)
class FusedConfig:
    tile: TileConfig
    options: fused_all_reduce.Options


#: K block of FP8 operands: 128 bytes of a row, as bf16's 64 elements are.
FP8_BK = 128


def tile_config(call: Call, scatter: bool, fp8: bool = False) -> TileConfig:
    """The tiling: 128 x 256, or ``SMALL_TILE`` for a small reduce-scatter; ``fp8`` operands take K
    blocks of ``FP8_BK``."""
    cfg = SMALL_TILE if scatter and call.m * call.n <= SMALL_ELEMS else TILE
    return dataclasses.replace(cfg, bk=FP8_BK) if fp8 else cfg


def fused_support(call: Call, facts, scatter: bool, fp8: bool = False) -> str | None:
    """Why the tile kernel (or its reduce-scatter form; on ``fp8`` operands) cannot take ``call``,
    or None."""
    why = symmetric_support(call, facts) or tile_support(call, facts)
    if why:
        return why
    if fp8 and call.k % 16:  # (the call's dtype is the output's; the operands are bytes)
        return "K is not a multiple of 16 (FP8 rows for TMA descriptors)"
    if scatter:
        if call.rows_dim != 0:
            return "a scatter along a dimension other than the rows"
        if call.m % call.world:
            return "rows that do not split into world shares"
    cfg = tile_config(call, scatter, fp8)
    if fused_all_reduce.tile_flag_slots(call.m, call.n, call.world, cfg, scatter) > TILE_FLAG_SLOTS:
        return "more tiles than the workspace has tile flags"
    if fused_all_reduce.data_elems(call.m, call.n, call.world, cfg, scatter) * call.itemsize > 2 * SYMM_MAX_BYTES:
        return "the workspace would be too large"
    return None


def fused_bytes(call: Call, scatter: bool) -> int:
    cfg = tile_config(call, scatter)
    return fused_all_reduce.data_elems(call.m, call.n, call.world, cfg, scatter) * call.itemsize


class FusedAllReduce(Path):
    name = "fused"

    def __init__(self, op: str = "mm_all_reduce", fp8: bool = False):
        self.op, self.fp8 = op, fp8

    def supports(self, call: Call, facts) -> str | None:
        return fused_support(call, facts, False, self.fp8)

    def workspace_bytes(self, call: Call) -> int:
        return fused_bytes(call, scatter=False)

    def config(self, call: Call, facts, variant=None) -> FusedConfig:
        stagger = tuple(us * 1000 for us in STAGGER_US)
        return FusedConfig(tile_config(call, False, self.fp8), fused_all_reduce.Options(stagger_ns=stagger))


FUSED = FusedAllReduce()
SCALED_FUSED = FusedAllReduce("scaled_mm_all_reduce", fp8=True)
ROWWISE_FUSED = FusedAllReduce("rowwise_scaled_mm_all_reduce", fp8=True)
