"""How ``paths/ar_fused.py``'s path runs a call: the kernels it launches, imported here, never on
the deciding side."""

from __future__ import annotations

import torch

from ...kernels import fused_all_reduce
from ..counters import launched
from ..paths.base import Context
from ..paths.common import exchange, workspace
from ..paths.ar_fused import FusedConfig, fused_bytes


def run(path, ctx: Context, args) -> torch.Tensor:
    a, b = args.a, args.b
    out = torch.empty((a.shape[0], b.shape[1]), dtype=path.spec.product_dtype(args), device=a.device)
    return run_fused(ctx, args, out, path.op, False, ctx.config or path.config(ctx.call, ctx.facts))


def run_fused(ctx: Context, args, out, op: str, scatter: bool, cfg: FusedConfig) -> torch.Tensor:
    """One kernel: GEMM tiles, their exchange and sum overlapped; ``scatter``: along the rows. An
    FP8 op's scales and accumulation go to the kernel (``fused_all_reduce.prepare``)."""
    a, b = args.a, args.b
    scales = (args.scale_a, args.scale_b) if hasattr(args, "scale_a") else None
    if getattr(args, "post_scale_a", None) is not None:  # the row-wise backward's form: one rounding
        scales = (args.scale_a * args.post_scale_a, args.scale_b * args.post_scale_b)
    ws = workspace(ctx, fused_bytes(ctx.call, scatter), a.device)
    launch = fused_all_reduce.prepare(ws, a, b, args.bias, out.view(-1, b.shape[1]), cfg.tile, scatter,
                                      cfg.options, scales=scales,
                                      use_fast_accum=getattr(args, "use_fast_accum", True))  # before the epoch
    with exchange(ctx, ws, op) as (epoch, parity):
        launch(epoch, parity)
    launched("fused_all_reduce", launch.variants)
    return out
