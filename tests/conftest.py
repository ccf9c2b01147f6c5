"""Shared fixtures: a fake process group of a chosen size, a clean Dynamo/report state per test."""

from __future__ import annotations

import os

# The tests' shapes are small: fuse them even without CUDA graphs (the launch-bound rule has its own
# tests, which set the bound explicitly). Subprocesses inherit this.
os.environ.setdefault("COMMFUSE_LAUNCH_BOUND_BYTES", "0")

import pytest
import torch

import commfuse
from helpers import init_fake_pg


def _gpu_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


def pytest_collection_modifyitems(config, items):
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason="needs 2 CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=[2, 4, 8], ids=lambda w: f"world{w}")
def world(request) -> int:
    init_fake_pg(request.param)
    return request.param


@pytest.fixture
def world2() -> int:
    init_fake_pg(2)
    return 2


@pytest.fixture(autouse=True)
def clean_state():
    torch._dynamo.reset()
    commfuse.clear_report()
    with torch._inductor.config.patch(fx_graph_cache=False):
        yield
    torch._dynamo.reset()
