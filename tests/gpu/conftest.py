"""GPU tests run under ``torchrun --nproc_per_node=2 -m pytest -m gpu tests/gpu``; each rank runs the
same tests in the same order (they are collective). Without torchrun or GPUs they skip."""

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
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    yield dist.group.WORLD
