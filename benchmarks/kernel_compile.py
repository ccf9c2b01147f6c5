"""Compile every fused-kernel variant for this GPU, without collectives (one GPU is enough), and
print per variant its registers, spills, shared memory and programs per SM: a variant that does
not compile, spills or no longer fits once per SM shows here before a multi-GPU run.

    python benchmarks/kernel_compile.py [--configs 128x256x64s3w8g8r0o1,...]

Two ranks emulated on this GPU (``commfuse.tools.emulated``) stand in for a group: the launchers
only compile here (``prepare`` warms the kernel up and returns its launch, which is never called).
Per tiling: the fused all-reduce, its reduce-scatter form (owners pushed to, or pulling), and the
fused all-gather (plain, also writing the gathered rows, traced).
"""

from __future__ import annotations

import argparse
import os
import sys

# every kernel loaded when CUDA starts, as ``commfuse.tools.emulated`` asks of its groups
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

CONFIGS = "128x256x64s3w8g8r0o1,128x128x64s4w8g8r0o1,64x128x64s4w4g8r0o1"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=CONFIGS, help="tilings, as TileConfig prints them (comma-separated)")
    return p


def main() -> int:
    args = parser().parse_args()
    import torch

    if not torch.cuda.is_available():
        print("kernel_compile: needs a CUDA GPU", file=sys.stderr)
        return 2
    from commfuse.kernels import fused_all_gather, fused_all_reduce, sync, tiles
    from commfuse.tools import emulated

    last: dict = {}
    resident = tiles.resident_programs

    def spy(kernel, device):
        """``tiles.resident_programs``, noting the compiled kernel's registers, spills and shared memory."""
        per_sm = resident(kernel, device)
        last.update(regs=kernel.n_regs, spills=kernel.n_spills, smem=kernel.metadata.shared, per_sm=per_sm)
        return per_sm

    tiles.resident_programs = spy  # the launchers call it once per new compile
    torch.manual_seed(0)
    ws = emulated.group(2, 64 << 20)[0]
    dt = torch.bfloat16
    failures = 0

    def compile_one(name, prepare):
        nonlocal failures
        last.clear()
        try:
            prepare()
            print(f"{name}: " + (f"{last.pop('per_sm')} programs per SM {last}" if last else "compiled earlier"),
                  flush=True)
        except Exception as exc:  # reported, the others still compile
            failures += 1
            print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:400]}", flush=True)

    for text in args.configs.split(","):
        cfg = tiles.TileConfig.parse(text)
        m, k, n = 2048, 2048, 2048
        a = torch.randn(m, k, device="cuda", dtype=dt)
        b = torch.randn(n, k, device="cuda", dtype=dt).t()
        for scatter, pull in ((False, False), (True, False), (True, True)):
            out = torch.empty(m // 2 if scatter else m, n, device="cuda", dtype=dt)
            opts = fused_all_reduce.Options(pull=pull)
            compile_one(f"{'rs' if scatter else 'ar'}{' pull' if pull else ''} {text}",
                        lambda: fused_all_reduce.prepare(ws, a, b, None, out, cfg, scatter, opts))
        rows = 1024
        shard = torch.randn(rows, k, device="cuda", dtype=dt)
        for gathered, traced in ((False, False), (True, False), (False, True)):
            out = torch.empty(2 * rows, n, device="cuda", dtype=dt)
            g = torch.empty(2 * rows, k, device="cuda", dtype=dt) if gathered else None
            trace = torch.empty(1024 * sync.TRACE_SLOTS, dtype=torch.int64, device="cuda") if traced else None
            compile_one(f"ag{' gathered' if gathered else ''}{' traced' if traced else ''} {text}",
                        lambda: fused_all_gather.prepare(ws, shard, b, None, g, out, cfg, trace))
    print("failures:", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
