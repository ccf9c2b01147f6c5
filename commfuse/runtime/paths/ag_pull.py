"""``symm``: ``all_gather_mm`` as the shard copied into the symmetric workspace, one Triton kernel
that pulls every rank's shard into the gathered tensor, then cuBLAS.

    unfused:   all_gather (NCCL) -> mm
    this path: copy shard into the workspace -> pull kernel (reads every peer's half) -> mm

Nothing overlaps: the gain is the gather itself, a kernel reading the links directly against
NCCL's latency, which matters most for small shards.
"""

from __future__ import annotations

import math

import torch

from ...kernels import exchange
from ...kernels.sync import OP_ALL_GATHER_MM
from .base import Call, Context, Path
from .common import exchange as epoch_of, matmul_into, workspace


def shard_bytes(call: Call) -> int:
    return call.m // max(call.world, 1) * call.k * call.itemsize


def gather_shape(shard: torch.Tensor, gather_dim: int, world: int) -> list:
    shape = list(shard.shape)
    shape[gather_dim] *= world
    return shape


class AllGatherPull(Path):
    op = "all_gather_mm"
    name = "symm"

    def workspace_bytes(self, call: Call) -> int:
        return shard_bytes(call)

    def run(self, ctx: Context, args):
        shard, b, bias, gather_dim, world = args.shard, args.b, args.bias, args.gather_dim, args.world_size
        k = shard.shape[-1]
        ws = workspace(ctx, shard.numel() * shard.element_size(), shard.device)
        out = torch.empty((ctx.call.m, b.shape[1]), dtype=shard.dtype, device=shard.device)
        gathered = torch.empty(gather_shape(shard, gather_dim, world), dtype=shard.dtype, device=shard.device)
        with epoch_of(ctx, ws, self.op) as (epoch, parity):
            pull(ws, shard, gathered, gather_dim, epoch, parity)
            matmul_into(gathered.view(-1, k), b, bias, out)
        return out, gathered


def pull(ws, shard, gathered, gather_dim: int, epoch: int, parity: int) -> None:
    """Copy ``shard`` into this call's half and gather every rank's into ``gathered``."""
    mine = ws.data(parity, shard.shape, shard.dtype)
    mine.copy_(shard)
    outer = math.prod(shard.shape[:gather_dim])
    inner = math.prod(shard.shape[gather_dim:])
    exchange.gather(ws, mine, gathered, outer, inner, epoch, OP_ALL_GATHER_MM)


SYMM = AllGatherPull()
