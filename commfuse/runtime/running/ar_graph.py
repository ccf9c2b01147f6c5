"""How ``paths/ar_graph.py``'s path runs a call: the kernels it launches, imported here, never on
the deciding side."""

from __future__ import annotations

import torch

from ...kernels import exchange, fused_split_k
from ...kernels.codes import GRAPH_LANE_OP, flag_value
from .. import capture, groups, reference
from ..paths.base import Context
from ..counters import ran_instead
from ..paths.common import lane_exchange, warn_once


def run(path, ctx: Context, args) -> torch.Tensor:
    a, b, bias = args.a, args.b, args.bias
    group = ctx.group
    capturing = torch.cuda.is_current_stream_capturing()
    nbytes = a.shape[0] * b.shape[1] * a.dtype.itemsize
    lane = capture.lane(group)
    if lane is None and not capturing:  # allocation is collective: never in a capture
        groups.workspace(group, nbytes, a.device)
        lane = capture.lane(group)
    if lane is None or nbytes > lane.data_bytes:
        warn_once(path.op, "no graph lane yet: the group's first call was captured" if lane is None
                  else "larger than the graph lane")
        ran_instead(path.op, path.name, "nccl")
        if capturing:
            capture.record(group, path.op, (tuple(a.shape), tuple(b.shape), a.dtype), "nccl")
        return reference.mm_all_reduce(a, b, bias, args.group_name)
    if capturing:
        capture.mark_replayed(group)
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
