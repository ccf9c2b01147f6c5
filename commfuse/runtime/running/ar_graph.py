"""How ``paths/ar_graph.py``'s path runs a call: the kernels it launches, imported here, never on
the deciding side."""

from __future__ import annotations

import torch

from ...kernels import exchange, fused_split_k
from ...kernels.codes import GRAPH_LANE_OP, flag_value
from .. import reference
from ..paths.base import Context
from .common import lane_for
from ..paths.common import lane_exchange


def run(path, ctx: Context, args) -> torch.Tensor:
    a, b, bias = args.a, args.b, args.bias
    capturing = torch.cuda.is_current_stream_capturing()
    lane = lane_for(path, ctx, args, a.shape[0] * b.shape[1] * a.dtype.itemsize, a.device, capturing)
    if lane is None:
        return path.spec.run_nccl(args)
    m, n = a.shape[0], b.shape[1]
    if ctx.config is not None:  # few rows: the split-K kernel, in the lane
        out = torch.empty((m, n), dtype=a.dtype, device=a.device)
        launch = fused_split_k.prepare(lane, a, b, bias, out, ctx.config, lane=True)
        with lane_exchange(lane, capturing):  # eager calls from two streams: in host order
            launch(flag_value(0, ctx.tag))
    else:
        with lane_exchange(lane, capturing):
            partial = reference.matmul(a, b, bias)
            out = torch.empty_like(partial)
            exchange.staged_all_reduce(lane, partial, out, GRAPH_LANE_OP, ctx.tag)
    return out
