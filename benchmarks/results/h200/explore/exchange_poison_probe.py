"""One GPU: the exchange kernels before and after the late-peer poison (session 22), an emulated
pair of ranks (each rank a workspace with half the SMs and a stream of its own), one-shot and
two-shot of a bf16 [M, N] partial, checked against fp32 with outputs NaN-poisoned, then timed in
alternating rounds (CUDA events around 50 calls queued behind a GPU sleep, so the host is ahead: the mean per call, per round).

    python benchmarks/results/h200/explore/exchange_poison_probe.py
(needs commfuse/kernels/_exchange_before.py: ``git show bf2c4c2~1:commfuse/kernels/exchange.py``)
"""
import statistics

import torch

from commfuse.kernels import _exchange_before as before, emulated, exchange as after
from commfuse.kernels.sync import OP_MM_ALL_REDUCE, check_errors

DT, WORLD = torch.bfloat16, 2
shapes = [(16, 4096), (128, 8192), (1024, 4096), (4096, 8192)]
streams = [torch.cuda.Stream() for _ in range(WORLD)]
rows = []
for m, n in shapes:
    ws = emulated.group(WORLD, m * n * DT.itemsize)
    parts = [torch.randn(m, n, device="cuda", dtype=DT) for _ in range(WORLD)]
    ref = sum(p.float() for p in parts)
    outs = [torch.full((m, n), float("nan"), device="cuda", dtype=DT) for _ in range(WORLD)]

    def call(mod, algo):
        for r, s in enumerate(streams):
            epoch, parity = ws[r].next_epoch()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                partial = ws[r].data(parity, (m, n), DT)
                mod.all_reduce(ws[r], partial, outs[r], epoch, algo, OP_MM_ALL_REDUCE)
        for s in streams:
            torch.cuda.current_stream().wait_stream(s)

    for algo in ("one_shot", "two_shot"):
        for mod in (before, after):
            for r in range(WORLD):
                outs[r].fill_(float("nan"))
            for r in range(WORLD):  # the partials go where the next call's parity reads them
                ws[r].data((ws[r].epoch + 1) % 2, (m, n), DT).copy_(parts[r])
            call(mod, algo)
            torch.cuda.synchronize()
            check_errors()
            for r in range(WORLD):
                err = ((outs[r].float() - ref).norm() / ref.norm()).item()
                assert err < 1e-2, (mod.__name__, algo, m, n, r, err)
        times = {"before": [], "after": []}
        for rnd in range(4):
            for name, mod in (("before", before), ("after", after)) if rnd % 2 == 0 else (("after", after), ("before", before)):
                for _ in range(5):
                    call(mod, algo)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(20_000_000)  # the host queues every call before the GPU starts them
                a.record()
                for _ in range(50):
                    call(mod, algo)
                b.record()
                torch.cuda.synchronize()
                times[name].append(a.elapsed_time(b) * 1e3 / 50)
        check_errors()
        row = (f"{algo} {m}x{n}: before {statistics.median(times['before']):.1f} us "
               f"(rounds {', '.join(f'{t:.1f}' for t in times['before'])}), after {statistics.median(times['after']):.1f} us "
               f"(rounds {', '.join(f'{t:.1f}' for t in times['after'])})")
        print(row, flush=True)
