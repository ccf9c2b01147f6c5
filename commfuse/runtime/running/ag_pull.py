"""How ``paths/ag_pull.py``'s path runs a call: the kernels it launches, imported here, never on
the deciding side."""

from __future__ import annotations

import torch

import math

from ...kernels import exchange
from ...kernels.codes import EXCHANGE_CODE, OP_ALL_GATHER_MM
from .. import reference
from ..paths.ag_pull import gather_shape
from ..paths.base import Context
from ..paths.common import exchange as epoch_of, workspace
from ..workspace import round_up


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


def run_rowwise(path, ctx: Context, args):
    """``paths/ag_pull.py``'s ``RowwiseGatherPull``: this rank's rows quantised, gathered with their
    multipliers as bytes, unpacked, multiplied; or, where the graph reads the high-precision
    gathered tensor, ``run``: that gathered, then the op's product (quantised after the gather),
    the unfused op's two forms (``reference``)."""
    if args.return_gathered:
        return run(path, ctx, args)
    shard, world = args.shard, args.world_size
    k = shard.shape[-1]
    rows = shard.numel() // k
    ws = workspace(ctx, path.workspace_bytes(ctx.call), shard.device)
    out = torch.empty((ctx.call.m, args.b.shape[1]), dtype=path.spec.product_dtype(args), device=shard.device)
    q, multiplier = reference.quantise_rows(shard.reshape(rows, k), args.float8_dtype, args.eps, args.pow2_scales)
    body = rows * k  # the FP8 rows' bytes; the multipliers' 4 bytes a row follow
    item = round_up(body + 4 * rows, 16)  # every rank's block 16-byte aligned in the gathered bytes
    packed = torch.empty((world, item), dtype=torch.uint8, device=shard.device)
    # every rank's rows and multipliers, dense (cuBLAS's FP8 GEMM needs 16-byte row strides; with
    # one row per rank a view of the packed blocks would keep their stride); allocated before the
    # epoch, so nothing between the gather and the product waits for the allocator
    q_all = torch.empty((world * rows, k), dtype=torch.uint8, device=shard.device)
    multipliers = torch.empty((world, rows), dtype=torch.float32, device=shard.device)
    with epoch_of(ctx, ws, path.op) as (epoch, parity):
        mine = ws.data(parity, (item,), torch.uint8)
        mine[:body].copy_(q.view(torch.uint8).reshape(-1))
        mine[body:body + 4 * rows].copy_(multiplier.reshape(-1).view(torch.uint8))
        exchange.gather(ws, mine, packed, 1, item, epoch, EXCHANGE_CODE[path.op])
        q_all.view(world, body).copy_(packed[:, :body])
        multipliers.view(torch.uint8).copy_(packed[:, body:body + 4 * rows])
        reference.rows_times(q_all.view(args.float8_dtype), multipliers, args.b, args.scale_b, args.bias,
                             args.out_dtype, args.use_fast_accum, out)
    return out, shard.new_empty((0,))
