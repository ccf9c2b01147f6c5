"""Exploration for the fused all-gather kernel of all_gather_mm (issue 5), run under torchrun:
per shape, cuBLAS on the gathered rows, the tile GEMM alone, the unfused and current commfuse
paths, and the fused kernel per (tile config, pushers), each first checked against an fp32
reference on fresh data with the outputs poisoned (the product, and the gathered rows).

    torchrun --nproc_per_node=2 benchmarks/ag_sweep.py [--shapes MxKxN,...] [--configs ...]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import commfuse  # noqa: F401
from commfuse.bench import AG_MM_SHAPES, sweep_details, sweep_finish, sweep_setup, sweep_variant, time_us
from commfuse.kernels import fused_all_gather, symm, tiles
from commfuse.kernels.sync import ErrorWord

CONFIGS = ["128x256x64s3w8g8r0o1", "128x128x64s4w8g8r0o1", "64x128x64s4w4g8r0o1"]


def call(shard, b, gname, world, gathered: bool):
    return torch.ops.commfuse.all_gather_mm(shard, b, None, 0, world, gname, gathered)


def check(shard, b, gname, world, group, cfg, side=None) -> tuple[float, float]:
    """Relative errors of the fused kernel's (out, gathered) against the fp32 reference on fresh
    data, both outputs NaN-poisoned first."""
    shard = torch.randn_like(shard)
    parts = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(parts, shard, group=group)
    full = torch.cat(parts)
    ref = full.float() @ b.float()
    out = torch.full((full.shape[0], b.shape[1]), float("nan"), device="cuda", dtype=shard.dtype)
    gathered = torch.full_like(full, float("nan"))
    ws = symm.workspace(gname, fused_all_gather.data_elems(shard.shape[0], shard.shape[1], world)
                        * shard.element_size(), shard.device)
    launch = fused_all_gather.prepare(ws, shard, b, None, gathered, out, cfg, side=side)
    launch(*ws.next_epoch())
    torch.cuda.synchronize()
    ErrorWord.check("ag_sweep")
    assert torch.isfinite(out).all() and torch.isfinite(gathered).all(), "unwritten or NaN output"
    e_out = ((out.float() - ref).norm() / ref.norm()).item()
    e_g = ((gathered.float() - full.float()).norm() / full.float().norm()).item()
    return e_out, e_g


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=",".join(f"{m}x{k}x{n}" for m, k, n in AG_MM_SHAPES))
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--pushers", default="8,16,32")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    group, rank = sweep_setup()
    world = group.size()
    gname = group.group_name
    records = []
    for shape in args.shapes.split(","):
        m, k, n = (int(x) for x in shape.split("x"))
        torch.manual_seed(1234 + rank)
        shard = torch.randn(m // world, k, device="cuda", dtype=torch.bfloat16)
        torch.manual_seed(99)  # the same weight on every rank
        b = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5).t()
        full = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        os.environ.pop("COMMFUSE_ALGO", None)
        t = {"cublas": time_us(lambda: torch.mm(full, b)),
             "nccl_ag": time_us(lambda: funcol.wait_tensor(funcol.all_gather_tensor(shard, 0, group))),
             "unfused": time_us(lambda: torch.mm(funcol.wait_tensor(funcol.all_gather_tensor(shard, 0, group)), b)),
             "commfuse_default": time_us(lambda: call(shard, b, gname, world, False))}
        for algo in ("symm", "overlap"):
            os.environ["COMMFUSE_ALGO"] = algo
            t[f"commfuse_{algo}"] = time_us(lambda: call(shard, b, gname, world, False))
        errs = {}
        os.environ["COMMFUSE_ALGO"] = "fused"
        for c in args.configs.split(","):
            cfg = tiles.TileConfig.parse(c)
            os.environ["COMMFUSE_TILE_CONFIG"] = c
            mm_key = f"tile_mm {cfg.bm}x{cfg.bn}x{cfg.bk}s{cfg.stages}w{cfg.warps}"
            t[mm_key] = time_us(lambda: tiles.matmul(full, b, None, cfg))
            for pushers in (int(x) for x in args.pushers.split(",")):
                fused_all_gather.PUSHERS = pushers
                name = f"{c} p{pushers}"
                sweep_variant(errs, t, name, lambda: check(shard, b, gname, world, group, cfg),
                              {f"fused {name}": lambda: call(shard, b, gname, world, False),
                               f"fused+gathered {name}": lambda: call(shard, b, gname, world, True)})
        os.environ.pop("COMMFUSE_TILE_CONFIG", None)
        os.environ.pop("COMMFUSE_ALGO", None)
        fused = [(v, key) for key, v in t.items() if key.startswith("fused ")]
        best = min(fused) if fused else (float("nan"), "none")
        floor = max(t["cublas"], t["nccl_ag"])
        records.append(dict(M=m, K=k, N=n, times=t, errors=errs, best_fused=best[1], floor_us=floor))
        if rank == 0:
            print(f"{m}x{k}x{n}: cublas {t['cublas']:.0f} unfused {t['unfused']:.0f} default "
                  f"{t['commfuse_default']:.0f} fused {best[0]:.0f} [{best[1]}] "
                  f"({t['unfused'] / best[0]:.2f}x vs unfused, default {t['unfused'] / t['commfuse_default']:.2f}x) "
                  f"floor~{floor:.0f}", flush=True)
            sweep_details(t, errs)
    return sweep_finish(records, args.out)


if __name__ == "__main__":
    sys.exit(main())
