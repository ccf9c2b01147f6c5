"""``pull``: ``mm_reduce_scatter`` as cuBLAS into the symmetric workspace, then one Triton kernel
that pulls every rank's partial of this rank's share and sums them in rank order.

    unfused:   mm -> reduce_scatter (NCCL)
    this path: mm into the workspace's half of this call -> pull-and-sum kernel -> this rank's share

The FP8 reduce-scatters (``scaled_mm_reduce_scatter``, ``rowwise_scaled_mm_reduce_scatter``) run
the same way, their product the graph's own ``_scaled_mm`` (``OpSpec.product``) into the workspace.
"""

from __future__ import annotations


from .base import Call, Path


def scattered_shape(args) -> list:
    shape = list(args.shape)
    shape[args.scatter_dim] //= args.world_size
    return shape


class ReduceScatterPull(Path):
    name = "pull"

    def __init__(self, op: str = "mm_reduce_scatter"):
        self.op = op

    def workspace_bytes(self, call: Call) -> int:
        return call.m * call.n * call.itemsize


PULL = ReduceScatterPull()
SCALED_PULL = ReduceScatterPull("scaled_mm_reduce_scatter")
ROWWISE_PULL = ReduceScatterPull("rowwise_scaled_mm_reduce_scatter")
