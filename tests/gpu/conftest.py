"""One NCCL process group for the whole pytest run of the GPU tests (under torchrun, one GPU per
rank), and settings for the rest of a test."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist

from commfuse import env


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


@pytest.fixture
def settings():
    """``settings(algo="fused", timeout_s=1)``: ``env.override`` for the rest of the test (settings
    are read once, so ``monkeypatch.setenv`` would not reach them); a later call's values win, and
    every one is undone when the test ends. What the run-time decided per call signature under
    other settings is dropped at each change (``env.on_change``)."""
    with contextlib.ExitStack() as stack:
        yield lambda **values: stack.enter_context(env.override(**values))
