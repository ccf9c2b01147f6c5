"""How ``paths/ar_norm.py``'s path runs a call: the kernels it launches, imported here, never on
the deciding side."""

from __future__ import annotations

import torch

from ...kernels import norm_epilogue
from ...kernels.codes import OP_AR_NORM
from .. import reference
from ..paths.base import Context
from .common import lane_for, norm_outputs
from ..paths.common import exchange as epoch_of, lane_exchange, matmul_into, workspace


def run(path, ctx: Context, args) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, n)``, each shaped as the residual and contiguous (the fake implementation's strides)."""
    return norm_outputs(path, ctx, args, args.a.shape[0], run_into)


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


def run_graph(path, ctx: Context, args) -> tuple[torch.Tensor, torch.Tensor]:
    """``paths/ar_norm.py``'s ``graph``: cuBLAS into a local buffer, then the staged exchange + add
    + norm kernel through the group's graph lane (capturable); the unfused chain where the group
    has no lane yet (its first call was captured: allocation is collective) or the call is past it,
    as ``running/ar_graph.py`` does."""
    a, b = args.a, args.b
    capturing = torch.cuda.is_current_stream_capturing()
    m, n = a.shape[0], b.shape[1]
    lane = lane_for(path, ctx, args, m * n * a.dtype.itemsize, a.device, capturing)
    if lane is None:
        return path.spec.run_nccl(args)
    x, weight = args.residual.reshape(m, n).contiguous(), args.weight.contiguous()
    with lane_exchange(lane, capturing):  # eager calls from two streams: in host order
        partial = reference.matmul(a, b, args.bias)
        h, out = torch.empty_like(partial), torch.empty_like(partial)
        norm_epilogue.staged_add_rms_norm(lane, partial, x, weight, h, out, args.eps, OP_AR_NORM, args.weight_last,
                                          ctx.tag)
    shape = args.residual.shape
    return h.view(shape), out.view(shape)
