"""The tile kernels' GEMM and the fused all-reduce kernel's tile order, in Triton's CPU interpreter
(fp16: the interpreter mishandles bf16). The cross-GPU parts run in tests/gpu."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def test_tile_gemm_and_fused_tile_order_in_the_interpreter():
    pytest.importorskip("triton.tools.tensor_descriptor")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, os.path.join(HERE, "interpreted_tiles.py")], env=env,
                         capture_output=True, text=True, timeout=600, cwd=os.path.dirname(HERE))
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
