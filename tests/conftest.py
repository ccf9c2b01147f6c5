"""Shared fixtures: a fake process group of a chosen size, a clean Dynamo/report state per test."""

from __future__ import annotations

import gc
import os
import pathlib

# Subprocesses (python -c, python -m commfuse, torchrun) import this checkout's package, not the one
# an editable install elsewhere points at: a test of this tree must not pass or fail on another's.
_ROOT = str(pathlib.Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join([_ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                      if p and p != _ROOT])
# The tests' shapes are small: fuse them even without CUDA graphs (the launch-bound rule has its own
# tests, which set the bound explicitly). Subprocesses inherit this.
os.environ.setdefault("COMMFUSE_LAUNCH_BOUND_BYTES", "0")
# Hardware queues for the one-GPU emulation's streams (tests/gpu/test_gpu_one_device.py: up to four per
# emulated rank, each may spin waiting for another rank). CUDA reads this when the process makes
# its context, which importing commfuse (Iris, Triton) may already do, so it is set here, first.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
# Every kernel loaded when the context is made (``commfuse.tools.emulated``: in a group emulated on
# one GPU, one host thread launches every rank, and a kernel loaded lazily at its first launch may
# make that thread wait for the device's running kernels, one of which spins for a rank it has not
# launched yet). Read with the context, like the setting above.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import pytest
import torch

import commfuse
from commfuse import exclusion
from helpers import init_fake_pg


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


if not _gpus():
    # Without a GPU, Inductor compiles in the process that compiles, not in a pool of worker
    # processes: the kernels are tiny C++ ones, and each process that compiles (xdist workers,
    # every rank a test starts) would otherwise start a pool that imports torch once more, on a CI
    # machine of two cores. Subprocesses inherit the setting.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    torch._inductor.config.compile_threads = int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"])
    # Scalar C++ kernels: the suite's CPU tensors are tiny and what it checks is the graph
    # commfuse rewrites and the values against eager, not the CPU kernels' speed; without the
    # vector ISA's templates each kernel compiles in about three quarters of the time.
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
    torch._inductor.config.cpp.vec_isa_ok = os.environ["TORCHINDUCTOR_VEC_ISA_OK"] == "1"

# Without a CUDA GPU every test under tests/gpu would be skipped one by one: the directory is not
# collected at all then, which the report's header says.
collect_ignore = [] if _gpus() else ["gpu"]


def pytest_report_header(config):
    if not _gpus():
        return "tests/gpu: not collected (no CUDA GPU; those tests run on GPU machines, see docs/benchmarks.md)"


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests need 2 GPUs, those also marked ``one_gpu`` one."""
    gpus = _gpus()
    two, one = pytest.mark.skip(reason="needs 2 CUDA GPUs"), pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and gpus < (1 if "one_gpu" in item.keywords else 2):
            item.add_marker(one if "one_gpu" in item.keywords else two)


def pytest_collection_finish(session):
    """What is alive once the tests are collected (torch, the tests' modules) lives to the end:
    frozen out of the collector's generations, so that each ``gc.collect()`` (``groups.release``
    makes one, and many tests release every group twice) walks only what the tests made since."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    gc.unfreeze()  # for the interpreter's own clean-up at exit (bindings check that theirs is freed)


@pytest.fixture(params=[2, 4, 8], ids=lambda w: f"world{w}")
def world(request) -> int:
    init_fake_pg(request.param)
    return request.param


@pytest.fixture
def world2() -> int:
    init_fake_pg(2)
    return 2


@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    torch._dynamo.reset()
    commfuse.clear_report()
    # Once any instance was excluded, the pass opts every later graph out of the FX graph cache for
    # the rest of the process (exclusion.any_instance_excluded): each test starts as a process in
    # which none was, or a cache test after an exclusion test sees a bypass instead of a miss.
    monkeypatch.setattr(exclusion, "_markers", {})
    with torch._inductor.config.patch(fx_graph_cache=False):
        yield
    torch._dynamo.reset()


@pytest.fixture
def fused_nodes(monkeypatch):
    """The fused op nodes each rewritten graph holds: (op name, its arguments that are not
    tensors)."""
    from commfuse.inductor_plugin import graph_pass

    found: list[tuple[str, tuple]] = []
    real = graph_pass.rewrite

    def rewrite(graph, settings):
        count = real(graph, settings)
        for node in graph.nodes:
            if node.op == "call_function" and node.target in graph_pass._FUSED_OPS:
                plain = tuple(a for a in node.args[:-1] if not isinstance(a, torch.fx.Node) and a is not None)
                found.append((node.target.__name__.split(".")[0], plain))
        return count

    monkeypatch.setattr(graph_pass, "rewrite", rewrite)
    return found

