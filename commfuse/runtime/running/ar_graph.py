"""How ``paths/ar_graph.py``'s path runs a call: the kernels it launches, imported here, never on
the deciding side."""

from __future__ import annotations

import torch

from ...kernels import exchange, fused_split_k
from ...kernels.codes import LANE_CODE, flag_value
from ..paths.base import Context
from .common import lane_for
from ..paths.common import lane_exchange


def run(path, ctx: Context, args) -> torch.Tensor:
    a, b = args.a, args.b
    m, n = a.shape[0], b.shape[1]
    dtype = path.spec.product_dtype(args)  # (an FP8 op's: its output dtype)
    capturing = torch.cuda.is_current_stream_capturing()
    lane = lane_for(path, ctx, args, m * n * dtype.itemsize, a.device, capturing)
    if lane is None:
        return path.spec.run_nccl(args)
    if ctx.config is not None:  # few rows: the split-K kernel, in the lane
        out = torch.empty((m, n), dtype=dtype, device=a.device)
        launch = fused_split_k.prepare(lane, a, b, args.bias, out, ctx.config, lane=True)
        with lane_exchange(lane, capturing):  # eager calls from two streams: in host order
            launch(flag_value(0, ctx.tag))
    else:
        with lane_exchange(lane, capturing):
            partial = torch.empty((m, n), dtype=dtype, device=a.device)
            path.spec.product_into(args, a, partial)
            out = torch.empty_like(partial)
            exchange.staged_all_reduce(lane, partial, out, LANE_CODE[path.op], ctx.tag)
    return out
