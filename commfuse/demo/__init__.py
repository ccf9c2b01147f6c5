"""The bundled example models, and the process-group set-up their scripts share."""

from __future__ import annotations

import os
import sys

#: What torchrun sets and ``init_process_group``'s default rendezvous (``env://``) reads.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launch_problem(what: str, launch: str, gpus: bool = False) -> str | None:
    """Why ``what`` cannot run in this process, in one line that says how to launch it
    (``torchrun --nproc_per_node=2 {launch}``), or None when it can."""
    if gpus:
        import torch

        if not torch.cuda.is_available():
            return (f"{what} needs CUDA GPUs and this machine has none; on a machine with GPUs run "
                    f"torchrun --nproc_per_node=2 {launch}")
    missing = [name for name in TORCHRUN_VARIABLES if not os.environ.get(name)]
    if missing:
        return (f"{what} runs one process per rank: launch it with torchrun --nproc_per_node=2 {launch} "
                f"({missing[0]} is not set)")
    return None


def exit_unless_launched(what: str, launch: str, gpus: bool = False) -> None:
    """Exit with status 2 and :func:`launch_problem`'s line, not a traceback from the rendezvous or
    from CUDA calls on a machine without GPUs."""
    problem = launch_problem(what, launch, gpus)
    if problem:
        print(problem, file=sys.stderr)
        raise SystemExit(2)


def init_distributed():
    """Under torchrun: NCCL with this rank's GPU when there are GPUs, else gloo on the CPU.
    Returns ``(device, dtype)``: bf16 on GPUs, fp32 on the CPU."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    return (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
