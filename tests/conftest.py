"""Shared fixtures: a fake process group of a chosen size, a clean Dynamo/report state per test."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import commfuse


def _gpu_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


def pytest_collection_modifyitems(config, items):
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason="needs 2 CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def init_fake_pg(world_size: int) -> None:
    if dist.is_initialized():
        if dist.get_world_size() == world_size and dist.get_backend() == "fake":
            return
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


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


def group_name() -> str:
    return dist.group.WORLD.group_name
