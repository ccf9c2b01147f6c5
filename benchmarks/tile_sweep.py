"""Exploration for the fused tile kernel of mm_all_reduce (issue 4), run under torchrun on 2 GPUs:
per shape, the GEMM alone (cuBLAS against the tile kernel's GEMM, per config), the unfused and
current commfuse paths, and the fused kernel per (config, reducers), after checking it against an
fp32 reference on fresh data with the output poisoned first.

    torchrun --nproc_per_node=2 benchmarks/tile_sweep.py [--shapes MxKxN,...] [--configs ...]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import commfuse  # noqa: F401
from commfuse.bench import (MM_AR_SHAPES, sweep_check, sweep_details, sweep_finish, sweep_setup,
                            sweep_variant, time_us)
from commfuse.kernels import fused_all_reduce, symm, tiles
from commfuse.kernels.sync import ErrorWord

CONFIGS = ["128x256x64s3w8g8r16o1", "128x256x64s3w8g8r8o1", "128x128x64s3w8g8r16o2",
           "128x128x64s3w8g8r8o2", "128x128x64s3w4g8r16o2", "128x128x64s4w4g8r16o2"]


def fused_call(ws, a, b, bias, out, cfg, ablate=0):
    launch = fused_all_reduce.prepare(ws, a, b, bias, out, cfg, ablate=ablate)
    launch(*ws.next_epoch())


def check(ws, m, k, n, cfg, group, bias: bool, transposed: bool) -> float:
    return sweep_check(lambda a, b, bb, out: fused_call(ws, a, b, bb, out, cfg), m, k, n, group, bias,
                       transposed, "tile_sweep")


def one_shot(a, b, gname) -> float:
    """The cuBLAS + one-shot path, forced (the default takes the fused kernel for many shapes)."""
    os.environ["COMMFUSE_ALGO"] = "one_shot"
    try:
        return time_us(lambda: torch.ops.commfuse.mm_all_reduce(a, b, None, gname))
    finally:
        del os.environ["COMMFUSE_ALGO"]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=",".join(f"{m}x{k}x{n}" for m, k, n in MM_AR_SHAPES if m >= 1024))
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--out", default=None)
    p.add_argument("--static", action="store_true",
                   help="also time the static tile order (COMMFUSE_FUSED_TICKETS=0); the ticket order, "
                        "the default, is always timed")
    p.add_argument("--ablate", action="store_true",
                   help="also time the first config with parts of the exchange removed (wrong results: "
                        "where the fused kernel's time over the GEMM goes)")
    args = p.parse_args()
    group, rank = sweep_setup()
    gname = group.group_name
    configs = [tiles.TileConfig.parse(c) for c in args.configs.split(",")]
    records = []
    for shape in args.shapes.split(","):
        m, k, n = (int(x) for x in shape.split("x"))
        torch.manual_seed(1234 + rank)
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        b = w.t()  # a linear layer's weight, as the compiled graphs pass it
        ws = symm.workspace(gname, 2 * max(fused_all_reduce.data_elems(m, n, 2, c) for c in configs), a.device)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        t = {"cublas": time_us(lambda: torch.mm(a, b)),
             "nccl_ar": time_us(lambda: funcol.wait_tensor(funcol.all_reduce(out, "sum", group))),
             "unfused": time_us(lambda: funcol.wait_tensor(funcol.all_reduce(torch.mm(a, b), "sum", group))),
             "commfuse_one_shot": one_shot(a, b, gname)}
        errs = {}
        for c in configs:
            mm_key = f"tile_mm {c.bm}x{c.bn}x{c.bk}s{c.stages}w{c.warps}o{c.per_sm}"
            if mm_key not in t:
                t[mm_key] = time_us(lambda: tiles.matmul(a, b, None, c, out=out, programs=c.per_sm * ws.max_programs))
            sm_key = f"{mm_key} on {c.per_sm * ws.max_programs - c.reducers} programs"
            if sm_key not in t:  # the GEMM on the fused kernel's compute programs only: its SM cost
                t[sm_key] = time_us(lambda: tiles.matmul(a, b, None, c, out=out,
                                                         programs=c.per_sm * ws.max_programs - c.reducers))
            for tickets in ("1", "0") if args.static else ("1",):
                os.environ["COMMFUSE_FUSED_TICKETS"] = tickets
                name = f"{c}" + (" static" if tickets == "0" else "")
                sweep_variant(errs, t, name, lambda: check(ws, m, k, n, c, group, bias=False, transposed=True),
                              {f"fused {name}": lambda: fused_call(ws, a, b, None, out, c)})
            os.environ.pop("COMMFUSE_FUSED_TICKETS", None)
        if args.ablate:
            c = configs[0]
            names = dict(fused_all_reduce.ABLATIONS, all=sum(fused_all_reduce.ABLATIONS.values()),
                         no_remote_no_wait=3)
            for name, bits in names.items():
                t[f"ablate {name}"] = time_us(lambda: fused_call(ws, a, b, None, out, c, ablate=bits))
            torch.cuda.synchronize()
            dist.barrier()  # no peer still writes into this rank's workspace
            ErrorWord.check("tile_sweep")
            symm.release_all()  # ablated calls leave flags and slabs inconsistent: start afresh
            ws = symm.workspace(gname, 2 * max(fused_all_reduce.data_elems(m, n, 2, c) for c in configs), a.device)
        if shape == args.shapes.split(",")[0]:  # the other forms, once
            c = configs[0]
            errs["bias+rowmajor"] = check(ws, m, k, n, c, group, bias=True, transposed=False)
        best_fused = min((v, key) for key, v in t.items() if key.startswith("fused"))
        dist.barrier()
        best_mm = min(v for key, v in t.items() if key.startswith("tile_mm") and " on " not in key)
        floor = max(t["cublas"], min(t["nccl_ar"], t["commfuse_one_shot"] - t["cublas"]))
        rec = dict(M=m, K=k, N=n, times=t, errors=errs, best_fused=best_fused[1], floor_us=floor)
        records.append(rec)
        if rank == 0 and shape == args.shapes.split(",")[0]:
            print("resident programs per SM:", {str(key[0]): v for key, v in fused_all_reduce._resident.items()})
        if rank == 0:
            print(f"{m}x{k}x{n}: cublas {t['cublas']:.0f} tile_mm {best_mm:.0f} ({t['cublas'] / best_mm:.2f}x) | "
                  f"unfused {t['unfused']:.0f} one_shot {t['commfuse_one_shot']:.0f} fused {best_fused[0]:.0f} "
                  f"[{best_fused[1]}] ({t['unfused'] / best_fused[0]:.2f}x vs unfused, "
                  f"{t['unfused'] / t['commfuse_one_shot']:.2f}x one_shot) floor~{floor:.0f}", flush=True)
            sweep_details(t, errs)
    return sweep_finish(records, args.out)


if __name__ == "__main__":
    sys.exit(main())
