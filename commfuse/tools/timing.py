"""How the benchmarks time a GPU call, and the set-up their torchrun scripts share.

``time_us`` is the one GPU timer of the op benchmark, the model benchmark's per-call check, the
path sweep and the trace script, so their numbers compare: the median of CUDA-event timings of
back-to-back calls queued behind a GPU sleep (the events time the device, not Python's launch
overhead), the larger over the ranks.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time

import torch
import torch.distributed as dist

from commfuse import env

#: ~20 ms at H200 clocks: long enough for the host to enqueue ``time_us``'s calls behind it.
SLEEP_CYCLES = 40_000_000


def commit() -> str:
    """The tree's commit for result records (the ``COMMFUSE_COMMIT`` setting wins: a copy of the
    tree may carry a stale ``.git``)."""
    if env.current().commit:
        return env.current().commit
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(__file__)).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def time_us(fn, warmup: int = 5, iters: int = 20) -> float:
    """Median per-call GPU time of ``fn`` in µs, max over ranks (this process's alone without a group).

    Calls run back to back on the stream behind a GPU sleep long enough for the host to enqueue
    them all, so the events time the device work, not Python's launch overhead.
    """
    grouped = dist.is_available() and dist.is_initialized()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if grouped:
        dist.barrier()
    torch.cuda._sleep(SLEEP_CYCLES)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    med = torch.tensor(statistics.median(s.elapsed_time(e) for s, e in events) * 1000.0, device="cuda")
    if grouped:
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return med.item()


def host_us(fn, n: int = 100, sleep_cycles: int = int(3e9)) -> float:
    """Host µs per call of ``fn`` while the GPU is kept busy (a long GPU sleep queued first), so
    only the host's work is timed; the ranks start together (collective ``fn`` stay paired). A
    ``fn`` of many launches can fill CUDA's launch queue behind the sleep, and then this times the
    sleep: keep ``n`` x launches per call under ~1000."""
    fn()
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda._sleep(sleep_cycles)
    start = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - start) / n * 1e6
    torch.cuda.synchronize()
    return us


def setup_ranks():
    """A GPU script's start under torchrun: this rank's GPU, an NCCL group, and cuBLAS without
    reduced-precision split-K sums (they would hide or mimic the kernels' errors). Returns the
    WORLD group and this rank."""
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    return dist.group.WORLD, dist.get_rank()


def finish(records: list, out: str | None) -> int:
    """Rank 0 writes a script's records to ``out``; every rank leaves the group."""
    if dist.get_rank() == 0 and out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(records, f, indent=1)
    from commfuse.demo import shutdown

    shutdown()
    return 0
