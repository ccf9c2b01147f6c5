"""``torchrun --nproc_per_node=N -m commfuse.bench ops``: time commfuse's ops against the unfused
cuBLAS + NCCL computation and peers, in one run per shape.

For every shape it times (median of CUDA-event timings of back-to-back calls, max over ranks):
the unfused matmul + NCCL collective, commfuse (default dispatch and each forced path), torch
symmetric memory's own ops where they exist, and the pieces alone: cuBLAS mm, NCCL collective,
commfuse's exchange kernels; unfused and commfuse's default are timed twice more in alternating
rounds, each the median of its three timings, so clock drift between them does not pick the
winner. floor = max(mm alone, fastest exchange alone). Prints a markdown table
(a progress line per shape on stderr) and writes ``benchmarks/results/<machine>/ops.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from . import env

MM_AR_SHAPES = [(m, k, n) for m in (16, 128, 1024, 4096, 8192)
                for k, n in ((14336, 8192), (4096, 8192), (7168, 4096), (2048, 4096))]
AG_MM_SHAPES = [(1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (4096, 8192, 5120),
                (8192, 8192, 28672), (2048, 4096, 7168), (16384, 4096, 7168)]


SLEEP_CYCLES = 40_000_000  # ~20 ms at H200 clocks: covers the host enqueueing 20 calls


def _commit() -> str:
    if os.environ.get("COMMFUSE_COMMIT"):
        return os.environ["COMMFUSE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(__file__)).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def time_us(fn, warmup: int = 5, iters: int = 20) -> float:
    """Median per-call GPU time in µs, max over ranks (this process's alone without a group).

    Calls run back to back on the stream behind a GPU sleep long enough for the host to enqueue
    them all, so the events time the device work, not Python's launch overhead.
    """
    grouped = dist.is_available() and dist.is_initialized()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if grouped:
        dist.barrier()
    torch.cuda._sleep(SLEEP_CYCLES)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    med = torch.tensor(statistics.median(s.elapsed_time(e) for s, e in events) * 1000.0, device="cuda")
    if grouped:
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return med.item()


def host_us(fn, n: int = 100, sleep_cycles: int = int(3e9)) -> float:
    """Host µs per call of ``fn`` while the GPU is kept busy (a long GPU sleep queued first), so
    only the host's work is timed; the ranks start together (collective ``fn`` stay paired). A
    ``fn`` of many launches can fill CUDA's launch queue behind the sleep, and then this times the
    sleep: keep ``n`` x launches per call under ~1000."""
    fn()
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda._sleep(sleep_cycles)
    start = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - start) / n * 1e6
    torch.cuda.synchronize()
    return us


@contextlib.contextmanager
def settings(values: dict):
    """Set environment variables (``None``: unset) for the block, then restore what was there:
    commfuse reads its settings per call, so a forced path or knob holds for the calls inside."""
    def apply(mapping):
        for key, value in mapping.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    old = {key: os.environ.get(key) for key in values}
    try:
        apply(values)
        yield
    finally:
        apply(old)


def _forced(algo: str | None):
    """``COMMFUSE_ALGO=algo`` for the block (``None``: the default dispatch)."""
    return settings({"COMMFUSE_ALGO": algo or None})


def _try(fn):
    try:
        return time_us(fn)
    except Exception as exc:  # a peer that fails on this shape is reported, not fatal
        if dist.get_rank() == 0:
            print(f"    (peer failed: {type(exc).__name__}: {str(exc)[:120]})", file=sys.stderr)
        torch.cuda.synchronize()
        return None


def _iris_peer(a, b):
    try:
        from commfuse.kernels.symm import iris_context

        ctx = iris_context()
        ia = ctx.zeros(a.shape, dtype=a.dtype)
        ib = ctx.zeros(b.shape, dtype=b.dtype)
        ic = ctx.zeros((a.shape[0], b.shape[1]), dtype=a.dtype)
        ia.copy_(a)
        ib.copy_(b)
    except Exception as exc:
        if dist.get_rank() == 0:
            print(f"    (iris peer unavailable: {type(exc).__name__}: {str(exc)[:120]})", file=sys.stderr)
        return None
    return _try(lambda: ctx.ops.matmul_all_reduce(ic, ia, ib))


#: Extra alternating rounds of unfused and commfuse's default per shape: their first timings are
#: seconds apart, yet a GEMM-bound shape's clocks drift a few % in between (8192x8192x28672,
#: whose default *is* the unfused computation, measured 0.95x at f43999e).
SETTLE_ROUNDS = 2


def _settle(t: dict, unfused, commfuse_call) -> None:
    """Re-time unfused and commfuse's default in ``SETTLE_ROUNDS`` alternating rounds; each
    becomes the median of its timings (all kept in ``t[...]_rounds``)."""
    rounds = {"unfused": [t["unfused"]], "commfuse_default": [t["commfuse_default"]]}
    for _ in range(SETTLE_ROUNDS):
        rounds["unfused"].append(time_us(unfused))
        with _forced(None):
            rounds["commfuse_default"].append(time_us(commfuse_call))
    for key, times in rounds.items():
        t[f"{key}_rounds"] = times
        t[key] = statistics.median(times)


def _matmul_then(m, k, n, dtype, name, collective):
    """Operands, and the times of mm alone, the NCCL collective alone and the two in sequence."""
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(k, n, device="cuda", dtype=dtype) / k ** 0.5
    partial = torch.mm(a, b)
    t = {"mm": time_us(lambda: torch.mm(a, b))}
    t[name] = time_us(lambda: funcol.wait_tensor(collective(partial)))
    t["unfused"] = time_us(lambda: funcol.wait_tensor(collective(torch.mm(a, b))))
    return a, b, partial, t


def bench_mm_all_reduce(m, k, n, dtype, group):
    from commfuse.kernels import exchange, symm

    gname, world = group.group_name, group.size()
    a, b, partial, t = _matmul_then(m, k, n, dtype, "nccl_ar", lambda x: funcol.all_reduce(x, "sum", group))
    ws = symm.workspace(gname, m * n * dtype.itemsize, a.device)
    out = torch.empty_like(partial)
    for algo in ("one_shot", "two_shot"):
        def exch(algo=algo):
            epoch, parity = ws.next_epoch()
            exchange.all_reduce(ws, ws.data(parity, (m, n), dtype), out, epoch, algo, 1)
        t[f"{algo}_ar"] = time_us(exch)
    lane_fits = m * n * dtype.itemsize <= symm.graph_data_bytes()
    from commfuse.kernels import dispatch, tiles

    fusable = dispatch.fused_unsupported(m, k, n, dtype, world) is None
    if fusable:  # the fused kernel's GEMM alone, against cuBLAS's
        t["tile_mm"] = time_us(lambda: tiles.matmul(a, b, None, dispatch.tile_config(m, k, n), out=out,
                                                    programs=ws.max_programs))
    few_rows = dispatch.split_k_unsupported(m, k, n, dtype, world) is None
    for algo in ((None, "one_shot", "two_shot") + (("graph",) if lane_fits else ()) + (("fused",) if fusable else ())
                 + (("split_k",) if few_rows else ())):
        with _forced(algo):
            t[f"commfuse_{algo or 'default'}"] = time_us(lambda: torch.ops.commfuse.mm_all_reduce(a, b, None, gname))
    ws_partial = ws.data(1, (m, n), dtype)
    t["mm_into_symm"] = time_us(lambda: torch.mm(a, b, out=ws_partial))
    if m >= 128:
        for chunks in ("2", "4", "8"):
            with settings({"COMMFUSE_ALGO": "ce_overlap", "COMMFUSE_CE_CHUNKS": chunks}):
                t[f"commfuse_ce_overlap_{chunks}"] = time_us(lambda: torch.ops.commfuse.mm_all_reduce(a, b, None, gname))
    if m >= 1024 and env.flag("COMMFUSE_BENCH_OVERLAP", True):
        for cfg in ("2x32", "4x32", "4x16", "8x32", "4x66"):
            with settings({"COMMFUSE_ALGO": "overlap", "COMMFUSE_OVERLAP": cfg}):
                t[f"commfuse_overlap_{cfg}"] = time_us(lambda: torch.ops.commfuse.mm_all_reduce(a, b, None, gname))
    peers = {}
    try:
        import torch.distributed._symmetric_memory as symm_mem

        sbuf = symm_mem.empty((m, n), dtype=dtype, device="cuda")
        symm_mem.rendezvous(sbuf, gname)

        def torch_two_shot():
            torch.mm(a, b, out=sbuf)
            torch.ops.symm_mem.two_shot_all_reduce_(sbuf, "sum", gname)

        def torch_one_shot():
            torch.mm(a, b, out=sbuf)
            return torch.ops.symm_mem.one_shot_all_reduce(sbuf, "sum", gname)

        peers["torch_symm_two_shot"] = _try(torch_two_shot)
        peers["torch_symm_one_shot"] = _try(torch_one_shot)
    except Exception as exc:
        if dist.get_rank() == 0:
            print(f"    (torch symm_mem peers unavailable: {exc})", file=sys.stderr)
    if env.flag("COMMFUSE_BENCH_IRIS", False):  # Iris's own fused op on its heap
        peers["iris_matmul_all_reduce"] = _iris_peer(a, b)
    _settle(t, lambda: funcol.wait_tensor(funcol.all_reduce(torch.mm(a, b), "sum", group)),
            lambda: torch.ops.commfuse.mm_all_reduce(a, b, None, gname))
    best_exchange = min(t["nccl_ar"], t["one_shot_ar"], t["two_shot_ar"])
    return dict(op="mm_all_reduce", M=m, K=k, N=n, dtype=str(dtype).replace("torch.", ""), world=world,
                unfused_us=t["unfused"], commfuse_us=t["commfuse_default"],
                floor_us=max(t["mm"], best_exchange), parts=t, peers=peers)


def sweep_setup():
    """The exploration sweeps' start under torchrun: this rank's GPU, an NCCL group, and cuBLAS
    without reduced-precision split-K sums (they would hide or mimic the kernels' errors)."""
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    return dist.group.WORLD, dist.get_rank()


def sweep_check(run, m: int, k: int, n: int, group, bias: bool, transposed: bool, what: str) -> float:
    """The sweeps' correctness check of an all-reducing ``run(a, b, bias, out)``: relative error
    against the fp32 sum over ranks of ``a @ b + bias`` on fresh data, ``out`` poisoned first;
    ``inf`` if the ranks' outputs differ in any bit. ``transposed``: ``b`` is a linear layer's
    weight ``W.t()``, else row-major."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    b = w.t() if transposed else w.t().contiguous()
    bb = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    ref = a.float() @ b.float() + (bb.float() if bias else 0)
    dist.all_reduce(ref, group=group)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    run(a, b, bb, out)
    torch.cuda.synchronize()
    from commfuse.kernels.sync import ErrorWord

    ErrorWord.check(what)
    same = out.clone()
    dist.broadcast(same, 0, group=group)
    if not torch.equal(same, out):
        return float("inf")
    return ((out.float() - ref).norm() / ref.norm()).item()


def sweep_variant(errs: dict, times: dict, name: str, check, runs: dict) -> None:
    """One variant of a sweep: ``errs[name] = check()``, then ``times[key]`` of each of ``runs``
    (key -> function); a variant that raises (a config that does not fit, a peer that failed) is
    recorded, not fatal."""
    try:
        errs[name] = check()
        for key, run in runs.items():
            times[key] = time_us(run)
    except Exception as exc:
        errs[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
        torch.cuda.synchronize()


def sweep_trace(ws, launch, traced) -> float:
    """The trace scripts' timing: ``launch`` (a fused kernel's ``prepare`` result) timed with
    ``time_us``, then three calls back to back and ``traced`` (the same call, recording its trace)
    after them, so the trace shows a call that follows others; returns the time in us."""
    from commfuse.kernels.sync import ErrorWord

    us = time_us(lambda: launch(*ws.next_epoch()))
    for _ in range(3):
        launch(*ws.next_epoch())
    traced(*ws.next_epoch())
    torch.cuda.synchronize()
    ErrorWord.check("a traced call")
    return us


#: Bin width of the trace scripts' busy profiles.
TRACE_BIN_NS = 2000


def trace_buffer(programs: int = 1024) -> torch.Tensor:
    """Room for a fused kernel's trace of up to ``programs`` programs (more than any grid here);
    the kernels' launchers mark every slot unused (-1) before each traced launch."""
    from commfuse.kernels import sync

    return torch.empty(programs * sync.TRACE_SLOTS, dtype=torch.int64, device="cuda")


def trace_rows(trace: torch.Tensor) -> tuple[list, int]:
    """A fused kernel's trace (``sync.TRACE_SLOTS`` int64 per program, -1 unused) as one list per
    program, and the earliest program start (ns)."""
    from commfuse.kernels import sync

    rows = trace.view(-1, sync.TRACE_SLOTS).tolist()
    return rows, min(row[0] for row in rows if row[0] >= 0)


def trace_positions(row: list) -> list[tuple[int, int, int]]:
    """(position, middle time, end) of every tile one program's row of a trace recorded."""
    from commfuse.kernels import sync

    out = []
    for j in range(sync.TRACE_TILES):
        pos, middle, end = row[2 + 3 * j:5 + 3 * j]
        if pos < 0:
            break
        out.append((pos, middle, end))
    return out


def trace_bins(spans: list, t0: int, last: int | None = None) -> list[int]:
    """Per ``TRACE_BIN_NS`` bin from ``t0`` to ``last`` (default: the spans' last end), how many
    (begin, end) spans cover more than half of it."""
    last = max(end for _, end in spans) if last is None else last
    counts = [0] * (int((last - t0) // TRACE_BIN_NS) + 1)
    for begin, end in spans:
        for b in range(int((begin - t0) // TRACE_BIN_NS), int((end - t0) // TRACE_BIN_NS) + 1):
            lo, hi = t0 + b * TRACE_BIN_NS, t0 + (b + 1) * TRACE_BIN_NS
            if min(hi, end) - max(lo, begin) > TRACE_BIN_NS / 2:
                counts[b] += 1
    return counts


def spread(values: list) -> list | None:
    """[min, median, max] of ``values``, rounded to 0.1, or None when there are none."""
    return [round(x, 1) for x in (min(values), statistics.median(values), max(values))] if values else None


def sweep_record(records: list, rec: dict) -> None:
    """Keep one sweep record; rank 0 prints it; the ranks meet before the next."""
    records.append(rec)
    if dist.get_rank() == 0:
        print(rec, flush=True)
    dist.barrier()


def sweep_details(times: dict, errs: dict) -> None:
    """Rank 0's detail lines of one sweep shape: every time, and every variant's error."""
    print("   ", {key: round(v, 1) for key, v in times.items()}, flush=True)
    print("    errors", {key: (f"{v:.1e}" if isinstance(v, float) else v) for key, v in errs.items()},
          flush=True)


def sweep_finish(records: list, out: str | None) -> int:
    """Rank 0 writes the sweep's records; every rank leaves the group."""
    if dist.get_rank() == 0 and out:
        with open(out, "w") as f:
            json.dump(records, f, indent=1)
    dist.destroy_process_group()
    return 0


def bench_all_gather_mm(m, k, n, dtype, group):
    from commfuse.kernels import dispatch, exchange, symm

    gname, world = group.group_name, group.size()
    shard = torch.randn(m // world, k, device="cuda", dtype=dtype)
    b = torch.randn(k, n, device="cuda", dtype=dtype) / k ** 0.5
    full = torch.randn(m, k, device="cuda", dtype=dtype)
    t = {}
    t["mm"] = time_us(lambda: torch.mm(full, b))
    t["nccl_ag"] = time_us(lambda: funcol.wait_tensor(funcol.all_gather_tensor(shard, 0, group)))
    t["unfused"] = time_us(lambda: torch.mm(funcol.wait_tensor(funcol.all_gather_tensor(shard, 0, group)), b))
    ws = symm.workspace(gname, shard.numel() * dtype.itemsize, shard.device)
    gathered = torch.empty_like(full)

    def exch():
        epoch, parity = ws.next_epoch()
        mine = ws.data(parity, shard.shape, dtype)
        exchange.gather(ws, mine, gathered, 1, shard.numel(), epoch, 2)
    t["symm_ag"] = time_us(exch)
    with _forced(None):
        t["commfuse_default"] = time_us(lambda: torch.ops.commfuse.all_gather_mm(shard, b, None, 0, world, gname, False))
    fusable = dispatch.fused_unsupported(m, k, n, dtype, world, gather=True) is None
    for algo in ("symm", "overlap") + (("fused",) if fusable else ()):
        with _forced(algo):
            t[f"commfuse_{algo}"] = time_us(lambda: torch.ops.commfuse.all_gather_mm(shard, b, None, 0, world, gname, False))
    peers = {}
    peers["torch_fused_all_gather_matmul"] = _try(
        lambda: torch.ops.symm_mem.fused_all_gather_matmul(shard, [b], 0, gname))
    _settle(t, lambda: torch.mm(funcol.wait_tensor(funcol.all_gather_tensor(shard, 0, group)), b),
            lambda: torch.ops.commfuse.all_gather_mm(shard, b, None, 0, world, gname, False))
    return dict(op="all_gather_mm", M=m, K=k, N=n, dtype=str(dtype).replace("torch.", ""), world=world,
                unfused_us=t["unfused"], commfuse_us=t["commfuse_default"],
                floor_us=max(t["mm"], min(t["nccl_ag"], t["symm_ag"])), parts=t, peers=peers)


def tune(group, dtype) -> None:
    """Exchange kernels alone over (block, programs, warps) at a few sizes: picks the defaults."""
    from commfuse.kernels import exchange, symm

    rows = []
    for mib in (1, 8, 32, 128):
        n = (mib << 20) // dtype.itemsize
        ws = symm.workspace(group.group_name, n * dtype.itemsize, torch.device("cuda"))
        out = torch.empty(n, device="cuda", dtype=dtype)
        ws.data(0, (n,), dtype).normal_()
        ws.data(1, (n,), dtype).normal_()
        nccl_in = torch.randn(n, device="cuda", dtype=dtype)
        row = {"MiB": mib, "nccl": time_us(lambda: funcol.wait_tensor(funcol.all_reduce(nccl_in, "sum", group)))}
        for algo in ("one_shot", "two_shot", "gather"):
            for block in (2048, 4096, 8192):
                for progs in (32, 66, 132):
                    for warps in (8, 16):
                        def call():
                            epoch, parity = ws.next_epoch()
                            buf = ws.data(parity, (n,), dtype)
                            if algo == "gather":
                                half = buf[: n // group.size()]
                                exchange.gather(ws, half, out, 1, half.numel(), epoch, 2, block, progs, warps)
                            else:
                                exchange.all_reduce(ws, buf, out, epoch, algo, 1, block, progs, warps)
                        row[f"{algo}/b{block}/p{progs}/w{warps}"] = time_us(call)
        rows.append(row)
        if dist.get_rank() == 0:
            best = {a: min((v, k) for k, v in row.items() if k.startswith(a)) for a in ("one_shot", "two_shot", "gather")}
            print(f"{mib} MiB: nccl {row['nccl']:.1f} µs; " + "; ".join(f"{v[1]} {v[0]:.1f}" for v in best.values()), flush=True)
    if dist.get_rank() == 0:
        print(json.dumps(rows))


def bench_mm_reduce_scatter(m, k, n, dtype, group):
    from commfuse.kernels import exchange, symm

    gname, world = group.group_name, group.size()
    a, b, _, t = _matmul_then(m, k, n, dtype, "nccl_rs",
                              lambda x: funcol.reduce_scatter_tensor(x, "sum", 0, group))
    ws = symm.workspace(gname, m * n * dtype.itemsize, a.device)
    out = torch.empty(m // world, n, device="cuda", dtype=dtype)

    def exch():
        epoch, parity = ws.next_epoch()
        exchange.reduce_scatter(ws, ws.data(parity, (m, n), dtype), out, 1, m * n // world, epoch, 3)
    t["symm_rs"] = time_us(exch)
    from commfuse.kernels import dispatch

    fusable = dispatch.fused_unsupported(m, k, n, dtype, world, scatter=True) is None
    for algo in (None, "symm", "ce_overlap") + (("fused",) if fusable else ()):  # each path forced
        with _forced(algo):
            t[f"commfuse_{algo or 'default'}"] = time_us(
                lambda: torch.ops.commfuse.mm_reduce_scatter(a, b, None, [m, n], 0, world, gname))
    peers = {"torch_fused_matmul_reduce_scatter": _try(
        lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, gname))}
    _settle(t, lambda: funcol.wait_tensor(funcol.reduce_scatter_tensor(torch.mm(a, b), "sum", 0, group)),
            lambda: torch.ops.commfuse.mm_reduce_scatter(a, b, None, [m, n], 0, world, gname))
    return dict(op="mm_reduce_scatter", M=m, K=k, N=n, dtype=str(dtype).replace("torch.", ""), world=world,
                unfused_us=t["unfused"], commfuse_us=t["commfuse_default"],
                floor_us=max(t["mm"], min(t["nccl_rs"], t["symm_rs"])), parts=t, peers=peers)


BENCHES = {"mm_all_reduce": bench_mm_all_reduce, "all_gather_mm": bench_all_gather_mm,
           "mm_reduce_scatter": bench_mm_reduce_scatter}


def _table(records) -> str:
    lines = ["| op | M | K | N | unfused µs | commfuse µs | floor µs | speed-up | of floor | best peer | best |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        peers = {k: v for k, v in r["peers"].items() if v}
        best = min(peers.items(), key=lambda kv: kv[1]) if peers else None
        best_s = f"{best[0]} {best[1]:.0f} ({r['unfused_us'] / best[1]:.2f}x)" if best else "-"
        fastest = min({"unfused": r["unfused_us"], "commfuse": r["commfuse_us"], **peers}.items(),
                      key=lambda kv: kv[1])[0]
        lines.append(f"| {r['op']} | {r['M']} | {r['K']} | {r['N']} | {r['unfused_us']:.0f} | "
                     f"{r['commfuse_us']:.0f} | {r['floor_us']:.0f} | {r['unfused_us'] / r['commfuse_us']:.2f}x | "
                     f"{r['commfuse_us'] / r['floor_us']:.2f} | {best_s} | {fastest} |")
    for op in sorted({r["op"] for r in records}):
        ratios = [r["unfused_us"] / r["commfuse_us"] for r in records if r["op"] == op]
        geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
        lines.append(f"\n{op}: geomean speed-up {geo:.3f}x over {len(ratios)} shapes, min {min(ratios):.3f}x, max {max(ratios):.3f}x")
    return "\n".join(lines)


def plot(json_path: str, png_path: str) -> None:
    """Speed-up over unfused per shape (and the floor's bound), one bar group per op."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        records = json.load(f)
    ops = list(dict.fromkeys(r["op"] for r in records))
    fig, axes = plt.subplots(len(ops), 1, figsize=(12, 3.2 * len(ops)), squeeze=False)
    for ax, op in zip(axes[:, 0], ops):
        rs = [r for r in records if r["op"] == op]
        x = range(len(rs))
        ax.bar(x, [r["unfused_us"] / r["commfuse_us"] for r in rs], label="speed-up (unfused / commfuse)")
        ax.plot(x, [r["unfused_us"] / r["floor_us"] for r in rs], "k_", markersize=14, label="floor bound")
        ax.axhline(1.0, color="red", linewidth=0.8)
        ax.set_xticks(list(x), [f"{r['M']}x{r['K']}x{r['N']}" for r in rs], rotation=60, fontsize=7)
        ax.set_ylabel("speed-up")
        ax.set_title(f"{op} (world {rs[0]['world']}, {rs[0]['dtype']}, commit {rs[0].get('commit')})")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


def table(json_path: str) -> str:
    with open(json_path) as f:
        return _table(json.load(f))


def main(argv=None, prog: str = "python -m commfuse.bench") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["ops", "model", "tune", "plot", "table", "model-table", "model-plot"])
    p.add_argument("files", nargs="*", help="plot: OPS_JSON OUT_PNG; table: OPS_JSON; model-table: "
                   "MODEL_JSON...; model-plot: MODEL_JSON... OUT_PNG")
    p.add_argument("--ops", default="mm_all_reduce,all_gather_mm,mm_reduce_scatter")
    p.add_argument("--shapes", choices=["default", "square"], default="default",
                   help="square: M=K=N from 256 to 4096 in steps of 128")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--limit", type=int, default=0, help="only the first N shapes per op (smoke runs)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<machine>/ops.json)")
    p.add_argument("--models", default="dtensor,sp,hooks",
                   help="model: which TP splits (also: hf, transformers' LlamaForCausalLM)")
    p.add_argument("--modes", default="prefill,decode,decode_cg,train",
                   help="model: which modes (decode_cg: decode under CUDA graphs, GPUs only; "
                   "also loss: loss curves against eager)")
    p.add_argument("--decode-batches", default="4,32", help="model: decode batch sizes")
    p.add_argument("--context", type=int, default=2048, help="model: KV-cache length decoding starts at")
    p.add_argument("--backends", default="eager,inductor,inductor_mptp,commfuse,floor")
    p.add_argument("--layers", type=int, default=4, help="model: decoder layers")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3,
                   help="model: alternating rounds over the backends (--iters steps split among them)")
    p.add_argument("--loss-steps", type=int, default=50, help="model: training steps of the loss mode")
    p.add_argument("--small", action="store_true", help="model: small sizes (the default on CPU)")
    p.add_argument("--call-times", type=int, default=0, metavar="STEPS",
                   help="model: after the timed rounds, STEPS more commfuse steps with every commfuse call "
                   "timed by CUDA events, each call's median against the same call alone (GPUs; prefill "
                   "and train)")
    args = p.parse_args(argv)
    if args.what in ("ops", "tune", "model"):  # GPU and torchrun problems as one line, not a traceback
        from commfuse.demo import exit_unless_launched

        exit_unless_launched(f"{prog} {args.what}", f"-m commfuse.bench {args.what}", gpus=args.what != "model")
    if args.what == "model":
        from commfuse import bench_model

        return bench_model.main(args)
    if args.what == "plot":
        if len(args.files) != 2:
            p.error("plot takes OPS_JSON OUT_PNG")
        plot(*args.files)
        return 0
    if args.what == "model-table":
        from commfuse import bench_model

        if not args.files:
            p.error("model-table takes one or more model JSON files")
        print(bench_model.table(args.files))
        return 0
    if args.what == "model-plot":
        from commfuse import bench_model

        if len(args.files) < 2:
            p.error("model-plot takes one or more model JSON files and OUT_PNG")
        bench_model.plot(args.files[:-1], args.files[-1])
        return 0
    if args.what == "table":
        if len(args.files) != 1:
            p.error("table takes OPS_JSON")
        print(table(args.files[0]))
        return 0

    import commfuse  # noqa: F401

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    group, rank = dist.group.WORLD, dist.get_rank()
    dtype = getattr(torch, args.dtype)
    if args.what == "tune":
        tune(group, dtype)
        dist.destroy_process_group()
        return 0
    todo = []
    for op in args.ops.split(","):
        if args.shapes == "square":
            shapes = [(s, s, s) for s in range(256, 4097, 128)]
        else:
            shapes = MM_AR_SHAPES if op == "mm_all_reduce" else AG_MM_SHAPES  # RS mirrors AG
        shapes = shapes[:args.limit] if args.limit else shapes
        todo += [(op, s) for s in shapes]
    records = []
    for i, (op, (m, k, n)) in enumerate(todo):
        start = time.time()
        rec = BENCHES[op](m, k, n, dtype, group)
        rec["commit"] = _commit()
        records.append(rec)
        if rank == 0:
            print(f"[{i + 1}/{len(todo)}] {op} {m}x{k}x{n}: unfused {rec['unfused_us']:.0f} µs, commfuse "
                  f"{rec['commfuse_us']:.0f} µs ({rec['unfused_us'] / rec['commfuse_us']:.2f}x), floor "
                  f"{rec['floor_us']:.0f} µs [{time.time() - start:.1f} s]", file=sys.stderr, flush=True)
    if rank == 0:
        machine = f"h200x{dist.get_world_size()}" if "H200" in torch.cuda.get_device_name() else socket.gethostname()
        out = args.out or os.path.join("benchmarks", "results", machine, "ops.json")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump(records, f, indent=1)
        print(_table(records))
        print(f"\nwrote {out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
