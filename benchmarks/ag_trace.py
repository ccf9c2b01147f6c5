"""Where the fused all-gather kernel's time goes, under torchrun on 2 GPUs: per shape, tile config
and pusher count, the kernel is checked against fp32 on fresh data (``ag_sweep.check``), timed
(``bench.time_us``), then one call, the last of several back to back, records per program the
GPU time of its start, the end of its pushes and, per tile, the end of its wait and of its tile
(``fused_all_gather.prepare(trace=...)``). Rank 0 prints, relative to the earliest program start:
when the pushes end, when own-row and peer-row tiles end, how long peer-row tiles waited, and the
number of programs multiplying / waiting in each 2 us bin.

    torchrun --nproc_per_node=2 benchmarks/ag_trace.py [--shapes 2048x2048x2048] [--configs ...]
        [--pushers 16,32] [--out F]
"""

from __future__ import annotations

import argparse
import sys

import torch

import commfuse  # noqa: F401
from ag_sweep import check
from commfuse.bench import (settings, spread, sweep_finish, sweep_record, sweep_setup, sweep_trace, trace_bins,
                            trace_buffer, trace_positions, trace_rows)
from commfuse.kernels import fused_all_gather, symm, tiles

def summary(trace: torch.Tensor, rows: int, n: int, world: int, cfg, pushers: int) -> dict:
    """The trace of one call in us from the earliest start: push ends, tile ends by source,
    waits of peer-row tiles, how many programs multiply / wait per bin."""
    slots, t0 = trace_rows(trace)
    per = tiles.cdiv(rows, cfg.bm) * tiles.cdiv(n, cfg.bn)
    us = lambda ns: (ns - t0) / 1e3
    own_end, peer_end, waits, spans = [], [], [], []
    for s in slots:
        if s[0] < 0:
            continue
        prev = s[1] if s[1] >= 0 else s[0]
        for pos, waited, end in trace_positions(s):
            (own_end if pos < per else peer_end).append(us(end))
            if pos >= per:
                waits.append((waited - prev) / 1e3)
            spans.append((prev, waited, end))
            prev = end
    last = max(end for _, _, end in spans)
    return {"start_spread_us": round(max(us(s[0]) for s in slots if s[0] >= 0), 1),
            "push_end_us": spread([us(s[1]) for s in slots[:pushers] if s[1] >= 0]),
            "own_tile_end_us": spread(own_end), "peer_tile_end_us": spread(peer_end),
            "peer_wait_us": spread(waits), "last_end_us": round(us(last), 1), "tiles_traced": len(spans),
            "busy_per_2us": trace_bins([(waited, end) for _, waited, end in spans], t0, last),
            "waiting_per_2us": trace_bins([(start, waited) for start, waited, _ in spans], t0, last)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="1024x1024x1024,2048x2048x2048")
    p.add_argument("--configs", default="128x128x64s4w8g8r0o1")
    p.add_argument("--pushers", default="16")
    p.add_argument("--push", default="sm,ce", help="who pushes the shard: the kernel's programs (sm), "
                   "the copy engines (ce; --pushers is then ignored)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    group, rank = sweep_setup()
    world, gname = group.size(), group.group_name
    records = []
    for shape in args.shapes.split(","):
        m, k, n = (int(x) for x in shape.split("x"))
        torch.manual_seed(1234 + rank)
        shard = torch.randn(m // world, k, device="cuda", dtype=torch.bfloat16)
        torch.manual_seed(99)
        b = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5).t()
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        ws = symm.workspace(gname, fused_all_gather.data_elems(m // world, k, world) * 2, shard.device)
        for text in args.configs.split(","):
            cfg = tiles.TileConfig.parse(text)
            variants = [("sm", int(x)) for x in args.pushers.split(",") if "sm" in args.push.split(",")]
            variants += [("ce", 0)] if "ce" in args.push.split(",") else []
            for push, pushers in variants:
                side = torch.cuda.Stream() if push == "ce" else None
                with settings({"COMMFUSE_AG_PUSHERS": str(max(pushers, 1)), "COMMFUSE_AG_PUSH": push}):
                    err = check(shard, b, gname, world, group, cfg, side)[0]
                    launch = fused_all_gather.prepare(ws, shard, b, None, None, out, cfg, side=side)
                    trace = trace_buffer()
                    traced = fused_all_gather.prepare(ws, shard, b, None, None, out, cfg, trace, side)
                    us = sweep_trace(ws, launch, traced)
                    sweep_record(records, dict(M=m, K=k, N=n, config=text, push=push, pushers=pushers,
                                               err=err, us=us,
                                               **summary(trace.cpu(), m // world, n, world, cfg, pushers)))
    return sweep_finish(records, args.out)


if __name__ == "__main__":
    sys.exit(main())
