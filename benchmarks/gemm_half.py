"""The GEMM half of the fused tile kernels against cuBLAS, on one GPU, L2 flushed before each call.

    python benchmarks/gemm_half.py --out gemm_half.json [--world 2] [--iters 15] [--alternatives]
    python benchmarks/gemm_half.py --kernels --ops mm_all_reduce,mm_reduce_scatter,all_gather_mm,split_k

For each shape of the op benchmark's table (``commfuse.tools.bench``), at one rank's share of a
group of ``--world`` ranks, this times ``torch.mm`` on nn.Linear's operands (the weight a
transposed view) and the tile kernels' GEMM (``kernels.tiles.matmul``: the same tile order, K loop
and epilogue helpers as the fused kernels, without any exchange) with the tiling the path would
use: the fused all-reduce's (``ar_fused.tile_config``), its reduce-scatter form's and the fused
all-gather's (``ag_fused.tile_config``). Per shape: both medians and their ratio; per op: the
geomean of tile ÷ cuBLAS at M >= 1024, where the GEMM dominates the call. ``--alternatives`` also
times a few other tilings per shape and reports the best, to show what choosing tiles per shape
class could gain. Every result is checked against an fp32 product first (output poisoned).

``--fp8 tensorwise|rowwise`` times the FP8 form instead: ``torch._scaled_mm`` on e4m3 operands
(nn.Linear's weight transposed, bf16 output, ``--slow-accum`` for ``use_fast_accum=False``)
against the tile GEMM with the same scales in its epilogue (``kernels.tiles.scaled_matmul``),
with the path's tiling in K blocks of 128 bytes (``ar_fused.FP8_BK``, what the FP8 ops' fused
paths take) and, with ``--alternatives``, ``FP8_ALTERNATIVES``.

``--queued`` also times each call with its flush queued behind a GPU sleep: the device's time
alone, where the default timing (the host launches each call after the flush) also shows a
launch that takes longer than the kernel.

``--kernels`` times the fused kernels themselves instead of ``tiles.matmul``: the all-reduce
kernel, its reduce-scatter form, the all-gather kernel and the split-K kernel (``--ops`` may name
``split_k``: the all-reduce's shapes it takes, at most ``SPLIT_K_ROWS`` rows), each with the
tiling its path picks for a group of ``--world`` ranks but launched in a group of one rank. There
the exchange is switched off by the group itself: no peer, so no pushes to another GPU, no waits,
no reducers' copies; what is left is the kernel's GEMM, its epilogue, its tile order and the
stores of its own tiles. The all-gather pushes as its path would (the copy engines from 2 MiB
shards, which with no peer push nothing, else pusher programs, idle here) and copies its own
rows into the workspace before the kernel reads them there: all M rows in a group of one, where
a rank of ``--world`` copies M / world. Each is checked against fp32 first (output poisoned) and
timed queued as well as after the flush; with ``--alternatives`` the fused kernels also run
``KERNEL_ALTERNATIVES`` (queued), each checked first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

import torch

#: Other tilings tried with ``--alternatives`` (Hopper, bf16): wide, square and tall tiles.
ALTERNATIVES = ("128x128x64s4w8g8r0", "128x256x64s4w8g8r0", "256x128x64s3w8g8r0", "64x256x64s4w4g8r0",
                "128x128x128s3w8g8r0")

#: Other tilings of the FP8 form (K blocks of 128 bytes, as bf16's 64 elements).
FP8_ALTERNATIVES = ("128x128x128s4w8g8r0", "128x256x128s4w8g8r0", "256x128x128s3w8g8r0", "64x256x128s4w4g8r0",
                    "128x128x256s3w8g8r0")


def _flush_buffer() -> torch.Tensor:
    # larger than the H200's 60 MB L2, so each timed call reads its operands from HBM
    return torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``out``'s error against the fp32 reference, relative to the reference's norm."""
    return ((out.float() - ref).norm() / ref.norm()).item()


def time_flushed(fn, flush: torch.Tensor, iters: int) -> float:
    """Median µs of ``fn`` over ``iters`` calls, each after the L2 is overwritten (CUDA events
    around the call only)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def _fp8_operands(a: torch.Tensor, weight: torch.Tensor, scales: str):
    """``a`` and ``weight`` quantised to e4m3 as torchao's float8 does (amax to the format's
    largest value): the FP8 operands (``b`` the weight's transpose, column-major as
    ``_scaled_mm`` takes it) and the float32 multipliers that undo the quantisation, one per
    tensor or one per row of ``a`` and column of ``b``."""
    fp8 = torch.float8_e4m3fn
    top = torch.finfo(fp8).max
    if scales == "rowwise":
        sa = a.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / top
        sb = weight.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12).t() / top
    else:
        sa = a.abs().amax().float().clamp(min=1e-12) / top
        sb = weight.abs().amax().float().clamp(min=1e-12) / top
    qa = (a.float() / sa).to(fp8)
    qb = (weight.float() / (sb.t() if scales == "rowwise" else sb)).to(fp8).t()
    return qa, qb, sa, sb


def time_flushed_queued(fn, flush: torch.Tensor, iters: int) -> float:
    """``time_flushed``'s median with every call and its flush queued behind a GPU sleep first, so
    the events time the device alone: a call whose host launch takes longer than its kernel shows
    there as the launch, here as the kernel."""
    from commfuse.tools.timing import SLEEP_CYCLES

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1000.0 for s, e in events)


#: The most rows the split-K kernel is timed at (the rules send it few rows).
SPLIT_K_ROWS = 256


def _one_rank_group():
    """A group of one rank on GPU 0, its facts agreed through one call of the op; returns
    ``workspace(nbytes)``: commfuse's workspace for it with at least ``nbytes`` per parity."""
    import os

    import torch.distributed as dist

    import commfuse  # noqa: F401  (registers the ops)
    from commfuse.runtime import groups

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29537")
    dist.init_process_group("nccl", rank=0, world_size=1)
    name = dist.group.WORLD.group_name
    x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
    torch.ops.commfuse.mm_all_reduce(x, x.t().contiguous(), None, name)
    group = groups.get(name)
    return lambda nbytes: groups.workspace(group, nbytes, torch.device("cuda", 0))


_SIDE: dict = {}  # the copy engines' side stream of ``fused_kernel``'s all-gathers


def fused_kernel(op: str, m: int, k: int, n: int, world: int, a, b, out, workspace, tile=None):
    """``op``'s fused kernel (``split_k``: the split-K kernel) with the tiling of its path for a
    group of ``world`` (or ``tile``, not for split-K), prepared in a group of one (``workspace``,
    ``_one_rank_group``); returns (a function that launches it once, with the workspace's next
    epoch, the tiling's text)."""
    from commfuse.kernels import fused_all_gather, fused_all_reduce, fused_split_k
    from commfuse.runtime.paths import ag_fused, ar_fused, rs_fused, split_k
    from commfuse.runtime.paths.base import Call

    dt = a.dtype
    spec_op = "mm_all_reduce" if op == "split_k" else op
    call, alone = Call(spec_op, m, k, n, dt, world), Call(spec_op, m, k, n, dt, 1)
    if op == "split_k":
        ws = workspace(split_k.plan_bytes(alone))
        cfg = split_k.config(call, ws.max_programs)
        launch, tiling = fused_split_k.prepare(ws, a, b, None, out, cfg), str(cfg)
    elif op == "all_gather_mm":
        cfg = ag_fused.FUSED.config(call, None)
        cfg = dataclasses.replace(cfg, tile=tile or cfg.tile)
        ws = workspace(ag_fused.fused_bytes(alone))
        # the path's push: the copy engines (no pusher programs) from a side stream, else pushers
        side = _SIDE.setdefault("stream", torch.cuda.Stream()) if cfg.push == "ce" else None
        launch = fused_all_gather.prepare(ws, a, b, None, None, out, cfg.tile, side=side, pushers=cfg.pushers)
        tiling = str(cfg.tile)
    else:
        scatter = op == "mm_reduce_scatter"
        cfg = (rs_fused.FUSED if scatter else ar_fused.FUSED).config(call, None)
        cfg = dataclasses.replace(cfg, tile=tile or cfg.tile)
        ws = workspace(ar_fused.fused_bytes(alone, scatter))
        launch = fused_all_reduce.prepare(ws, a, b, None, out, cfg.tile, scatter, cfg.options)
        tiling = str(cfg.tile)
    return (lambda: launch(*ws.next_epoch())), tiling


#: Tilings tried in the fused kernels with ``--kernels --alternatives``: the tile GEMM's, and two
#: programs per SM where the tiles' stages fit twice in shared memory.
KERNEL_ALTERNATIVES = tuple(t.replace("r0", "r0o1") for t in ALTERNATIVES) + ("128x128x64s3w8g8r0o2",
                                                                            "64x256x64s3w4g8r0o2")


def _kernel_alternatives(op, m, k, n, args, a, b, out, ref, workspace, flush, rec) -> tuple[float, str]:
    """Time ``op``'s kernel with each of ``KERNEL_ALTERNATIVES`` (queued: the device's time),
    each checked against fp32 first; fills ``rec`` and returns (best µs, its tiling)."""
    from commfuse.kernels.sizes.tiles import TileConfig

    best = (rec["kernel_queued_us"], rec["tiling"])
    for text in KERNEL_ALTERNATIVES:
        try:
            out.fill_(float("nan"))
            run, _ = fused_kernel(op, m, k, n, args.world, a, b, out, workspace, TileConfig.parse(text))
            run()
            err = _relative_error(out, ref)
            if not err < 1e-2:
                rec.setdefault("alt_wrong", {})[text] = err
                continue
            us = time_flushed_queued(run, flush, args.iters)
        except Exception as exc:  # a tiling the kernel or the device cannot fit
            rec.setdefault("alt_failed", {})[text] = f"{type(exc).__name__}: {exc}"[:200]
            continue
        rec.setdefault("alt_queued_us", {})[text] = us
        best = min(best, (us, text))
    rec["best_queued_us"], rec["best_tiling"] = best
    return best


def time_kernels(args, flush) -> tuple[list, dict]:
    """``--kernels`` (module docstring): records and the per-op summary."""
    from commfuse.tools.bench import shapes_of

    workspace = _one_rank_group()
    dt, records = torch.bfloat16, []
    print(f"{'kernel':18s} {'M':>6s} {'K':>6s} {'N':>6s} {'tiling':>24s} {'cuBLAS us':>10s} {'kernel us':>10s} "
          f"{'ratio':>6s} {'queued cuBLAS/kernel us':>24s} {'ratio':>6s}", flush=True)
    for op in args.ops.split(","):
        shapes = shapes_of("mm_all_reduce" if op == "split_k" else op)
        if op == "split_k":
            shapes = [s for s in shapes if s[0] <= SPLIT_K_ROWS]
        for m, k, n in shapes:
            a = torch.randn(m, k, device="cuda", dtype=dt)
            b = (torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5).t()
            out = torch.full((m, n), float("nan"), device="cuda", dtype=dt)
            rec = dict(op=op, M=m, K=k, N=n, world=args.world)
            try:
                run, rec["tiling"] = fused_kernel(op, m, k, n, args.world, a, b, out, workspace)
                run()
            except Exception as exc:  # a shape the kernel (or the workspace of one rank) cannot take
                rec["skipped"] = f"{type(exc).__name__}: {exc}"[:300]
                print(f"{op:18s} {m:6d} {k:6d} {n:6d}  skipped: {rec['skipped']}", flush=True)
                records.append(rec)
                continue
            ref = a.float() @ b.float()
            err = _relative_error(out, ref)
            if not err < 1e-2:  # recorded, not timed; the run goes on and exits non-zero
                rec["wrong"] = err
                print(f"{op:18s} {m:6d} {k:6d} {n:6d}  WRONG: relative error {err:.3g} ({rec['tiling']})", flush=True)
                records.append(rec)
                continue

            def library(out=out):
                torch.mm(a, b, out=out)

            rec.update(kernel_err=err, cublas_us=time_flushed(library, flush, args.iters),
                       kernel_us=time_flushed(run, flush, args.iters),
                       cublas_queued_us=time_flushed_queued(library, flush, args.iters),
                       kernel_queued_us=time_flushed_queued(run, flush, args.iters))
            rec["ratio"] = rec["kernel_us"] / rec["cublas_us"]
            rec["queued_ratio"] = rec["kernel_queued_us"] / rec["cublas_queued_us"]
            line = (f"{op:18s} {m:6d} {k:6d} {n:6d} {rec['tiling']:>24s} {rec['cublas_us']:10.1f} "
                    f"{rec['kernel_us']:10.1f} {rec['ratio']:6.3f} "
                    f"{rec['cublas_queued_us']:11.1f}/{rec['kernel_queued_us']:<11.1f} {rec['queued_ratio']:6.3f}")
            if args.alternatives and op != "split_k":
                best = _kernel_alternatives(op, m, k, n, args, a, b, out, ref, workspace, flush, rec)
                line += f"  best {best[1]} {best[0] / rec['cublas_queued_us']:.3f}"
            print(line, flush=True)
            records.append(rec)
    summary = {}
    for op in args.ops.split(","):
        timed = [r for r in records if r["op"] == op and "ratio" in r]
        big = timed if op == "split_k" else [r for r in timed if r["M"] >= 1024]
        if not big:
            continue
        summary[op] = {key: statistics.geometric_mean(r[ratio] for r in big)
                       for key, ratio in (("geomean_kernel_over_cublas", "ratio"),
                                          ("geomean_queued_kernel_over_cublas", "queued_ratio"))}
        if args.alternatives and op != "split_k":
            summary[op]["geomean_queued_best_over_cublas"] = statistics.geometric_mean(
                r["best_queued_us"] / r["cublas_queued_us"] for r in big)
        summary[op].update(shapes=len(big), rows="all (at most SPLIT_K_ROWS)" if op == "split_k" else "M >= 1024")
        print(f"{op}: geomean kernel/cuBLAS over {len(big)} shapes ({summary[op]['rows']}): "
              f"{summary[op]['geomean_kernel_over_cublas']:.3f}; queued (device time alone): "
              f"{summary[op]['geomean_queued_kernel_over_cublas']:.3f}"
              + (f"; best tiling per shape (queued): {summary[op]['geomean_queued_best_over_cublas']:.3f}"
                 if "geomean_queued_best_over_cublas" in summary[op] else ""), flush=True)
    return records, summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="the group size whose per-rank shares are timed")
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--alternatives", action="store_true", help="also time the tilings in ALTERNATIVES")
    p.add_argument("--ops", default="mm_all_reduce,mm_reduce_scatter,all_gather_mm")
    p.add_argument("--fp8", choices=("tensorwise", "rowwise"), default=None,
                   help="time the FP8 form against torch._scaled_mm with these scales")
    p.add_argument("--slow-accum", action="store_true", help="FP8: use_fast_accum=False")
    p.add_argument("--queued", action="store_true",
                   help="also time each call queued behind a GPU sleep (device time without the host's launch)")
    p.add_argument("--kernels", action="store_true", help="time the fused kernels themselves in a group of one "
                   "rank (no exchange) instead of the tile GEMM; --ops may add split_k")
    p.add_argument("--out", default="")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gemm_half: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.kernels:
        if args.fp8:
            p.error("--kernels times the bf16 kernels (no --fp8)")
        from commfuse.kernels import tiles
        from commfuse.tools.timing import commit

        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        tiles.ensure_allocator()
        torch.manual_seed(0)
        records, summary = time_kernels(args, _flush_buffer())
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "commit": commit(),
                           "kernels": True, "records": records, "summary": summary}, f, indent=1)
        return 1 if any("wrong" in r for r in records) else 0
    from commfuse.kernels import tiles
    from commfuse.kernels.sizes.tiles import TileConfig
    from commfuse.runtime.paths import ag_fused, ar_fused
    from commfuse.runtime.paths.base import Call
    from commfuse.tools.bench import shapes_of

    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    tiles.ensure_allocator()
    dt, w = torch.bfloat16, args.world
    flush = _flush_buffer()
    torch.manual_seed(0)
    records = []
    print(f"{'op':18s} {'M':>6s} {'K':>6s} {'N':>6s} {'tiling':>20s} {'cuBLAS us':>10s} {'tile us':>9s} "
          f"{'tile/cuBLAS':>11s}" + (f" {'best alt':>20s} {'alt/cuBLAS':>10s}" if args.alternatives else ""),
          flush=True)
    for op in args.ops.split(","):
        for m, k, n in shapes_of(op):
            call = Call(op, m, k, n, dt, w)
            if op == "mm_all_reduce":
                cfg = ar_fused.tile_config(call, scatter=False)
            elif op == "mm_reduce_scatter":
                cfg = ar_fused.tile_config(call, scatter=True)
            else:
                cfg = ag_fused.tile_config(call)
            # one rank's GEMM: the all-reduce and reduce-scatter multiply all M rows by their K
            # share (the table's K is already the per-rank K); the all-gather multiplies all M
            # gathered rows
            a = torch.randn(m, k, device="cuda", dtype=dt)
            weight = torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5
            b = weight.t()
            out = torch.full((m, n), float("nan"), device="cuda", dtype=dt)
            if args.fp8:  # the FP8 paths' tiling (``tile_config(..., fp8=True)``)
                cfg = dataclasses.replace(cfg, bk=ar_fused.FP8_BK)
                a, b, sa, sb = _fp8_operands(a, weight, args.fp8)
                fast = not args.slow_accum
                ref = (a.float() * sa) @ (b.float() * sb)

                def library(out=out):
                    torch._scaled_mm(a, b, sa, sb, out_dtype=dt, use_fast_accum=fast, out=out)

                def ours(cfg, out=out):
                    tiles.scaled_matmul(a, b, sa, sb, None, dt, fast, cfg, out=out)
            else:
                ref = a.float() @ b.float()

                def library(out=out):
                    torch.mm(a, b, out=out)

                def ours(cfg, out=out):
                    tiles.matmul(a, b, None, cfg, out=out)
            ours(cfg)
            err = _relative_error(out, ref)
            if not err < 1e-2:
                raise RuntimeError(f"gemm_half: the tile GEMM is wrong at {op} {m}x{k}x{n} ({cfg}): {err}")
            out.fill_(float("nan"))
            library()
            lib_err = _relative_error(out, ref)
            cublas = time_flushed(library, flush, args.iters)
            tile = time_flushed(lambda: ours(cfg), flush, args.iters)
            rec = dict(op=op, M=m, K=k, N=n, world=w, tiling=str(cfg), cublas_us=cublas, tile_us=tile,
                       ratio=tile / cublas, tile_err=err, cublas_err=lib_err)
            if args.queued:
                rec["cublas_queued_us"] = time_flushed_queued(library, flush, args.iters)
                rec["tile_queued_us"] = time_flushed_queued(lambda: ours(cfg), flush, args.iters)
            line = f"{op:18s} {m:6d} {k:6d} {n:6d} {str(cfg):>20s} {cublas:10.1f} {tile:9.1f} {tile / cublas:11.3f}"
            if args.queued:
                line += f"  queued {rec['cublas_queued_us']:.1f}/{rec['tile_queued_us']:.1f}"
            if args.alternatives:
                best = (tile, str(cfg))
                for text in FP8_ALTERNATIVES if args.fp8 else ALTERNATIVES:
                    alt = TileConfig.parse(text)
                    try:
                        ours(alt)
                        us = time_flushed(lambda alt=alt: ours(alt), flush, args.iters)
                    except Exception as exc:  # a tiling the device cannot fit (shared memory)
                        rec.setdefault("alt_failed", {})[text] = f"{type(exc).__name__}"
                        continue
                    rec.setdefault("alt_us", {})[text] = us
                    best = min(best, (us, text))
                rec["best_us"], rec["best_tiling"] = best
                line += f" {best[1]:>20s} {best[0] / cublas:10.3f}"
            print(line, flush=True)
            records.append(rec)
    summary = {}
    for op in args.ops.split(","):
        big = [r for r in records if r["op"] == op and r["M"] >= 1024]
        if big:
            summary[op] = {"geomean_tile_over_cublas_M_ge_1024": statistics.geometric_mean(
                r["ratio"] for r in big), "shapes": len(big)}
            if args.alternatives:
                summary[op]["geomean_best_over_cublas_M_ge_1024"] = statistics.geometric_mean(
                    r["best_us"] / r["cublas_us"] for r in big)
            if args.queued:  # the device's time alone: the launch's host time left out
                summary[op]["geomean_queued_tile_over_cublas_M_ge_1024"] = statistics.geometric_mean(
                    r["tile_queued_us"] / r["cublas_queued_us"] for r in big)
            print(f"{op}: geomean tile/cuBLAS at M >= 1024: "
                  f"{summary[op]['geomean_tile_over_cublas_M_ge_1024']:.3f} over {len(big)} shapes"
                  + (f"; best tiling per shape: {summary[op]['geomean_best_over_cublas_M_ge_1024']:.3f}"
                     if args.alternatives else "")
                  + (f"; queued (device time alone): {summary[op]['geomean_queued_tile_over_cublas_M_ge_1024']:.3f}"
                     if args.queued else ""), flush=True)
    if args.out:
        from commfuse.tools.timing import commit

        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "commit": commit(), "fp8": args.fp8, "use_fast_accum": not args.slow_accum,
                       "records": records, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
