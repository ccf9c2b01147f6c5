"""How ``paths/split_k.py``'s path runs a call: the kernels it launches, imported here, never on
the deciding side."""

from __future__ import annotations

import torch

from ...kernels import fused_split_k
from ..paths.base import Context
from ..paths.common import exchange, workspace
from ..paths.split_k import config, plan_bytes
from .common import tile_scales


def run(path, ctx: Context, args) -> torch.Tensor:
    a, b = args.a, args.b
    m, n = a.shape[0], b.shape[1]
    scales, bias, why = tile_scales(path, args)  # (an FP8 op's; ``running/common.py``)
    if why:
        return path.spec.run_nccl(args)
    ws = workspace(ctx, ctx.nbytes or plan_bytes(ctx.call), a.device)
    cfg = ctx.config or config(ctx.call, ws.max_programs)  # (with a tag: ``make_context``'s)
    out = torch.empty((m, n), dtype=path.spec.product_dtype(args), device=a.device)
    launch = fused_split_k.prepare(ws, a, b, bias, out, cfg, scales=scales,
                                   use_fast_accum=getattr(args, "use_fast_accum", True))  # before the epoch
    with exchange(ctx, ws, path.op) as (epoch, parity):
        launch(epoch, parity)
    return out
