"""How ``paths/ag_pull.py``'s path runs a call: the kernels it launches, imported here, never on
the deciding side."""

from __future__ import annotations

import torch

import math

from ...kernels import exchange
from ...kernels.codes import EXCHANGE_CODE, OP_ALL_GATHER_MM
from ..paths.ag_pull import gather_shape
from ..paths.base import Context
from ..paths.common import exchange as epoch_of, workspace


def run(path, ctx: Context, args):
    """The gathered shards (an FP8 op's as FP8: its bytes move, not bf16), then the op's product."""
    shard, gather_dim, world = args.shard, args.gather_dim, args.world_size
    k = shard.shape[-1]
    ws = workspace(ctx, shard.numel() * shard.element_size(), shard.device)
    out = torch.empty((ctx.call.m, args.b.shape[1]), dtype=path.spec.product_dtype(args), device=shard.device)
    gathered = torch.empty(gather_shape(shard, gather_dim, world), dtype=shard.dtype, device=shard.device)
    with epoch_of(ctx, ws, path.op) as (epoch, parity):
        pull(ws, shard, gathered, gather_dim, epoch, parity, EXCHANGE_CODE[path.op])
        path.spec.product_into(args, gathered.view(-1, k), out)
    return out, gathered


def pull(ws, shard, gathered, gather_dim: int, epoch: int, parity: int, op_code: int = OP_ALL_GATHER_MM) -> None:
    """Copy ``shard`` into this call's half and gather every rank's into ``gathered``."""
    mine = ws.data(parity, shard.shape, shard.dtype)
    mine.copy_(shard)
    outer = math.prod(shard.shape[:gather_dim])
    inner = math.prod(shard.shape[gather_dim:])
    exchange.gather(ws, mine, gathered, outer, inner, epoch, op_code)
