"""Where a fused tile kernel's time goes, under torchrun on 2 GPUs: per op, shape and variant the
kernel is checked against fp32 on fresh data (outputs NaN-poisoned), timed (``tools/timing.py``),
then one call, the last of several back to back, records per program GPU times
(``prepare(trace=...)``, ``kernels/sync.py``'s ``TRACE_SLOTS`` per program). Rank 0 prints a
summary per call, relative to the earliest program start, with busy profiles in 2 µs bins:

* ``ar`` / ``rs`` (``kernels/fused_all_reduce.py``; ``--configs`` tilings, ``--pull`` for the
  reduce-scatter): when the peers' tiles (multiplied first) and the own tiles (last: they wait for
  the peers' partials) end, how long each kind took, when the programs and any reducers end, how
  many programs hold a position per bin;
* ``ag`` (``kernels/fused_all_gather.py``; ``--push sm`` with ``--pushers`` programs, or ``ce``,
  the copy engines): when the pushes end, when own-row and peer-row tiles end, how long peer-row
  tiles waited, how many programs multiply and wait per bin.

    torchrun --nproc_per_node=2 benchmarks/trace.py [--ops ar,rs,ag] [--shapes 2048x2048x2048]
        [--configs 128x256x64s3w8g8r0o1,...] [--pull 0,1] [--push sm,ce] [--pushers 16] [--out F]
"""

from __future__ import annotations

import argparse
import statistics
import sys

#: Bin width of the busy profiles.
BIN_NS = 2000


def spread(values: list) -> list | None:
    """[min, median, max] of ``values``, rounded to 0.1, or None when there are none."""
    return [round(x, 1) for x in (min(values), statistics.median(values), max(values))] if values else None


def rows_of(trace) -> tuple[list, int]:
    """A trace (``TRACE_SLOTS`` int64 per program, -1 unused) as one list per program, and the
    earliest program start (ns)."""
    from commfuse.kernels import sync

    rows = trace.view(-1, sync.TRACE_SLOTS).tolist()
    return rows, min(row[0] for row in rows if row[0] >= 0)


def positions(row: list) -> list[tuple[int, int, int]]:
    """(position, middle time, end) of every tile one program's row recorded."""
    from commfuse.kernels import sync

    out = []
    for j in range(sync.TRACE_TILES):
        pos, middle, end = row[2 + 3 * j:5 + 3 * j]
        if pos < 0:
            break
        out.append((pos, middle, end))
    return out


def bins(spans: list, t0: int, last: int | None = None) -> list[int]:
    """Per ``BIN_NS`` bin from ``t0`` to ``last`` (default: the spans' last end), how many
    (begin, end) spans cover more than half of it."""
    last = max(end for _, end in spans) if last is None else last
    counts = [0] * (int((last - t0) // BIN_NS) + 1)
    for begin, end in spans:
        for b in range(int((begin - t0) // BIN_NS), int((end - t0) // BIN_NS) + 1):
            lo, hi = t0 + b * BIN_NS, t0 + (b + 1) * BIN_NS
            if min(hi, end) - max(lo, begin) > BIN_NS / 2:
                counts[b] += 1
    return counts


def reduce_summary(trace, own_from: int, compute: int) -> dict:
    """A traced all-reduce / reduce-scatter call in µs from the earliest start: positions from
    ``own_from`` on are this rank's own tiles; programs from ``compute`` on are reducers."""
    slots, t0 = rows_of(trace)
    us = lambda ns: round((ns - t0) / 1e3, 1)  # noqa: E731
    kinds = {"peer": ([], []), "own": ([], [])}  # (durations, ends)
    spans = []
    for s in slots[:compute]:
        for pos, begin, end in positions(s):
            durations, ends = kinds["own" if pos >= own_from else "peer"]
            durations.append((end - begin) / 1e3)
            ends.append(us(end))
            spans.append((begin, end))
    return {"start_spread_us": max(us(s[0]) for s in slots if s[0] >= 0),
            "peer_tile_us": spread(kinds["peer"][0]), "peer_tile_end_us": spread(kinds["peer"][1]),
            "own_tile_us": spread(kinds["own"][0]), "own_tile_end_us": spread(kinds["own"][1]),
            "program_end_us": spread([us(s[1]) for s in slots[:compute] if s[1] >= 0]),
            "reducer_end_us": spread([us(s[1]) for s in slots[compute:] if s[1] >= 0]),
            "last_tile_end_us": us(max(end for _, end in spans)), "tiles_traced": len(spans),
            "busy_per_2us": bins(spans, t0)}


def gather_summary(trace, rows: int, n: int, cfg, pushers: int) -> dict:
    """A traced all-gather call in µs from the earliest start: push ends, tile ends by source,
    waits of peer-row tiles, how many programs multiply / wait per bin."""
    from commfuse.kernels import tiles

    slots, t0 = rows_of(trace)
    per = tiles.cdiv(rows, cfg.bm) * tiles.cdiv(n, cfg.bn)
    us = lambda ns: (ns - t0) / 1e3  # noqa: E731
    own_end, peer_end, waits, spans = [], [], [], []
    for s in slots:
        if s[0] < 0:
            continue
        prev = s[1] if s[1] >= 0 else s[0]
        for pos, waited, end in positions(s):
            (own_end if pos < per else peer_end).append(us(end))
            if pos >= per:
                waits.append((waited - prev) / 1e3)
            spans.append((prev, waited, end))
            prev = end
    last = max(end for _, _, end in spans)
    return {"start_spread_us": round(max(us(s[0]) for s in slots if s[0] >= 0), 1),
            "push_end_us": spread([us(s[1]) for s in slots[:pushers] if s[1] >= 0]),
            "own_tile_end_us": spread(own_end), "peer_tile_end_us": spread(peer_end),
            "peer_wait_us": spread(waits), "last_end_us": round(us(last), 1), "tiles_traced": len(spans),
            "busy_per_2us": bins([(waited, end) for _, waited, end in spans], t0, last),
            "waiting_per_2us": bins([(start, waited) for start, waited, _ in spans], t0, last)}


class Traced:
    """The WORLD group's run-time state on this rank (facts agreed, workspaces grown through it)."""

    def __init__(self, group):
        import torch

        from commfuse.runtime import groups

        self.group, self.world, self.rank = group, group.size(), group.rank()
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.state = groups.get(group.group_name)
        self.facts = groups.group_facts(self.state, self.device, False)

    def workspace(self, nbytes: int):
        from commfuse.runtime import groups

        return groups.workspace(self.state, nbytes, self.device)


def trace_buffer():
    """Room for the trace of up to 1024 programs (more than any grid here); the launchers mark
    every slot unused (-1) before each traced launch."""
    import torch

    from commfuse.kernels import sync

    return torch.empty(1024 * sync.TRACE_SLOTS, dtype=torch.int64, device="cuda")


def timed_then_traced(ws, launch, traced) -> float:
    """``launch`` (a ``prepare`` result) timed, then three calls back to back and ``traced`` (the
    same call, recording its trace) after them, so the trace shows a call that follows others;
    returns the time in µs."""
    import torch

    from commfuse.runtime import errors
    from commfuse.tools.timing import time_us

    us = time_us(lambda: launch(*ws.next_epoch()))
    for _ in range(3):
        launch(*ws.next_epoch())
    traced(*ws.next_epoch())
    torch.cuda.synchronize()
    errors.check_errors()
    return us


def trace_reduce(g: Traced, op: str, m: int, k: int, n: int, text: str, pull: bool) -> dict:
    import torch
    import torch.distributed as dist

    from commfuse.kernels import fused_all_reduce, tiles
    from commfuse.runtime import errors
    from commfuse.runtime.paths import ar_fused
    from commfuse.runtime.paths.base import Call

    scatter = op == "rs"
    cfg = tiles.TileConfig.parse(text)
    default = ar_fused.FUSED.config(Call("mm_all_reduce", m, k, n, torch.bfloat16, g.world), g.facts)
    opts = default.options._replace(pull=pull)  # the path's options (its staggered start), the pull as asked
    ws = g.workspace(fused_all_reduce.data_elems(m, n, g.world, cfg, scatter) * 2)
    torch.manual_seed(1234 + g.rank)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    torch.manual_seed(99)
    b = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5).t()
    ref = a.float() @ b.float()
    dist.all_reduce(ref, group=g.group)
    if scatter:
        ref = ref.chunk(g.world)[g.rank]
    out = torch.full(ref.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    launch = fused_all_reduce.prepare(ws, a, b, None, out, cfg, scatter, opts)
    launch(*ws.next_epoch())
    torch.cuda.synchronize()
    errors.check_errors()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    trace = trace_buffer()
    traced = fused_all_reduce.prepare(ws, a, b, None, out, cfg, scatter, opts, trace=trace)
    us = timed_then_traced(ws, launch, traced)
    count = fused_all_reduce.num_tiles(m, n, g.world, cfg, scatter)
    own = count // g.world if scatter else len(range(g.rank, count, g.world))
    programs = cfg.per_sm * ws.max_programs  # as prepare counts them (per_sm 1 fits here)
    compute = min(count, programs) if scatter else max(1, min(count, programs - cfg.reducers))
    return dict(op=op, M=m, K=k, N=n, config=text, pull=pull, err=err, us=us,
                **reduce_summary(trace.cpu(), count - own, compute))


def trace_gather(g: Traced, m: int, k: int, n: int, text: str, push: str, pushers: int) -> dict:
    import torch
    import torch.distributed as dist

    from commfuse.kernels import fused_all_gather, tiles
    from commfuse.runtime import errors

    cfg = tiles.TileConfig.parse(text)
    rows = m // g.world
    ws = g.workspace(fused_all_gather.data_elems(rows, k, g.world) * 2)
    side = g.state.side_streams(g.device)[0] if push == "ce" else None
    pushers = max(pushers, 1)
    torch.manual_seed(99)  # the same weight on every rank
    b = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5).t()
    # the check, on fresh data, both outputs poisoned: the product and the gathered rows
    torch.manual_seed(4321 + g.rank)
    shard = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    parts = [torch.empty_like(shard) for _ in range(g.world)]
    dist.all_gather(parts, shard, group=g.group)
    full = torch.cat(parts)
    ref = full.float() @ b.float()
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    gathered = torch.full_like(full, float("nan"))
    fused_all_gather.prepare(ws, shard, b, None, gathered, out, cfg, side=side, pushers=pushers)(*ws.next_epoch())
    torch.cuda.synchronize()
    errors.check_errors()
    err = max(((out.float() - ref).norm() / ref.norm()).item(),
              ((gathered.float() - full.float()).norm() / full.float().norm()).item())
    torch.manual_seed(1234 + g.rank)
    shard = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    launch = fused_all_gather.prepare(ws, shard, b, None, None, out, cfg, side=side, pushers=pushers)
    trace = trace_buffer()
    traced = fused_all_gather.prepare(ws, shard, b, None, None, out, cfg, trace, side, pushers=pushers)
    us = timed_then_traced(ws, launch, traced)
    return dict(op="ag", M=m, K=k, N=n, config=text, push=push, pushers=pushers if push == "sm" else 0, err=err,
                us=us, **gather_summary(trace.cpu(), rows, n, cfg, pushers if push == "sm" else 0))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default="ar,rs,ag", help="ar, rs, ag (comma-separated)")
    p.add_argument("--shapes", default="2048x2048x2048,8192x2048x4096", help="MxKxN (comma-separated; the "
                   "all-gather's M is the gathered rows)")
    p.add_argument("--configs", default="128x256x64s3w8g8r0o1,128x128x64s4w8g8r0o1", help="tilings")
    p.add_argument("--pull", default="0", help="reduce-scatter: 0, 1 or 0,1 (owners pull the partials)")
    p.add_argument("--push", default="sm,ce", help="all-gather: who pushes the shard: the kernel's programs "
                   "(sm), the copy engines (ce)")
    p.add_argument("--pushers", default="16", help="all-gather with --push sm: pushing programs (comma-separated)")
    p.add_argument("--out", default=None)
    return p


def main() -> int:
    args = parser().parse_args()
    import torch.distributed as dist

    import commfuse  # noqa: F401
    from commfuse.tools.timing import finish, setup_ranks

    group, rank = setup_ranks()
    g = Traced(group)
    records = []

    def keep(rec):
        records.append(rec)
        if rank == 0:
            print(rec, flush=True)
        dist.barrier()

    for op in args.ops.split(","):
        for shape in args.shapes.split(","):
            m, k, n = (int(x) for x in shape.split("x"))
            for text in args.configs.split(","):
                if op == "ag":
                    variants = [("sm", int(p)) for p in args.pushers.split(",") if "sm" in args.push.split(",")]
                    variants += [("ce", 0)] if "ce" in args.push.split(",") else []
                    for push, pushers in variants:
                        keep(trace_gather(g, m, k, n, text, push, pushers))
                else:
                    for pull in (args.pull.split(",") if op == "rs" else ["0"]):
                        keep(trace_reduce(g, op, m, k, n, text, pull == "1"))
    return finish(records, args.out)


if __name__ == "__main__":
    sys.exit(main())
