"""Compile helpers for the CPU tests."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._inductor.utils import run_and_get_code
from torch.testing._internal.distributed.fake_pg import FakeStore

import commfuse


def init_fake_pg(world_size: int) -> None:
    """A single-process fake process group of ``world_size`` ranks (this process is rank 0)."""
    if dist.is_initialized():
        if dist.get_world_size() == world_size and dist.get_backend() == "fake":
            return
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def group_name() -> str:
    return dist.group.WORLD.group_name


def compile_code(fn, *args, backend=None, train: bool = False):
    """Compile ``fn`` with commfuse, run it (and its backward when ``train``); return (out, code)."""
    compiled = torch.compile(fn, backend=backend or commfuse.backend(min_mnk=0), fullgraph=True)

    def step(*a):
        out = compiled(*a)
        if train:
            (out[0] if isinstance(out, tuple) else out).float().sum().backward()
        return out

    out, codes = run_and_get_code(step, *args)
    return out, "\n".join(codes)


def calls(code: str, op: str) -> int:
    """How many times the generated code calls ``op`` (e.g. "commfuse.mm_all_reduce")."""
    return code.count(f"torch.ops.{op}.default(")


def gloo_rank(rank: int, init_file: str, world_size: int, seed: int = 100):
    """Join a gloo group of ``world_size`` CPU processes (a spawned test's rank): collectives that
    do not pair fail in a minute instead of gloo's 30; every rank holds different random data.
    Returns the group."""
    import datetime

    torch._inductor.config.fx_graph_cache = False
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(seed + rank)
    return dist.group.WORLD


def fp8(*shape, dtype=torch.float8_e4m3fn):
    """A random FP8 tensor (drawn in fp32, then cast)."""
    return torch.randn(*shape).to(dtype)


def _then_shutdown(rank: int, worker, *args) -> None:
    """``worker(rank, *args)``; once it returns, the rank leaves without interpreter finalization.

    A gloo group outlives ``destroy_process_group()`` after a compile (torch's own references to
    it remain: docs/reliability.md), so its worker threads meet interpreter finalization, which can
    abort a rank after its test passed. What a test checks is done when the worker returns; the
    teardown itself is the soak's subject (``tests/test_examples.py``)."""
    import os
    import sys

    from commfuse.demo import shutdown

    worker(rank, *args)
    shutdown()  # a group the worker left: barrier, commfuse's state released, destroyed
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(worker, args: tuple = (), nprocs: int = 2) -> None:
    """``torch.multiprocessing.spawn`` of ``worker`` on ``nprocs`` ranks, each leaving as
    ``_then_shutdown`` says."""
    import torch.multiprocessing as mp

    mp.spawn(_then_shutdown, args=(worker, *args), nprocs=nprocs, join=True)
