"""The bundled example models, and the process-group set-up their scripts share."""

from __future__ import annotations


def init_distributed():
    """Under torchrun: NCCL with this rank's GPU when there are GPUs, else gloo on the CPU.
    Returns ``(device, dtype)``: bf16 on GPUs, fp32 on the CPU."""
    import os

    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    return (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
