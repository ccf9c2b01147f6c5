"""Why the copy-engine all-reduce overlap helps a prefill but slows a training step
(``model/model_f24116a.*``): (torchrun --nproc_per_node=2 benchmarks/diag_skew.py)

1. One GEMM-bound all-reduce (8192x7168x4096 by default) per path while rank 1 starts each call
   late by a GPU sleep of 0 / 100 / 300 us: a path that only waits for the late rank costs
   about the skew more; one whose waits hold SMs that the GEMM needs costs more than that.
2. The DTensor training step with each of ``--model-settings`` (the defaults, the copy-engine
   overlap for K >= 7168 with 8 or 4 chunks), timed, then profiled: GPU time per kernel family and
   per commfuse call.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys

import torch
import torch.distributed as dist

SLEEP_CYCLES_PER_US = 1980  # H200 SM clock ~1.98 GHz


def _p(*args):
    if dist.get_rank() == 0:
        print(*args, file=sys.stderr, flush=True)


def skewed(fn, skew_us: int, iters: int = 20) -> float:
    """Median µs per call (events on rank 0) with rank 1's stream held back by ``skew_us``."""
    rank = dist.get_rank()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if rank == 1 and skew_us:
            torch.cuda._sleep(skew_us * SLEEP_CYCLES_PER_US)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000)
        dist.barrier()
    return statistics.median(times)


def family(name: str) -> str:
    low = name.lower()
    for key, fam in (("memcpy", "memcpy"), ("memset", "memset"), ("barrier", "commfuse barrier"),
                     ("nccl", "nccl"), ("gemm", "gemm"), ("cutlass", "gemm"), ("sm90", "gemm"),
                     ("nvjet", "gemm"), ("fused_", "commfuse/triton fused"), ("_kernel", "triton/other")):
        if key in low:
            return fam
    return "other"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8192x7168x4096")
    p.add_argument("--skews", default="0,100,300")
    p.add_argument("--paths", default="fused,one_shot,ce_overlap,ce_overlap+CE_CHUNKS=4,nccl",
                   help="paths, each a model-benchmark backend suffix (a path and/or KEY=VALUE settings)")
    p.add_argument("--model-settings", default=",CE_MIN_K=7168,CE_MIN_K=7168+CE_CHUNKS=4",
                   help="the training step's variants (empty: the defaults)")
    p.add_argument("--no-model", action="store_true")
    args = p.parse_args()
    from commfuse import bench_model
    from commfuse.demo import init_distributed
    from commfuse.demo import transformer as demo

    device, dtype = init_distributed()
    group = dist.group.WORLD.group_name
    m, k, n = (int(x) for x in args.shape.split("x"))
    b = (torch.randn(n, k, device=device, dtype=dtype) / k ** 0.5).t()
    for layout in ("row-major A", "column-major A"):  # a backward's dY may come transposed
        a = torch.randn(m, k, device=device, dtype=dtype)
        if layout.startswith("column"):
            a = a.t().contiguous().t()
        for skew in (int(s) for s in args.skews.split(",")):
            row = {}
            for spec in args.paths.split(","):
                row[spec] = skewed(bench_model._with_algo(
                    spec, lambda: torch.ops.commfuse.mm_all_reduce(a, b, None, group)), skew)
            _p(f"{layout}, skew {skew} us, {args.shape}: " + ", ".join(f"{k_} {v:.0f}" for k_, v in row.items()))
    if args.no_model:
        dist.destroy_process_group()
        return 0

    from torch.profiler import ProfilerActivity, profile

    cfg = demo.sized_config(False, 2, dist.get_world_size())
    torch.manual_seed(5)
    x = torch.randn(4, 2048, cfg.dim, device=device, dtype=dtype)
    torch._dynamo.reset()
    bench_model._allow_many_compiles()
    model = bench_model._build("dtensor", cfg, device, dtype)
    compiled = bench_model._compile("commfuse", model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, foreach=False)
    plain = bench_model._make_step("train", compiled, x, None, opt, False)
    for setting in args.model_settings.split(","):
        step = bench_model._with_algo(setting, plain)
        for _ in range(3):
            step()
        ms = statistics.median(bench_model._step_times(step, device, 10))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        fams, calls = collections.Counter(), collections.Counter()
        for evt in prof.key_averages():
            total = getattr(evt, "device_time_total", 0) or getattr(evt, "cuda_time_total", 0)
            if evt.key.startswith("commfuse::"):
                calls[f"{evt.key} x{evt.count}"] += total
            elif getattr(evt, "device_type", None) is not None and "CUDA" in str(evt.device_type):
                fams[family(evt.key)] += getattr(evt, "self_device_time_total", total)
        _p(f"train {setting or 'defaults'}: {ms:.2f} ms/step; GPU us by family "
           + ", ".join(f"{f} {v:.0f}" for f, v in fams.most_common()) + "; commfuse calls "
           + ", ".join(f"{c} {v:.0f}" for c, v in calls.items()))
        _p(prof.key_averages().table(sort_by="device_time_total", row_limit=16, max_name_column_width=70))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
