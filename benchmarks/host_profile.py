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
import io
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist


def _enqueue_ms(step, device, n: int) -> float:
    """Median host time to enqueue one synchronised step."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize(device)
    return statistics.median(times)


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
            enqueue = _enqueue_ms(step, device, args.steps) if cuda else float("nan")
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
                print(f"=== {mode} {backend}: host enqueues a step in {enqueue:.2f} ms (unprofiled); "
                      f"profile of {args.steps} steps, per step divide by {args.steps}\n{out.getvalue()}",
                      file=sys.stderr, flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
