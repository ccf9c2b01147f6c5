"""Probe (one GPU, a group of one): the split-K kernel's K loop with Triton's automatic warp
specialization (``tl.range(..., warp_specialize=True)``: a producer warp issues the TMA loads while
the others multiply), against the plain software-pipelined loop, per tiling. Run once plain and
once with ``--ws`` (the loop is swapped in before anything compiles):

    torchrun --nproc_per_node=1 benchmarks/ws_probe.py [--ws] [--shapes MxKxN,...] [--tiles ...]

Each variant is checked against ``a @ b`` (fp32) with the output poisoned first."""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from commfuse.bench import sweep_setup, time_us
from commfuse.kernels import fused_split_k, symm, tiles


@triton.jit
def _mma_range_ws(a_desc, b_desc, off_m, off_n, k_lo, k_hi, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, B_TRANSPOSED: tl.constexpr):
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in tl.range(k_lo, k_hi, warp_specialize=True):
        a = a_desc.load([off_m, k * BK])
        if B_TRANSPOSED:
            b = b_desc.load([off_n, k * BK]).T
        else:
            b = b_desc.load([k * BK, off_n])
        acc = tl.dot(a, b, acc)
    return acc


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ws", action="store_true")
    p.add_argument("--shapes", default="128x14336x8192,128x4096x8192,16x4096x8192")
    p.add_argument("--tiles", default="128x64x64s8w4g1r0o1,128x64x128s4w4g1r0o1,16x64x256s4w4g1r0o1")
    args = p.parse_args()
    if args.ws:
        fused_split_k.mma_range = _mma_range_ws
    group, _ = sweep_setup()
    ws = symm.workspace(group.group_name, 64 << 20, torch.device("cuda", torch.cuda.current_device()))
    for shape in args.shapes.split(","):
        m, k, n = (int(x) for x in shape.split("x"))
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5).t()
        ref = a.float() @ b.float()
        line = [f"{shape}{' ws' if args.ws else ''}: cublas {time_us(lambda: torch.mm(a, b)):.1f}"]
        for text in args.tiles.split(","):
            tile = tiles.TileConfig.parse(text)
            if (m <= 16) != (tile.bm == 16):  # 16-row tilings for 16 rows, 128-row ones for more
                continue
            cfg = fused_split_k.config(m, k, n, ws.max_programs, None, tile)
            try:
                out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                run = fused_split_k.prepare(ws, a, b, None, out, cfg)
                run(*ws.next_epoch())
                torch.cuda.synchronize()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                us = time_us(lambda: run(*ws.next_epoch()))
                line.append(f"{cfg} {us:.1f} (err {err:.1e})")
            except Exception as exc:  # a tiling the specialisation cannot compile: reported
                line.append(f"{cfg} failed: {type(exc).__name__}: {str(exc)[:160]}")
                torch.cuda.synchronize()
        print(" | ".join(line), flush=True)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
