"""Does all-reduce + residual add + RMSNorm in one kernel pay on Hopper? Timed on one GPU with the
ranks emulated (``commfuse.tools.emulated``: every rank a workspace or graph lane and a stream of
its own), bf16, two forms alternating round by round:

* unfused: the exchange into its output, then Inductor's compiled ``h = x + y; n = rmsnorm(h) * w``
  (``LlamaRMSNorm``'s rounding: normalised, cast, times the weight);
* fused: ``commfuse/kernels/norm_epilogue.py``, the same rounding.

Decode row counts run through the graph lane (its staged one-shot: the form commfuse replays under
CUDA graphs), each rank's ``--unroll`` calls captured in a CUDA graph of its own and the ranks'
graphs replayed together; prefill row counts run eagerly through the one-shot over the workspace,
the partial already there as a GEMM leaves it. ``--sequence-parallel`` row counts (the product's
rows, every rank's) time the sequence-parallel form eagerly: the pull reduce-scatter of the rank's
share then Inductor's add + norm, against the pull + add + norm kernel. The fused form is checked against an fp32
reference of the unfused chain before it is timed and again after (outputs poisoned first).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        python benchmarks/norm_epilogue.py --out benchmarks/results/h200/norm_epilogue_COMMIT.json

A row's ``floor_*_us`` is the bytes that form moves through HBM at ``--hbm-tbs``: the emulated
ranks share the one device's memory, so every rank's bytes count, and no link is modelled. Cases
left when ``--budget-s`` has passed are listed as skipped, not run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

# no multicast objects or NVLS: what the kernels are meant to run without
for _name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_name, "0" if _name == "NCCL_NVLS_ENABLE" else "1")
# every kernel loaded when CUDA starts: one thread launches every emulated rank
# (``commfuse.tools.emulated``)
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import torch  # noqa: E402
import triton  # noqa: E402

from commfuse.kernels import exchange, norm_epilogue  # noqa: E402
from commfuse.kernels.codes import GRAPH_LANE_OP, OP_MM_ALL_REDUCE, OP_MM_REDUCE_SCATTER  # noqa: E402
from commfuse.runtime import errors  # noqa: E402
from commfuse.tools import emulated  # noqa: E402
from commfuse.tools.timing import SLEEP_CYCLES, commit  # noqa: E402

DT = torch.bfloat16
EPS = 1e-6
TOLERANCE = 1e-2  # relative L2 error against fp32; bf16 rounding alone is ~3e-3


def _add_norm(x, y, w):
    """The unfused chain's second kernel, as transformers' LlamaRMSNorm writes it."""
    h = x + y
    hf = h.float()
    return h, (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype) * w


ADD_NORM = torch.compile(_add_norm, dynamic=False)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _relerr(got, want) -> float:
    if not bool(torch.isfinite(got).all()):
        return float("inf")  # unwritten (NaN-poisoned) or non-finite
    return ((got.float() - want).norm() / want.norm()).item()


class Case:
    """One (world, rows, hidden): every rank's ``rows x hidden`` partial, its residual ``x``, the
    weight (the same on every rank, as in tensor parallelism), its fp32 reference of the unfused
    chain and poisoned outputs. The all-reduce form: every rank's outputs and residual are all
    ``rows`` (the residual the same on every rank); ``scatter`` (the sequence-parallel form): each
    rank's are its share, ``rows / world`` rows, with a residual of its own."""

    def __init__(self, world: int, rows: int, hidden: int, scatter: bool = False):
        torch.manual_seed(world * 100_000 + rows + hidden + scatter)
        share = rows // world if scatter else rows
        self.world, self.rows, self.hidden, self.full = world, share, hidden, rows
        self.parts = [torch.randn(rows, hidden, device="cuda", dtype=DT) for _ in range(world)]
        if scatter:
            self.xs = [torch.randn(share, hidden, device="cuda", dtype=DT) for _ in range(world)]
        else:
            x = torch.randn(rows, hidden, device="cuda", dtype=DT)
            self.xs = [x.clone() for _ in range(world)]
        w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(DT)
        self.ws = [w.clone() for _ in range(world)]
        total = sum(p.float() for p in self.parts)
        self.refs = []
        for r in range(world):
            h = self.xs[r].float() + (total[r * share:(r + 1) * share] if scatter else total)
            self.refs.append((h, h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * w.float()))
        self.sums = [torch.empty(share, hidden, device="cuda", dtype=DT) for _ in range(world)]
        self.hs = [torch.empty(share, hidden, device="cuda", dtype=DT) for _ in range(world)]
        self.ns = [torch.empty(share, hidden, device="cuda", dtype=DT) for _ in range(world)]
        self.poison()
        # compiled (and tuned) before any rank's kernel spins: a module load can wait for
        # running kernels, here a peer's spinning one
        ADD_NORM(self.xs[0], self.sums[0], self.ws[0])
        torch.cuda.synchronize()

    def poison(self) -> None:
        for t in self.hs + self.ns:
            t.fill_(float("nan"))

    def errors(self, outs) -> dict:
        """Largest relative error of ``h`` and ``n`` over the ranks' ``outs`` [(h, n)]."""
        return {"h_err": max(_relerr(h, ref[0]) for (h, _), ref in zip(outs, self.refs)),
                "n_err": max(_relerr(n, ref[1]) for (_, n), ref in zip(outs, self.refs))}

    def bytes_moved(self, staged: bool) -> tuple[int, int]:
        """HBM bytes of one call over all ranks, (unfused, fused): every rank reads every rank's
        rows of its output; the fused form reads x and writes h and n, the unfused one also writes
        the sum and reads it back; staging copies the local tensor into the lane first."""
        elems = self.rows * self.hidden * DT.itemsize
        stage = 2 * elems if staged else 0
        return (self.world * (self.world * elems + 5 * elems + stage),
                self.world * (self.world * elems + 3 * elems + stage))


def _checked(case: Case, outs, what: str) -> dict:
    errs = case.errors(outs)
    if not (errs["h_err"] < TOLERANCE and errs["n_err"] < TOLERANCE):
        raise AssertionError(f"{what}: the fused outputs are off the fp32 reference: {errs}")
    return errs


def _timed(streams, enqueue, calls: int) -> float:
    """µs per call of ``enqueue()`` (every rank's launches on its stream), ``calls`` calls, queued
    behind a GPU sleep so the events time the device, not the host."""
    main = torch.cuda.current_stream()
    for s in streams:
        s.wait_stream(main)
    torch.cuda._sleep(SLEEP_CYCLES)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(main)
    for s in streams:
        s.wait_event(start)
    enqueue()
    for s in streams:
        main.wait_stream(s)
    end.record(main)
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def _alternate(forms: dict, rounds: int) -> dict:
    """Median µs per call of each form, the forms alternating round by round."""
    times = {name: [] for name in forms}
    for _ in range(rounds):
        for name, run in forms.items():
            times[name].append(run())
    return {name: statistics.median(t) for name, t in times.items()}


def decode(world: int, rows: int, hidden: int, args) -> dict:
    """Graph lane, CUDA graphs: each rank's graph holds ``args.unroll`` calls of one form."""
    case = Case(world, rows, hidden)
    lanes = emulated.lanes(world, rows * hidden * DT.itemsize, timeout_s=args.wait_s)
    streams = [torch.cuda.Stream() for _ in range(world)]

    def unfused(r):
        exchange.staged_all_reduce(lanes[r], case.parts[r], case.sums[r], GRAPH_LANE_OP)
        return ADD_NORM(case.xs[r], case.sums[r], case.ws[r])

    def fused(r):
        norm_epilogue.staged_add_rms_norm(lanes[r], case.parts[r], case.xs[r], case.ws[r], case.hs[r], case.ns[r],
                                          EPS, GRAPH_LANE_OP)
        return case.hs[r], case.ns[r]

    def each_rank(fn):
        outs = []
        for r, s in enumerate(streams):
            with torch.cuda.stream(s):
                outs.append(fn(r))
        torch.cuda.synchronize()
        return outs

    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    row = {"eager": _checked(case, each_rank(fused), "eager"), "unfused_eager": case.errors(each_rank(unfused))}
    graphs, outs = {}, {}
    for name, fn in (("unfused", unfused), ("fused", fused)):
        graphs[name], outs[name] = [], []
        for r, s in enumerate(streams):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=s):
                for _ in range(args.unroll):
                    last = fn(r)
            graphs[name].append(g)
            outs[name].append(last)

    def replay(name, times):
        def enqueue():
            for _ in range(times):
                for r, s in enumerate(streams):
                    with torch.cuda.stream(s):
                        graphs[name][r].replay()
        return enqueue

    case.poison()
    _timed(streams, replay("fused", 1), 1)
    row["replayed"] = _checked(case, outs["fused"], "replayed")
    _timed(streams, replay("unfused", 1), 1)
    row["unfused_replayed"] = case.errors(outs["unfused"])
    calls = args.replays * args.unroll
    row.update(_alternate({name: lambda name=name: _timed(streams, replay(name, args.replays), calls)
                           for name in graphs}, args.rounds))
    case.poison()
    _timed(streams, replay("fused", 1), 1)
    row["after"] = _checked(case, outs["fused"], "after timing")
    errors.check(emulated.GroupState(lanes[0]))  # no wait timed out
    return _row(row, case, args, staged=True, form="graph lane, CUDA graphs")


def prefill(world: int, rows: int, hidden: int, args, scatter: bool = False) -> dict:
    """One-shot over the workspace, eager: the partial already in both data halves. ``scatter``:
    the sequence-parallel form (the pull reduce-scatter of this rank's rows)."""
    case = Case(world, rows, hidden, scatter)
    ws = emulated.group(world, rows * hidden * DT.itemsize, timeout_s=args.wait_s)
    for r in range(world):
        for parity in (0, 1):
            ws[r].data(parity, (rows, hidden), DT).copy_(case.parts[r])
    streams = [torch.cuda.Stream() for _ in range(world)]

    def unfused(r, epoch, parity):
        partial = ws[r].data(parity, (rows, hidden), DT)
        if scatter:
            exchange.reduce_scatter(ws[r], partial, case.sums[r], 1, rows * hidden // world, epoch,
                                    OP_MM_REDUCE_SCATTER)
        else:
            exchange.all_reduce(ws[r], partial, case.sums[r], epoch, "one_shot", OP_MM_ALL_REDUCE)
        return ADD_NORM(case.xs[r], case.sums[r], case.ws[r])

    def fused(r, epoch, parity):
        partial = ws[r].data(parity, (rows, hidden), DT)
        if scatter:
            norm_epilogue.reduce_scatter_add_rms_norm(ws[r], partial, case.xs[r], case.ws[r], case.hs[r], case.ns[r],
                                                      rows // world, EPS, epoch, OP_MM_REDUCE_SCATTER)
        else:
            norm_epilogue.all_reduce_add_rms_norm(ws[r], partial, case.xs[r], case.ws[r], case.hs[r], case.ns[r],
                                                  EPS, epoch, OP_MM_ALL_REDUCE)
        return case.hs[r], case.ns[r]

    def calls(fn, times):
        def enqueue():
            outs = None
            for _ in range(times):
                outs = []
                for r, s in enumerate(streams):
                    epoch, parity = ws[r].next_epoch()
                    with torch.cuda.stream(s):
                        outs.append(fn(r, epoch, parity))
            return outs
        return enqueue

    def once(fn):
        """Every rank's call, finished: its outputs [(h, n)] ready to read."""
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
        outs = calls(fn, 1)()
        torch.cuda.synchronize()
        return outs

    row = {"eager": _checked(case, once(fused), "eager"), "unfused_eager": case.errors(once(unfused))}
    iters = args.prefill_iters
    row.update(_alternate({"unfused": lambda: _timed(streams, calls(unfused, iters), iters),
                           "fused": lambda: _timed(streams, calls(fused, iters), iters)}, args.rounds))
    case.poison()
    row["after"] = _checked(case, once(fused), "after timing")
    errors.check(emulated.GroupState(ws[0]))
    return _row(row, case, args, staged=False, form="pull (SP), eager" if scatter else "one-shot, eager")


def _row(row: dict, case: Case, args, staged: bool, form: str) -> dict:
    unfused_bytes, fused_bytes = case.bytes_moved(staged)
    tbs = args.hbm_tbs * 1e12
    return dict(world=case.world, rows=case.full, hidden=case.hidden, form=form,
                unfused_us=row.pop("unfused"),
                fused_us=row.pop("fused"), **row, floor_unfused_us=unfused_bytes / tbs * 1e6,
                floor_fused_us=fused_bytes / tbs * 1e6)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="2,1", help="emulated group sizes, in order (default 2,1)")
    p.add_argument("--hidden", default="4096,8192")
    p.add_argument("--decode", default="1,8,32,128,256", help="row counts timed under CUDA graphs")
    p.add_argument("--prefill", default="1024,4096,16384", help="row counts timed eagerly")
    p.add_argument("--sequence-parallel", default="", help="row counts (every rank's) of the sequence-parallel "
                   "form, timed eagerly")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds; the median is kept")
    p.add_argument("--replays", type=int, default=50, help="graph replays per decode round")
    p.add_argument("--unroll", type=int, default=8, help="calls captured in each rank's graph")
    p.add_argument("--prefill-iters", type=int, default=20, help="eager calls per prefill round")
    p.add_argument("--hbm-tbs", type=float, default=4.8, help="HBM TB/s for the floor (H200: 4.8)")
    p.add_argument("--wait-s", type=float, default=20.0, help="bound on every wait of the kernels")
    p.add_argument("--budget-s", type=float, default=180.0, help="start no case after this many seconds")
    p.add_argument("--out", default="", help="JSON results (rewritten after every case)")
    args = p.parse_args()
    # one compiled add + norm per shape: more recompiles than Dynamo allows by default
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    began = time.monotonic()
    cases = [(kind, world, hidden, m) for world in _ints(args.worlds) for hidden in _ints(args.hidden)
             for kind, ms in (("decode", _ints(args.decode)), ("prefill", _ints(args.prefill)),
                              ("sp", _ints(args.sequence_parallel))) for m in ms if kind != "sp" or m % world == 0]
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "commit": commit(), "dtype": "bf16", "eps": EPS, "args": vars(args), "rows": [], "failed": [],
              "skipped": []}
    print(f"{'world':>5} {'form':>24} {'rows':>6} {'hidden':>6} {'unfused us':>11} {'fused us':>9} "
          f"{'fused/unf':>9} {'saved us':>8} {'floor unf/fused us':>19}", flush=True)
    for kind, world, hidden, m in cases:
        if time.monotonic() - began > args.budget_s:
            record["skipped"].append(dict(kind=kind, world=world, hidden=hidden, rows=m))
            continue
        try:
            row = decode(world, m, hidden, args) if kind == "decode" else prefill(world, m, hidden, args, kind == "sp")
        except Exception as exc:  # noqa: BLE001 - recorded; the next case gets fresh ranks
            torch.cuda.synchronize()
            record["failed"].append(dict(kind=kind, world=world, hidden=hidden, rows=m, error=repr(exc)[:500]))
            print(f"FAILED {kind} world {world} {m}x{hidden}: {exc!r}"[:600], flush=True)
            continue
        row["fused_over_unfused"] = row["fused_us"] / row["unfused_us"]
        row["saved_us"] = row["unfused_us"] - row["fused_us"]
        record["rows"].append(row)
        print(f"{world:>5} {row['form']:>24} {m:>6} {hidden:>6} {row['unfused_us']:>11.2f} {row['fused_us']:>9.2f} "
              f"{row['fused_over_unfused']:>9.3f} {row['saved_us']:>8.2f} "
              f"{row['floor_unfused_us']:>9.2f}/{row['floor_fused_us']:.2f}", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)
    record["seconds"] = time.monotonic() - began
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    print(f"{len(record['rows'])} rows, {len(record['failed'])} failed, {len(record['skipped'])} skipped, "
          f"{record['seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
