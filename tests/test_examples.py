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
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "commfuse", "bench",
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


def _without_torchrun() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                            "LOCAL_RANK")}


@pytest.mark.parametrize("script", ["tp_transformer.py", "hf_llama.py"])
def test_an_example_outside_torchrun_says_how_to_launch_it(script):
    """It raised a bare ``ValueError ... RANK expected`` from the rendezvous."""
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=_without_torchrun())
    assert proc.returncode == 2
    assert proc.stderr == (f"examples/{script} runs one process per rank: launch it with torchrun "
                           f"--nproc_per_node=2 examples/{script} (RANK is not set)\n")


@pytest.mark.slow
def test_tp_transformer_on_one_rank_says_there_is_nothing_to_fuse():
    """One rank: no collective to fuse; the run checks the values and says why nothing fused
    instead of failing "nothing fused"."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = _without_torchrun() | dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                     OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "tp_transformer.py"), "--layers", "1",
                           "--seq", "32", "--batch", "1"], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "note: forward#0: no collectives in this graph; one rank: nothing to exchange" in proc.stdout
    assert "one rank: nothing to exchange, so nothing to fuse; launch two or more" in proc.stdout
    assert "(torch.float32, 1 ranks, cpu)" in proc.stdout
