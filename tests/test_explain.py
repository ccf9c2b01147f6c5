"""``python -m commfuse explain`` on the CPU: what it prints for the bundled model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _explain(*args: str, env: dict | None = None) -> str:
    proc = subprocess.run([sys.executable, "-m", "commfuse", "explain", *args],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("world", ["2", "4", "8"])
def test_explain_dtensor_training(world):
    out = _explain("--world-size", world, "--layers", "1")
    # forward: wo, w2 (row-parallel); backward: the wq+wk+wv and w1+w3 input gradients, each sum
    # merged into one matmul and fused
    assert "commfuse: 4 fused, 0 skipped, 2 sums merged" in out, out
    assert out.count("FUSED   mm_all_reduce") == 4 and out.count("MERGED  merge_sums") == 2
    assert "layers.0.attention.wo" in out and "layers.0.feed_forward.w1" in out


@pytest.mark.slow
def test_explain_sequence_parallel_with_exclusion():
    out = _explain("--model", "sp", "--world-size", "4", "--exclude", "layers.1.feed_forward")
    assert out.count("FUSED   all_gather_mm") == 6, out
    assert "matches excluded name pattern 'layers.1.feed_forward'" in out


@pytest.mark.slow
def test_explain_hooks_inference_threshold():
    out = _explain("--model", "hooks", "--inference", "--min-mnk", str(10**12))
    assert "commfuse: 0 fused, 4 skipped" in out, out
    assert "below the size threshold" in out


@pytest.mark.slow
def test_explain_launch_bound_decode_sizes_fuse_only_with_cuda_graphs():
    """With the real default bound (the suite sets it to 0), a decode-sized step stays unfused
    unless compiled for CUDA graphs; the demo's default sizes are above it."""
    env = {k: v for k, v in os.environ.items() if k != "COMMFUSE_LAUNCH_BOUND_BYTES"}
    small = ("--layers", "1", "--batch", "2", "--seq", "64", "--inference")
    out = _explain(*small, env=env)
    assert "commfuse: 0 fused, 2 skipped" in out and "launch-bound without CUDA graphs" in out, out
    assert "commfuse: 2 fused, 0 skipped" in _explain(*small, "--cuda-graphs", env=env)
    assert "commfuse: 4 fused, 0 skipped, 2 sums merged" in _explain("--layers", "1", env=env)


def test_explain_bad_sizes_are_clear_errors():
    proc = subprocess.run([sys.executable, "-m", "commfuse", "explain", "--world-size", "3"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "commfuse explain: n_heads=8 is not divisible by the TP size 3" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_usage():
    proc = subprocess.run([sys.executable, "-m", "commfuse", "frobnicate"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown command" in proc.stderr
