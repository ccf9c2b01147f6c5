"""Which path wins per shape, with run-to-run noise measured: every candidate path of the three
ops (forced through ``COMMFUSE_ALGO`` and its knobs) is checked once against an fp32 reference on
fresh data, then timed in interleaved rounds (round r times every candidate once), so drift of
clocks or of the NVLink state hits all candidates alike. Prints per candidate the median and
spread of its rounds beside unfused (cuBLAS + NCCL) timed in the same rounds. Under torchrun:

    torchrun --nproc_per_node=2 benchmarks/path_sweep.py [--ops ar,ag,rs] [--rounds 5] [--out F]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import commfuse  # noqa: F401
from commfuse.bench import AG_MM_SHAPES, MM_AR_SHAPES, settings, sweep_finish, sweep_setup, time_us
from commfuse.kernels.sync import check_errors

#: Tilings the fused kernels are also timed with (``COMMFUSE_TILE_CONFIG``) besides their default.
TILINGS = {"128x128": "128x128x64s4w8g8r0o1", "128x64": "128x64x64s4w4g8r0o1",
           "64x128": "64x128x64s4w4g8r0o1"}
AR_CANDIDATES = {"default": {}, "one_shot": {"COMMFUSE_ALGO": "one_shot"},
                 "fused": {"COMMFUSE_ALGO": "fused"},
                 "fused_reducers": {"COMMFUSE_ALGO": "fused", "COMMFUSE_TILE_CONFIG": "128x256x64s3w8g8r16o1"},
                 # the copies of the pushed sums inline, COMMFUSE_AR_COPY_LAG waves behind
                 **{f"fused_inline_lag{lag}": {"COMMFUSE_ALGO": "fused", "COMMFUSE_AR_COPY_LAG": lag,
                                               "COMMFUSE_TILE_CONFIG": "128x256x64s3w8g8r0o1"}
                    for lag in ("0.5", "1", "2", "4", "100")},
                 "fused_inline_128x128": {"COMMFUSE_ALGO": "fused", "COMMFUSE_TILE_CONFIG": "128x128x64s4w8g8r0o1"},
                 # smaller tiles: more waves, so the first waves' exchange overlaps the later ones
                 # (one wave of 128 x 256 tiles at 1024 rows leaves the whole exchange after it)
                 **{f"fused_{name}": {"COMMFUSE_ALGO": "fused", "COMMFUSE_TILE_CONFIG": cfg}
                    for name, cfg in TILINGS.items() if name != "128x128"},
                 "fused_tma": {"COMMFUSE_ALGO": "fused", "COMMFUSE_FUSED_TMA_PUSH": "1"},
                 # every chunk pulled by the copy engines (the tail too: before c0b19f0's default)
                 **{f"ce_overlap_{c}": {"COMMFUSE_ALGO": "ce_overlap", "COMMFUSE_CE_CHUNKS": str(c),
                                        "COMMFUSE_CE_TAIL": "copy"} for c in (2, 4, 8)},
                 # the programs' first tiles started over a spread of µs (desynchronised pushes;
                 # "fused" has the default spread, 0 starts them together as before c0b19f0)
                 **{f"fused_stagger{us}": {"COMMFUSE_ALGO": "fused", "COMMFUSE_FUSED_STAGGER_US": us}
                    for us in ("0", "10", "15", "25", "35", "50")},
                 # the last chunk pulled and summed by the one-shot kernel on the SMs
                 **{f"ce_overlap_{c}_tail": {"COMMFUSE_ALGO": "ce_overlap", "COMMFUSE_CE_CHUNKS": str(c),
                                             "COMMFUSE_CE_TAIL": "one_shot"} for c in (2, 4, 8, 16)},
                 # the chunks' side work on fewer streams (COMMFUSE_CE_STREAMS: before session 17, 1)
                 **{f"ce_overlap_{c}_tail_streams{n}": {"COMMFUSE_ALGO": "ce_overlap", "COMMFUSE_CE_CHUNKS": str(c),
                                                        "COMMFUSE_CE_TAIL": "one_shot", "COMMFUSE_CE_STREAMS": str(n)}
                    for c in (4, 8) for n in (1, 2)},
                 # a shorter last chunk (COMMFUSE_CE_LAST_ROWS), so less exchange after the last GEMM
                 **{f"ce_overlap_{c}_last{r}": {"COMMFUSE_ALGO": "ce_overlap", "COMMFUSE_CE_CHUNKS": str(c),
                                                "COMMFUSE_CE_LAST_ROWS": str(r)}
                    for c in (4, 8) for r in (128, 256, 512)},
                 # the copy-engine calls run eagerly, not replayed as CUDA graphs (before this session)
                 "ce_overlap_eager": {"COMMFUSE_ALGO": "ce_overlap", "COMMFUSE_CE_GRAPHS": "0"}}
AG_CANDIDATES = {"default": {}, "symm": {"COMMFUSE_ALGO": "symm"},
                 **{f"overlap_{src}": {"COMMFUSE_ALGO": "overlap", "COMMFUSE_AG_LOCAL": src}
                    for src in ("workspace", "copy")},
                 "fused": {"COMMFUSE_ALGO": "fused"},
                 **{f"fused_p{p}": {"COMMFUSE_ALGO": "fused", "COMMFUSE_AG_PUSHERS": str(p)} for p in (8, 32)},
                 **{f"fused_{name}": {"COMMFUSE_ALGO": "fused", "COMMFUSE_TILE_CONFIG": cfg}
                    for name, cfg in TILINGS.items()},
                 **{f"fused_ce{c}": {"COMMFUSE_ALGO": "fused", "COMMFUSE_AG_PUSH": "ce",
                                     "COMMFUSE_AG_CE_CHUNKS": str(c)} for c in (1, 2, 4, 8)},
                 **{f"fused_ce4_{name}": {"COMMFUSE_ALGO": "fused", "COMMFUSE_AG_PUSH": "ce",
                                          "COMMFUSE_AG_CE_CHUNKS": "4", "COMMFUSE_TILE_CONFIG": cfg}
                    for name, cfg in TILINGS.items()}}
RS_CANDIDATES = {"default": {}, "symm": {"COMMFUSE_ALGO": "symm"},
                 **{f"ce_overlap_{c}": {"COMMFUSE_ALGO": "ce_overlap", "COMMFUSE_RS_CHUNKS": str(c)}
                    for c in (1, 2, 4)},
                 "fused": {"COMMFUSE_ALGO": "fused"},
                 "fused_tma": {"COMMFUSE_ALGO": "fused", "COMMFUSE_FUSED_TMA_PUSH": "1"},
                 **{f"fused_{name}": {"COMMFUSE_ALGO": "fused", "COMMFUSE_TILE_CONFIG": cfg}
                    for name, cfg in TILINGS.items()},
                 **{f"fused_tma_{name}": {"COMMFUSE_ALGO": "fused", "COMMFUSE_FUSED_TMA_PUSH": "1",
                                          "COMMFUSE_TILE_CONFIG": cfg} for name, cfg in TILINGS.items()},
                 "fused_pull": {"COMMFUSE_ALGO": "fused", "COMMFUSE_RS_PULL": "1"},
                 **{f"fused_stagger{us}": {"COMMFUSE_ALGO": "fused", "COMMFUSE_FUSED_STAGGER_US": us}
                    for us in ("5", "10", "25")},
                 **{f"fused_pull_{name}": {"COMMFUSE_ALGO": "fused", "COMMFUSE_RS_PULL": "1",
                                           "COMMFUSE_TILE_CONFIG": cfg} for name, cfg in TILINGS.items()}}


def problem(op: str, m: int, k: int, n: int, group, batch: int = 1):
    """(call, unfused call, fp32 reference) for one shape on fresh data (different per rank).
    ``batch`` > 1: the all-gather and reduce-scatter run sequence-parallel style, on [batch, rows /
    batch, ...] along dim 1 (the outputs are compared in that layout)."""
    gname, world, rank = group.group_name, group.size(), dist.get_rank()
    dt = torch.bfloat16
    dim = 1 if batch > 1 else 0
    b = (torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5).t()  # a linear layer's W.t()
    if op == "ag":
        shard = torch.randn(batch, m // world // batch, k, device="cuda", dtype=dt).squeeze(0)
        parts = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(parts, shard, group=group)
        ref = torch.cat(parts, dim).reshape(-1, k).float() @ b.float()

        def unfused():
            gathered = funcol.wait_tensor(funcol.all_gather_tensor(shard, 0, group))
            if dim:  # funcol gathers along dim 0
                gathered = torch.cat(gathered.chunk(world), dim)
            return torch.mm(gathered.reshape(-1, k), b)
        return (lambda: torch.ops.commfuse.all_gather_mm(shard, b, None, dim, world, gname, False)[0],
                unfused, ref)
    a = torch.randn(m, k, device="cuda", dtype=dt)
    ref = a.float() @ b.float()
    dist.all_reduce(ref, group=group)
    if op == "ar":
        return (lambda: torch.ops.commfuse.mm_all_reduce(a, b, None, gname),
                lambda: funcol.wait_tensor(funcol.all_reduce(torch.mm(a, b), "sum", group)), ref)
    shape = [batch, m // batch, n] if dim else [m, n]
    return (lambda: torch.ops.commfuse.mm_reduce_scatter(a, b, None, shape, dim, world, gname),
            lambda: funcol.wait_tensor(funcol.reduce_scatter_tensor(torch.mm(a, b).view(shape), "sum", dim, group)),
            ref.view(shape).chunk(world, dim)[rank])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ops", default="ar,ag,rs")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ar-min-m", type=int, default=1024, help="all-reduce shapes from this many rows")
    p.add_argument("--batch", type=int, default=1, help="all-gather / reduce-scatter along dim 1 of a "
                   "[batch, rows / batch, ...] tensor (sequence parallel with a batch)")
    p.add_argument("--shapes", default=None, help="these MxKxN instead of the benchmark's (comma-separated)")
    p.add_argument("--only", default=None, help="only these candidates (comma-separated names)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    group, rank = sweep_setup()
    given = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")] if args.shapes else None
    only = set(args.only.split(",")) if args.only else None
    candidates = {"ar": AR_CANDIDATES, "ag": AG_CANDIDATES, "rs": RS_CANDIDATES}
    records = []
    for op in args.ops.split(","):
        shapes = [s for s in MM_AR_SHAPES if s[0] >= args.ar_min_m] if op == "ar" else AG_MM_SHAPES
        for m, k, n in given or shapes:
            batch = 1 if op == "ar" else args.batch
            if m % (batch * group.size()):
                if rank == 0:
                    print(f"{op} {m}x{k}x{n}: skipped, {m} rows do not split into {batch} x {group.size()}",
                          flush=True)
                continue
            torch.manual_seed(99 + rank)
            call, unfused, ref = problem(op, m, k, n, group, batch)
            errs, runs = {}, {"unfused": unfused}
            for name, values in candidates[op].items():
                if only is not None and name not in only:
                    continue
                with settings(values):
                    try:
                        out = call()
                        torch.cuda.synchronize()
                        check_errors()
                        errs[name] = ((out.float().reshape(ref.shape) - ref).norm() / ref.norm()).item()
                        runs[name] = values
                    except Exception as exc:  # a path that cannot take the shape: recorded
                        errs[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
                        torch.cuda.synchronize()
            times = {name: [] for name in runs}
            for _ in range(args.rounds):
                for name, values in runs.items():
                    if name == "unfused":
                        times[name].append(time_us(unfused))
                    else:
                        with settings(values):
                            times[name].append(time_us(call))
            med = {name: statistics.median(v) for name, v in times.items()}
            bad = {name: e for name, e in errs.items() if not isinstance(e, float) or e > 2e-2}
            if rank == 0:
                best = min((v, name) for name, v in med.items() if name != "unfused")
                line = ", ".join(f"{name} {v:.1f} ({med['unfused'] / v:.3f}x, +-{(max(times[name]) - min(times[name])) / 2:.1f})"
                                 for name, v in med.items())
                print(f"{op} {m}x{k}x{n}: {line} | best {best[1]}" + (f" | BAD {bad}" if bad else ""),
                      flush=True)
            records.append(dict(op=op, M=m, K=k, N=n, times=times, median=med, errors=errs))
    return sweep_finish(records, args.out)


if __name__ == "__main__":
    sys.exit(main())
