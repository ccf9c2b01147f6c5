"""``python -m commfuse``: every command listed at once; GPU and torchrun problems in one line;
``tune --show`` / ``--clear`` on the CPU."""

from __future__ import annotations

import math
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
    assert commands == ["explain", "bench", "tune"]
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
    (("bench", "ops"), "-m commfuse bench ops"), (("bench", "ops", "--tuned"), "-m commfuse bench ops"),
    (("tune", "--model", "dtensor"), "-m commfuse tune --model dtensor"),
    (("tune", "--", "train.py", "--steps", "3"), "-m commfuse tune -- SCRIPT [ARGS...]")])
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


@pytest.mark.slow
def test_tune_shows_and_clears_a_machines_cache(tmp_path):
    """A cache written as the run-time writes it, for 2 simulated H200s on this machine's software,
    beside one for another GPU: ``--show`` prints this machine's as a table, ``--clear`` removes
    it (and its lock) but not the other, ``--clear --all`` the other too."""
    from commfuse import env
    from commfuse.runtime import tuning
    from commfuse.runtime.paths.base import Call
    from commfuse.tools import machine

    sig = tuning.Signature.of(Call("mm_all_reduce", 4000, 4096, 8192, torch.bfloat16, 2)).text()
    entry = tuning.Entry("fused", "one_shot", {"nccl": 500.0, "one_shot": 300.0, "fused": 250.0,
                                               "split_k": math.inf}, ["split_k"], 0.03)
    with env.override(cache_dir=str(tmp_path)):
        key = tuning.machine_key(machine.simulated(2, "sm_90"))
        mine = tuning.cache_path(key)
        tuning.write(mine, key, {sig: entry})
        other_key = dict(key, gpu="NVIDIA B200", arch="sm_100")
        other = tuning.cache_path(other_key)
        tuning.write(other, other_key, {sig: entry})
    assert mine.exists() and mine.with_suffix(".lock").exists() and other.exists()
    cache = {"COMMFUSE_CACHE_DIR": str(tmp_path)}
    if not torch.cuda.is_available():
        proc = _run("-m", "commfuse", "tune", "--show", env=cache)
        assert proc.returncode == 0 and "this machine has no CUDA GPU" in proc.stdout, proc.stderr
    proc = _run("-m", "commfuse", "tune", "--show", "--gpu", "sm_90", env=cache)
    assert proc.returncode == 0, proc.stderr
    assert f"{mine} (NVIDIA H200, world 2, 1 signature)" in proc.stdout
    assert (f"| {sig} | fused | one_shot | 0.03 | 0.833 | nccl 500.0, one_shot 300.0, fused 250.0, split_k failed |"
            in proc.stdout), proc.stdout
    assert f"(1 more cache files in {tmp_path} for other machines, versions or settings)" in proc.stdout
    proc = _run("-m", "commfuse", "tune", "--clear", "--gpu", "sm_90", "--gpus", "2", env=cache)
    assert proc.returncode == 0 and f"removed 1 cache file from {tmp_path}" in proc.stdout, proc.stderr
    assert not mine.exists() and not mine.with_suffix(".lock").exists() and other.exists()
    proc = _run("-m", "commfuse", "tune", "--clear", "--all", env=cache)
    assert proc.returncode == 0 and f"removed 1 cache file from {tmp_path}" in proc.stdout, proc.stderr
    assert not list(tmp_path.glob("tuned-*"))


def test_tune_runs_a_script_as_main_with_tuning_on_first_use(tmp_path, monkeypatch, capsys):
    """``tune -- SCRIPT ARGS``: the script runs in this process as ``__main__`` with its own
    arguments and COMMFUSE_TUNE=first-use in force; its exit status is the command's; then the
    count of tuned signatures (none here: the CPU runs the unfused ops)."""
    from commfuse import env
    from commfuse.tools import tune

    monkeypatch.setenv("COMMFUSE_TUNE", "off")  # restored after the test
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    seen = tmp_path / "seen.txt"
    script = tmp_path / "train.py"
    script.write_text("import sys\nfrom commfuse import env\n"
                      f"open({str(seen)!r}, 'w').write(' '.join([__name__, env.current().tune, *sys.argv[1:]]))\n"
                      "sys.exit(3)\n")
    try:
        assert tune.run_script(str(script), ["--steps", "2"]) == 3
    finally:
        monkeypatch.undo()
        env.reload()
    assert seen.read_text() == "__main__ first-use --steps 2"
    assert f"commfuse tune: {script}: 0 call signatures tuned in 0.0 s" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [("explain",), ("tune", "--show"), ("bench", "table", "ops.json"), ("bench", "ops"),
                                  ("bench", "model")])
def test_a_bad_setting_ends_every_command_in_one_line(argv, monkeypatch, capsys):
    """``explain`` and ``tune`` printed a 30-line traceback for a bad ``COMMFUSE_*`` value."""
    from commfuse.__main__ import main

    monkeypatch.setenv("COMMFUSE_TUNE", "always")
    assert main(list(argv)) == 2
    assert capsys.readouterr().err == (f"python -m commfuse {argv[0]}: COMMFUSE_TUNE='always' is not one of off, "
                                       "cache, first-use\n")


def test_a_bad_setting_and_a_misspelt_one_on_the_command_line():
    """The same from a shell: one line each, the warning naming the command (not runpy's frame)."""
    proc = _run("-m", "commfuse", "explain", env={"COMMFUSE_TUNE": "always", "COMMFUSE_TIMEOUT": "5"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr == ("python -m commfuse explain: warning: COMMFUSE_TIMEOUT is not a commfuse setting and is "
                           "ignored; did you mean COMMFUSE_TIMEOUT_S?\n"
                           "python -m commfuse explain: COMMFUSE_TUNE='always' is not one of off, cache, first-use\n")


@pytest.mark.parametrize("argv", [("explain", "--gpu", "sm90"), ("explain", "--gpu", "sm_abc"),
                                  ("tune", "--show", "--gpu", "H2000")])
def test_an_unknown_gpu_is_refused_in_one_line_before_any_work(argv, monkeypatch):
    """``explain --gpu sm90`` showed every call as NCCL and ``--gpu sm_abc`` the default rules, both
    after a 15 s compile, with status 0."""
    from commfuse.__main__ import main
    from commfuse.tools import explain

    monkeypatch.setattr(explain, "run", lambda args: pytest.fail("compiled before checking --gpu"))
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    assert str(info.value) == (f"commfuse {argv[0]}: --gpu {argv[-1]!r} is not a known architecture (sm_80, sm_86, "
                               "sm_89, sm_90, sm_100) or GPU (A100, A10, L40S, H100 PCIe, H100, H200, B200)")


@pytest.mark.parametrize("gpu, want", [
    ("sm_90", ("sm_90", "NVIDIA H200", 132)), ("h100", ("sm_90", "NVIDIA H100", 132)),
    ("NVIDIA  H100 PCIe", ("sm_90", "NVIDIA H100 PCIe", 114)), ("sm_80", ("sm_80", "NVIDIA A100", 108)),
    ("B200", ("sm_100", "NVIDIA B200", 148))])
def test_a_simulated_gpu_takes_its_sm_count_from_the_table(gpu, want):
    from commfuse.tools import machine

    assert machine.resolve(gpu) == want
    facts = machine.simulated(2, gpu)
    assert (facts.arch, facts.name, facts.sms) == want


def test_tune_refuses_a_world_size_below_one():
    from commfuse.tools import tune

    with pytest.raises(SystemExit, match="^commfuse tune: --gpus must be at least 1, got 0$"):
        tune.main(["--show", "--gpu", "sm_90", "--gpus", "0"])
