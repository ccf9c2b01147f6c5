"""``pull``: ``all_gather_mm`` as the shard copied into the symmetric workspace, one Triton kernel
that pulls every rank's shard into the gathered tensor, then cuBLAS.

    unfused:   all_gather (NCCL) -> mm
    this path: copy shard into the workspace -> pull kernel (reads every peer's half) -> mm

Nothing overlaps: the gain is the gather itself, a kernel reading the links directly against
NCCL's latency, which matters most for small shards.

``all_gather_scaled_mm`` runs the same way: the FP8 shards' bytes are gathered (half a bf16
gather's), then the graph's own ``_scaled_mm`` (``OpSpec.product``) multiplies them.
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
