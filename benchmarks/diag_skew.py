"""What a late rank costs each all-reduce path, and where a model step's time goes (written when
the copy-engine overlap helped a prefill but slowed a training step, ``model/model_f24116a.*``):
(torchrun --nproc_per_node=2 benchmarks/diag_skew.py)

1. One GEMM-bound all-reduce (8192x7168x4096 by default) per path while rank 1 starts each call
   late by a GPU sleep of 0 / 100 / 300 us: a path that only waits for the late rank costs
   about the skew more; one whose waits hold SMs that the GEMM needs costs more than that.
2. The DTensor (``--model sp``: sequence-parallel) training step (``--mode prefill``: the
   prefill) with each of ``--model-settings`` (commfuse settings; ``inductor`` and ``floor``
   name those backends), timed (median of 10 steps), then one step profiled: GPU time per kernel
   family, the GPU's busy time (the union of its kernels' intervals) against that profiled step's
   wall time (the rest is the GPU waiting for the host; the profiler slows the host, so the
   profiled step is slower than the timed ones), and per input shape the GPU time of the kernels
   each commfuse call and each ``aten::mm`` launched (summed: concurrent streams and spin-waits
   count in full; the ``aten::mm`` rows include commfuse's own cuBLAS calls).

    torchrun --nproc_per_node=2 benchmarks/diag_skew.py --skews "" --mode prefill \
        --model-settings "inductor,,CE_MIN_K=0,floor"
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time

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


def _annotation(evt) -> bool:
    """A record_function span on the GPU timeline (e.g. a compiled graph's call), not a kernel."""
    return bool(getattr(evt, "is_user_annotation", False))


def _busy_ms(prof) -> float:
    """Length of the union of the GPU kernels' intervals (ms)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if "CUDA" in str(getattr(e, "device_type", "")) and not _annotation(e)
                   and e.time_range.end > e.time_range.start)
    busy, end = 0.0, float("-inf")
    for lo, hi in spans:
        if hi > end:
            busy += hi - max(lo, end)
            end = hi
    return busy / 1e3


def _report(prof, label: str, ms: float, profiled_ms: float) -> None:
    fams = collections.Counter()
    for evt in prof.key_averages():
        if getattr(evt, "device_type", None) is not None and "CUDA" in str(evt.device_type) \
                and not _annotation(evt):
            total = getattr(evt, "device_time_total", 0) or getattr(evt, "cuda_time_total", 0)
            fams[family(evt.key)] += getattr(evt, "self_device_time_total", total)
    try:
        busy = f"{_busy_ms(prof):.2f} ms"
    except Exception as exc:  # profiler event fields differ across torch versions
        busy = f"unknown ({type(exc).__name__})"
    _p(f"{label}: {ms:.2f} ms/step; profiled step {profiled_ms:.2f} ms, GPU busy {busy}; GPU us by family "
       + ", ".join(f"{f} {v:.0f}" for f, v in fams.most_common()))
    for evt in prof.key_averages(group_by_input_shape=True):
        if evt.key.startswith("commfuse::") or evt.key in ("aten::mm", "aten::addmm"):
            total = getattr(evt, "device_time_total", 0) or getattr(evt, "cuda_time_total", 0)
            if total:
                shapes = [s for s in evt.input_shapes if s][:2]
                _p(f"  {label}: {evt.key} {shapes} x{evt.count}: {total / evt.count:.0f} us GPU each")
    _p(prof.key_averages().table(sort_by="device_time_total", row_limit=12, max_name_column_width=70))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8192x7168x4096")
    p.add_argument("--skews", default="0,100,300")
    p.add_argument("--paths", default="fused,one_shot,ce_overlap,ce_overlap+CE_CHUNKS=4,nccl",
                   help="paths, each a model-benchmark backend suffix (a path and/or KEY=VALUE settings)")
    p.add_argument("--model-settings", default=",CE_MIN_K=0,CE_CHUNKS=4",
                   help="the step's variants: commfuse settings (empty: the defaults), or the "
                        "backends inductor / floor")
    p.add_argument("--mode", default="train", choices=("train", "prefill"))
    p.add_argument("--model", default="dtensor", choices=("dtensor", "sp"),
                   help="sp: the sequence-parallel split (its all-gathers and reduce-scatters; "
                        "settings such as overlap / ce_overlap force their paths)")
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
        for skew in (int(s) for s in args.skews.split(",") if s):
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
    torch.manual_seed(5 + (dist.get_rank() if args.model == "sp" else 0))  # SP: each rank its own shard
    x = torch.randn(4, 2048 // (dist.get_world_size() if args.model == "sp" else 1), cfg.dim,
                    device=device, dtype=dtype)
    torch._dynamo.reset()
    bench_model._allow_many_compiles()
    compiled_by = {}
    for setting in args.model_settings.split(","):
        backend = setting if setting in ("inductor", "floor") else "commfuse"
        if backend not in compiled_by:
            model = bench_model._build(args.model, cfg, device, dtype)
            opt = torch.optim.SGD(model.parameters(), lr=1e-4, foreach=False) if args.mode == "train" else None
            compiled_by[backend] = bench_model._make_step(
                args.mode, bench_model._compile(backend, model), x, None, opt, False)
        plain = compiled_by[backend]
        step = plain if backend != "commfuse" else bench_model._with_algo(setting, plain)
        for _ in range(3):
            step()
        ms = statistics.median(bench_model._step_times(step, device, 10))
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            start = time.perf_counter()
            step()
            torch.cuda.synchronize()
            profiled_ms = (time.perf_counter() - start) * 1e3
        _report(prof, f"{args.model} {args.mode} {setting or 'defaults'}", ms, profiled_ms)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
