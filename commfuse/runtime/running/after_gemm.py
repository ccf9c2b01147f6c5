"""How ``paths/after_gemm.py``'s path runs a call: the kernels it launches, imported here, never on
the deciding side."""

from __future__ import annotations

import torch

from ...kernels import exchange
from ...kernels.codes import OP_MM_ALL_REDUCE
from ..paths.base import Context
from ..paths.common import exchange as epoch_of, matmul_into, workspace


def run(path, ctx: Context, args) -> torch.Tensor:
    a, b, bias = args.a, args.b, args.bias
    m, n = a.shape[0], b.shape[1]
    ws = workspace(ctx, m * n * a.dtype.itemsize, a.device)
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)  # allocations before the epoch
    with epoch_of(ctx, ws, path.op) as (epoch, parity):
        partial = ws.data(parity, (m, n), a.dtype)
        matmul_into(a, b, bias, partial)
        exchange.all_reduce(ws, partial, out, epoch, path.name, OP_MM_ALL_REDUCE)
    return out
