"""Compile a tensor-parallel Llama-style stack with ``backend="commfuse"`` and check it against eager.

    torchrun --nproc_per_node=2 examples/tp_transformer.py                 # NCCL on GPUs, else gloo
    torchrun --nproc_per_node=2 examples/tp_transformer.py --model sp      # sequence parallel
    torchrun --nproc_per_node=2 examples/tp_transformer.py --model hooks   # gpt-fast-style hooks

Rank 0 prints what fused (``commfuse.report()``) and the relative error of the compiled output
against eager. The model code is untouched: only the ``backend=`` argument changes. With small sizes
(``--small``, the default on the CPU, where the fused ops run the unfused computation) nothing is
left launch-bound (``launch_bound_bytes=0``), so the small outputs fuse and their values are
checked; a run of two or more ranks in which nothing fused fails. One rank has nothing to exchange,
so nothing to fuse: that run checks the values and says so.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import commfuse
from commfuse.demo import exit_unless_launched, init_distributed, shutdown
from commfuse.demo import transformer as demo


def main() -> None:
    args = parse_args()
    exit_unless_launched("examples/tp_transformer.py", "examples/tp_transformer.py")
    device, dtype = init_distributed()
    try:
        run(args, device, dtype)
    except BaseException:
        shutdown(agree=False)  # a peer may never reach the barrier: leave without one
        raise
    shutdown()  # every rank done: in order, before the interpreter's own teardown


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["dtensor", "sp", "hooks"], default="dtensor")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--small", action="store_true", help="small sizes (the default on CPU)")
    p.add_argument("--exclude", action="append", default=[], help="qualified-name pattern to opt out")
    return p.parse_args()


def run(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    small = args.small or device.type != "cuda"
    cfg = demo.sized_config(small, args.layers, world)

    torch.manual_seed(0)  # same weights on every rank before sharding
    model = demo.Transformer(cfg).to(device=device, dtype=dtype)
    if args.model == "hooks":
        demo.parallelize_hooks(model)
    else:
        demo.parallelize_dtensor(model, init_device_mesh(device.type, (world,)), sequence_parallel=args.model == "sp")
    seq = args.seq // world if args.model == "sp" else args.seq
    torch.manual_seed(1 + (rank if args.model == "sp" else 0))  # SP: each rank holds its own shard
    x = torch.randn(args.batch, seq, cfg.dim, device=device, dtype=dtype)

    compiled = torch.compile(model, backend=commfuse.backend(exclude=args.exclude,
                                                             launch_bound_bytes=0 if small else None))
    with torch.no_grad():
        want = model(x)
        got = compiled(x)
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    if rank == 0:
        print(commfuse.report())
        ranks = f"{world} rank{'' if world == 1 else 's'}"
        print(f"relative error of commfuse vs eager: {err:.2e} ({dtype}, {ranks}, {device.type})")
        if world == 1:
            print("one rank: nothing to exchange, so nothing to fuse; launch two or more to see fusion "
                  "(torchrun --nproc_per_node=2 examples/tp_transformer.py)")
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    if err > tol:
        raise SystemExit(f"rank {rank}: relative error {err:.2e} exceeds {tol}")
    if world > 1 and not commfuse.report().fused and not args.exclude:
        raise SystemExit(f"rank {rank}: nothing fused, so the check compared Inductor with eager")


if __name__ == "__main__":
    main()
