"""How ``paths/rs_fused.py``'s path runs a call: the kernels it launches, imported here, never on
the deciding side."""

from __future__ import annotations

import torch

from ..paths.base import Context
from .ar_fused import run_fused


def run(path, ctx: Context, args) -> torch.Tensor:
    out = torch.empty(_scattered(args), dtype=path.spec.product_dtype(args), device=args.a.device)  # before the epoch
    return run_fused(path, ctx, args, out, True, ctx.config or path.config(ctx.call, ctx.facts))


def _scattered(args) -> list:
    shape = list(args.shape)
    shape[args.scatter_dim] //= args.world_size
    return shape
