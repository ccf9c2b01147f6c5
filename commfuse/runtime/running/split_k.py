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
    out = torch.empty((m, n), dtype=path.spec.product_dtype(args), device=a.device)
    scales = (args.scale_a, args.scale_b) if hasattr(args, "scale_a") else None
    if getattr(args, "post_scale_a", None) is not None:  # the row-wise backward's form: one rounding
        scales = (args.scale_a * args.post_scale_a, args.scale_b * args.post_scale_b)
    launch = fused_split_k.prepare(ws, a, b, bias, out, cfg, scales=scales,
                                   use_fast_accum=getattr(args, "use_fast_accum", True))  # before the epoch
    with exchange(ctx, ws, path.op) as (epoch, parity):
        launch(epoch, parity)
    return out
