"""One GPU, no group: the tile kernels' GEMM (``tiles.matmul``) against cuBLAS and against the same
persistent loop written as ``tl.range(..., flatten=True)`` (with and without ``warp_specialize``),
which lets Triton's pipeliner load the next tile's first K blocks during this tile's epilogue. The
fused kernels cannot take that form (their next tile comes from a ticket claim, and copies
interleave), so this measures what the tile boundaries cost, each variant checked against fp32.

    python benchmarks/gemm_flatten_probe.py MxKxN[,...] TILECONFIG[,...]
"""
import sys

import torch
import triton
import triton.language as tl

from commfuse.bench import time_us
from commfuse.kernels import tiles
from commfuse.kernels.tiles import mma_tile, tile_coords
from commfuse.kernels.launch import run as run_kernel


@triton.jit
def flat_kernel(a_desc, b_desc, c, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr, WS: tl.constexpr):
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    tile_c = tl.program_id(0) - NUM_SMS
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_SMS, flatten=FLATTEN, warp_specialize=WS):
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        acc = mma_tile(a_desc, b_desc, pid_m * BM, pid_n * BN, K, BM, BN, BK, True)  # (W.t() operands)
        tile_c += NUM_SMS
        pm, pn = tile_coords(tile_c, num_m, num_n, GROUP_M)
        rows = pm * BM + tl.arange(0, BM)
        cols = pn * BN + tl.arange(0, BN)
        tl.store(c + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(c.dtype.element_ty))


def main():
    tiles.ensure_allocator()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [tuple(int(x) for x in s.split("x")) for s in sys.argv[1].split(",")]
    cfgs = sys.argv[2].split(",")
    for m, k, n in shapes:
        torch.manual_seed(0)
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        b = w.t()
        ref = a.float() @ b.float()
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        t = {"cublas": time_us(lambda: torch.mm(a, b))}
        errs = {}
        for cs in cfgs:
            cfg = tiles.TileConfig.parse(cs)
            for kind in ("tile", "flat", "flat_ws"):
                name = f"{kind} {cs}"
                try:
                    if kind == "tile":
                        fn = lambda: tiles.matmul(a, b, None, cfg, out=out)
                    else:
                        a_desc, b_desc, _ = tiles.descriptor_operands(a, b, cfg)
                        fn = lambda: run_kernel(flat_kernel, (min(sms, tiles.cdiv(m, cfg.bm) * tiles.cdiv(n, cfg.bn)),),
                                                a_desc, b_desc, out, m, n, k, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk,
                                                GROUP_M=cfg.group_m, NUM_SMS=sms, FLATTEN=True, WS=kind == "flat_ws",
                                                num_warps=cfg.warps, num_stages=cfg.stages)
                    out.fill_(float("nan"))
                    fn()
                    torch.cuda.synchronize()
                    errs[name] = ((out.float() - ref).norm() / ref.norm()).item()
                    t[name] = time_us(fn)
                except Exception as exc:
                    errs[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
        print(f"{m}x{k}x{n}: " + ", ".join(f"{key} {v:.1f}" for key, v in t.items()), flush=True)
        print("   errors", {key: (f"{v:.1e}" if isinstance(v, float) else v) for key, v in errs.items()}, flush=True)


if __name__ == "__main__":
    main()
