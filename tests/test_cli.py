"""``python -m commfuse``: every command listed at once; GPU and torchrun problems in one line."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch


def _run(*args, env=None, timeout=120):
    full = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          env=full | (env or {}))


def test_help_lists_every_command_without_the_compiler_stack():
    start = time.perf_counter()
    proc = _run("-m", "commfuse", "--help")
    took = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    commands = [line.split()[0] for line in proc.stdout.split("commands:\n")[1].splitlines() if line.startswith("  ")]
    assert commands == ["explain", "bench"]
    assert took < 15  # about 2 s here (import torch, for the ops' registration); was 5.4 s with Dynamo
    probe = _run("-c", "import sys, commfuse; print(sorted(m for m in ('torch._dynamo', 'torch._inductor', "
                 "'commfuse.inductor_plugin', 'triton') if m in sys.modules))")
    assert probe.stdout.strip() == "[]", probe.stderr


def test_bench_is_a_command_too():
    proc = _run("-m", "commfuse", "bench", "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: python -m commfuse bench ")
    assert "model-table" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message for a machine without CUDA GPUs")
@pytest.mark.parametrize("argv, launch", [
    (("bench", "ops"), "-m commfuse bench ops"), (("bench", "ops", "--tuned"), "-m commfuse bench ops")])
def test_gpu_commands_without_gpus_exit_with_one_line(argv, launch):
    """``bench ops`` on the CPU died in ``torch.cuda.set_device`` (no ``_cuda_setDevice``)."""
    proc = _run("-m", "commfuse", *argv)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "needs CUDA GPUs and this machine has none" in proc.stderr
    assert f"torchrun --nproc_per_node=2 {launch}" in proc.stderr


def test_bench_model_outside_torchrun_exits_with_one_line():
    proc = _run("-m", "commfuse", "bench", "model")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "launch it with torchrun --nproc_per_node=2 -m commfuse bench model (RANK is not set)" in proc.stderr
