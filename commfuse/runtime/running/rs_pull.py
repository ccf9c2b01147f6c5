"""How ``paths/rs_pull.py``'s path runs a call: the kernels it launches, imported here, never on
the deciding side."""

from __future__ import annotations

import torch

import math

from ...kernels import exchange
from ...kernels.codes import EXCHANGE_CODE, OP_MM_REDUCE_SCATTER
from ..paths.base import Context
from ..paths.common import exchange as epoch_of, matmul_into, workspace
from ..paths.rs_pull import scattered_shape


def run(path, ctx: Context, args) -> torch.Tensor:
    a = args.a
    m, n, dtype = a.shape[0], args.b.shape[1], ctx.call.dtype  # the product's dtype (an FP8 op's out_dtype)
    out = torch.empty(scattered_shape(args), dtype=dtype, device=a.device)  # before the epoch
    ws = workspace(ctx, m * n * dtype.itemsize, a.device)
    with epoch_of(ctx, ws, path.op) as (epoch, parity):
        partial = ws.data(parity, (m, n), dtype)
        path.spec.product_into(args, a, partial)
        scatter(ws, partial, out, args.shape, args.scatter_dim, args.world_size, epoch, EXCHANGE_CODE[path.op])
    return out


def pull(ws, a, b, bias, partial, out, shape, scatter_dim: int, world: int, epoch: int) -> None:
    """This rank's share of the sum of every rank's ``a @ b + bias`` (viewed as ``shape``)."""
    matmul_into(a, b, bias, partial)
    scatter(ws, partial, out, shape, scatter_dim, world, epoch, OP_MM_REDUCE_SCATTER)


def scatter(ws, partial, out, shape, scatter_dim: int, world: int, epoch: int, op_code: int) -> None:
    """This rank's share of the sum of every rank's ``partial`` (viewed as ``shape``)."""
    outer = math.prod(shape[:scatter_dim])
    exchange.reduce_scatter(ws, partial, out, outer, partial.numel() // outer // world, epoch, op_code)
