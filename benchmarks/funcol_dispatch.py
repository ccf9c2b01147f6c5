"""The host cost of torch's functional collectives before and after importing
``torch.distributed._functional_collectives``, in one process, on a group of one rank.

    python benchmarks/funcol_dispatch.py [--device cpu|cuda] [--samples 20000] [--out F]

Importing that module (torch's symmetric memory imports it, and so do DTensor and the compilation
of a graph with collectives) registers Python autograd kernels for several functional collectives,
and every later call crosses them, gradients needed or not. This times, as Inductor's generated
code calls them, ``wait_tensor`` alone, ``all_reduce_`` + ``wait_tensor`` and
``all_gather_into_tensor`` + ``wait_tensor``: first in a process that has not imported it, then
after the import, then under ``torch.no_grad()`` and under ``torch.inference_mode()``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist

FUNCOL = "torch.distributed._functional_collectives"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--samples", type=int, default=20000)
    p.add_argument("--out", default="")
    args = p.parse_args()
    from ordinary_calls import time_probes  # (the script beside this one; after --help, which runs elsewhere)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29537")
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    if FUNCOL in sys.modules:  # (checked after the group is made: nothing before the first step may import it)
        print(f"funcol_dispatch: {FUNCOL} is imported already; nothing to compare", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    group = dist.group.WORLD.group_name
    c10d = torch.ops._c10d_functional
    # the calls' host work is what is timed: on the CPU the collectives copy the tensor on the host,
    # so a small one there; on the GPU the size ordinary_calls.py uses
    x = (torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16) if cuda else torch.randn(64, 64))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    calls = {
        "wait_tensor": lambda: c10d.wait_tensor(x),
        "all_reduce_ + wait": lambda: c10d.wait_tensor(c10d.all_reduce_(x, "sum", group)),
        "all_gather_into_tensor + wait": lambda: c10d.wait_tensor(c10d.all_gather_into_tensor(x, 1, group)),
    }
    steps = []
    for name, enter in (("before the import", contextlib.nullcontext),
                        (f"after import {FUNCOL}", contextlib.nullcontext),
                        ("after, under torch.no_grad()", torch.no_grad),
                        ("after, under torch.inference_mode()", torch.inference_mode)):
        if name.startswith("after import"):
            __import__(FUNCOL)
        with enter():
            times = time_probes(calls, args.samples, min(1000, args.samples), sync)
        steps.append({"step": name, "times_us": times})
        cells = "  ".join(f"{k} {v['min']:.2f}/{v['median']:.2f}" for k, v in times.items())
        print(f"{name:56s} min/median µs: {cells}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
                       "samples": args.samples, "steps": steps}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
