"""The session's NCCL process group for the GPU tests (run under torchrun, one GPU per rank)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="session")
def nccl():
    if "RANK" not in os.environ or not torch.cuda.is_available():
        pytest.skip("GPU tests run under torchrun with one GPU per rank")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # cuBLAS may otherwise reduce split-K partial sums in bf16/fp16 for small M, an error of the
    # GEMM itself (the unfused graph has it too) that would hide or mimic ours.
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    yield dist.group.WORLD
