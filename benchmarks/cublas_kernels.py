"""Which cuBLAS kernel (tile, cluster, split-K, as its name says) ``torch.mm`` runs for each
shape of a linear layer's ``x @ W.t()``, and its time: what the fused kernels' GEMMs are
measured against. One GPU, no process group.

    python benchmarks/cublas_kernels.py [--shapes MxKxN,...]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from commfuse.bench import time_us

SHAPES = "16x2048x4096,16x4096x8192,16x7168x4096,16x14336x8192,128x2048x4096,128x4096x8192,128x7168x4096,128x14336x8192,1024x2048x4096,1024x4096x8192,1024x7168x4096,1024x14336x8192"


def main() -> None:
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=SHAPES)
    for m, k, n in ((int(x) for x in shape.split("x")) for shape in p.parse_args().shapes.split(",")):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
        us = time_us(lambda: torch.mm(a, b))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.mm(a, b)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
        print(f"{m}x{k}x{n}: {us:.1f} us  kernels: {' | '.join(names)}", flush=True)


if __name__ == "__main__":
    main()
