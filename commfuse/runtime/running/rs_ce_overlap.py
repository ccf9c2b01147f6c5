"""How ``paths/rs_ce_overlap.py``'s path runs a call: the kernels it launches, imported here, never on
the deciding side."""

from __future__ import annotations

import torch

from ...kernels import exchange, tiles
from ...kernels.codes import OP_MM_REDUCE_SCATTER
from ..paths.base import Context
from ..counters import ran_instead
from ..paths.common import bias_rows, exchange as epoch_of, matmul_into, sum_rank_order, workspace
from ..paths.rs_pull import scattered_shape
from .rs_pull import pull


def run(path, ctx: Context, args) -> torch.Tensor:
    a, b, bias, world = args.a, args.b, args.bias, args.world_size
    m, n = a.shape[0], b.shape[1]
    slabs = max(ctx.call.slabs, 1)
    count = (ctx.config or path.config(ctx.call, ctx.facts)).chunks
    out = torch.empty(scattered_shape(args), dtype=a.dtype, device=a.device)  # allocations before the epoch
    ws = workspace(ctx, m * n * a.dtype.itemsize, a.device)
    recv = torch.empty((world - 1, m // world, n), dtype=a.dtype, device=a.device)
    own = torch.empty((m // world, n), dtype=a.dtype, device=a.device) if count * slabs == 1 else None
    with epoch_of(ctx, ws, path.op) as (epoch, parity):
        partial = ws.data(parity, (m, n), a.dtype)
        peers = [ws.peer_data(p, parity, (m, n), a.dtype) for p in range(ws.world)]
        if all(p is not None for p in peers):
            side = ctx.group.side_streams(a.device)[0]
            overlapped(ws, a, b, bias, partial, out.view(-1, n), recv, own, count, peers, epoch, side, slabs)
            return out
        ran_instead(path.op, path.name, "pull")  # (``supports`` keeps such providers away)
        pull(ws, a, b, bias, partial, out, args.shape, args.scatter_dim, world, epoch)
    return out


def overlapped(ws, a, b, bias, partial, out, recv, own, count: int, peers, epoch, side, slabs: int = 1) -> None:
    """The call's work (module docstring): ``count`` chunks per share, in ``slabs`` slabs, each
    holding every rank's share in rank order."""
    world, rank, rows = ws.world, ws.rank, a.shape[0] // ws.world // slabs  # a share's rows in a slab
    step_rows = tiles.cdiv(rows, count)
    # (first row of the slab in the product, first of it in a share, chunk start, chunk stop)
    bounds = [(o * world * rows, o * rows, lo, min(lo + step_rows, rows))
              for o in range(slabs) for lo in range(0, rows, step_rows)]
    main = torch.cuda.current_stream(a.device)
    side.wait_stream(main)  # out and recv were allocated on main (the events below also order them)
    done = []  # (step, chunk, the event after its GEMM): GEMMs queued first, as in the all-reduce
    for step in range(1, world):
        p = (rank + step) % world
        for c, (base, share, lo, hi) in enumerate(bounds):
            r0, r1 = base + p * rows + lo, base + p * rows + hi
            matmul_into(a[r0:r1], b, bias_rows(bias, r0, r1), partial[r0:r1])
            done.append((step, c, main.record_event()))
    landed = []
    with torch.cuda.stream(side):
        for step, c, event in done:
            q = (rank - step) % world  # at this step rank q multiplied this rank's share
            base, share, lo, hi = bounds[c]
            side.wait_event(event)
            exchange.barrier(ws, epoch, OP_MM_REDUCE_SCATTER, slot=(step - 1) * len(bounds) + c)
            mine = base + rank * rows
            recv[step - 1, share + lo:share + hi].copy_(peers[q][mine + lo:mine + hi], non_blocking=True)
            if step == world - 1:
                landed.append(side.record_event())
    if own is not None:  # one chunk: multiply the own share while the pulls run, sum after
        r0, r1 = rank * rows, (rank + 1) * rows
        matmul_into(a[r0:r1], b, bias_rows(bias, r0, r1), own)
        main.wait_event(landed[0])
        # recv[step - 1] came from rank (rank - step) % world
        sum_rank_order([own if q == rank else recv[(rank - q) % world - 1] for q in range(world)], out)
        main.wait_stream(side)
        return
    for c, (base, share, lo, hi) in enumerate(bounds):
        main.wait_event(landed[c])  # every peer's partial of these rows is here
        # recv[step - 1] came from rank (rank - step) % world: add the peers' parts in rank order
        parts = [recv[(rank - q) % world - 1, share + lo:share + hi] for q in range(world) if q != rank]
        acc = parts[0]
        if len(parts) > 1:
            sum_rank_order(parts, acc)  # in place: the first part becomes the sum
        r0, r1 = base + rank * rows + lo, base + rank * rows + hi
        row_bias = bias_rows(bias, r0, r1)
        if row_bias is not None:
            acc.add_(row_bias)
        torch.addmm(acc, a[r0:r1], b, out=out[share + lo:share + hi])
    main.wait_stream(side)
