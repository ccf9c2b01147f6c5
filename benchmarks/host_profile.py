"""Where the host's time goes inside a model step: a cProfile of synchronised steps of the
DTensor stack compiled by each backend, with the host time to enqueue a step.

    torchrun --nproc_per_node=2 benchmarks/host_profile.py [--modes prefill,train] [--steps 20]

The model benchmark's ``--call-times`` showed commfuse's calls spending far more host time inside
a step than alone, and the first all-reduce of each step paying it as GPU idle time
(``NOTES.md`` §30): this says which functions that host time is in. Rank 0 prints; cProfile adds
about a microsecond per Python call, so compare backends within one run, not with unprofiled
times.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist


class _GcClock:
    """Time spent in Python's cyclic garbage collector (``gc.callbacks``), per generation."""

    def __init__(self):
        self.ms = [0.0, 0.0, 0.0]
        self.count = [0, 0, 0]
        self._start = 0.0

    def __call__(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.ms[info["generation"]] += (time.perf_counter() - self._start) * 1e3
            self.count[info["generation"]] += 1


def _enqueue_ms(step, sync, n: int) -> tuple[float, _GcClock]:
    """Median host time to enqueue one synchronised step, and the collector's time meanwhile."""
    times, clock = [], _GcClock()
    gc.callbacks.append(clock)
    try:
        for _ in range(n):
            sync()
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
        sync()
    finally:
        gc.callbacks.remove(clock)
    return statistics.median(times), clock


def main() -> int:
    from commfuse import bench_model
    from commfuse.demo import init_distributed
    from commfuse.demo import transformer as demo

    p = argparse.ArgumentParser()
    p.add_argument("--modes", default="prefill,train")
    p.add_argument("--backends", default="inductor,commfuse")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rows", type=int, default=30, help="functions printed per profile")
    p.add_argument("--gc", default="on,freeze",
                   help="collector settings timed in turn: on, freeze (gc.freeze() after the warm-up "
                        "steps: the objects alive then are never scanned again), off")
    p.add_argument("--callees", default="_fused,launch,prepare,_copy_engine_overlapped,mm_all_reduce",
                   help="functions whose callees are printed (cumulative)")
    args = p.parse_args()
    device, dtype = init_distributed()
    cuda = device.type == "cuda"
    cfg = demo.sized_config(not cuda, args.layers, dist.get_world_size())
    batch, seq = (4, 2048) if cuda else (2, 16)
    x = torch.randn(batch, seq, cfg.dim, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if cuda else (lambda *a: None)
    for mode in args.modes.split(","):
        for backend in args.backends.split(","):
            torch._dynamo.reset()
            model = bench_model._build("dtensor", cfg, device, dtype)
            opt = torch.optim.SGD(model.parameters(), lr=1e-4, foreach=False) if mode == "train" else None
            step = bench_model._make_step(mode, bench_model._compile(backend, model), x, None, opt, False)
            for _ in range(5):
                step()
            for setting in args.gc.split(","):
                gc.unfreeze()
                gc.enable()
                if setting == "freeze":
                    gc.collect()
                    gc.freeze()
                elif setting == "off":
                    gc.disable()
                enqueue, clock = _enqueue_ms(step, sync, args.steps)
                if dist.get_rank() == 0:
                    print(f"=== {mode} {backend} gc={setting}: host enqueues a step in {enqueue:.2f} ms; "
                          f"collector {sum(clock.ms) / args.steps:.2f} ms per step (generations "
                          f"0/1/2: {'/'.join(f'{m:.1f}' for m in clock.ms)} ms in "
                          f"{'/'.join(map(str, clock.count))} runs over {args.steps} steps)",
                          file=sys.stderr, flush=True)
            gc.unfreeze()
            gc.enable()
            prof = cProfile.Profile()
            for _ in range(args.steps):
                sync()
                prof.enable()
                step()
                prof.disable()
            sync()
            if dist.get_rank() == 0:
                out = io.StringIO()
                stats = pstats.Stats(prof, stream=out)
                stats.sort_stats("tottime").print_stats(args.rows)
                stats.sort_stats("cumtime").print_stats("commfuse|triton|_ops.py|custom_ops", 2 * args.rows)
                for name in args.callees.split(","):
                    stats.print_callees(rf"commfuse.*\({name}\)")
                print(f"=== {mode} {backend}: profile of {args.steps} steps, per step divide by "
                      f"{args.steps}\n{out.getvalue()}", file=sys.stderr, flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
