"""The benchmarks' reports (tables, geomeans, fastest backend) from records, the model benchmark on
CPU ranks, and every maintained benchmark script's ``--help``, without a GPU."""

from __future__ import annotations

import json
import re
import types

import pytest
import torch

from commfuse.tools import bench


def _rec(op, m, unfused, commfuse, peers, one_shot=None):
    if op == "mm_all_reduce":  # every unfused alternative the best unfused takes, measured or failed (None)
        peers = {"torch_symm_one_shot": None, "torch_symm_two_shot": None, **peers}
    return dict(op=op, M=m, K=64, N=64, dtype="bfloat16", world=2, unfused_us=unfused,
                commfuse_us=commfuse, floor_us=min(unfused, commfuse) / 2, parts={"commfuse_one_shot": one_shot},
                peers=peers, commit="x")


def test_table_reports_speedups_and_the_fastest_backend(tmp_path):
    records = [
        _rec("mm_all_reduce", 16, 100.0, 50.0, {"torch_symm_two_shot": 80.0}),
        _rec("mm_all_reduce", 32, 100.0, 200.0, {"torch_symm_two_shot": 90.0, "broken_peer": None}, one_shot=80.0),
        _rec("all_gather_mm", 16, 100.0, 50.0, {"torch_fused_all_gather_matmul": 120.0}),
    ]
    path = tmp_path / "ops.json"
    path.write_text(json.dumps(records))
    text = bench.table(str(path))
    rows = [line for line in text.splitlines() if line.startswith("| mm_all_reduce")]
    assert rows[0].endswith("| commfuse |") and "2.00x" in rows[0]
    assert rows[1].endswith("| torch_symm_two_shot |") and "0.50x" in rows[1]
    # the best unfused: cuBLAS + torch's two-shot (80) for the first, commfuse's one-shot (80) for the second
    assert "| 100 | 80 | 50 |" in rows[0] and "| 2.00x | 1.60x |" in rows[0]
    assert "| 100 | 80 | 200 |" in rows[1] and "| 0.50x | 0.40x |" in rows[1]
    assert ("mm_all_reduce: geomean speed-up 1.000x over 2 shapes, min 0.500x, max 2.000x; over the best unfused "
            "0.800x (min 0.400x); 0 of 2 within 1.2x of the floor") in text
    # no unfused alternative measured for the all-gather: no best unfused claimed
    assert "| all_gather_mm | 16 | 64 | 64 | - | 100 | - | 50 |" in text
    assert "all_gather_mm: geomean speed-up 2.000x over 1 shapes, min 2.000x, max 2.000x; 0 of 1" in text


def test_the_table_of_the_cited_file_computes_the_readmes_figure():
    """README cites 1.16x (min 1.00x) over the best unfused for mm_all_reduce from this file, which
    has no ``best_unfused_us``: the table printed 1.384x, unfused cuBLAS + NCCL, without a word."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    text = bench.table(str(root / "benchmarks/results/h200x2/ops_ar_e082243.json"))
    assert "geomean speed-up 1.384x over 20 shapes, min 1.118x, max 1.760x; over the best unfused 1.158x " \
           "(min 0.997x)" in text
    readme = (root / "README.md").read_text()
    assert "| `mm_all_reduce` | 20 (M 16–8192) | 1.38× (1.12–1.76×) | 1.16× (min 1.00×) |" in readme


def test_the_table_refuses_records_without_the_fields_it_shows(tmp_path):
    path = tmp_path / "ops.json"
    old = _rec("mm_all_reduce", 16, 100.0, 50.0, {})
    del old["parts"]["commfuse_one_shot"], old["peers"]["torch_symm_two_shot"]
    path.write_text(json.dumps([old]))
    with pytest.raises(ValueError, match=r"ops.json: the record of mm_all_reduce 16x64x64 has no "
                                         r"peers.torch_symm_two_shot, parts.commfuse_one_shot, which the best "
                                         r"unfused needs"):
        bench.table(str(path))
    path.write_text(json.dumps([{"op": "mm_all_reduce", "M": 16}]))
    with pytest.raises(ValueError, match="has no K, N, unfused_us, commfuse_us, floor_us, peers, parts: not a bench"):
        bench.table(str(path))


@pytest.mark.parametrize("argv, message", [
    (("table", "missing.json"), "commfuse bench table: No such file or directory: missing.json\n"),
    (("model-table", "missing.json"), "commfuse bench model-table: No such file or directory: missing.json\n"),
    (("table", "README.md"), "commfuse bench table: README.md is not JSON (Expecting value: line 1 column 1 "
                             "(char 0))\n"),
])
def test_a_file_the_table_cannot_read_is_one_line(argv, message, capsys, monkeypatch):
    import pathlib

    monkeypatch.chdir(pathlib.Path(__file__).resolve().parents[1])
    with pytest.raises(SystemExit) as info:
        bench.main(list(argv))
    assert str(info.value) + "\n" == message


def test_each_subcommand_describes_its_own_options(capsys):
    helps = {}
    for what in ("ops", "model", "table", "plot", "model-table", "model-plot"):
        with pytest.raises(SystemExit):
            bench.main([what, "--help"])
        helps[what] = capsys.readouterr().out
    assert helps["ops"].startswith("usage: python -m commfuse bench ops")
    assert "--tuned" in helps["ops"] and "--models" not in helps["ops"]
    assert "--models" in helps["model"] and "--tuned" not in helps["model"]
    assert len(set(helps.values())) == 6
    for what, text in helps.items():  # every option has a line of its own saying what it does
        options = re.findall(r"^  (--[a-z-]+)(.*)$", text, re.M)
        assert options or what not in ("ops", "model")
        for option, rest in options:
            described = rest.strip() and not rest.strip().isupper() or re.search(
                rf"^  {option}[^\n]*\n {{10,}}\S", text, re.M)
            assert described, (what, option)


def test_model_defaults_on_the_cpu_are_small_and_said_first():
    from commfuse.tools import bench_model

    args = bench.parser().parse_args(["model"])
    plan = bench_model.fill_defaults(args, cuda=False)
    assert (args.layers, args.batch, args.seq, args.models, args.backends) == (1, 2, 128, "dtensor",
                                                                              "eager,inductor,commfuse")
    assert plan == ["models dtensor; modes prefill,decode,train; backends eager,inductor,commfuse",
                    "1 layer (small sizes), batch 2, sequence 128, decode batches 4 from context 128; 4 steps per "
                    "backend in 2 alternating rounds"]
    args = bench.parser().parse_args(["model", "--layers", "3", "--modes", "prefill"])
    plan = bench_model.fill_defaults(args, cuda=True)
    assert (args.layers, args.seq, args.models) == (3, 2048, "dtensor,sp,hooks")
    assert plan[1].startswith("3 layers (8B-class sizes), batch 4, sequence 2048; 10 steps")
    assert bench_model.header(torch.device("cpu"), 1).startswith("commfuse bench model: 1 rank, cpu")
    with pytest.raises(SystemExit, match="^commfuse bench model: --seq must be at least 1, got 0$"):
        bench_model.fill_defaults(bench.parser().parse_args(["model", "--seq", "0"]), cuda=False)


def test_tuned_table_puts_the_rules_and_the_tuned_choice_side_by_side(tmp_path):
    def rec(m, rules, rules_us, tuned, tuned_us):
        return dict(op="mm_all_reduce", M=m, K=4096, N=8192, dtype="bfloat16", world=2, rules=rules, tuned=tuned,
                    rules_us=rules_us, tuned_us=tuned_us, unfused_us=2 * rules_us, tuning_s=1.5,
                    candidates_us={}, failed=[], margin=0.03, parts={})
    path = tmp_path / "ops_tuned.json"
    path.write_text(json.dumps([rec(16, "split_k", 25.0, "split_k", 25.0),
                                rec(1024, "fused", 140.0, "one_shot", 126.0)]))
    text = bench.table(str(path))
    assert "| mm_all_reduce | 1024 | 4096 | 8192 | fused | 140.0 | one_shot | 126.0 | 0.900 | 280 | 1.5 |" in text
    assert "tuned differs from the rules on 1 of 2 shapes; geomean tuned / rules there 0.900" in text


def test_shape_sets_match_the_baselines():
    assert len(bench.MM_AR_SHAPES) == 20 and (8192, 2048, 4096) in bench.MM_AR_SHAPES
    assert len(bench.AG_MM_SHAPES) == 7 and (16384, 4096, 7168) in bench.AG_MM_SHAPES


@pytest.mark.slow
def test_model_benchmark_runs_on_cpu_ranks(tmp_path):
    """The model benchmark on 2 gloo ranks, tiny sizes: every backend timed, commfuse fused and
    equal to eager, a forward-only (decode) and a training case. (CPU times mean nothing; the GPU
    run is what the numbers come from.)"""
    import subprocess
    import sys

    out = tmp_path / "model.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "commfuse", "bench",
           "model", "--models", "hooks", "--modes", "decode,train", "--layers", "1", "--batch", "2",
           "--seq", "32", "--iters", "2", "--decode-batches", "2", "--context", "16",
           "--backends", "eager,inductor,commfuse,floor", "--rounds", "2", "--call-times", "1", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(out.read_text())
    assert [(r["model"], r["mode"]) for r in records] == [("hooks", "decode_b2"), ("hooks", "train")]
    for r in records:
        assert set(r["ms"]) == {"eager", "inductor", "commfuse", "floor"}
        assert r["fused"] > 0 and r["skipped"] >= 0
        assert "speedup_vs_inductor" in r
        # one median per alternating round and backend (each the max over ranks, like the run's
        # median, which therefore cannot exceed the largest of them)
        assert all(len(ts) == 2 and min(ts) > 0 for ts in r["round_ms"].values())
        assert r["ms"]["commfuse"] <= max(r["round_ms"]["commfuse"])
    for r in records:
        if r["mode"] != "train":
            assert r["commfuse_rel_err"] < 1e-5
    assert next(r for r in records if r["mode"] == "decode_b2")["seq"] == 16
    assert not any("call_times" in r for r in records)  # CUDA events: GPUs only


def test_call_time_lines_add_up_what_the_step_loses_against_the_calls_alone():
    from commfuse.tools import bench_model

    extra = {"in_model_us_ranks": [380.0, 400.0], "host_us": 150.0, "idle_at_entry": 0.25,
             "host_cpu_us": 120.0, "in_model_us_by_position": [500.0, 300.0]}
    rows = [{"op": "mm_all_reduce", "a": [8192, 2048], "b": [2048, 4096], "b_transposed": True, "path": "fused",
             "calls_per_step": 2.0, "in_model_us": 400.0, "alone_us": 290.0, **extra},
            {"op": "mm_all_reduce", "a": [8192, 7168], "b": [7168, 4096], "b_transposed": False,
             "path": "ce_overlap", "calls_per_step": 2.0, "in_model_us": 700.0, "alone_us": 710.0, **extra},
            {"op": "all_gather_mm", "a": [4096, 4096], "b": [4096, 7168], "b_transposed": True, "path": "pull",
             "calls_per_step": 1.0, "in_model_us": 100.0, **extra}]  # not timed alone
    lines = bench_model._call_lines(rows, 7.0, 5.5)
    assert lines[0] == ("    mm_all_reduce 8192x2048 @ 2048x4096 (W.t()) fused, 2/step: in the step 400 us "
                        "(ranks 380/400; by position 500/300; host 150 us, 120 of CPU; stream idle at "
                        "entry 25%), alone 290 us")
    assert lines[2].endswith("in the step 100 us (ranks 380/400; by position 500/300; host 150 us, 120 of "
                             "CPU; stream idle at entry 25%)")
    # (400 - 290) * 2 + (700 - 710) * 2 = 200 us; 2 * 400 + 2 * 700 + 100 = 2300 us of calls
    assert lines[-1] == ("    commfuse calls: 2.30 ms of GPU time per step (step 7.00 ms); +0.20 ms per step "
                         "against the same calls alone; the host enqueues a step in 5.50 ms")


@pytest.mark.slow
def test_loss_mode_tracks_eager_over_many_steps(tmp_path):
    """50 SGD steps through the fused graphs (forward and backward) of the sequence-parallel split
    (its gathers, scatters and merged sums) give eager's loss curve; asked for decode too, the
    split has none (one token per sequence cannot be split along the sequence)."""
    import subprocess
    import sys

    out = tmp_path / "loss.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "commfuse", "bench",
           "model", "--models", "sp", "--modes", "decode,loss", "--layers", "1", "--batch", "2",
           "--seq", "32", "--loss-steps", "50", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(out.read_text())
    assert [(r["model"], r["mode"]) for r in records] == [("sp", "loss")]
    for r in records:
        curve = r["losses"]["commfuse"]
        assert len(curve) == 50 and curve[-1] < curve[0]  # it trains
        assert r["commfuse_max_rel_dev"] < 1e-4
        assert r["fused"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_loss_mode_fuses_and_tracks_inductor(tmp_path, recipe):
    """The FP8 loss mode on CPU ranks: torchao's float8 training of the DTensor split, every matched
    call fused however small (its numerics are what the mode checks; a run that fused nothing
    would check nothing), and the curve through commfuse's rewritten graphs is Inductor's."""
    import subprocess
    import sys

    pytest.importorskip("torchao")
    out = tmp_path / "loss.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "commfuse", "bench",
           "model", "--models", "dtensor", "--modes", "loss", "--fp8", recipe, "--loss-steps", "16", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (r,) = json.loads(out.read_text())
    assert r["fused"] > 0 and r["dtype"] == "bfloat16"
    curve, inductor = r["losses"]["commfuse"], r["losses"]["inductor"]
    assert len(curve) == 16 and curve[-4] < curve[0]  # (four batches in turn: step 12 sees step 0's again)
    assert max(abs(c - i) / abs(i) for c, i in zip(curve, inductor)) < 1e-3


def test_hidden_share_and_its_range_over_rounds():
    from commfuse.tools import bench_model

    assert bench_model.hidden_share(24.0, 22.0, 20.0) == 0.5
    assert bench_model.hidden_share(20.0, 21.0, 20.0) is None  # nothing to hide
    rec = {"model": "dtensor", "mode": "train", "ms": {"inductor": 24.0, "commfuse": 22.0, "floor": 20.0},
           "hidden_share": 0.5, "hidden_share_rounds": [0.4, 0.6], "fused": 14}
    assert "hides 50% of the communication (rounds 40..60%)" in bench_model._line(rec)


def test_model_plot_keeps_the_latest_record_per_case(tmp_path):
    import pytest

    pytest.importorskip("matplotlib")
    from commfuse.tools import bench_model

    old = [{"model": "dtensor", "mode": "prefill", "ms": {"inductor": 10.0, "commfuse": 11.0, "floor": 8.0}},
           {"model": "dtensor", "mode": "loss", "losses": {}}]  # no times: not plotted
    new = [{"model": "dtensor", "mode": "prefill", "ms": {"inductor": 10.0, "commfuse": 9.0, "floor": 8.0}},
           {"model": "hooks", "mode": "decode_cg_b4", "ms": {"inductor": 1.0, "commfuse": 0.9}}]
    paths = []
    for name, records in (("run_aaa.json", old), ("run_bbb.json", new)):
        (tmp_path / name).write_text(json.dumps(records))
        paths.append(str(tmp_path / name))
    png = tmp_path / "model.png"
    assert bench.main(["model-plot", *paths, str(png)]) == 0
    assert png.stat().st_size > 1000
    labels = {}
    import matplotlib.axes

    real = matplotlib.axes.Axes.set_yticks
    matplotlib.axes.Axes.set_yticks = lambda self, ticks, names=None, **kw: labels.update(zip(ticks, names))
    try:
        bench_model.plot(paths, str(png))
    finally:
        matplotlib.axes.Axes.set_yticks = real
    assert sorted(labels.values()) == ["dtensor prefill (bbb)", "hooks decode_cg_b4 (bbb)"]


@pytest.mark.slow
def test_every_maintained_benchmark_answers_help_on_the_cpu():
    """Each script in benchmarks/ (they run under torchrun on GPUs) imports on the CPU and
    describes its options: one interpreter runs every Python script's ``--help``, and the device
    script prints its stages."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    scripts = {"path_sweep.py": ("--rules", "--rounds", "--tilings", "--only"), "kernel_compile.py": ("--configs",),
               "trace.py": ("--ops", "--pushers"),
               "host_time.py": ("--batches", "--profile", "--commfuse", "--parts"),
               "gemm_half.py": ("--alternatives", "--world", "--queued", "--kernels"), "ordinary_calls.py": ("--samples", "--provider-first", "--funcol-first"),
               "funcol_dispatch.py": ("--device", "--samples"), "host_python.py": ("--calls", "--profile", "--cases", "--parts"),
               "launch_cost.py": ("--samples",), "norm_epilogue.py": ("--decode", "--budget-s"),
               "tune_one_gpu.py": ("--out",), "pairing_check.py": ("--world", "--rounds", "--iters"),
               "replay_check_cost.py": ("--groups", "--steps", "--out")}
    assert sorted(p.name for p in (root / "benchmarks").glob("*.py")) == sorted(scripts)
    probe = ("import contextlib, io, runpy, sys\n"
             "for script in sys.argv[1:]:\n"
             "    sys.argv = [script, '--help']\n"
             "    out = io.StringIO()\n"
             "    try:\n"
             "        with contextlib.redirect_stdout(out):\n"
             "            runpy.run_path(script, run_name='__main__')\n"
             "    except SystemExit as exc:\n"
             "        assert exc.code in (0, None), (script, exc.code)\n"
             "    print('=== ' + script)\n"
             "    print(out.getvalue())\n")
    proc = subprocess.run([sys.executable, "-c", probe, *(str(root / "benchmarks" / s) for s in scripts)],
                          capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    helps = dict(part.split("\n", 1) for part in proc.stdout.split("=== ")[1:])
    for script, options in scripts.items():
        text = helps[str(root / "benchmarks" / script)]
        assert text.startswith("usage:"), (script, text[:200])
        for option in options:
            assert option in text, (script, option)
    device = subprocess.run(["bash", str(root / "benchmarks" / "device_h200x2.sh"), "--help"],
                            capture_output=True, text=True, timeout=60, cwd=root)
    assert device.returncode == 0 and "stages:" in device.stdout, device.stdout + device.stderr


def test_model_backend_settings_hold_during_each_step_only():
    """``commfuse@...`` backends: a forced path and settings, in force inside each step only; a
    setting that no longer exists (a sweep knob) or none at all is an error naming it."""
    import pytest

    from commfuse import env
    from commfuse.tools import bench_model

    seen = []

    def step():
        s = env.current()
        seen.append((s.algo, s.merge_sums, s.fast_launch))
    bench_model._with_algo("one_shot", step)()
    bench_model._with_algo("MERGE_SUMS=0+fast_launch=0", step)()
    bench_model._with_algo("ce_overlap+MERGE_SUMS=0", step)()
    assert seen == [("one_shot", True, True), (None, False, False), ("ce_overlap", False, True)]
    assert env.current().algo is None and env.current().merge_sums
    with pytest.raises(ValueError, match="COMMFUSE_CE_CHUNKS no longer exists.*path configuration"):
        bench_model.settings_of("ce_overlap+CE_CHUNKS=4")
    with pytest.raises(ValueError, match="'FROB=1' is neither a path nor a commfuse setting"):
        bench_model.settings_of("FROB=1")
    with pytest.raises(ValueError, match="COMMFUSE_ALGO='frobnicate' is not one of"):
        bench_model.settings_of("frobnicate")


def test_call_times_case_rows(monkeypatch):
    """``--call-times``: each recorded call's median per step on each rank (the larger reported),
    its host time and how often it found the stream idle (the larger over ranks), its time by
    position in the step only where every step on every rank made it equally often, and the same
    mm_all_reduce alone with its path forced and its weight in the recorded layout (CUDA timing
    replaced)."""
    from commfuse import env
    from commfuse.tools import bench_model, call_times, timing

    C = call_times.Call
    fused = ("mm_all_reduce", (8, 4), (4, 6), True, "fused")
    pull = ("all_gather_mm", (2, 4), (4, 6), False, "pull")
    uneven = ("mm_all_reduce", (4, 4), (4, 6), False, "one_shot")
    only_here = ("mm_all_reduce", (1, 4), (4, 6), False, "split_k")
    steps_here = [  # what this rank recorded in each of two steps
        {fused: [C(5.0, 50, False, 40), C(7.0, 70, True, 60)], pull: [C(3.0, 30, False, 5)],
         uneven: [C(1.0, 1, False, 1), C(9.0, 1, False, 1), C(1.0, 1, False, 1)], only_here: [C(1.0, 1, False, 1)]},
        {fused: [C(6.0, 60, False, 50), C(9.0, 90, True, 80)], pull: [C(3.0, 20, False, 5)],
         uneven: [C(1.0, 1, False, 1), C(9.0, 1, False, 1)], only_here: [C(1.0, 1, False, 1)]}]
    # the peer's statistics: (median, host, idle share, count, CPU, by position)
    peer = {fused: (8.0, 10.0, 0.0, 4, 10.0, [8.5, 7.0]), pull: (2.0, 40.0, 1.0, 2, 30.0, [2.0, 2.0]),
            uneven: (1.0, 1.0, 0.0, 4, 1.0, [1.0, 9.0])}
    steps, alone, gathered = [], [], []
    pending = iter(steps_here)

    def collect(detail=False):
        assert detail or not steps  # the per-step reads ask for the records
        return dict(next(pending)) if steps else {}

    def mm_all_reduce(a, b, bias, group):
        alone.append((tuple(a.shape), a.dtype, tuple(b.shape), b.stride(), bias, group, env.current().algo))
        return a @ b

    def time_us(fn):
        fn()
        return 4.0

    def step():
        steps.append(call_times._on)

    def all_gather_object(out, obj):
        gathered.append(obj)
        out[:] = [obj, peer]

    monkeypatch.setattr(call_times, "collect", collect)
    monkeypatch.setattr(timing, "time_us", time_us)
    monkeypatch.setattr(torch.ops.commfuse, "mm_all_reduce", mm_all_reduce)
    monkeypatch.setattr(bench_model, "_max_over_ranks", lambda v, device: v)
    monkeypatch.setattr(bench_model.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(bench_model.dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(bench_model.dist, "group", types.SimpleNamespace(WORLD=types.SimpleNamespace(group_name="0")))
    rows, host_ms = bench_model.call_times_case(step, torch.device("cpu"), torch.bfloat16, 2)
    assert steps == [True, True] and not call_times._on  # recording on for the steps only
    assert 0 <= host_ms < 1000
    # this rank's own statistics: medians over both steps, the idle share, the count, the CPU
    # time and the median of each position; none for a key called 3 times, then twice
    assert gathered[0][fused] == (6.5, 65.0, 0.5, 4, 55.0, [5.5, 8.0])
    assert gathered[0][uneven][5] == [] and gathered[0][uneven][3] == 5
    # only mm_all_reduce is timed alone: the recorded shapes, the weight as W.t(), no bias, the
    # WORLD group, the recorded path forced; the call the peer never made is left out
    assert sorted(alone) == [((4, 4), torch.bfloat16, (4, 6), (6, 1), None, "0", "one_shot"),
                             ((8, 4), torch.bfloat16, (4, 6), (1, 4), None, "0", "fused")]
    assert env.current().algo is None
    assert rows == [
        {"op": "all_gather_mm", "a": [2, 4], "b": [4, 6], "b_transposed": False, "path": "pull",
         "calls_per_step": 1.0, "in_model_us": 3.0, "in_model_us_ranks": [3.0, 2.0], "host_us": 40.0,
         "idle_at_entry": 1.0, "host_cpu_us": 30.0, "in_model_us_by_position": []},  # 1 position here, 2 there
        {"op": "mm_all_reduce", "a": [4, 4], "b": [4, 6], "b_transposed": False, "path": "one_shot",
         "calls_per_step": 2.5, "in_model_us": 1.0, "in_model_us_ranks": [1.0, 1.0], "host_us": 1.0,
         "idle_at_entry": 0.0, "host_cpu_us": 1.0, "in_model_us_by_position": [], "alone_us": 4.0},
        {"op": "mm_all_reduce", "a": [8, 4], "b": [4, 6], "b_transposed": True, "path": "fused",
         "calls_per_step": 2.0, "in_model_us": 8.0, "in_model_us_ranks": [6.5, 8.0], "host_us": 65.0,
         "idle_at_entry": 0.5, "host_cpu_us": 55.0, "in_model_us_by_position": [8.5, 8.0], "alone_us": 4.0}]
    lines = bench_model._call_lines(rows, 20.0, host_ms)
    assert ("in the step 8 us (ranks 6/8; by position 8/8; host 65 us, 55 of CPU; stream idle at entry 50%), "
            "alone 4 us") in lines[2]
    assert "by position uneven" in lines[0]
    assert "commfuse calls: 0.02 ms of GPU time per step" in lines[-1]  # 3 * 1 + 1 * 2.5 + 8 * 2 us


def test_call_times_warn_about_calls_past_the_limit(monkeypatch):
    import pytest

    from commfuse.runtime.spec import MM_ALL_REDUCE
    from commfuse.tools import call_times

    monkeypatch.setattr(call_times, "LIMIT", 2)
    monkeypatch.setattr(call_times, "_event", lambda: types.SimpleNamespace(record=lambda: None,
                                                                          elapsed_time=lambda end: 1.0))
    monkeypatch.setattr(call_times, "_timeable", lambda a: True)
    monkeypatch.setattr(call_times, "_idle", lambda a: False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    counter = {}

    @call_times.timed(counter)
    def entry(spec, args, site=0):
        counter["mm_all_reduce:one_shot"] = counter.get("mm_all_reduce:one_shot", 0) + 1
        return args.a @ args.b

    a, b = torch.ones(2, 3), torch.ones(3, 4)
    call_times.record(True)
    try:
        outs = [entry(MM_ALL_REDUCE, MM_ALL_REDUCE.Args(a, b, None, "g")) for _ in range(3)]
    finally:
        call_times.record(False)
    assert all(torch.equal(o, a @ b) for o in outs)  # the call past the limit still runs
    with pytest.warns(UserWarning, match="1 calls past the first 2 were not timed"):
        times = call_times.collect()
    assert times == {("mm_all_reduce", (2, 3), (3, 4), False, "one_shot"): [1e3, 1e3]}


def test_a_cpu_run_says_it_times_the_unfused_computation():
    """On the CPU the ops run the unfused computation: a CPU run printed "commfuse/inductor 1.052x,
    hides 17%" as if fusion had hidden communication."""
    from commfuse.tools import bench_model

    rec = {"model": "dtensor", "mode": "prefill", "device": "cpu", "fused": 4,
           "ms": {"inductor": 24.0, "commfuse": 22.0, "floor": 20.0}, "compile_s": {"inductor": 1.0, "commfuse": 1.0},
           "round_ms": {"inductor": [24.0], "commfuse": [22.0], "floor": [20.0]}}
    bench_model._compare(rec)
    assert "hidden_share" not in rec and rec["speedup_vs_inductor"] == 24.0 / 22.0
    line = bench_model._line(rec)
    assert "commfuse/inductor 1.091x (unfused computation: no fusion runs on the CPU)" in line
    assert "hides" not in line
    header = bench_model.header(torch.device("cpu"), 2)
    assert "On the CPU the commfuse ops run the unfused computation (no fusion runs on the CPU)" in header
    gpu = dict(rec, device="cuda")
    bench_model._compare(gpu)
    assert gpu["hidden_share"] == 0.5 and "hides 50%" in bench_model._line(gpu)
    assert "CPU" not in bench_model._line(gpu) and "CPU" not in bench_model.header(torch.device("cuda"), 2)


def test_path_sweep_turns_its_winners_into_a_rules_table(monkeypatch):
    """``path_sweep.py --rules``: per op one rule per swept shape naming the winner's path (a
    winning configuration said in the note), each citing the sweep's file, then NCCL; what the
    sweep did not time carried from the table in force; the result parses as the run-time's data
    and decides the swept shapes as measured."""
    import runpy
    from pathlib import Path

    from commfuse.runtime import policy, rules
    from commfuse.runtime.facts import GroupFacts
    from commfuse.runtime.paths.base import Call

    sweep = runpy.run_path(str(Path(__file__).resolve().parents[1] / "benchmarks" / "path_sweep.py"))

    def rec(m, k, n, median, op="mm_all_reduce"):
        return dict(op=op, M=m, K=k, N=n, batch=1, rows_dim=0, rules="x", times={}, errors={},
                    median=dict(unfused=500.0, default=400.0, **median))
    records = [rec(8192, 2048, 4096, {"nccl": 480.0, "one_shot": 420.0, "fused": 280.0,
                                      "fused@128x128x64s4w8g8r0o1": 300.0}),
               rec(1024, 7168, 4096, {"nccl": 150.0, "ce_overlap@chunks2": 110.0, "fused": 115.0}),
               rec(2048, 2048, 2048, {"nccl": 90.0, "pull": 60.0}, op="all_gather_mm")]
    current = rules.table("sm_90", 2, "NVIDIA H200", 132)
    data = sweep["rules_from"](records, "sm_90", 2, "NVIDIA H200", "benchmarks/results/h200x2/paths.json@abc1234",
                               current)
    table, = rules.parse(data, "generated")
    ar = table.rules("mm_all_reduce")
    assert [(r.path, dict(r.when)) for r in ar] == [
        ("ce_overlap", {"m": (1024, 1024), "k": (7168, 7168), "n": (4096, 4096)}),
        ("fused", {"m": (8192, 8192), "k": (2048, 2048), "n": (4096, 4096)}), ("nccl", {})]
    assert "fastest as ce_overlap@chunks2" in ar[0].note and "280.0 us against unfused 500.0 us" == ar[1].note
    assert all(r.evidence == ("benchmarks/results/h200x2/paths.json@abc1234",) for r in ar)
    assert [r.path for r in table.rules("all_gather_mm")] == ["pull", "nccl"]
    # not swept: carried over from the table in force, unchanged
    assert table.rules("mm_all_reduce@capture") == current.rules("mm_all_reduce@capture")
    assert table.rules("mm_reduce_scatter") == current.rules("mm_reduce_scatter")
    assert table.rules("scaled_mm_all_reduce") == current.rules("scaled_mm_all_reduce")
    carried = table.note.split("; ")[1].removesuffix(" carried over from the table in force (sm_90 world 2)")
    assert carried.split(", ") == sorted(set(current.ops) - {"mm_all_reduce", "all_gather_mm"}), table.note
    facts = GroupFacts.simulated(2)
    monkeypatch.setattr(rules, "load", lambda arch: (table,))
    assert policy.rules_choice(Call("mm_all_reduce", 8192, 2048, 4096, torch.bfloat16, 2), facts).name == "fused"
    assert policy.rules_choice(Call("mm_all_reduce", 16, 2048, 4096, torch.bfloat16, 2), facts).name == "nccl"


@pytest.mark.parametrize("op", ["scaled_mm_all_reduce", "all_gather_scaled_mm", "scaled_mm_reduce_scatter",
                                "rowwise_scaled_mm_all_reduce", "all_gather_rowwise_scaled_mm",
                                "rowwise_scaled_mm_reduce_scatter"])
def test_fp8_ops_are_timed_through_their_specs(op, monkeypatch, world2):
    """``bench ops --ops <FP8 op>``'s record on the CPU (a fake group of 2, every timing a call
    counted instead of timed, no symmetric path on a CPU group): the spec's operands, its product
    alone, the NCCL collective and the op itself each run, and the record has what the table reads."""
    import torch.distributed as dist

    from commfuse.runtime import groups
    from commfuse.runtime.facts import GroupFacts
    from commfuse.tools import bench

    timed = []
    monkeypatch.setattr(bench, "time_us", lambda fn: timed.append(fn()) or float(len(timed)))
    monkeypatch.setattr(bench, "_exchange_alone", lambda t, *_: t.update({"symm": 1.0}))
    monkeypatch.setattr(groups, "group_facts", lambda state, device, capturing: GroupFacts(2, "cpu", "cpu", 0))
    rec = bench.bench_spec_shape(op, 64, 32, 48, torch.bfloat16, dist.group.WORLD, device=torch.device("cpu"))
    assert rec["op"] == op and rec["path"] == "nccl" and rec["peers"] == {}
    assert set(rec["parts"]) >= {"mm", "unfused", "commfuse_default"}
    assert any(key.startswith("nccl_") for key in rec["parts"])
    out = timed[-1]  # the last timed call: commfuse's default, settled
    out = out[0] if isinstance(out, tuple) else out
    assert out.shape == ((64, 48) if "scatter" not in op else (32, 48)) and out.dtype == torch.bfloat16
    assert rec["dtype"] == ("float8_e4m3fn" if "gather" in op else "bfloat16")
    assert f"| {op} | 64 | 32 | 48 | nccl |" in bench._table([rec])


@pytest.mark.parametrize("op", ["mm_all_reduce_add_rms_norm", "mm_reduce_scatter_add_rms_norm"])
def test_norm_ops_are_timed_against_their_collective_and_inductors_norm(op, monkeypatch, world2):
    """``bench ops --ops <norm op>``'s record on the CPU (a fake group of 2, every timing a call
    counted instead of timed): unfused is the collective's own op then the compiled add + norm (its
    outputs the op's), the eager chain beside it; the op's shapes hold hidden sizes up to 8192."""
    import torch.distributed as dist

    from commfuse.runtime import groups
    from commfuse.runtime.facts import GroupFacts
    from commfuse.tools import bench

    timed = {}
    monkeypatch.setattr(bench, "time_us", lambda fn: timed.setdefault(len(timed), fn()) is None or float(len(timed)))
    monkeypatch.setattr(groups, "group_facts", lambda state, device, capturing: GroupFacts(2, "cpu", "cpu", 0))
    m = 64
    rec = bench.bench_norm_shape(op, m, 32, 48, torch.float32, dist.group.WORLD, device=torch.device("cpu"))
    assert rec["op"] == op and rec["path"] == "nccl"
    assert set(rec["parts"]) >= {"collective", "unfused", "nccl_chain", "commfuse_default"}
    unfused, chain, fused = timed[1], timed[2], timed[3]  # (collective, unfused, eager chain, the op)
    rows = m // 2 if "scatter" in op else m
    for h, n in (unfused, chain, fused):
        assert h.shape[-1] == n.shape[-1] == 48 and h.numel() == rows * 48
    torch.testing.assert_close(unfused[0], fused[0])
    torch.testing.assert_close(unfused[1], fused[1], rtol=1e-5, atol=1e-5)
    assert all(n <= 8192 for _, _, n in bench.shapes_of(op)) and bench.shapes_of(op)
    assert f"| {op} | 64 | 32 | 48 | nccl |" in bench._table([rec])


@pytest.mark.parametrize("form", ["tensorwise", "rowwise", "weights"])
def test_model_benchmark_builds_the_fp8_forms_explain_shows(form, world2):
    """``bench model --fp8``: the bundled stack in the FP8 form ``explain --fp8`` compiles (torchao's
    Float8Linear before the split, FP8 weights after it), on the split each form takes."""
    from commfuse.demo import fp8
    from commfuse.demo import transformer as demo
    from commfuse.tools import bench_model

    if form != "weights":
        pytest.importorskip("torchao")
        from torchao.float8.float8_linear import Float8Linear
    kind = "hooks" if form == "weights" else "sp"
    model = bench_model._build(kind, demo.sized_config(True, 1, 2), torch.device("cpu"), torch.bfloat16, form)
    linears = [m for m in model.modules() if isinstance(m, (fp8.Fp8Linear if form == "weights" else Float8Linear))]
    assert len(linears) == 7, model  # wq, wk, wv, wo, w1, w2, w3


@pytest.mark.parametrize("argv, message", [
    (["--fp8", "tensorwise", "--models", "hf"], "--fp8 takes the bundled stack's splits (dtensor, sp, hooks), not hf"),
    (["--fp8", "weights", "--models", "dtensor"], "--fp8 weights takes --models hooks and inference modes"),
    (["--fp8", "weights", "--models", "hooks", "--modes", "prefill,train"],
     "--fp8 weights takes --models hooks and inference modes"),
])
def test_model_benchmark_refuses_fp8_forms_a_split_cannot_take(argv, message):
    from commfuse.tools import bench, bench_model

    args = bench.parser().parse_args(["model", *argv])
    with pytest.raises(SystemExit) as info:
        bench_model.fill_defaults(args, cuda=False)
    assert str(info.value).startswith(f"commfuse bench model: {message}"), info.value


def test_model_benchmark_has_a_backend_with_the_norm_chains_opted_in(world2):
    """``bench model --backends commfuse_norm``: commfuse with the opt-in ``add_rms_norm`` pattern,
    which takes the bundled stack's add + norm chains (two ranks, a forward graph)."""
    import commfuse
    from commfuse.demo import transformer as demo
    from commfuse.tools import bench_model

    assert "commfuse_norm" in bench_model.BACKENDS
    cfg = demo.sized_config(True, 1, world2)
    torch.manual_seed(0)
    model = demo.parallelize_hooks(demo.Transformer(cfg).eval())
    x = torch.randn(2, 16, cfg.dim)
    commfuse.clear_report()
    with torch.no_grad():
        out = bench_model._compile("commfuse_norm", model)(x)
        torch.testing.assert_close(out, model(x))
    assert [r.module for r in commfuse.report().fused if r.pattern == "add_rms_norm"] == ["layers.0.attention.wo"]


def test_host_python_runs_every_case_on_its_own_path(tmp_path):
    """``benchmarks/host_python.py`` on the CPU: each case's calls take the path the case names
    (forced, each case's plans decided afresh) and launch one kernel per call through the kept
    launch, the GPU's parts stood in; what it records is what it prints; ``--parts`` times the
    split-K call's parts."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "host.json"
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "host_python.py"), "--calls", "3", "--rounds", "1",
                           "--parts", "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    saved = json.loads(out.read_text())
    records = saved["records"]
    assert set(saved["split_k_parts"]) == {"call", "checks", "entry", "path_run", "prepare", "exchange",
                                           "epoch", "launch", "output"}
    assert all(v > 0 for v in saved["split_k_parts"].values())
    assert [r["case"] for r in records] == [c[0] for c in __import__("runpy").run_path(
        str(root / "benchmarks" / "host_python.py"))["CASES"]]
    for r in records:
        assert r["ran"] == [r["path"]], r
        assert r["launches_per_call"] == 1 and r["python_calls_per_call"] > 0, r
        assert f"{r['case']:12} {r['us_per_call']:7.1f} us/call" in proc.stdout
    assert "NOTE" not in proc.stdout


def test_host_parts_each_part_does_its_step_and_no_more():
    """``commfuse.tools.host_parts.split_k_parts`` (through ``host_python.py``'s stand-ins, in a
    process of its own): the parts that include the kernel's launch launch it once and take one
    epoch each, as a call does; the others launch nothing and take no epoch; the whole call and
    the entry run the split-K path; where the calls take another path it says what to do."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = """
import os, runpy
os.environ["CUDA_VISIBLE_DEVICES"] = ""
import torch
from commfuse import env
from commfuse.ops import library
from commfuse.runtime import counters, entry, groups
from commfuse.tools.host_parts import split_k_parts
hp = runpy.run_path("benchmarks/host_python.py")
name = hp["stand_ins"]()
a = torch.randn(32, 256, dtype=torch.bfloat16)
b = torch.randn(512, 256, dtype=torch.bfloat16).t()
with env.override(algo="one_shot", verify=False, ce_graphs=False):
    try:
        split_k_parts(name, a, b)
    except RuntimeError as exc:
        print("NO PLAN:", "force the path" in str(exc))
with env.override(algo="split_k", verify=False, ce_graphs=False):
    entry.forget()
    parts = split_k_parts(name, a, b)
    ws = groups.get(name).workspace
    for part, fn in parts.items():
        counters.PATHS.clear()
        launches, epoch = hp["LAUNCHES"][0], ws.epoch
        fn()
        ran = sorted(k for k, v in counters.PATHS.items() if v)
        print(part, hp["LAUNCHES"][0] - launches, ws.epoch - epoch, ran)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert "NO PLAN: True" in lines
    seen = {line.split()[0]: line.split(None, 3)[1:] for line in lines if not line.startswith("NO PLAN")}
    assert set(seen) == {"call", "checks", "entry", "path_run", "output", "prepare", "exchange", "epoch",
                         "launch"}
    for part in ("call", "path_run", "exchange", "launch"):
        assert seen[part][:2] == ["1", "1"], (part, seen[part])
    for part in ("checks", "entry", "output", "prepare"):
        assert seen[part][:2] == ["0", "0"], (part, seen[part])
    assert seen["epoch"][:2] == ["0", "1"]
    for part in ("call", "entry"):
        assert seen[part][2] == "['mm_all_reduce:split_k']", (part, seen[part])
