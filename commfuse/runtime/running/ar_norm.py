"""How ``paths/ar_norm.py``'s path runs a call: the kernels it launches, imported here, never on
the deciding side."""

from __future__ import annotations

import torch

from ...kernels import norm_epilogue
from ...kernels.codes import OP_AR_NORM
from ..paths.base import Context
from ..paths.common import exchange as epoch_of, matmul_into, workspace


def run(path, ctx: Context, args) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, n)``, each shaped as the residual and contiguous (the fake implementation's strides)."""
    m, n = args.a.shape[0], args.b.shape[1]
    # allocations before the epoch
    h = torch.empty((m, n), dtype=args.a.dtype, device=args.a.device)
    out = torch.empty_like(h)
    run_into(path, ctx, args, h, out)
    shape = args.residual.shape
    return h.view(shape), out.view(shape)


def run_into(path, ctx: Context, args, h: torch.Tensor, out: torch.Tensor) -> None:
    """One call into contiguous ``[M, N]`` outputs ``h`` and ``out``."""
    a, b = args.a, args.b
    m, n = a.shape[0], b.shape[1]
    ws = workspace(ctx, m * n * a.dtype.itemsize, a.device)
    # the kernel reads rows of n contiguous elements
    x, weight = args.residual.reshape(m, n).contiguous(), args.weight.contiguous()
    with epoch_of(ctx, ws, path.op) as (epoch, parity):
        partial = ws.data(parity, (m, n), a.dtype)
        matmul_into(a, b, args.bias, partial)
        norm_epilogue.all_reduce_add_rms_norm(ws, partial, x, weight, h, out, args.eps, epoch, OP_AR_NORM,
                                              args.weight_last)
