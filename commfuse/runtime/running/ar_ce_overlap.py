"""How ``paths/ar_ce_overlap.py``'s path runs a call: the kernels it launches, imported here, never on
the deciding side."""

from __future__ import annotations

import torch

from ...kernels import exchange
from ...kernels.codes import OP_MM_ALL_REDUCE
from .. import ce_graphs
from ..paths.base import Context
from ..paths.ar_ce_overlap import CeConfig
from ..counters import ran_instead
from ..paths.common import exchange as epoch_of, matmul_into, row_chunks, sum_rank_order, workspace


def run(path, ctx: Context, args) -> torch.Tensor:
    a, b, bias = args.a, args.b, args.bias
    m, n = a.shape[0], b.shape[1]
    cfg: CeConfig = ctx.config or path.config(ctx.call, ctx.facts)
    ws = workspace(ctx, m * n * a.dtype.itemsize, a.device)
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)  # allocations before the epoch
    recv = torch.empty((ws.world - 1, m, n), dtype=a.dtype, device=a.device)
    sides = ctx.group.side_streams(a.device)
    with epoch_of(ctx, ws, path.op) as (epoch, parity):
        partial = ws.data(parity, (m, n), a.dtype)
        peers = [ws.peer_data(p, parity, (m, n), a.dtype) for p in range(ws.world)]
        if not all(p is not None for p in peers):  # (``supports`` keeps such providers away)
            ran_instead(path.op, path.name, "one_shot")
            matmul_into(a, b, bias, partial)
            exchange.all_reduce(ws, partial, out, epoch, "one_shot", OP_MM_ALL_REDUCE)
            return out
        if cfg.graphs and ce_graphs.enabled():
            key = ce_graphs.key(ws, parity, (a, b, bias, out, recv), cfg.rows)
            ce_graphs.run(ws, epoch, key, lambda capture_sides: overlapped(
                ws, a, b, bias, partial, out, recv, peers, None, cfg, capture_sides or sides), a.device.index)
        else:
            overlapped(ws, a, b, bias, partial, out, recv, peers, epoch, cfg, sides)
    return out


def overlapped(ws, a, b, bias, partial, out, recv, peers, epoch, cfg: CeConfig, sides: tuple) -> None:
    """The call's work on the caller's stream and ``sides`` = (pulls, adds, barriers) (module
    docstring). ``epoch`` None: the kernels read it from the workspace's epoch cell, and the call
    may be captured in a CUDA graph."""
    rows = list(cfg.rows)
    a_rows, partial_rows, out_rows = a.split(rows), partial.split(rows), out.split(rows)
    bias_rows = row_chunks(bias, rows)
    # the one-shot's flag slots follow the chunks' barriers: where they do not fit (hundreds of
    # chunks at many ranks), every rank alike keeps the copy engines for the last chunk too
    one_shot_tail = len(a_rows) > 1 and (len(a_rows) + exchange.MAX_PROGRAMS) * ws.world <= ws.flags.numel()
    side, adder, syncer = sides
    main = torch.cuda.current_stream(a.device)
    side.wait_stream(main)  # out and recv were allocated on main (the events below also order them)
    done = []
    for a_i, bias_i, partial_i in zip(a_rows, bias_rows, partial_rows):
        matmul_into(a_i, b, bias_i, partial_i)
        done.append(main.record_event())
    if one_shot_tail:
        done.pop()
        exchange.all_reduce(ws, partial_rows[-1], out_rows[-1], epoch, "one_shot", OP_MM_ALL_REDUCE,
                            slot_base=len(a_rows))
    others = [p for p in range(ws.world) if p != ws.rank]
    pulls = [(recv[j].split(rows), peers[p].split(rows)) for j, p in enumerate(others)]
    # the parts of each chunk in rank order: this rank's partial, the others' pulled rows
    ordered = [partial_rows if p == ws.rank else pulls[others.index(p)][0] for p in range(ws.world)]
    ready, pulled = [], []
    with torch.cuda.stream(syncer):
        for i, event in enumerate(done):
            syncer.wait_event(event)
            exchange.barrier(ws, epoch, OP_MM_ALL_REDUCE, slot=i)  # every rank's chunk i is ready
            ready.append(syncer.record_event())
    with torch.cuda.stream(side):
        for i, event in enumerate(ready):
            side.wait_event(event)
            for into, src in pulls:
                into[i].copy_(src[i], non_blocking=True)
            pulled.append(side.record_event())
    with torch.cuda.stream(adder):
        for i, event in enumerate(pulled):  # (each pull follows its chunk's GEMM event)
            adder.wait_event(event)
            sum_rank_order([part[i] for part in ordered], out_rows[i])
    main.wait_stream(syncer)
    main.wait_stream(adder)
    main.wait_stream(side)
