"""Compile every fused-kernel variant for this GPU, without collectives (one GPU is enough), and
print per variant its registers, spills, shared memory and programs per SM: a variant that does
not compile, spills or no longer fits once per SM shows here before a multi-GPU run.

    python benchmarks/kernel_compile.py

Two workspaces over this GPU's memory stand in for a 2-rank group (the launchers only compile
here: ``prepare`` warms the kernel up and returns its launch, which is never called).
"""

from __future__ import annotations

import sys

import torch

from commfuse.bench import trace_buffer
from commfuse.kernels import fused_all_gather, fused_all_reduce, symm, tiles


def _group(world: int, data_bytes: int) -> list:
    bufs = [torch.zeros(symm.HEADER_BYTES + 2 * data_bytes, dtype=torch.uint8, device="cuda")
            for _ in range(world)]
    bases = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return [symm.Workspace("0", r, world, bufs[r], bases, data_bytes, max_programs=sms) for r in range(world)]


_last: dict = {}
_resident_programs = tiles.resident_programs


def _spy(kernel, device):
    """``tiles.resident_programs``, noting the compiled kernel's registers, spills and shared memory."""
    _last.update(regs=kernel.n_regs, spills=kernel.n_spills, smem=kernel.metadata.shared)
    return _resident_programs(kernel, device)


tiles.resident_programs = _spy


def main() -> int:
    torch.manual_seed(0)
    ws = _group(2, 64 << 20)[0]
    dt = torch.bfloat16
    failures = 0
    configs = ["128x256x64s3w8g8r0o1", "128x128x64s4w8g8r0o1", "64x128x64s4w4g8r0o1"]
    for text in configs:
        cfg = tiles.TileConfig.parse(text)
        for scatter, pull in ((False, False), (True, False), (True, True)):
            m, k, n = 2048, 2048, 2048
            a = torch.randn(m, k, device="cuda", dtype=dt)
            b = torch.randn(n, k, device="cuda", dtype=dt).t()
            out = torch.empty(m // 2 if scatter else m, n, device="cuda", dtype=dt)
            name = f"{'rs' if scatter else 'ar'}{' pull' if pull else ''} {text}"
            _last.clear()
            try:
                fused_all_reduce.prepare(ws, a, b, None, out, cfg, scatter, pull=pull)
                key = next(key for key in fused_all_reduce._resident
                           if key[0] == cfg and key[-4] == scatter and key[-2] == pull)
                print(f"{name}: {fused_all_reduce._resident[key]} programs per SM {_last}", flush=True)
            except Exception as exc:  # reported, the others still compile
                failures += 1
                print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:400]}", flush=True)
        for gathered, traced in ((False, False), (True, False), (False, True)):
            rows, k, n = 1024, 2048, 2048
            shard = torch.randn(rows, k, device="cuda", dtype=dt)
            b = torch.randn(n, k, device="cuda", dtype=dt).t()
            out = torch.empty(2 * rows, n, device="cuda", dtype=dt)
            g = torch.empty(2 * rows, k, device="cuda", dtype=dt) if gathered else None
            trace = trace_buffer() if traced else None
            name = f"ag{' gathered' if gathered else ''}{' traced' if traced else ''} {text}"
            _last.clear()
            try:
                fused_all_gather.prepare(ws, shard, b, None, g, out, cfg, trace)
                key = next(key for key in fused_all_gather._resident
                           if key[0] == cfg and key[-2] == gathered and key[-1] == traced)
                print(f"{name}: {fused_all_gather._resident[key]} programs per SM {_last}", flush=True)
            except Exception as exc:
                failures += 1
                print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:400]}", flush=True)
    print("failures:", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
