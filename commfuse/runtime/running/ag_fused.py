"""How ``paths/ag_fused.py``'s path runs a call: the kernels it launches, imported here, never on
the deciding side."""

from __future__ import annotations

import torch

from ...kernels import fused_all_gather
from .. import reference
from . import ag_pull
from ..paths.ag_pull import gather_shape
from ..counters import launched
from ..paths.base import Context
from ..paths.common import exchange, workspace
from ..paths.ag_fused import fused_bytes


def run(path, ctx: Context, args):
    shard, b, bias, world = args.shard, args.b, args.bias, args.world_size
    cfg = ctx.config or path.config(ctx.call, ctx.facts)
    k = shard.shape[-1]
    out = torch.empty((ctx.call.m, b.shape[1]), dtype=path.spec.product_dtype(args), device=shard.device)
    gathered = (torch.empty(gather_shape(shard, args.gather_dim, world), dtype=shard.dtype, device=shard.device)
                if args.return_gathered else None)
    ws = workspace(ctx, ctx.nbytes or fused_bytes(ctx.call), shard.device)
    side = ctx.group.side_streams(shard.device)[0] if cfg.push == "ce" else None
    launch = fused_all_gather.prepare(ws, shard.reshape(-1, k), b, bias,
                                      None if gathered is None else gathered.view(-1, k), out, cfg.tile,
                                      side=side, pushers=cfg.pushers, ce_chunk_count=cfg.ce_chunks,
                                      scales=(args.scale_a, args.scale_b) if hasattr(args, "scale_a") else None,
                                      use_fast_accum=getattr(args, "use_fast_accum", True))
    with exchange(ctx, ws, path.op) as (epoch, parity):  # (everything above before the epoch)
        launch(epoch, parity)
    launched("fused_all_gather", launch.variants)
    return out, gathered


def run_rowwise(path, ctx: Context, args):
    """``paths/ag_fused.py``'s ``RowwiseFusedAllGather``: this rank's rows quantised (the graph's
    steps), then the kernel gathers the FP8 rows with their scales while it multiplies; where the
    graph reads the high-precision gathered tensor, the pull path's form (``ag_pull.run``)."""
    if args.return_gathered:
        return ag_pull.run(path, ctx, args)
    cfg = ctx.config or path.config(ctx.call, ctx.facts)
    shard = args.shard
    k = shard.shape[-1]
    q, multiplier = reference.quantise_rows(shard.reshape(-1, k), args.float8_dtype, args.eps, args.pow2_scales)
    out = torch.empty((ctx.call.m, args.b.shape[1]), dtype=path.spec.product_dtype(args), device=shard.device)
    ws = workspace(ctx, path.workspace_bytes(ctx.call), shard.device)
    # (``_scaled_mm`` takes the multipliers' reciprocals, as the unfused op's product does)
    launch = fused_all_gather.prepare(ws, q, args.b, args.bias, None, out, cfg.tile, pushers=cfg.pushers,
                                      scales=(multiplier.reshape(-1).reciprocal(), args.scale_b),
                                      use_fast_accum=args.use_fast_accum, rowwise=True)
    with exchange(ctx, ws, path.op) as (epoch, parity):
        launch(epoch, parity)
    launched("fused_all_gather", launch.variants)
    return out, shard.new_empty((0,))
