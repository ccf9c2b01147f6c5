"""``torchrun --nproc_per_node=N -m commfuse bench model``: the bundled Llama-style stack, split for
tensor parallelism three ways (DTensor, sequence-parallel DTensor, gpt-fast-style hooks), and
transformers' ``LlamaForCausalLM`` split by its own TP plan (``hf``: prefill and train only, token ids
in, logits out; needs transformers), timed in one run per (model, mode) for every backend:

* ``eager``; ``inductor``; ``inductor_mptp`` (Inductor's ``_micro_pipeline_tp``, sequence-parallel
  only, on CUDA); ``commfuse``; ``floor``: Inductor with the collectives replaced by local stand-ins
  (compute only, wrong values by design).

Modes: ``prefill`` (forward of batch x seq tokens under no_grad), ``train`` (forward, backward,
SGD step), ``decode`` (one token per sequence against a KV cache of ``--context`` positions that
grows by one every step; for each ``--decode-batches``; not for the sequence-parallel split) and
``decode_cg``, the same under CUDA graphs (``mode="reduce-overhead"`` for every compiled backend;
eager is left out). All backends of a case stay compiled and are timed in alternating rounds.
``loss`` trains ``--loss-steps`` SGD steps with eager, Inductor and commfuse from the same weights
and data and reports the loss curves and their largest relative deviation from eager.
Reported for the timed modes: median step time (wall clock, synchronised, max over ranks), tokens/s, speed-up over
Inductor, the share of Inductor's communication time commfuse hides,
``(inductor - commfuse) / (inductor - floor)``, first-call (compile) time with Inductor's caches
off and its ratio to Inductor's, the fused-match count, and commfuse's error against eager (or
against Inductor where eager is not run). ``--call-times STEPS`` (GPUs): every commfuse call's
GPU time inside the step, timed by CUDA events over STEPS more steps, against the same call
alone on fresh operands (``tools/call_times.py``): where a step loses time inside the
model that the op benchmark does not show.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from commfuse.demo import hf_llama, init_distributed, shutdown

BACKENDS = ("eager", "inductor", "inductor_mptp", "commfuse", "commfuse_norm", "floor")
MODES = ("prefill", "train", "decode", "decode_cg", "loss")
MODELS = ("dtensor", "sp", "hooks", "hf")


def _build(kind: str, cfg, device, dtype, fp8: str | None = None):
    """The model of ``kind``, in FP8 form ``fp8`` (``demo.fp8.split_in``; the bundled stack only)."""
    from torch.distributed.device_mesh import init_device_mesh

    from commfuse.demo import fp8 as fp8_forms
    from commfuse.demo import transformer as demo

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if kind == "hf":  # transformers' LlamaForCausalLM, split by its own TP plan: ids -> logits
        return hf_llama.Logits(hf_llama.parallelize_by_own_plan(hf_llama.build(cfg, device, dtype), mesh))
    torch.manual_seed(0)  # identical weights on every rank and for every backend
    model = demo.Transformer(cfg).to(device=device, dtype=dtype)

    def split(model):
        if kind == "hooks":
            return demo.parallelize_hooks(model)
        return demo.parallelize_dtensor(model, mesh, sequence_parallel=kind == "sp", fp8=fp8)

    return fp8_forms.split_in(model, fp8, split, "commfuse bench model")


def _compile(backend: str, model, cudagraphs: bool = False, every_call: bool = False):
    """``cudagraphs``: Inductor's ``mode="reduce-overhead"`` for every compiled backend;
    ``every_call``: commfuse fuses calls of every size (no launch bound), for numerics checks."""
    import commfuse

    from .floor import make_floor_backend

    mode = "reduce-overhead" if cudagraphs else None
    if backend == "eager":
        return model
    if backend == "inductor":
        return torch.compile(model, mode=mode)
    if backend == "inductor_mptp":
        return torch.compile(model, options={"_micro_pipeline_tp": True, "triton.cudagraphs": cudagraphs})
    if backend == "commfuse":
        return torch.compile(model, backend=commfuse.backend(mode=mode, launch_bound_bytes=0 if every_call else None))
    if backend == "commfuse_norm":  # the opt-in add + RMSNorm chains too
        return torch.compile(model, backend=commfuse.backend(mode=mode, patterns=[*commfuse.DEFAULT_PATTERNS,
                                                                                   "add_rms_norm"]))
    if backend == "floor":
        return torch.compile(model, backend=make_floor_backend(**{"triton.cudagraphs": cudagraphs}))
    raise ValueError(backend)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _step_times(step, device, n: int) -> list[float]:
    """Wall time in ms of each of ``n`` synchronised calls of ``step`` (the host is part of a step)."""
    times = []
    for _ in range(n):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def hidden_share(inductor: float, commfuse: float, floor: float) -> float | None:
    """The share of Inductor's communication time commfuse hides; None without any to hide."""
    return (inductor - commfuse) / (inductor - floor) if inductor > floor else None


def _max_over_ranks(value: float, device) -> float:
    t = torch.tensor([value], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


#: Timed steps are split into rounds that alternate between the backends, so drift of the host
#: (the step is partly launch-bound) or of the GPU clocks spreads over all of them alike.
ROUNDS = 3
WARMUP = 3


def _allow_many_compiles() -> None:
    """All backends stay compiled at once (interleaved timing): one code object, several entries."""
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)


def call_times_case(step, device, dtype, steps: int) -> tuple[list[dict], float]:
    """Every commfuse call of ``step``, timed by CUDA events on the caller's stream over ``steps``
    synchronised steps, beside the same ``mm_all_reduce`` call alone: fresh operands of the same
    shapes and weight layout, the path forced (``time_us``, the WORLD group). Per call: the median
    GPU time on each rank (``in_model_us``: the larger), the median host time inside the call and
    the share of calls that found the caller's stream already idle (the larger over ranks: where
    the host, not the GPU, set the pace). Only the calls every rank made are reported (they pair
    up collectively). By position: the median of the j-th call of a key in each step, where
    every step on every rank made that key's calls equally often (else none). Also returns the
    median host time to enqueue a step (before its synchronisation, with the timing on; the
    larger over ranks) in ms: near the step's time, the host sets the pace."""
    from commfuse import env

    from . import call_times, timing

    call_times.collect()  # nothing recorded earlier counts
    call_times.record(True)
    enqueue, per_step = [], {}  # key -> that key's calls in each step that made any
    try:
        for _ in range(steps):
            start = time.perf_counter()
            step()
            enqueue.append((time.perf_counter() - start) * 1e3)
            _sync(device)
            for key, calls in call_times.collect(detail=True).items():
                per_step.setdefault(key, []).append(calls)
    finally:
        call_times.record(False)

    def stats(lists):
        cs = [c for calls in lists for c in calls]
        even = len(lists) == steps and len({len(calls) for calls in lists}) == 1
        positions = ([statistics.median(calls[j].gpu_us for calls in lists) for j in range(len(lists[0]))]
                     if even else [])
        return (statistics.median(c.gpu_us for c in cs), statistics.median(c.host_us for c in cs),
                sum(c.idle for c in cs) / len(cs), len(cs), statistics.median(c.cpu_us for c in cs),
                positions)

    mine = {key: stats(lists) for key, lists in per_step.items()}
    ranks = [mine]
    if dist.get_world_size() > 1:
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    rows = []
    for key in sorted(set.intersection(*(set(r) for r in ranks))):
        op, a_shape, b_shape, b_transposed, path = key
        per_rank = [r[key] for r in ranks]
        row = {"op": op, "a": list(a_shape), "b": list(b_shape), "b_transposed": b_transposed, "path": path,
               "calls_per_step": max(r[3] for r in per_rank) / steps,
               "in_model_us": max(r[0] for r in per_rank),
               "in_model_us_ranks": [r[0] for r in per_rank],
               "host_us": max(r[1] for r in per_rank),
               "idle_at_entry": max(r[2] for r in per_rank),
               "host_cpu_us": max(r[4] for r in per_rank),
               "in_model_us_by_position": _by_position([r[5] for r in per_rank])}
        if op == "mm_all_reduce" and path != "?":
            a = torch.randn(a_shape, device=device, dtype=dtype)
            b = torch.randn(b_shape[::-1] if b_transposed else b_shape, device=device, dtype=dtype)
            b = (b.t() if b_transposed else b) / a_shape[-1] ** 0.5
            group = dist.group.WORLD.group_name
            with env.override(algo=path):
                row["alone_us"] = timing.time_us(lambda: torch.ops.commfuse.mm_all_reduce(a, b, None, group))
        rows.append(row)
    return rows, _max_over_ranks(statistics.median(enqueue), device)


def _by_position(per_rank: list[list[float]]) -> list[float]:
    """The larger over ranks at each position; none unless every rank has the same positions."""
    if not per_rank[0] or len({len(p) for p in per_rank}) != 1:
        return []
    return [max(t) for t in zip(*per_rank)]


def _call_lines(rows: list[dict], step_ms: float | None, host_ms: float) -> list[str]:
    lines, extra = [], 0.0
    for r in rows:
        shape = "x".join(map(str, r["a"])) + " @ " + "x".join(map(str, r["b"]))
        shape += " (W.t())" if r["b_transposed"] else ""
        ranks = "/".join(f"{t:.0f}" for t in r["in_model_us_ranks"])
        at = "/".join(f"{t:.0f}" for t in r["in_model_us_by_position"]) or "uneven"
        line = (f"    {r['op']} {shape} {r['path']}, {r['calls_per_step']:g}/step: "
                f"in the step {r['in_model_us']:.0f} us (ranks {ranks}; by position {at}; host "
                f"{r['host_us']:.0f} us, {r['host_cpu_us']:.0f} of CPU; stream idle at entry "
                f"{r['idle_at_entry']:.0%})")
        if "alone_us" in r:
            line += f", alone {r['alone_us']:.0f} us"
            extra += (r["in_model_us"] - r["alone_us"]) * r["calls_per_step"] / 1e3
        lines.append(line)
    total = sum(r["in_model_us"] * r["calls_per_step"] for r in rows) / 1e3
    lines.append(f"    commfuse calls: {total:.2f} ms of GPU time per step"
                 + (f" (step {step_ms:.2f} ms)" if step_ms else "")
                 + f"; {extra:+.2f} ms per step against the same calls alone; the host enqueues a "
                 f"step in {host_ms:.2f} ms")
    return lines


def run_case(kind: str, mode: str, cfg, batch: int, seq: int, device, dtype, backends, iters: int,
             context: int = 0, rounds: int = ROUNDS, call_steps: int = 0, fp8: str | None = None) -> dict:
    import commfuse

    world, rank = dist.get_world_size(), dist.get_rank()
    decode = mode.startswith("decode")
    graphs = mode == "decode_cg"
    local_seq = 1 if decode else (seq // world if kind == "sp" else seq)
    torch.manual_seed(100 + (rank if kind == "sp" else 0))  # SP: each rank holds its own shard
    if kind == "hf":
        x = torch.randint(0, hf_llama.vocab_size(cfg), (batch, local_seq), device=device)
    else:
        x = torch.randn(batch, local_seq, cfg.dim, device=device, dtype=dtype)
    label = (f"decode_cg_b{batch}" if graphs else f"decode_b{batch}") if decode else mode
    rec = {"model": _named(kind, fp8), "mode": label, "batch": batch, "seq": context if decode else seq,
           "world": world, "layers": cfg.n_layers, "dim": cfg.dim, "device": device.type,
           "dtype": str(dtype).replace("torch.", ""), "ms": {}, "compile_s": {}, "fp8": fp8}
    outputs, steps = {}, {}
    torch._dynamo.reset()
    _allow_many_compiles()
    for backend in backends:
        if backend == "inductor_mptp" and (kind != "sp" or device.type != "cuda"):
            continue
        if graphs and (backend == "eager" or device.type != "cuda"):
            continue
        model = _build(kind, cfg, device, dtype, fp8)
        pos = None
        if decode:
            model.setup_cache(batch, context + iters + WARMUP + 16, device, dtype)
            pos = torch.tensor([context], device=device)
        base, _, algo = backend.partition("@")  # "commfuse@one_shot": a forced path (``_with_algo``)
        compiled = _compile(base, model, cudagraphs=graphs)
        # foreach=False: the DTensor split mixes DTensor and plain (norm) parameters
        opt = torch.optim.SGD(model.parameters(), lr=1e-4, foreach=False) if mode == "train" else None
        steps[backend] = step = _with_algo(algo, _make_step(mode, compiled, x, pos, opt, graphs))
        commfuse.clear_report()
        _sync(device)
        start = time.perf_counter()
        out = step()
        _sync(device)
        rec["compile_s"][backend] = time.perf_counter() - start
        if backend == "commfuse_norm":
            rec["fused_norm"] = sum(r.pattern == "add_rms_norm" for r in commfuse.report().fused)
        if backend == "commfuse":
            rec["fused"] = len(commfuse.report().fused)
            rec["merged"] = len(commfuse.report().merged)  # sums of matmuls made one (merge_sums)
            rec["skipped"] = len(commfuse.report().skipped)
        if mode != "train":
            outputs[backend] = out.float().clone()
        for _ in range(WARMUP):
            step()
    times: dict[str, list[float]] = {b: [] for b in steps}
    rec["round_ms"] = {b: [] for b in steps}  # each round's median: how far one run's rounds agree
    for _ in range(rounds):
        for backend, step in steps.items():
            ts = _step_times(step, device, max(1, iters // rounds))
            times[backend] += ts
            rec["round_ms"][backend].append(_max_over_ranks(statistics.median(ts), device))
    for backend, ts in times.items():
        rec["ms"][backend] = _max_over_ranks(statistics.median(ts), device)
        if rank == 0:
            print(f"  {kind} {label} {backend}: first call {rec['compile_s'][backend]:.1f} s, "
                  f"step {rec['ms'][backend]:.3f} ms", file=sys.stderr, flush=True)
    if call_steps and device.type == "cuda" and "commfuse" in steps and not decode:  # a decode step
        # moves its KV cache on, which was sized for the timed steps only
        rec["call_times"], rec["host_step_ms"] = call_times_case(steps["commfuse"], device, dtype, call_steps)
        if rank == 0:
            print("\n".join([f"  {kind} {label} commfuse, per call:"]
                            + _call_lines(rec["call_times"], rec["ms"].get("commfuse"), rec["host_step_ms"])),
                  file=sys.stderr, flush=True)
    ms = rec["ms"]
    _compare(rec)
    ref = outputs.get("eager", outputs.get("inductor"))
    if ref is not None and "commfuse" in outputs:
        rec["commfuse_rel_err"] = ((outputs["commfuse"] - ref).norm() / ref.norm()).item()
        rec["rel_err_against"] = "eager" if "eager" in outputs else "inductor"
        if "eager" in outputs and "inductor" in outputs:  # the scale of a compiler's own rounding
            rec["inductor_rel_err"] = ((outputs["inductor"] - ref).norm() / ref.norm()).item()
    tokens = batch * (1 if decode else seq)
    rec["tokens_per_s"] = {b: tokens / (t / 1e3) for b, t in ms.items()}
    return rec


def _compare(rec: dict) -> None:
    """commfuse against Inductor: the step-time ratio, and on GPUs the share of the communication
    hidden. On the CPU the commfuse ops run the unfused computation (no fusion runs there), so
    nothing was hidden by fusion and no share is claimed."""
    ms = rec["ms"]
    if "inductor" not in ms or "commfuse" not in ms:
        return
    rec["speedup_vs_inductor"] = ms["inductor"] / ms["commfuse"]
    if rec.get("device") == "cuda" and "floor" in ms and ms["inductor"] > ms["floor"]:
        rec["hidden_share"] = hidden_share(ms["inductor"], ms["commfuse"], ms["floor"])
        per_round = zip(*(rec["round_ms"][b] for b in ("inductor", "commfuse", "floor")))
        rounds = [h for h in (hidden_share(*r) for r in per_round) if h is not None]
        if rounds:
            rec["hidden_share_rounds"] = [min(rounds), max(rounds)]
    rec["compile_ratio"] = rec["compile_s"]["commfuse"] / rec["compile_s"]["inductor"]


#: What a CPU run measures: said in the header and next to every ratio.
CPU_NOTE = "unfused computation: no fusion runs on the CPU"


def header(device, world: int) -> str:
    """The run's first line (rank 0, stderr)."""
    from . import count

    line = f"commfuse bench model: {count(world, 'rank')}, {device.type}"
    if device.type != "cuda":
        line += (". On the CPU the commfuse ops run the unfused computation (no fusion runs on the CPU): "
                 "the timings compare Inductor with that, not with fusion")
    return line


def settings_of(algo: str) -> dict:
    """The settings a backend's ``@`` suffix asks for: ``+``-joined items, each a path forced as
    ``COMMFUSE_ALGO`` would (``commfuse@one_shot``) or a setting ``KEY=VALUE`` of
    ``COMMFUSE_KEY`` (``commfuse@MERGE_SUMS=0+FAST_LAUNCH=0``), as ``env.override`` fields.
    Raises ``ValueError`` naming an item that is no setting (or no longer one)."""
    from commfuse import env

    values = {}
    for item in filter(None, algo.split("+")):
        key, _, value = item.partition("=") if "=" in item else ("ALGO", "", item)
        name = f"{env.PREFIX}{key.upper()}"
        if name in env.REMOVED:
            raise ValueError(f"commfuse bench model: {item!r}: {name} no longer exists: {env.REMOVED[name]}")
        if name not in {s.name for s in env.SETTINGS}:
            raise ValueError(f"commfuse bench model: {item!r} is neither a path nor a commfuse setting")
        values[key.lower()] = value
    with env.override(**values):  # parsed as the environment's value would be: a bad one raises here
        pass
    return values


def _with_algo(algo: str, step):
    """``step`` with the settings ``settings_of(algo)`` in force around every call. Entering and
    leaving them drops the plans the run-time kept per call signature, so each such step decides
    its calls' paths anew (host time the default backend's steps do not pay)."""
    if not algo:
        return step
    from commfuse import env

    values = settings_of(algo)

    def forced():
        with env.override(**values):
            return step()

    return forced


def _make_step(mode: str, compiled, x, pos, opt, graphs: bool):
    def step():
        if graphs:  # a new step: the previous replay's outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        if pos is not None:
            with torch.no_grad():
                out = compiled(x, pos)
            pos.add_(1)  # the cache grows by one token a step; same shapes, no recompile
            return out
        if mode == "prefill":
            with torch.no_grad():
                return compiled(x)
        opt.zero_grad(set_to_none=True)
        loss = compiled(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    return step


def loss_case(kind: str, cfg, batch: int, seq: int, device, dtype, steps: int, fp8: str | None = None) -> dict:
    """Train ``steps`` SGD steps on a fixed regression task with eager, Inductor and commfuse from
    the same weights and data; the loss curves and commfuse's largest relative deviation."""
    import torch.nn.functional as F

    world, rank = dist.get_world_size(), dist.get_rank()
    if fp8 in ("tensorwise", "rowwise"):
        # torchao's float8 training keeps bf16 around its FP8 matmuls (the CPU's default fp32 puts a
        # cast between a row-wise product and its collective, which then stays unfused)
        dtype = torch.bfloat16
    local_seq = seq // world if kind == "sp" else seq
    gen = torch.Generator().manual_seed(200 + (rank if kind == "sp" else 0))
    if kind == "hf":
        batches = [torch.randint(0, hf_llama.vocab_size(cfg), (batch, local_seq), generator=gen) for _ in range(4)]
    else:
        batches = [torch.randn(batch, local_seq, cfg.dim, generator=gen) for _ in range(4)]
    data = [batches[i % len(batches)] for i in range(steps)]  # a few batches, revisited: the loss falls
    import commfuse

    losses: dict[str, list[float]] = {}
    torch._dynamo.reset()
    _allow_many_compiles()
    commfuse.clear_report()
    for backend in ("eager", "inductor", "commfuse"):
        model = _build(kind, cfg, device, dtype, fp8)
        # every matched call fused, however small: the loss curve checks the fused ops' numerics
        compiled = _compile(backend, model, every_call=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, foreach=False)
        curve = []
        for x in data:
            x = x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype)
            out = compiled(x).float()
            target = torch.zeros_like(out)  # pull the outputs towards 0: the loss falls steadily
            loss = F.mse_loss(out, target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            curve.append(loss.item())
        losses[backend] = curve

    def max_rel_dev(backend: str) -> float:
        return max(abs(c - e) / max(abs(e), 1e-12) for c, e in zip(losses[backend], losses["eager"]))

    return {"model": _named(kind, fp8), "mode": "loss", "steps": steps, "batch": batch, "seq": seq, "world": world,
            "fp8": fp8, "layers": cfg.n_layers, "dim": cfg.dim, "dtype": str(dtype).replace("torch.", ""),
            "losses": losses, "commfuse_max_rel_dev": max_rel_dev("commfuse"), "fused": len(commfuse.report().fused),
            "inductor_max_rel_dev": max_rel_dev("inductor")}


def _named(kind: str, fp8: str | None) -> str:
    """A record's model: its split, and its FP8 form where it has one (tables and plots key on it)."""
    return f"{kind} fp8-{fp8}" if fp8 else kind


def _line(rec: dict) -> str:
    if rec["mode"] == "loss":
        curve = rec["losses"]["commfuse"]
        return (f"{rec['model']:>7} loss    {rec['steps']} steps: commfuse {curve[0]:.4f} -> {curve[-1]:.4f}, "
                f"largest relative deviation from eager {rec['commfuse_max_rel_dev']:.1e} "
                f"(Inductor's {rec['inductor_max_rel_dev']:.1e}); {rec['fused']} calls fused")
    ms = " ".join(f"{b}={t:.2f}" for b, t in rec["ms"].items())
    extra = ""
    if "speedup_vs_inductor" in rec:
        extra += f" commfuse/inductor {rec['speedup_vs_inductor']:.3f}x"
        if rec.get("device", "cuda") != "cuda":  # records before the device was kept ran on GPUs
            extra += f" ({CPU_NOTE})"
    if "hidden_share" in rec and rec.get("device", "cuda") == "cuda":
        extra += f", hides {100 * rec['hidden_share']:.0f}% of the communication"
        if "hidden_share_rounds" in rec:
            lo, hi = rec["hidden_share_rounds"]
            extra += f" (rounds {100 * lo:.0f}..{100 * hi:.0f}%)"
    if "commfuse_rel_err" in rec:
        extra += f", rel err vs {rec.get('rel_err_against', 'eager')} {rec['commfuse_rel_err']:.1e}"
        if "inductor_rel_err" in rec:
            extra += f" (Inductor's {rec['inductor_rel_err']:.1e})"
    return f"{rec['model']:>7} {rec['mode']:<7} ms: {ms};{extra}; fused {rec.get('fused')}"


def table(paths: list[str]) -> str:
    """A markdown table of model-benchmark JSON files (one row per model and mode)."""
    rows = ["| model | mode | inductor ms | commfuse ms | floor ms | commfuse / inductor | comm. hidden "
            "| compile vs inductor | fused | commit |", "|" + "---|" * 10]
    for path in paths:
        with open(path) as f:
            records = json.load(f)
        commit = os.path.basename(path).rsplit("_", 1)[-1].removesuffix(".json")
        for r in records:
            if "ms" not in r:  # loss curves: no times
                continue
            ms = r["ms"]
            get = lambda b: f"{ms[b]:.2f}" if b in ms else "-"  # noqa: E731
            speed = f"{r['speedup_vs_inductor']:.3f}x" if "speedup_vs_inductor" in r else "-"
            if speed != "-" and r.get("device", "cuda") != "cuda":
                speed += f" ({CPU_NOTE})"
            hidden = f"{100 * r['hidden_share']:.0f}%" if "hidden_share" in r else "-"
            comp = f"{r['compile_ratio']:.2f}x" if "compile_ratio" in r else "-"
            rows.append(f"| {r['model']} | {r['mode']} | {get('inductor')} | {get('commfuse')} | "
                        f"{get('floor')} | {speed} | {hidden} | {comp} | {r.get('fused', '-')} | {commit} |")
    return "\n".join(rows)


def _label(r) -> str:
    return f"{r['model']} {r['mode']}"  # decode modes carry their batch (decode_b4)


def plot(paths: list[str], png_path: str) -> None:
    """Step time of commfuse and of the compute-only floor relative to Inductor's, one bar pair per
    (model, mode, batch); a later file's record replaces an earlier one's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    latest: dict[str, tuple[dict, str]] = {}
    for path in paths:
        with open(path) as f:
            commit = os.path.basename(path).rsplit("_", 1)[-1].removesuffix(".json")
            for r in json.load(f):
                if {"inductor", "commfuse"} <= set(r.get("ms", {})):
                    latest[_label(r)] = (r, commit)
    labels = list(latest)
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(labels) + 1.2))
    y = range(len(labels))
    ms = [latest[k][0]["ms"] for k in labels]
    ax.barh([i + 0.2 for i in y], [m["commfuse"] / m["inductor"] for m in ms], height=0.4, label="commfuse")
    ax.barh([i - 0.2 for i in y], [m.get("floor", float("nan")) / m["inductor"] for m in ms], height=0.4,
            color="lightgray", label="compute-only floor")
    ax.axvline(1.0, color="red", linewidth=0.8)
    ax.set_yticks(list(y), [f"{k} ({latest[k][1]})" for k in labels], fontsize=8)
    ax.set_xlim(0.5, max(1.1, *(m["commfuse"] / m["inductor"] + 0.05 for m in ms)))
    ax.set_xlabel("step time / Inductor's (lower is faster)")
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


def _write(path: str | None, records: list) -> None:
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(records, f, indent=1)


#: ``bench model``'s defaults: on GPUs the README's runs (8B-class layers); on the CPU, where the
#: ops run the unfused computation and every compile takes seconds, a run of about a minute.
MODEL_DEFAULTS = {
    "cuda": dict(models="dtensor,sp,hooks", modes="prefill,decode,decode_cg,train", decode_batches="4,32",
                 context=2048, backends="eager,inductor,inductor_mptp,commfuse,floor", layers=4, batch=4, seq=2048,
                 iters=10, rounds=3),
    "cpu": dict(models="dtensor", modes="prefill,decode,train", decode_batches="4", context=128,
                backends="eager,inductor,commfuse", layers=1, batch=2, seq=128, iters=4, rounds=2),
}



def fill_defaults(args, cuda: bool) -> list[str]:
    """Set each option left unset to its default on GPUs or on the CPU (``MODEL_DEFAULTS``);
    return what will run, in words."""
    from . import count

    for option, value in MODEL_DEFAULTS["cuda" if cuda else "cpu"].items():
        if getattr(args, option) is None:
            setattr(args, option, value)
    for option in ("layers", "batch", "seq", "context", "iters", "rounds"):
        if getattr(args, option) < 1:
            raise SystemExit(f"commfuse bench model: --{option} must be at least 1, got {getattr(args, option)}")
    fp8 = getattr(args, "fp8", None)
    if fp8 and "hf" in args.models.split(","):
        raise SystemExit("commfuse bench model: --fp8 takes the bundled stack's splits (dtensor, sp, hooks), not hf")
    if fp8 == "weights" and (set(args.models.split(",")) != {"hooks"}
                             or {"train", "loss"} & set(args.modes.split(","))):
        raise SystemExit("commfuse bench model: --fp8 weights takes --models hooks and inference modes "
                         "(prefill, decode, decode_cg): its weights are buffers, nothing trains")
    modes = [m for m in args.modes.split(",") if m and (cuda or m != "decode_cg")]
    decode = (f", decode batches {args.decode_batches} from context {args.context}"
              if any(m.startswith("decode") for m in modes) else "")
    fp8 = f"; FP8: {fp8}" if fp8 else ""
    return [f"models {args.models}{fp8}; modes {','.join(modes)}; backends {args.backends}",
            f"{count(args.layers, 'layer')} ({'small' if args.small or not cuda else '8B-class'} sizes), batch "
            f"{args.batch}, sequence {args.seq}{decode}; {count(args.iters, 'step')} per backend in "
            f"{count(args.rounds, 'alternating round')}"]


def main(args) -> int:
    from commfuse.demo import transformer as demo

    plan = fill_defaults(args, torch.cuda.is_available())
    backends = [b for b in args.backends.split(",") if b]
    for backend in backends:  # a misspelt setting fails now, not after the other backends compiled
        base, _, algo = backend.partition("@")
        if base not in BACKENDS:
            raise SystemExit(f"commfuse bench model: unknown backend {base!r}: choose from {', '.join(BACKENDS)}")
        try:
            settings_of(algo)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None

    # Cold compiles for every backend: comparable compile times, and commfuse's pass really runs
    # (a cache hit would skip it and leave the fused count empty).
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    # Inductor's debug check that nothing but outputs stays alive from a CUDA-graph warm-up trips on
    # the tensors ProcessGroupNCCL keeps until its watchdog sees a collective finish (in and out of
    # each all-reduce): they are freed later and are no hazard, so the check is off for every backend.
    torch._inductor.config.triton.slow_path_cudagraph_asserts = False
    device, dtype = init_distributed()
    cuda = device.type == "cuda"
    if dist.get_rank() == 0:
        print(header(device, dist.get_world_size()), file=sys.stderr, flush=True)
        print("commfuse bench model: will run " + "; ".join(plan), file=sys.stderr, flush=True)
    cfg = demo.sized_config(args.small or not cuda, args.layers, dist.get_world_size())
    records = []
    for kind in args.models.split(","):
        for mode in args.modes.split(","):
            if mode not in MODES:
                raise SystemExit(f"unknown mode {mode!r}: choose from {', '.join(MODES)}")
            if mode == "decode_cg" and not cuda:
                continue  # CUDA graphs need CUDA
            if mode.startswith("decode"):
                if kind == "sp":
                    continue  # one token per sequence cannot be split along the sequence
                if kind == "hf":
                    continue  # decoding the transformers model needs its own cache classes: not here
                cases = [(b, dict(context=args.context)) for b in map(int, args.decode_batches.split(","))]
            else:
                cases = [(args.batch, {})]
            for batch, extra in cases:
                if mode == "loss":
                    rec = loss_case(kind, cfg, batch, args.seq, device, dtype, args.loss_steps, args.fp8)
                else:
                    rec = run_case(kind, mode, cfg, batch, args.seq, device, dtype, backends, args.iters,
                                   rounds=args.rounds, call_steps=args.call_times, fp8=args.fp8, **extra)
                records.append(rec)
                if dist.get_rank() == 0:
                    print(_line(rec), file=sys.stderr, flush=True)
                    _write(args.out, records)  # after every case: a run cut short keeps its data
    if dist.get_rank() == 0 and args.out:
        print(f"wrote {args.out}")
    if any(r["mode"].startswith("decode_cg") for r in records):
        # destroy_process_group() hangs once CUDA graphs captured NCCL collectives (Inductor's
        # own all_reduce here; pytorch/pytorch#115388): the graphed runs wrote their results and
        # then hung until killed (model/cg_7df2006.log, cg_5b4db3f.log). Every rank is past its
        # last collective: leave without the group's teardown.
        if dist.get_rank() == 0:
            print("commfuse bench model: exiting without destroy_process_group() after CUDA-graph "
                  "runs (pytorch/pytorch#115388)", file=sys.stderr, flush=True)
        torch.cuda.synchronize()
        dist.barrier()
        sys.stdout.flush()
        os._exit(0)
    shutdown()
    return 0
