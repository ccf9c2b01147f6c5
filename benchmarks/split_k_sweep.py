"""Exploration for the few-rows path of mm_all_reduce (``fused_split_k.py``, issue 4 item 2), run
under torchrun on 2 GPUs: per shape, cuBLAS alone, NCCL alone and unfused, commfuse's current
default and forced one-shot, and the split-K kernel per number of K slices, each checked first
against an fp32 reference on fresh data with the output poisoned (bias and a row-major weight on
the first shape too).

    torchrun --nproc_per_node=2 benchmarks/split_k_sweep.py [--shapes MxKxN,...] [--splits 0,1,2,...]
        [--alone]

``--alone`` also times each variant as a group of one (``Alone``: the same GEMM, slices and
local stores, no push, no flag, no wait), so the tail the exchange adds shows as the difference.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import commfuse  # noqa: F401
from commfuse.bench import (_forced, sweep_check, sweep_details, sweep_finish, sweep_setup, sweep_variant,
                            time_us)
from commfuse.kernels import fused_split_k, symm, tiles

SHAPES = [(m, k, n) for m in (1, 4, 16, 32, 64, 128, 256) for k, n in ((2048, 4096), (7168, 4096))] + [
    (m, k, n) for m in (16, 128) for k, n in ((14336, 8192), (4096, 8192))] + [
    (512, 2048, 4096), (1024, 2048, 4096), (1024, 4096, 8192)]


class Alone:
    """The workspace seen as a group of one (rank 0): the kernel pushes to itself only and waits
    for nobody. Timing only: its output is this rank's partial, not the sum."""

    def __init__(self, ws):
        object.__setattr__(self, "_ws", ws)

    world, rank = 1, 0

    def __getattr__(self, name):
        return getattr(self._ws, name)

    def __setattr__(self, name, value):  # (ticket_base: the real workspace's ticket advances)
        setattr(self._ws, name, value)


def call(ws, a, b, bias, out, cfg):
    fused_split_k.prepare(ws, a, b, bias, out, cfg)(*ws.next_epoch())


def check(ws, m, k, n, cfg, group, bias: bool, transposed: bool) -> float:
    return sweep_check(lambda a, b, bb, out: call(ws, a, b, bb, out, cfg), m, k, n, group, bias,
                       transposed, "split_k_sweep")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=",".join(f"{m}x{k}x{n}" for m, k, n in SHAPES))
    p.add_argument("--splits", default="0,1,2,4,8,16", help="K slices; 0: the kernel's own choice")
    p.add_argument("--tiles", default="", help="tilings to try besides the kernel's own "
                   "(TileConfig strings, e.g. 64x64x128s4w4g1r0o1)")
    p.add_argument("--alone", action="store_true", help="also time each variant as a group of one")
    p.add_argument("--ll", default="", help="LL forms to time (comma-separated 0 and 1; default: "
                   "each variant's own)")
    p.add_argument("--workspace-mb", type=int, default=64, help="workspace bytes per parity, MiB "
                   "(many-row tilings with K slices need more than the default)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    group, rank = sweep_setup()
    gname = group.group_name
    ws = symm.workspace(gname, args.workspace_mb << 20, torch.device("cuda", torch.cuda.current_device()))
    records = []
    first = True
    for shape in args.shapes.split(","):
        m, k, n = (int(x) for x in shape.split("x"))
        torch.manual_seed(1234 + rank)
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5).t()
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        t = {"cublas": time_us(lambda: torch.mm(a, b)),
             "nccl_ar": time_us(lambda: funcol.wait_tensor(funcol.all_reduce(out, "sum", group))),
             "unfused": time_us(lambda: funcol.wait_tensor(funcol.all_reduce(torch.mm(a, b), "sum", group)))}
        for algo in (None, "one_shot"):
            with _forced(algo):
                t[f"commfuse_{algo or 'default'}"] = time_us(
                    lambda: torch.ops.commfuse.mm_all_reduce(a, b, None, gname))
        errs = {}
        auto = fused_split_k.config(m, k, n, ws.max_programs)
        tilings = [None] + [tiles.TileConfig.parse(x) for x in args.tiles.split(",") if x]
        lls = [x == "1" for x in args.ll.split(",")] if args.ll else [None]
        variants = [(split, tile, ll) for tile in tilings for split in (int(s) for s in args.splits.split(","))
                    for ll in lls if tile is None or split]
        for split, tile, ll in variants:
            cfg = fused_split_k.config(m, k, n, ws.max_programs, split or None, tile, ll)
            if split and split * 2 > -(-k // cfg.tile.bk):
                continue
            name = f"auto={cfg}" if split == 0 else str(cfg)
            runs = {f"split_k {name}": lambda: call(ws, a, b, None, out, cfg)}
            if args.alone:
                runs[f"alone {name}"] = lambda: call(Alone(ws), a, b, None, out, cfg)
            sweep_variant(errs, t, name, lambda: check(ws, m, k, n, cfg, group, bias=False, transposed=True),
                          runs)
        if first:
            errs["bias+rowmajor"] = check(ws, m, k, n, auto, group, bias=True, transposed=False)
            first = False
        dist.barrier()
        best = min((v, key) for key, v in t.items() if key.startswith("split_k"))
        floor = max(t["cublas"], min(t["nccl_ar"], t["commfuse_one_shot"] - t["cublas"]))
        records.append(dict(M=m, K=k, N=n, times=t, errors=errs, best=best[1], floor_us=floor))
        if rank == 0:
            print(f"{m}x{k}x{n}: cublas {t['cublas']:.1f} unfused {t['unfused']:.1f} one_shot "
                  f"{t['commfuse_one_shot']:.1f} split_k {best[0]:.1f} [{best[1]}] auto "
                  f"{t.get('split_k auto=' + str(auto), float('nan')):.1f} floor~{floor:.1f} | "
                  f"{t['unfused'] / best[0]:.2f}x unfused, {t['commfuse_one_shot'] / best[0]:.2f}x one_shot, "
                  f"{best[0] / floor:.2f} of floor", flush=True)
            sweep_details(t, errs)
    return sweep_finish(records, args.out)


if __name__ == "__main__":
    sys.exit(main())
