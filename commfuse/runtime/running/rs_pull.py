"""How ``paths/rs_pull.py``'s path runs a call: the kernels it launches, imported here, never on
the deciding side."""

from __future__ import annotations

import torch

import math

from ...kernels import exchange
from ...kernels.codes import OP_MM_REDUCE_SCATTER
from ..paths.base import Context
from ..paths.common import exchange as epoch_of, matmul_into, workspace
from ..paths.rs_pull import scattered_shape


def run(path, ctx: Context, args) -> torch.Tensor:
    a, b = args.a, args.b
    m, n = a.shape[0], b.shape[1]
    out = torch.empty(scattered_shape(args), dtype=a.dtype, device=a.device)  # before the epoch
    ws = workspace(ctx, m * n * a.dtype.itemsize, a.device)
    with epoch_of(ctx, ws, path.op) as (epoch, parity):
        partial = ws.data(parity, (m, n), a.dtype)
        pull(ws, a, b, args.bias, partial, out, args.shape, args.scatter_dim, args.world_size, epoch)
    return out


def pull(ws, a, b, bias, partial, out, shape, scatter_dim: int, world: int, epoch: int) -> None:
    """This rank's share of the sum of every rank's ``a @ b + bias`` (viewed as ``shape``)."""
    m, n = a.shape[0], b.shape[1]
    matmul_into(a, b, bias, partial)
    outer = math.prod(shape[:scatter_dim])
    exchange.reduce_scatter(ws, partial, out, outer, m * n // outer // world, epoch, OP_MM_REDUCE_SCATTER)
