"""The examples run under torchrun on CPU ranks (gloo) and fuse what they should."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_hf_llama_split_by_its_own_plan_fuses_every_row_parallel_linear():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           str(ROOT / "examples" / "hf_llama.py"), "--small", "--layers", "2", "--seq", "64"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "commfuse: 4 fused, 0 skipped" in proc.stdout  # o_proj and down_proj of 2 layers
    assert "layers.1.mlp.down_proj" in proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_model_benchmark_runs_the_transformers_model(tmp_path):
    out = tmp_path / "hf.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "commfuse.bench",
           "model", "--small", "--layers", "1", "--models", "hf", "--modes", "prefill,decode,train",
           "--backends", "eager,commfuse", "--iters", "2", "--seq", "32", "--batch", "2", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    records = json.loads(out.read_text())
    assert [r["mode"] for r in records] == ["prefill", "train"]  # no decode for this model
    # training: q/k/v and gate/up input gradients merged (2 sums), then fused with the forward's 2
    assert records[0]["fused"] == 2 and records[1]["fused"] == 4 and records[1]["merged"] == 2
    assert records[0]["commfuse_rel_err"] < 1e-4
