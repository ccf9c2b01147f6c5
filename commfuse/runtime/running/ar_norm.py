"""How ``paths/ar_norm.py``'s path runs a call: the kernels it launches, imported here, never on
the deciding side."""

from __future__ import annotations

import torch

from ...kernels import norm_epilogue
from ...kernels.codes import OP_AR_NORM
from ..paths.base import Context
from ..paths.common import exchange as epoch_of, matmul_into, workspace


def run(path, ctx: Context, args) -> tuple[torch.Tensor, torch.Tensor]:
    a, b, residual = args.a, args.b, args.residual
    m, n = a.shape[0], b.shape[1]
    ws = workspace(ctx, m * n * a.dtype.itemsize, a.device)
    # the kernel reads rows of n contiguous elements: the residual (and weight) as such, and the
    # outputs made so, shaped as the residual (the fake implementation's contiguous strides)
    x = residual.reshape(m, n).contiguous()
    weight = args.weight.contiguous()
    h = torch.empty((m, n), dtype=a.dtype, device=a.device)  # allocations before the epoch
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    with epoch_of(ctx, ws, path.op) as (epoch, parity):
        partial = ws.data(parity, (m, n), a.dtype)
        matmul_into(a, b, args.bias, partial)
        norm_epilogue.all_reduce_add_rms_norm(ws, partial, x, weight, h, out, args.eps, epoch, OP_AR_NORM,
                                              args.weight_last)
    return h.view(residual.shape), out.view(residual.shape)
