"""What the pairing check (``COMMFUSE_PAIRING_CHECK``) costs the kernels, on one GPU: each kernel
of an emulated group (``commfuse.tools.emulated``, every rank a workspace and a stream of its own
on the one device) timed with tags off and on, the two interleaved round by round.

    python benchmarks/pairing_check.py --out pairing.json [--world 2] [--rounds 7] [--iters 50]

With the check on a wait compares its peer's tag once its count arrived, and the split-K kernel
exchanges with flags instead of LL words (which have no room for a tag); the split-K rows show
that switch. An emulated group shares one device's SMs and memory between its ranks: the figures
show the protocol's cost, not the link's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

# every kernel loaded when CUDA starts: one thread launches every emulated rank
# (``commfuse.tools.emulated``)
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import torch  # noqa: E402

from commfuse.kernels import exchange, fused_all_reduce, fused_split_k, tiles
from commfuse.kernels.codes import OP_MM_ALL_REDUCE
from commfuse.runtime import errors
from commfuse.tools import emulated

DT = torch.bfloat16
TAG = 0x155


def _cases(world: int, programs: int) -> list:
    """(name, make(ws) -> launches per rank, bytes per parity) for each kernel and size."""
    cases = []
    for m, n in ((16, 4096), (256, 4096), (2048, 4096)):
        def one_shot(ws, m=m, n=n):
            outs = [torch.empty(m, n, device="cuda", dtype=DT) for _ in ws]

            def run(r, epoch, parity):  # (the partials: whatever the halves hold; the exchange is timed)
                exchange.all_reduce(ws[r], ws[r].data(parity, (m, n), DT), outs[r], epoch, "one_shot",
                                    OP_MM_ALL_REDUCE)
            return run
        cases.append((f"one_shot {m}x{n}", one_shot, m * n * DT.itemsize, None))
    for m, k, n in ((16, 4096, 4096), (64, 4096, 4096)):
        default = fused_split_k.config(m, k, n, programs)
        takes_ll = fused_split_k.uses_ll(default, m, n, world, DT)
        for ll in ((None, False) if takes_ll else (False,)):  # where LL does not apply: flags alone
            cfg = fused_split_k.config(m, k, n, programs, ll=ll)

            def split_k(ws, m=m, k=k, n=n, cfg=cfg):
                a = [torch.randn(m, k, device="cuda", dtype=DT) for _ in ws]
                b = [(torch.randn(n, k, device="cuda", dtype=DT) / k ** 0.5).t() for _ in ws]
                outs = [torch.empty(m, n, device="cuda", dtype=DT) for _ in ws]
                launches = [fused_split_k.prepare(ws[r], a[r], b[r], None, outs[r], cfg) for r in range(len(ws))]
                return lambda r, epoch, parity: launches[r](epoch, parity)
            label = "LL words (the default)" if ll is None else ("flags" if takes_ll else "flags (the default)")
            cases.append((f"split_k {m}x{k}x{n} {label}", split_k,
                          fused_split_k.data_bytes(m, n, world, cfg, DT), ll))
    cfg = tiles.TileConfig.parse("128x256x64s3w8g8r0o1")
    m, k, n = 2048, 2048, 4096

    def fused(ws):
        a = [torch.randn(m, k, device="cuda", dtype=DT) for _ in ws]
        b = [(torch.randn(n, k, device="cuda", dtype=DT) / k ** 0.5).t() for _ in ws]
        outs = [torch.empty(m, n, device="cuda", dtype=DT) for _ in ws]
        launches = [fused_all_reduce.prepare(ws[r], a[r], b[r], None, outs[r], cfg) for r in range(len(ws))]
        return lambda r, epoch, parity: launches[r](epoch, parity)
    cases.append((f"fused {m}x{k}x{n}", fused, fused_all_reduce.data_elems(m, n, world, cfg, False) * DT.itemsize,
                  None))
    return cases


def _time(ws, streams, run, tag: int, iters: int) -> float:
    """µs per call of every rank's launch, ``iters`` calls back to back."""
    main = torch.cuda.current_stream()
    for s in streams:
        s.wait_stream(main)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(main)
    for s in streams:
        s.wait_event(start)
    for _ in range(iters):
        for r, s in enumerate(streams):
            epoch, parity = ws[r].next_epoch(tag=tag)
            with torch.cuda.stream(s):
                run(r, epoch, parity)
    for s in streams:
        main.wait_stream(s)
    end.record(main)
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="")
    args = p.parse_args()
    programs = torch.cuda.get_device_properties(0).multi_processor_count // args.world
    rows = []
    for name, make, nbytes, ll in _cases(args.world, programs):
        ws = emulated.group(args.world, nbytes, timeout_s=30.0)
        streams = [torch.cuda.Stream() for _ in ws]
        run = make(ws)
        # split-K's LL words time with tags off only (the check takes them off)
        tags = (0,) if ll is None and name.startswith("split_k") else (0, TAG)
        times = {t: [] for t in tags}
        for t in tags:
            _time(ws, streams, run, t, 5)  # compile and warm up
        for _ in range(args.rounds):
            for t in tags:
                times[t].append(_time(ws, streams, run, t, args.iters))
        errors.check(emulated.GroupState(ws[0]))  # no wait timed out or met another call
        row = {"case": name, "world": args.world, "off_us": statistics.median(times[0])}
        if TAG in times:
            row["on_us"] = statistics.median(times[TAG])
            row["on_over_off"] = row["on_us"] / row["off_us"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
