"""``python -m commfuse explain`` on the CPU: what it prints for the bundled model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _explain(*args: str, env: dict | None = None) -> str:
    """``python -m commfuse explain ARGS``'s output: run as the README runs it where ``env`` is
    given (the real launch bound), else in this process (``explain.main``, what the command calls;
    the suite's settings are the environment's), which spares the run a Python and a compiler
    stack of its own to start."""
    if env is None:
        import contextlib
        import io

        from commfuse.tools import explain
        from helpers import init_fake_pg

        init_fake_pg(int(args[args.index("--world-size") + 1]) if "--world-size" in args else 2)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert explain.main(list(args)) == 0
        return out.getvalue()
    proc = subprocess.run([sys.executable, "-m", "commfuse", "explain", *args],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _assert_dtensor_training(out: str) -> None:
    # forward: wo, w2 (row-parallel); backward: the wq+wk+wv and w1+w3 input gradients, each sum
    # merged into one matmul and fused
    assert "commfuse: 4 fused, 0 skipped, 2 sums merged" in out, out
    assert out.count("FUSED   mm_all_reduce") == 4 and out.count("MERGED  merge_sums") == 2
    assert "layers.0.attention.wo" in out and "layers.0.feed_forward.w1" in out


def _without_the_suites_bound() -> dict:
    """The environment with the real default launch bound (the suite sets it to 0)."""
    return {k: v for k, v in os.environ.items() if k != "COMMFUSE_LAUNCH_BOUND_BYTES"}


@pytest.mark.slow
def test_explain_dtensor_training_at_8_ranks():
    """The demo's training step at its default sizes, at 8 ranks, under the real default launch
    bound: every row-parallel linear forward and every merged input gradient backward fuse (the
    sizes are above the bound)."""
    _assert_dtensor_training(_explain("--world-size", "8", "--layers", "1", env=_without_the_suites_bound()))


@pytest.mark.slow
def test_explain_sequence_parallel_with_exclusion():
    out = _explain("--model", "sp", "--world-size", "4", "--exclude", "layers.1.feed_forward")
    assert out.count("FUSED   all_gather_mm") == 6, out
    assert "matches excluded name pattern 'layers.1.feed_forward'" in out


@pytest.mark.slow
def test_explain_fp8_tensorwise_sequence_parallel():
    """torchao float8 under its TP plan: the FP8 gathers and scatters fuse forward and backward
    and each runs NCCL by a rule that says why (not measured yet); the amax all-reduces (max) stay
    with theirs."""
    pytest.importorskip("torchao")
    out = _explain("--fp8", "tensorwise", "--model", "sp", "--layers", "1", "--seq", "256")
    assert out.count("FUSED   all_gather_scaled_mm") == 4 and out.count("FUSED   scaled_mm_reduce_scatter") == 2, out
    assert "float8_e4m3fn->bfloat16" in out and "float8_e5m2->bfloat16" in out
    assert out.count("-> nccl  [rules: nccl when otherwise: FP8 paths not yet measured on real links") == 6, out


@pytest.mark.slow
def test_explain_fp8_weights_inference():
    out = _explain("--fp8", "weights", "--model", "hooks", "--layers", "1")
    assert "commfuse: 2 fused, 0 skipped" in out and out.count("FUSED   scaled_mm_all_reduce") == 2, out
    assert "; inference; FP8: FP8 weights" in out


@pytest.mark.slow
def test_explain_hooks_inference_threshold():
    out = _explain("--model", "hooks", "--inference", "--min-mnk", str(10**12))
    assert "commfuse: 0 fused, 4 skipped" in out, out
    assert "below the size threshold" in out


@pytest.mark.slow
def test_explain_launch_bound_decode_sizes_fuse_only_with_cuda_graphs():
    """With the real default bound (the suite sets it to 0), a decode-sized step stays unfused
    unless compiled for CUDA graphs (the demo's default sizes, above it: the 8-rank test)."""
    env = _without_the_suites_bound()
    small = ("--layers", "1", "--batch", "2", "--seq", "64", "--inference")
    out = _explain(*small, env=env)
    assert "commfuse: 0 fused, 2 skipped" in out and "launch-bound without CUDA graphs" in out, out
    assert "commfuse: 2 fused, 0 skipped" in _explain(*small, "--cuda-graphs", env=env)


@pytest.mark.slow
def test_explain_bad_sizes_are_clear_errors():
    proc = subprocess.run([sys.executable, "-m", "commfuse", "explain", "--world-size", "3"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "commfuse explain: n_heads=8 is not divisible by the TP size 3" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_usage():
    proc = subprocess.run([sys.executable, "-m", "commfuse", "frobnicate"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown command" in proc.stderr


def _record(shape=(4096, 4096, 8192), module="layers.0.attention.wo"):
    from commfuse.report import MatchRecord

    return MatchRecord("mm_all_reduce", "forward#0", "all_reduce", "mm", True, "fused", shape, "bfloat16", "0",
                       module)


def test_path_column_says_where_each_choice_comes_from(tmp_path):
    """Per fused call: the path the policy picks on the simulated GPU, from the rules, a tuned
    answer of this machine's cache, tuning at first use, COMMFUSE_ALGO, or why NCCL."""
    import torch

    from commfuse import env
    from commfuse.report import Report
    from commfuse.runtime import tuning
    from commfuse.runtime.paths.base import Call
    from commfuse.tools import explain, machine

    rep = Report([_record(), _record((16, 2048, 4096), "layers.0.feed_forward.w2")])
    big, small = explain.paths(rep, "sm_90", 2)
    assert " ".join(big.split()) == ("layers.0.attention.wo mm_all_reduce 4096x4096x8192 bfloat16 w2 -> fused "
                                     "[rules: fused when m >= 4096, k_le_m = True (sm_90 world 2)]")
    assert "-> split_k" in small and "[rules: split_k when m <= 128" in small
    assert all("-> nccl" in line and "[unsupported: one rank: nothing to exchange]" in line
               for line in explain.paths(rep, "sm_90", 1))
    assert all("(default world 2)]" in line for line in explain.paths(rep, "sm_80", 2))  # no sm_80 rows
    with env.override(algo="two_shot"):
        assert "-> two_shot [forced: COMMFUSE_ALGO=two_shot]" in " ".join(explain.paths(rep, "sm_90", 2)[0].split())
    with env.override(cache_dir=str(tmp_path), tune="cache"):
        key = tuning.machine_key(machine.simulated(2, "sm_90"))
        sig = tuning.Signature.of(Call("mm_all_reduce", 4096, 4096, 8192, torch.bfloat16, 2)).text()
        tuning.write(tuning.cache_path(key), key, {sig: tuning.Entry("one_shot", "fused", {}, [], 0.03)})
        big, small = (" ".join(line.split()) for line in explain.paths(rep, "sm_90", 2))
        assert "-> one_shot [cache: tuned on this machine for this GPU]" in big
        assert "-> split_k [rules: split_k" in small  # no kept answer: the rules
    with env.override(cache_dir=str(tmp_path), tune="first-use"):
        small = explain.paths(rep, "sm_90", 2)[1]
        assert "[tuned at its first call (COMMFUSE_TUNE=first-use); until then rules: split_k" in small


@pytest.mark.slow
def test_explain_prints_the_path_of_every_fused_call():
    """The calls come from the compiled graph's fused nodes: the sequence-parallel split's gathers
    along the sequence (dim 1 of [batch, seq, dim]) are calls in 2 slabs, which the fused
    all-gather kernel does not take."""
    out = _explain("--model", "sp", "--layers", "1", "--batch", "2", "--seq", "256", "--inference")
    assert "Paths on 2 simulated sm_90 GPUs (NVIDIA H200, 132 SMs)" in out, out
    lines = [line for line in out.splitlines() if line.startswith("  layers.")]
    assert len(lines) == 4
    assert "layers.0.attention.wq all_gather_mm 512x256x128 bfloat16 w2 dim1x2 -> pull" in " ".join(lines[0].split())
    assert all("[rules: " in line and "(sm_90 world 2)]" in line for line in lines)


@pytest.mark.parametrize("argv, message", [
    (["--dim", "7"], "--dim 7 is not divisible by --heads 8"),
    (["--layers", "-1"], "--layers must be at least 1, got -1"),
    (["--batch", "0"], "--batch must be at least 1, got 0"),
    (["--seq", "0"], "--seq must be at least 1, got 0"),
    (["--gpus", "0"], "--gpus must be at least 1, got 0"),
    (["--heads", "6", "--dim", "240"], "--heads 6 is not divisible by the key/value heads 4 (--kv-heads)"),
])
def test_sizes_the_model_cannot_take_are_one_line_before_the_compile(argv, message, monkeypatch):
    """``--dim 7`` and ``--seq 0`` ended in a Dynamo traceback, ``--batch 0`` compiled for minutes,
    ``--layers -1`` reported "0 fused" with status 0."""
    from commfuse.tools import explain

    monkeypatch.setattr(explain, "run", lambda args: pytest.fail("compiled before checking the sizes"))
    with pytest.raises(SystemExit) as info:
        explain.main(argv)
    assert str(info.value) == f"commfuse explain: {message}"


@pytest.mark.slow
def test_explain_fp8_rowwise_sequence_parallel():
    """torchao's row-wise recipe under torch's TP plan: the forward's bf16 gathers fuse with their
    row-wise quantisation, the row-wise products with their reduce-scatters forward and backward,
    each running NCCL by a rule that says why (not measured yet); the backward's gathers say why
    they stay unfused."""
    pytest.importorskip("torchao")
    out = _explain("--fp8", "rowwise", "--model", "sp", "--layers", "1", "--seq", "256", "--launch-bound-bytes", "0")
    assert out.count("FUSED   all_gather_rowwise_scaled_mm") == 2, out
    assert out.count("FUSED   rowwise_scaled_mm_reduce_scatter") == 2, out
    assert out.count("the backward's form, the row scales multiplied in after the product, is not fused yet") >= 2
    assert out.count("-> nccl  [rules: nccl when otherwise: FP8 paths not yet measured on real links") == 4, out
