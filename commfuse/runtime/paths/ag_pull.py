"""``pull``: ``all_gather_mm`` as the shard copied into the symmetric workspace, one Triton kernel
that pulls every rank's shard into the gathered tensor, then cuBLAS.

    unfused:   all_gather (NCCL) -> mm
    this path: copy shard into the workspace -> pull kernel (reads every peer's half) -> mm

Nothing overlaps: the gain is the gather itself, a kernel reading the links directly against
NCCL's latency, which matters most for small shards.

``all_gather_scaled_mm`` runs the same way: the FP8 shards' bytes are gathered (half a bf16
gather's), then the graph's own ``_scaled_mm`` (``OpSpec.product``) multiplies them.

``all_gather_rowwise_scaled_mm`` (``RowwiseGatherPull``) quantises its own rows first, as the graph
would have quantised them after the gather (``reference.quantise_rows``: each row is its own, so
the same bits), and gathers each rank's FP8 rows with their float32 multipliers packed behind them,
one gather of ``rows * (K + 4)`` bytes per rank (to a multiple of 16) instead of ``rows * K * 2``:

    unfused:   all_gather(bf16 x) -> quantise rows -> _scaled_mm
    this path: quantise own rows -> [FP8 rows | multipliers] into the workspace -> pull kernel
               -> unpack -> _scaled_mm

Where the graph still reads the bf16 gathered tensor (``return_gathered``: training quantises it
column-wise too), it gathers that once and quantises after the gather, as the unfused op does. Each
rank's rows must be one block (``Call.rows_dim`` 0): the multipliers travel as a second block.
"""

from __future__ import annotations


import torch

from .base import Call, Path


def shard_bytes(call: Call) -> int:
    return call.m // max(call.world, 1) * call.k * call.itemsize


def gather_shape(shard: torch.Tensor, gather_dim: int, world: int) -> list:
    shape = list(shard.shape)
    shape[gather_dim] *= world
    return shape


class AllGatherPull(Path):
    name = "pull"

    def __init__(self, op: str = "all_gather_mm"):
        self.op = op

    def workspace_bytes(self, call: Call) -> int:
        return shard_bytes(call)


PULL = AllGatherPull()
SCALED_PULL = AllGatherPull("all_gather_scaled_mm")


class RowwiseGatherPull(AllGatherPull):
    def __init__(self):
        super().__init__("all_gather_rowwise_scaled_mm")

    def supports(self, call: Call, facts) -> str | None:
        if call.rows_dim != 0:
            return "each rank's rows in slabs (its FP8 rows and multipliers gather as two blocks per rank)"
        return super().supports(call, facts)

    def workspace_bytes(self, call: Call) -> int:
        """The larger of the two forms: FP8 rows and a float32 multiplier each (to a multiple of 16
        bytes), or the bf16 shard."""
        rows = call.m // max(call.world, 1)
        return max(-(-rows * (call.k + 4) // 16) * 16, rows * 2 * call.k)


ROWWISE_PULL = RowwiseGatherPull()
