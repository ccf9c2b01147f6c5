"""How ``paths/ar_fused.py``'s path runs a call: the kernels it launches, imported here, never on
the deciding side."""

from __future__ import annotations

import torch

from ...kernels import fused_all_reduce
from ..counters import launched
from ..paths.base import Context
from ..paths.common import exchange, workspace
from ..paths.ar_fused import FusedConfig, fused_bytes
from .common import tile_scales


def run(path, ctx: Context, args) -> torch.Tensor:
    a, b = args.a, args.b
    out = torch.empty((a.shape[0], b.shape[1]), dtype=path.spec.product_dtype(args), device=a.device)
    return run_fused(path, ctx, args, out, False, ctx.config or path.config(ctx.call, ctx.facts))


def run_fused(path, ctx: Context, args, out, scatter: bool, cfg: FusedConfig) -> torch.Tensor:
    """One kernel: GEMM tiles, their exchange and sum overlapped; ``scatter``: along the rows. An
    FP8 op's scales and accumulation go to the kernel (``fused_all_reduce.prepare``; scales the
    kernel cannot take: the unfused computation, alike on every rank, as the shapes are)."""
    a, b = args.a, args.b
    scales, bias, why = tile_scales(path, args)
    if why:
        return path.spec.run_nccl(args)
    ws = workspace(ctx, ctx.nbytes or fused_bytes(ctx.call, scatter), a.device)
    launch = fused_all_reduce.prepare(ws, a, b, bias, out.view(-1, b.shape[1]), cfg.tile, scatter,
                                      cfg.options, scales=scales,
                                      use_fast_accum=getattr(args, "use_fast_accum", True))  # before the epoch
    with exchange(ctx, ws, path.op) as (epoch, parity):
        launch(epoch, parity)
    launched("fused_all_reduce", launch.variants)
    return out
