"""How ``paths/after_gemm.py``'s path runs a call: the kernels it launches, imported here, never on
the deciding side."""

from __future__ import annotations

import torch

from ...kernels import exchange
from ...kernels.codes import EXCHANGE_CODE
from ..paths.base import Context
from ..paths.common import exchange as epoch_of, workspace


def run(path, ctx: Context, args) -> torch.Tensor:
    spec, a = path.spec, args.a
    m, n, dtype = a.shape[0], args.b.shape[1], ctx.call.dtype  # the product's dtype (an FP8 op's out_dtype)
    ws = workspace(ctx, m * n * dtype.itemsize, a.device)
    out = torch.empty((m, n), dtype=dtype, device=a.device)  # allocations before the epoch
    with epoch_of(ctx, ws, path.op) as (epoch, parity):
        partial = ws.data(parity, (m, n), dtype)
        spec.product_into(args, a, partial)
        exchange.all_reduce(ws, partial, out, epoch, path.name, EXCHANGE_CODE[path.op])
    return out
