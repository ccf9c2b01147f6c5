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


def shutdown(agree: bool = True) -> None:
    """Leave the process group in order (the examples' and commands' last step, on every rank).

    With ``agree`` (a run that ended normally on every rank), a barrier first: no rank tears down
    while a peer still waits on it. Then commfuse's per-group state (symmetric memory, graph lanes)
    is released, Dynamo's compiled graphs are dropped, and the process groups destroyed, while the
    interpreter is whole. A gloo group left to interpreter finalization (not destroyed, or still
    referenced by compiled code) can abort the process after its output: torch's gloo worker
    threads then destroy work that holds Python objects (``terminate called without an active
    exception``, pytorch/pytorch#190489; the fix proposed in torch, an ``atexit`` destroy in
    ``init_process_group``, pytorch/pytorch#179291, was not merged). Without ``agree`` (an error
    path, where a peer may never reach a barrier) only the local teardown runs.
    """
    import gc

    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return
    if agree:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dist.barrier()
    groups = sys.modules.get("commfuse.runtime.groups")
    if groups is not None and agree:  # collective (the graph lanes restart together)
        groups.release()
    torch._dynamo.reset()
    gc.collect()
    dist.destroy_process_group()
