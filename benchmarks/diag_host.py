"""Host time of one commfuse call per path, and where it goes (cProfile), with the GPU kept busy
so only the host is timed: a training step measured host-bound (``explore/diag_skew_ea260fa.log``:
the copy-engine overlap's 14 calls took 20 ms of host in a 20 ms-GPU step).

    torchrun --nproc_per_node=2 benchmarks/diag_host.py [--profile fused,ce_overlap]
    torchrun --nproc_per_node=2 benchmarks/diag_host.py --bound [--rounds 2]
    torchrun --nproc_per_node=N benchmarks/diag_host.py --cycle [--batches 30] [--profile ...]

``--bound``: shapes so small that the GPU finishes each call long before the host issues the
next, timed back to back with no sleep: µs per call is the host's cost (of the slower rank: the
ranks pair every call), with the launch queue never full (a sleep-first loop of many launches can
time the sleep instead); ``CE_CHUNKS=4`` beside the copy-engine overlap's default 8 chunks, each
path timed ``--rounds`` times in turn (``explore/diag_host_bound_*.log``: later rounds ran faster
for every path, so compare within a round).

``--cycle``: the DTensor model's calls (``CYCLE_CASES``), every one in turn in each batch behind a
GPU sleep, so each call meets caches the others used, as inside a model step (a loop of one call
keeps them warm and hides costs, ``NOTES.md`` §30). Runs at one rank too: there the paths are
forced past the dispatch (which sends one rank to NCCL), so one GPU times their host work (the
copy-engine overlap then pulls nothing: one copy per chunk and peer less than at two ranks).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from commfuse.bench import host_us

#: M x K x N per path: tiny, except M where the path's chunking needs rows (8 chunks of 1024)
BOUND_CASES = {"fused": (1024, 256, 256), "one_shot": (1024, 256, 256), "split_k": (16, 256, 256),
               "ce_overlap": (8192, 64, 256), "ce_overlap+CE_CHUNKS=4": (8192, 64, 256),
               "overlap": (8192, 64, 256), "nccl": (1024, 256, 256)}
#: (path, M, K, N, weight layout) of the DTensor model's row-parallel calls at TP=2 (8B-class
#: sizes, 4x2048 tokens) and the path each takes there; ``T``: a transposed weight view
CYCLE_CASES = [("fused", 8192, 2048, 4096, "T"), ("fused", 8192, 3072, 4096, "N"),
               ("ce_overlap", 8192, 7168, 4096, "T"), ("ce_overlap", 8192, 14336, 4096, "N"),
               ("one_shot", 2048, 2048, 4096, "T"), ("split_k", 32, 2048, 4096, "T"),
               ("nccl", 8192, 2048, 4096, "T")]
CASES = {"fused": (8192, 2048, 4096), "one_shot": (8192, 2048, 4096), "split_k": (16, 2048, 4096),
         "ce_overlap": (8192, 7168, 4096), "nccl": (8192, 2048, 4096)}


def parts(group_name: str, rank: int) -> None:
    """The fused all-reduce call's host steps, each alone (8192x2048x4096, GPU kept busy)."""
    from commfuse.kernels import cuda_paths, dispatch, fused_all_reduce, ops, symm

    m, k, n = CASES["fused"]
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    cfg = dispatch.tile_config(m, k, n)
    ws = symm.workspace(group_name, dispatch.fused_workspace_bytes(m, k, n, a.dtype, 2), a.device)
    launch = fused_all_reduce.prepare(ws, a, b, None, out, cfg)
    steps = {
        "whole op (torch.ops)": lambda: torch.ops.commfuse.mm_all_reduce(a, b, None, group_name),
        "cuda_paths.mm_all_reduce": lambda: cuda_paths.mm_all_reduce(a, b, None, group_name),
        "ops validation": lambda: ops._validate_mm_all_reduce(a, b, None, group_name),
        "dispatch.mm_all_reduce": lambda: dispatch.mm_all_reduce(m, k, n, a.dtype, 2, 0),
        "tile_config + workspace bytes + symm.workspace": lambda: symm.workspace(
            group_name, dispatch.fused_workspace_bytes(m, k, n, a.dtype, 2), a.device),
        "torch.empty": lambda: torch.empty(m, n, device="cuda", dtype=torch.bfloat16),
        "prepare": lambda: fused_all_reduce.prepare(ws, a, b, None, out, cfg),
        "launch (kernel only)": lambda: launch(*ws.next_epoch()),
    }
    for name, fn in steps.items():
        us = host_us(fn)
        if rank == 0:
            print(f"host us, fused step: {name}: {us:.1f}", flush=True)


def _print_profile(prof, label: str, rank: int, rows: int) -> None:
    if rank == 0:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(rows)
        print(f"--- cProfile of {label} (tottime)\n" + s.getvalue()[-6000:], flush=True)


def _profiled(call, n: int = 100, sleep_cycles: int = 0) -> cProfile.Profile:
    """A cProfile of ``n`` calls (after a GPU sleep of ``sleep_cycles``, if any)."""
    prof = cProfile.Profile()
    if sleep_cycles:
        torch.cuda._sleep(sleep_cycles)
    prof.enable()
    for _ in range(n):
        call()
    prof.disable()
    torch.cuda.synchronize()
    return prof


def bound(group, rank: int, rounds: int, profile: list[str], n: int = 300) -> None:
    """Host-bound loops (tiny shapes, no sleep): µs per call for each path, ``rounds`` times."""
    import time

    from commfuse.bench import settings

    def per_call(fn):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / n * 1e6

    for case, (m, k, n_) in BOUND_CASES.items():
        algo, _, knob = case.partition("+")
        extra = dict([knob.split("=")]) if knob else {}
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n_, k, device="cuda", dtype=torch.bfloat16).t()
        call = (lambda: torch.ops.commfuse.mm_all_reduce(a, b, None, group.group_name))
        env = {"COMMFUSE_ALGO": algo, **{f"COMMFUSE_{key}": value for key, value in extra.items()}}
        with settings(env):
            row = [f"{per_call(call):.1f}" for _ in range(rounds)]
            if algo in profile:
                _print_profile(_profiled(call), f"100 host-bound {case} calls", rank, 25)
        ref = per_call(lambda: funcol.wait_tensor(funcol.all_reduce(torch.mm(a, b), "sum", group)))
        mm = per_call(lambda: torch.mm(a, b))
        if rank == 0:
            print(f"host-bound us/call {case} {m}x{k}x{n_}: commfuse {' / '.join(row)}; "
                  f"mm + funcol all_reduce {ref:.1f}; mm {mm:.1f}", flush=True)


def cycle(group, rank: int, batches: int, profile: list[str], sleep_ms: float = 40.0) -> dict:
    """``--cycle``: median host µs inside ``cuda_paths.mm_all_reduce`` per case."""
    import statistics
    import time

    from commfuse.kernels import cuda_paths, dispatch

    forced = {"algo": None}
    real = dispatch.mm_all_reduce
    dispatch.mm_all_reduce = lambda *a, **k: forced["algo"] or real(*a, **k)  # this process only
    cases = []
    torch.manual_seed(0)  # the same operands on every rank: the sum is world x one product
    for algo, m, k, n, layout in CYCLE_CASES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        b = w.t() if layout == "T" else w.t().contiguous()
        cases.append((f"{algo} {m}x{k}x{n}{' (W.t())' if layout == 'T' else ''}", algo, a, b))

    def call(algo, a, b):
        forced["algo"] = algo
        try:
            return cuda_paths.mm_all_reduce(a, b, None, group.group_name)
        finally:
            forced["algo"] = None

    for name, algo, a, b in cases:  # compile, allocate, and the direct launch's first launches
        for _ in range(3):
            call(algo, a, b)
        # then one call checked against fp32, its output likely in a NaN-poisoned block
        poison = torch.full((a.shape[0], b.shape[1]), float("nan"), device="cuda", dtype=a.dtype)
        del poison
        out = call(algo, a, b).float()
        ref = (a.float() @ b.float()) * dist.get_world_size()
        err = ((out - ref).norm() / ref.norm()).item()
        if rank == 0:
            print(f"  check {name}: relative error {err:.2e} against fp32", flush=True)
        if not err < 2e-2:
            raise RuntimeError(f"diag_host: {name} is wrong (relative error {err})")
    torch.cuda.synchronize()
    dist.barrier()
    cycles = int(sleep_ms * (getattr(torch.cuda.get_device_properties(0), "clock_rate", 0) or 1_980_000))
    host = {name: [] for name, *_ in cases}
    for _ in range(batches):
        torch.cuda._sleep(cycles)
        for name, algo, a, b in cases:
            start = time.perf_counter()
            call(algo, a, b)
            host[name].append((time.perf_counter() - start) * 1e6)
        torch.cuda.synchronize()
    medians = {name: statistics.median(times) for name, times in host.items()}
    if rank == 0:
        print(f"host us inside one call, every case in turn (median of {batches} batches, "
              f"{dist.get_world_size()} rank(s), GPU kept busy):", flush=True)
        for name, us in medians.items():
            print(f"  {name:36s} {us:8.1f}  (min {min(host[name]):.1f})", flush=True)
    for name, algo, a, b in cases:
        if algo in profile:
            _print_profile(_profiled(lambda: call(algo, a, b), 20, cycles), f"20 {name} calls", rank, 25)
    dispatch.mm_all_reduce = real
    return medians


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--profile", default="fused,ce_overlap")
    p.add_argument("--parts", action="store_true", help="also time the fused call's steps one by one")
    p.add_argument("--bound", action="store_true",
                   help="only the host-bound loops of tiny shapes (no GPU sleep)")
    p.add_argument("--rounds", type=int, default=2, help="with --bound: timings per path, in turn")
    p.add_argument("--cycle", action="store_true", help="only the model's calls, every one in turn")
    p.add_argument("--batches", type=int, default=30, help="with --cycle: timed batches")
    p.add_argument("--out", default="", help="with --cycle: JSON of the medians")
    args = p.parse_args()
    import commfuse  # noqa: F401

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    rank, group = dist.get_rank(), dist.group.WORLD
    if args.cycle:
        medians = cycle(group, rank, args.batches, args.profile.split(","))
        if rank == 0 and args.out:
            with open(args.out, "w") as f:
                json.dump({"world": dist.get_world_size(), "batches": args.batches, "host_us": medians,
                           "torch": torch.__version__}, f, indent=1)
        dist.destroy_process_group()
        return 0
    if args.bound:
        bound(group, rank, args.rounds, args.profile.split(","))
        dist.destroy_process_group()
        return 0
    for algo, (m, k, n) in CASES.items():
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
        os.environ["COMMFUSE_ALGO"] = algo
        call = (lambda: torch.ops.commfuse.mm_all_reduce(a, b, None, group.group_name))
        us = host_us(call)
        ref = host_us(lambda: funcol.wait_tensor(funcol.all_reduce(torch.mm(a, b), "sum", group)))
        mm = host_us(lambda: torch.mm(a, b))
        if rank == 0:
            print(f"host us/call {algo} {m}x{k}x{n}: commfuse {us:.1f}, mm + funcol all_reduce {ref:.1f}, "
                  f"mm {mm:.1f}", flush=True)
        if algo in args.profile.split(","):
            _print_profile(_profiled(call, sleep_cycles=int(3e9)), f"100 {algo} calls", rank, 22)
    os.environ["COMMFUSE_ALGO"] = ""
    if args.parts:
        parts(group.group_name, rank)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
