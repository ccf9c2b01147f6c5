"""How ``paths/ag_ce_overlap.py``'s path runs a call: the kernels it launches, imported here, never on
the deciding side."""

from __future__ import annotations

import torch

from ...kernels import exchange
from ...kernels.codes import OP_ALL_GATHER_MM
from ..paths.ag_pull import gather_shape
from ..paths.base import Context
from ..counters import ran_instead
from ..paths.common import bias_rows, exchange as epoch_of, matmul_into, workspace
from .ag_pull import pull


def run(path, ctx: Context, args):
    shard, b, bias, gather_dim, world = args.shard, args.b, args.bias, args.gather_dim, args.world_size
    slabs = ctx.call.slabs
    ws = workspace(ctx, shard.numel() * shard.element_size(), shard.device)
    out = torch.empty((ctx.call.m, b.shape[1]), dtype=shard.dtype, device=shard.device)
    gathered = torch.empty(gather_shape(shard, gather_dim, world), dtype=shard.dtype, device=shard.device)
    with epoch_of(ctx, ws, path.op) as (epoch, parity):
        mine = ws.data(parity, shard.shape, shard.dtype)
        peers = [ws.peer_data(p, parity, shard.shape, shard.dtype) for p in range(ws.world)]
        if all(p is not None for p in peers):
            side = ctx.group.side_streams(shard.device)[0]
            overlapped(ws, shard, mine, b, bias, gathered, out, peers, epoch, args.return_gathered, side, slabs)
            return out, gathered if args.return_gathered else None  # (its own rows were not copied)
        ran_instead(path.op, path.name, "pull")  # (``supports`` keeps such providers away)
        pull(ws, shard, gathered, gather_dim, epoch, parity)
        matmul_into(gathered.view(-1, shard.shape[-1]), b, bias, out)
    return out, gathered


def overlapped(ws, shard, mine, b, bias, gathered, out, peers, epoch, return_gathered: bool, side,
               slabs: int = 1) -> None:
    """The call's work (module docstring). ``slabs``: the gathered rows are that many slabs, each
    holding every rank's block of rows in rank order."""
    world, rank, k = ws.world, ws.rank, shard.shape[-1]
    inner = shard.numel() // k // slabs  # rows of one rank's block in one slab
    g3, o3 = gathered.view(slabs, world * inner, k), out.view(slabs, world * inner, out.shape[-1])
    mine3 = mine.view(slabs, inner, k)
    main = torch.cuda.current_stream(shard.device)
    lo, hi = rank * inner, (rank + 1) * inner

    def rows_of(o, start, stop):  # the bias of slab o's rows start:stop
        return bias_rows(bias, o * world * inner + start, o * world * inner + stop)

    mine.copy_(shard)
    side.wait_stream(main)  # the shard is in the workspace; gathered and out were allocated on main
    with torch.cuda.stream(side):
        exchange.barrier(ws, epoch, OP_ALL_GATHER_MM)
        for p, view in enumerate(peers):
            if p != rank:
                for o, block in enumerate(view.view(slabs, inner, k)):
                    g3[o, p * inner:(p + 1) * inner].copy_(block, non_blocking=True)
        for o in range(slabs if return_gathered else 0):
            g3[o, lo:hi].copy_(mine3[o], non_blocking=True)
    for o in range(slabs):
        matmul_into(mine3[o], b, rows_of(o, lo, hi), o3[o, lo:hi])
    main.wait_stream(side)
    for o in range(slabs):
        for start, stop in ((0, lo), (hi, world * inner)):  # the peers' rows, in at most two GEMMs
            if stop > start:
                matmul_into(g3[o, start:stop], b, rows_of(o, start, stop), o3[o, start:stop])
