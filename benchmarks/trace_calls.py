"""Where a copy-engine all-reduce's GPU time goes, alone and inside a model step (torch.profiler).

    torchrun --nproc_per_node=2 benchmarks/trace_calls.py --out DIR [--parts alone,prefill,train]

1. The down_proj-sized call alone (8192x7168 @ 7168x4096, the copy-engine path), replayed as a CUDA
   graph and eager (``COMMFUSE_CE_GRAPHS=0``): every GPU activity of one call (kernels and copies,
   their kind, stream, start and length from the call's first activity), rank 0 printed.
2. One prefill step (and with ``--parts ...,train`` one training step) of the DTensor model (2
   layers, 4x2048 tokens) compiled with commfuse: each rank's GPU activities from the step's first
   one, saved as JSON (``prefill_rank{r}.json``, ``train_rank{r}.json``) for an offline look at
   each call's neighbourhood and at the ranks' skew.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile


def _activities(prof) -> list[dict]:
    """The GPU activities of a profile (kernels, copies, fills), sorted by start, in µs."""
    out = []
    for e in prof.events():
        kind = getattr(e, "device_type", None)
        if kind is None or "CUDA" not in str(kind):
            continue
        start = e.time_range.start
        out.append(dict(name=e.name[:70], start=start, us=e.time_range.elapsed_us(),
                        stream=getattr(e, "device_resource_id", None)))
    out.sort(key=lambda r: r["start"])
    t0 = out[0]["start"] if out else 0
    for r in out:
        r["start"] -= t0
    return out


def _p(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, file=sys.stderr, flush=True)


def op_alone(group: str, device) -> dict:
    torch.manual_seed(5 + dist.get_rank())
    a = torch.randn(8192, 7168, device=device, dtype=torch.bfloat16)
    b = (torch.randn(4096, 7168, device=device, dtype=torch.bfloat16) / 85).t()
    result = {}
    for graphs in ("1", "0"):
        os.environ["COMMFUSE_CE_GRAPHS"] = graphs
        for _ in range(6):
            torch.ops.commfuse.mm_all_reduce(a, b, None, group)
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                torch.ops.commfuse.mm_all_reduce(a, b, None, group)
            torch.cuda.synchronize()
        acts = _activities(prof)
        calls = [r for r in acts if "gemm" in r["name"].lower() or "sm90" in r["name"].lower()
                 or "cutlass" in r["name"].lower()]
        result[graphs] = acts
        _p(f"--- ce call alone, graphs={graphs}: {len(acts)} GPU activities in 3 calls, "
           f"{len(calls)} GEMM-like; span {acts[-1]['start'] + acts[-1]['us'] - acts[0]['start']:.0f} us")
        third = len(acts) // 3
        for r in acts[third:2 * third]:  # about the middle call
            _p(f"  {r['start']:9.1f} +{r['us']:7.1f}  s{r['stream']}  {r['name']}")
    os.environ.pop("COMMFUSE_CE_GRAPHS", None)
    return result


def model_step(mode: str, device, dtype, out_dir: str) -> None:
    """One ``mode`` step (``prefill`` or ``train``, as ``commfuse.bench model`` runs it) profiled."""
    from commfuse import bench_model
    from commfuse.demo import transformer as demo

    cfg = demo.sized_config(False, 2, dist.get_world_size())
    torch.manual_seed(100)
    x = torch.randn(4, 2048, cfg.dim, device=device, dtype=dtype)
    model = bench_model._build("dtensor", cfg, device, dtype)
    compiled = bench_model._compile("commfuse", model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, foreach=False) if mode == "train" else None
    step = bench_model._make_step(mode, compiled, x, None, opt, False)
    for _ in range(5):
        step()
    times = bench_model._step_times(step, device, 10)
    _p(f"--- {mode} step: median {statistics.median(times):.3f} ms")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    acts = _activities(prof)
    with open(os.path.join(out_dir, f"{mode}_rank{dist.get_rank()}.json"), "w") as f:
        json.dump(acts, f)
    _p(f"--- {mode} step profiled: {len(acts)} GPU activities, span "
       f"{acts[-1]['start'] + acts[-1]['us']:.0f} us (rank 0)")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--parts", default="alone,prefill", help="any of alone, prefill, train (comma-separated)")
    args = p.parse_args()
    import commfuse  # noqa: F401  (registers the ops)
    from commfuse.demo import init_distributed

    device, dtype = init_distributed()
    os.makedirs(args.out, exist_ok=True)
    if "alone" in args.parts:
        alone = op_alone(dist.group.WORLD.group_name, device)
        with open(os.path.join(args.out, f"ce_alone_rank{dist.get_rank()}.json"), "w") as f:
            json.dump(alone, f)
    for mode in ("prefill", "train"):
        if mode in args.parts:
            model_step(mode, device, dtype, args.out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
