"""How ``paths/split_k.py``'s path runs a call: the kernels it launches, imported here, never on
the deciding side."""

from __future__ import annotations

import torch

from ...kernels import fused_split_k
from ..paths.base import Context
from ..paths.common import exchange, workspace
from ..paths.split_k import config, plan_bytes


def run(path, ctx: Context, args) -> torch.Tensor:
    a, b, bias = args.a, args.b, args.bias
    m, n = a.shape[0], b.shape[1]
    ws = workspace(ctx, plan_bytes(ctx.call), a.device)
    cfg = ctx.config or config(ctx.call, ws.max_programs)  # (with a tag: ``make_context``'s)
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    launch = fused_split_k.prepare(ws, a, b, bias, out, cfg)  # before the epoch
    with exchange(ctx, ws, path.op) as (epoch, parity):
        launch(epoch, parity)
    return out
