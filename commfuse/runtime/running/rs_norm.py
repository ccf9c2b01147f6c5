"""How ``paths/rs_norm.py``'s path runs a call: the kernels it launches, imported here, never on
the deciding side."""

from __future__ import annotations

import math

import torch

from ...kernels import norm_epilogue
from ...kernels.codes import OP_RS_NORM
from .. import reference
from ..paths.base import Context
from ..paths.common import exchange as epoch_of, matmul_into, workspace
from .common import norm_outputs


def run(path, ctx: Context, args) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, n)``, each shaped as the residual (this rank's share) and contiguous (the fake
    implementation's strides)."""
    return norm_outputs(path, ctx, args, args.a.shape[0] // args.world_size, run_into)


def run_into(path, ctx: Context, args, h: torch.Tensor, out: torch.Tensor) -> None:
    """One call into contiguous ``[M / world, N]`` outputs ``h`` and ``out``."""
    a, b = args.a, args.b
    m, n, world = a.shape[0], b.shape[1], args.world_size
    shape = reference.resolve_shape(args.shape, m * n)
    # this rank's share: `chunk` consecutive rows of the product in each of the `outer` slabs
    # before the scattered dimension
    chunk = m // math.prod(shape[:args.scatter_dim]) // world
    ws = workspace(ctx, m * n * a.dtype.itemsize, a.device)
    x, weight = args.residual.reshape(m // world, n).contiguous(), args.weight.contiguous()
    with epoch_of(ctx, ws, path.op) as (epoch, parity):
        partial = ws.data(parity, (m, n), a.dtype)
        matmul_into(a, b, args.bias, partial)
        norm_epilogue.reduce_scatter_add_rms_norm(ws, partial, x, weight, h, out, chunk, args.eps, epoch,
                                                  OP_RS_NORM, args.weight_last)
