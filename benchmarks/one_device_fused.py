"""One GPU, no torchrun: the fused all-reduce kernel as an emulated group of ranks
(``commfuse.kernels.emulated``: every rank a workspace on this GPU with 1/world of its SMs and a
stream of its own), per variant (environment settings read when a call is prepared), in
alternating rounds, after checking each variant against an fp32 reference on fresh data with
the outputs NaN-poisoned. Also the GEMMs alone the same way (cuBLAS, one per rank's stream).

What it can show: how a change to the kernel's own memory traffic moves a call, with every
exchanged byte also costing this one device's HBM (a remote store is local here). Not a 2-GPU
number, and not a floor.

    python benchmarks/one_device_fused.py [--shapes MxKxN,...] [--variants default,tma_push,...]
        [--world 2] [--rounds 3] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from commfuse.bench import time_us
from commfuse.kernels import dispatch, emulated, fused_all_reduce
from commfuse.kernels.sync import check_errors

#: Settings to compare (999477e also had the epilogue's local traffic through TMA descriptors,
#: ``COMMFUSE_FUSED_TMA_EPILOGUE``: slower, reverted; ``results/h200/README.md``).
VARIANTS = {
    "default": {},
    "tma_push": {"COMMFUSE_FUSED_TMA_PUSH": "1"},
    "stagger0": {"COMMFUSE_FUSED_STAGGER_US": "0"},
    "lag2": {"COMMFUSE_AR_COPY_LAG": "2"},
}
SHAPES = "1024x2048x4096,4096x2048x4096,4096x4096x8192,8192x2048x4096"


def _setting(env: dict):
    """Apply ``env`` and return what to restore."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    return saved


def _restore(saved: dict) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


class Case:
    """One shape on an emulated group: operands per rank, the fp32 reference, outputs, streams."""

    def __init__(self, world: int, m: int, k: int, n: int, seed: int = 0):
        torch.manual_seed(seed + m + k + n)
        self.world, self.m, self.k, self.n = world, m, k, n
        self.cfg = dispatch.tile_config(m, k, n, False)
        dt = torch.bfloat16
        self.a = [torch.randn(m, k, device="cuda", dtype=dt) for _ in range(world)]
        self.b = [(torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5).t() for _ in range(world)]  # W.t()
        self.outs = [torch.empty(m, n, device="cuda", dtype=dt) for _ in range(world)]
        self.ws = emulated.group(world, fused_all_reduce.data_elems(m, n, world, self.cfg) * dt.itemsize)
        self.streams = [torch.cuda.Stream() for _ in range(world)]

    def fused(self) -> None:
        """One call on every rank, each on its own stream, joined back into the current one."""
        main = torch.cuda.current_stream()
        launches = [fused_all_reduce.prepare(self.ws[r], self.a[r], self.b[r], None, self.outs[r], self.cfg)
                    for r in range(self.world)]
        for r, s in enumerate(self.streams):
            s.wait_stream(main)
            with torch.cuda.stream(s):
                launches[r](*self.ws[r].next_epoch())
        for s in self.streams:
            main.wait_stream(s)

    def gemms(self) -> None:
        main = torch.cuda.current_stream()
        for r, s in enumerate(self.streams):
            s.wait_stream(main)
            with torch.cuda.stream(s):
                torch.mm(self.a[r], self.b[r], out=self.outs[r])
        for s in self.streams:
            main.wait_stream(s)

    def check(self) -> float:
        """Relative error of every rank's output against fp32, outputs poisoned first."""
        ref = sum(x.float() @ y.float() for x, y in zip(self.a, self.b))
        for o in self.outs:
            o.fill_(float("nan"))
        self.fused()
        torch.cuda.synchronize()
        check_errors()
        worst = 0.0
        for o in self.outs:
            if not torch.isfinite(o).all():
                raise AssertionError(f"{self.m}x{self.k}x{self.n}: unwritten (NaN-poisoned) output")
            worst = max(worst, ((o.float() - ref).norm() / ref.norm()).item())
        if worst > 1e-2:
            raise AssertionError(f"{self.m}x{self.k}x{self.n}: relative error {worst:.2e}")
        return worst


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=SHAPES)
    p.add_argument("--variants", default="default,tma_push")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="JSON file for the results")
    args = p.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
    print(f"{torch.cuda.get_device_name()}: {args.world} emulated ranks, {args.rounds} rounds", flush=True)
    rows = []
    for shape in args.shapes.split(","):
        m, k, n = (int(x) for x in shape.split("x"))
        case = Case(args.world, m, k, n)
        times = {v: [] for v in ["gemms"] + variants}
        for v in variants:
            saved = _setting(VARIANTS[v])
            try:
                err = case.check()
            finally:
                _restore(saved)
            print(f"{shape} {v}: relative error {err:.2e}", flush=True)
        for _ in range(args.rounds):
            times["gemms"].append(time_us(case.gemms))
            for v in variants:
                saved = _setting(VARIANTS[v])
                try:
                    times[v].append(time_us(case.fused))
                finally:
                    _restore(saved)
        check_errors()
        row = {"shape": shape, "world": args.world, "cfg": str(case.cfg),
               **{v: [round(t, 1) for t in ts] for v, ts in times.items()}}
        rows.append(row)
        print(f"{shape} ({case.cfg}) µs per round: " + "; ".join(
            f"{v} {', '.join(f'{t:.1f}' for t in ts)} (median {statistics.median(ts):.1f})"
            for v, ts in times.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
