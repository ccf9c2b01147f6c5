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
import statistics
import sys

import torch

import commfuse  # noqa: F401
from ag_sweep import check
from commfuse.bench import settings, sweep_finish, sweep_record, sweep_setup, sweep_trace
from commfuse.kernels import fused_all_gather, symm, sync, tiles

BIN_NS = 2000


def summary(trace: torch.Tensor, rows: int, n: int, world: int, cfg, pushers: int) -> dict:
    """The trace of one call (``TRACE_SLOTS`` int64 per program, -1 unused) in us from the
    earliest start: push ends, tile ends by source, waits of peer-row tiles, a busy profile."""
    slots = trace.view(-1, sync.TRACE_SLOTS).tolist()
    per = tiles.cdiv(rows, cfg.bm) * tiles.cdiv(n, cfg.bn)
    t0 = min(s[0] for s in slots if s[0] >= 0)
    us = lambda ns: (ns - t0) / 1e3
    push_end = [us(s[1]) for s in slots[:pushers] if s[1] >= 0]
    own_end, peer_end, waits, spans = [], [], [], []
    for s in slots:
        if s[0] < 0:
            continue
        prev = s[1] if s[1] >= 0 else s[0]
        for j in range(sync.TRACE_TILES):
            pos, waited, end = s[2 + 3 * j:5 + 3 * j]
            if pos < 0:
                break
            (own_end if pos < per else peer_end).append(us(end))
            if pos >= per:
                waits.append((waited - prev) / 1e3)
            spans.append((prev, waited, end))
            prev = end
    last = max(end for _, _, end in spans)
    bins = int((last - t0) // BIN_NS) + 1
    busy, wait = [0] * bins, [0] * bins
    for start, waited, end in spans:
        for b in range(int((start - t0) // BIN_NS), int((end - t0) // BIN_NS) + 1):
            lo, hi = t0 + b * BIN_NS, t0 + (b + 1) * BIN_NS
            if min(hi, waited) - max(lo, start) > BIN_NS / 2:
                wait[b] += 1
            elif min(hi, end) - max(lo, waited) > BIN_NS / 2:
                busy[b] += 1
    q = lambda v: [round(x, 1) for x in (min(v), statistics.median(v), max(v))] if v else None
    return {"start_spread_us": round(max(us(s[0]) for s in slots if s[0] >= 0), 1),
            "push_end_us": q(push_end), "own_tile_end_us": q(own_end), "peer_tile_end_us": q(peer_end),
            "peer_wait_us": q(waits), "last_end_us": round(us(last), 1),
            "tiles_traced": len(spans), "busy_per_2us": busy, "waiting_per_2us": wait}


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
                    trace = torch.full((1024 * sync.TRACE_SLOTS,), -1, dtype=torch.int64,
                                       device="cuda")
                    traced = fused_all_gather.prepare(ws, shard, b, None, None, out, cfg, trace, side)
                    us = sweep_trace(ws, launch, traced)
                    sweep_record(records, dict(M=m, K=k, N=n, config=text, push=push, pushers=pushers,
                                               err=err, us=us,
                                               **summary(trace.cpu(), m // world, n, world, cfg, pushers)))
    return sweep_finish(records, args.out)


if __name__ == "__main__":
    sys.exit(main())
