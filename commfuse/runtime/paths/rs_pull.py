"""``symm``: ``mm_reduce_scatter`` as cuBLAS into the symmetric workspace, then one Triton kernel
that pulls every rank's partial of this rank's share and sums them in rank order.

    unfused:   mm -> reduce_scatter (NCCL)
    this path: mm into the workspace's half of this call -> pull-and-sum kernel -> this rank's share
"""

from __future__ import annotations

import math

import torch

from ...kernels import exchange
from ...kernels.sync import OP_MM_REDUCE_SCATTER
from .base import Call, Context, Path
from .common import exchange as epoch_of, matmul_into, workspace


def scattered_shape(args) -> list:
    shape = list(args.shape)
    shape[args.scatter_dim] //= args.world_size
    return shape


def pull(ws, a, b, bias, partial, out, shape, scatter_dim: int, world: int, epoch: int) -> None:
    """This rank's share of the sum of every rank's ``a @ b + bias`` (viewed as ``shape``)."""
    m, n = a.shape[0], b.shape[1]
    matmul_into(a, b, bias, partial)
    outer = math.prod(shape[:scatter_dim])
    exchange.reduce_scatter(ws, partial, out, outer, m * n // outer // world, epoch, OP_MM_REDUCE_SCATTER)


class ReduceScatterPull(Path):
    op = "mm_reduce_scatter"
    name = "symm"

    def workspace_bytes(self, call: Call) -> int:
        return call.m * call.n * call.itemsize

    def run(self, ctx: Context, args) -> torch.Tensor:
        a, b = args.a, args.b
        m, n = a.shape[0], b.shape[1]
        out = torch.empty(scattered_shape(args), dtype=a.dtype, device=a.device)  # before the epoch
        ws = workspace(ctx, m * n * a.dtype.itemsize, a.device)
        with epoch_of(ctx, ws, self.op) as (epoch, parity):
            partial = ws.data(parity, (m, n), a.dtype)
            pull(ws, a, b, args.bias, partial, out, args.shape, args.scatter_dim, args.world_size, epoch)
        return out


SYMM = ReduceScatterPull()
