"""``fused``: ``all_gather_mm`` in one persistent Triton kernel (``kernels/fused_all_gather.py``):
the tiles of this rank's own rows multiply at once while the shard is pushed into every peer's
workspace, chunk by chunk, each chunk flagged; a tile of a peer's rows waits only for its chunks.

    unfused:   [ all_gather ---- ][ mm ------------------------------ ]
    this path: [ own rows' tiles | peers' rows' tiles, each as its chunks land ]
               [ push the shard: copy engines (side stream) or a few programs ]

Who pushes: from ``CE_MIN_SHARD_BYTES`` shards the copy engines (no SMs taken from the GEMM, each
chunk's flag a stream write), below it ``PUSHERS`` programs of the kernel (a copy's start-up
latency costs more than they do there).

``all_gather_scaled_mm`` (FP8 shards, tensor-wise scales) runs the same kernel on FP8 tensor
cores: the FP8 bytes are pushed, and the scales applied to each output tile.
``all_gather_rowwise_scaled_mm`` quantises this rank's rows first (the graph's steps, as the pull
path does) and the kernel pushes the FP8 rows with their scales under the same flags, so the
gather moves FP8 rows and one float32 a row while the GEMM runs; where the graph reads the
high-precision gathered tensor, the call runs the pull path's form instead (that tensor gathered,
then quantised), which this path's workspace also holds.
"""

from __future__ import annotations

import dataclasses


from ...kernels.sizes import fused_all_gather
from ...kernels.sizes.tiles import TileConfig
from ..workspace import TILE_FLAG_SLOTS
from .ag_pull import ROWWISE_PULL
from .ar_fused import FP8_BK
from .base import SYMM_MAX_BYTES, Call, Path, symmetric_support, tile_support

#: Shards from this size are pushed by the copy engines, smaller ones by programs of the kernel.
CE_MIN_SHARD_BYTES = 2 << 20
#: Outputs up to this many elements take 64 x 128 tiles, up to 2048 x 2048 128 x 128 ones (128 x 256
#: tiles would not fill the GPU there), larger ones the default 128 x 256.
SMALL_ELEMS, MID_ELEMS = 1 << 20, 2048 * 2048


@dataclasses.dataclass(frozen=True)
class AgFusedConfig:
    tile: TileConfig
    push: str  # "ce" (copy engines) or "sm" (programs of the kernel)
    pushers: int = fused_all_gather.PUSHERS
    ce_chunks: int = 1


def tile_config(call: Call, fp8: bool = False) -> TileConfig:
    if call.m * call.n <= SMALL_ELEMS:
        cfg = TileConfig(bm=64, bn=128, stages=4, warps=4, reducers=0)
    elif call.m * call.n <= MID_ELEMS:
        cfg = TileConfig(bm=128, bn=128, stages=4, reducers=0)
    else:
        cfg = TileConfig(reducers=0)
    return dataclasses.replace(cfg, bk=FP8_BK) if fp8 else cfg


def fused_bytes(call: Call) -> int:
    return fused_all_gather.data_elems(call.m // max(call.world, 1), call.k, call.world) * call.itemsize


class FusedAllGather(Path):
    name = "fused"

    def __init__(self, op: str = "all_gather_mm", fp8: bool = False):
        self.op, self.fp8 = op, fp8

    def supports(self, call: Call, facts) -> str | None:
        why = symmetric_support(call, facts) or tile_support(call, facts)
        if why:
            return why
        if call.rows_dim != 0:
            return "a gather along a dimension other than the rows"
        if call.m % call.world:
            return "rows that do not split into world shares"
        cfg = tile_config(call, self.fp8)
        if cfg.bm % fused_all_gather.CHUNK_ROWS:
            return f"tile height {cfg.bm} is not a multiple of {fused_all_gather.CHUNK_ROWS} rows"
        if fused_all_gather.chunk_flag_slots(call.m // call.world, call.world) > TILE_FLAG_SLOTS:
            return "more row chunks than the workspace has tile flags"
        if fused_bytes(call) > 2 * SYMM_MAX_BYTES:
            return "the workspace would be too large"
        return None

    def workspace_bytes(self, call: Call) -> int:
        return fused_bytes(call)

    def config(self, call: Call, facts, variant=None) -> AgFusedConfig:
        shard = call.m // call.world * call.k * call.itemsize
        return AgFusedConfig(tile_config(call, self.fp8), "ce" if shard >= CE_MIN_SHARD_BYTES else "sm")


FUSED = FusedAllGather()
SCALED_FUSED = FusedAllGather("all_gather_scaled_mm", fp8=True)


class RowwiseFusedAllGather(FusedAllGather):
    def __init__(self):
        super().__init__("all_gather_rowwise_scaled_mm", fp8=True)

    def workspace_bytes(self, call: Call) -> int:
        rows = call.m // max(call.world, 1)
        return max(fused_all_gather.rowwise_bytes(rows, call.k, call.world, call.itemsize),
                   ROWWISE_PULL.workspace_bytes(call))

    def supports(self, call: Call, facts) -> str | None:
        why = super().supports(call, facts)
        if why is None and self.workspace_bytes(call) > 2 * SYMM_MAX_BYTES:
            why = "the workspace would be too large"
        return why

    def config(self, call: Call, facts, variant=None) -> AgFusedConfig:
        # the row scales go with the rows: the kernel's pushers push both
        return dataclasses.replace(super().config(call, facts, variant), push="sm")


ROWWISE_FUSED = RowwiseFusedAllGather()
