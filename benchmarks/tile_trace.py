"""Where the fused all-reduce / reduce-scatter kernel's time goes (``fused_all_reduce.py``), under
torchrun on 2 GPUs: per op, shape and tile config the kernel is checked against fp32 on fresh
data (output poisoned), timed (``bench.time_us``), then one call, the last of several back to
back, records per program the GPU time of its start and end and of each position's start and end
(``prepare(trace=...)``). Rank 0 prints, relative to the earliest start: when the peers' tiles
(multiplied first) and the own tiles (last: they wait for the peers' partials) end, how long each
kind took, when the programs and the reducers end, and how many programs hold a position in each
2 us bin.

    torchrun --nproc_per_node=2 benchmarks/tile_trace.py [--ops rs,ar] [--shapes 2048x2048x2048]
        [--configs 128x256x64s3w8g8r16o1,...] [--out F]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

import commfuse  # noqa: F401
from commfuse.bench import (spread, sweep_finish, sweep_record, sweep_setup, sweep_trace, trace_bins,
                            trace_buffer, trace_positions, trace_rows)
from commfuse.kernels import fused_all_reduce, symm, tiles
from commfuse.kernels.sync import ErrorWord

def summary(trace: torch.Tensor, own_from: int, compute: int) -> dict:
    """One traced call in us from the earliest start: positions from ``own_from`` on are this
    rank's own tiles; programs from ``compute`` on are reducers."""
    slots, t0 = trace_rows(trace)
    us = lambda ns: round((ns - t0) / 1e3, 1)
    kinds = {"peer": ([], []), "own": ([], [])}  # (durations, ends)
    spans = []
    for s in slots[:compute]:
        for pos, begin, end in trace_positions(s):
            durations, ends = kinds["own" if pos >= own_from else "peer"]
            durations.append((end - begin) / 1e3)
            ends.append(us(end))
            spans.append((begin, end))
    return {"start_spread_us": max(us(s[0]) for s in slots if s[0] >= 0),
            "peer_tile_us": spread(kinds["peer"][0]), "peer_tile_end_us": spread(kinds["peer"][1]),
            "own_tile_us": spread(kinds["own"][0]), "own_tile_end_us": spread(kinds["own"][1]),
            "program_end_us": spread([us(s[1]) for s in slots[:compute] if s[1] >= 0]),
            "reducer_end_us": spread([us(s[1]) for s in slots[compute:] if s[1] >= 0]),
            "last_tile_end_us": us(max(end for _, end in spans)), "tiles_traced": len(spans),
            "busy_per_2us": trace_bins(spans, t0)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ops", default="rs,ar")
    p.add_argument("--shapes", default="2048x2048x2048,8192x2048x4096")
    p.add_argument("--configs", default="128x256x64s3w8g8r16o1,128x128x64s4w8g8r16o1")
    p.add_argument("--pull", default="0", help="reduce-scatter: 0, 1 or 0,1 (owners pull the partials)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    group, rank = sweep_setup()
    world, gname = group.size(), group.group_name
    records = []
    for op in args.ops.split(","):
        scatter = op == "rs"
        for shape in args.shapes.split(","):
            m, k, n = (int(x) for x in shape.split("x"))
            variants = [(text, pull == "1") for text in args.configs.split(",")
                        for pull in (args.pull.split(",") if scatter else ["0"])]
            for text, pull in variants:
                cfg = tiles.TileConfig.parse(text)
                ws = symm.workspace(gname, fused_all_reduce.data_elems(m, n, world, cfg, scatter) * 2,
                                    torch.device("cuda", torch.cuda.current_device()))
                torch.manual_seed(1234 + rank)
                a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                b = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5).t()
                ref = a.float() @ b.float()
                dist.all_reduce(ref, group=group)
                if scatter:
                    ref = ref.chunk(world)[rank]
                out = torch.full(ref.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
                launch = fused_all_reduce.prepare(ws, a, b, None, out, cfg, scatter, pull=pull)
                launch(*ws.next_epoch())
                torch.cuda.synchronize()
                ErrorWord.check("tile_trace")
                err = ((out.float() - ref).norm() / ref.norm()).item()
                trace = trace_buffer()
                traced = fused_all_reduce.prepare(ws, a, b, None, out, cfg, scatter, pull=pull, trace=trace)
                us = sweep_trace(ws, launch, traced)
                count = fused_all_reduce.num_tiles(m, n, world, cfg, scatter)
                own = (count // world if scatter else len(range(rank, count, world)))
                programs = cfg.per_sm * ws.max_programs  # as prepare counts them (per_sm 1 fits here)
                compute = min(count, programs) if scatter else max(1, min(count, programs - cfg.reducers))
                sweep_record(records, dict(op=op, M=m, K=k, N=n, config=text, pull=pull, err=err, us=us,
                                           **summary(trace.cpu(), count - own, compute)))
    return sweep_finish(records, args.out)


if __name__ == "__main__":
    sys.exit(main())
