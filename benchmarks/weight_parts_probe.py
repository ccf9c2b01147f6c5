"""What a merged sum's weight concatenation (``patterns/merge_sums.py``) costs the copy-engine
all-reduce's GEMMs, and whether multiplying the weights as parts would save it, on one GPU: per
shape, the row-chunked cuBLAS GEMMs of ``cuda_paths._copy_engine_overlapped`` (the chunks of
``dispatch.copy_engine_rows``) with the weights concatenated first (what a merged sum's graph
does), with the weights as parts (each chunk one product per part, the later ones added in place
with cuBLAS's ``beta = 1``), and with a concatenation made once outside the timing (the GEMMs
alone). Each checked against fp32 first. No process group. (Measured in session 20: the parts
save 12 µs of 1236 at 8192 rows, so the graph keeps the concatenation; ``NOTES.md`` §37.)

    python benchmarks/weight_parts_probe.py [--shapes M:K1+K2+...:N,...]
"""

from __future__ import annotations

import argparse

import torch

from commfuse.bench import time_us
from commfuse.kernels import dispatch

#: The DTensor Llama stack's merged input-gradient sums at 8B sizes, TP=2, 4 x 2048 tokens:
#: gate/up (w1, w3) and q/k/v.
SHAPES = "8192:7168+7168:4096,8192:2048+512+512:4096,4096:7168+7168:4096"


def chunked(a, b, out, rows) -> None:
    """``out = a @ b`` in row chunks; ``b`` a list: each part times its columns of ``a``, summed."""
    parts = b if isinstance(b, list) else [b]
    for a_i, out_i in zip(a.split(rows), out.split(rows)):
        k = 0
        for j, part in enumerate(parts):
            cols = a_i[:, k:k + part.shape[0]]
            if j == 0:
                torch.mm(cols, part, out=out_i)
            else:
                out_i.addmm_(cols, part)
            k += part.shape[0]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=SHAPES)
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    for shape in args.shapes.split(","):
        m, ks, n = shape.split(":")
        m, n, ks = int(m), int(n), [int(k) for k in ks.split("+")]
        a = torch.randn(m, sum(ks), device="cuda", dtype=torch.bfloat16)
        parts = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / sum(ks) ** 0.5 for k in ks]
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        rows = dispatch.copy_engine_rows(m)
        whole = torch.cat(parts)
        ref = a.float() @ whole.float()
        runs = {"cat then GEMMs": lambda: chunked(a, torch.cat(parts), out, rows),
                "parts": lambda: chunked(a, parts, out, rows),
                "GEMMs alone": lambda: chunked(a, whole, out, rows),
                "cat alone": lambda: torch.cat(parts)}
        times, errs = {}, {}
        for name, run in runs.items():
            out.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            if name != "cat alone":
                errs[name] = ((out.float() - ref).norm() / ref.norm()).item()
            times[name] = time_us(run)
        print(f"{shape} ({len(rows)} chunks): " + ", ".join(
            f"{name} {t:.1f} us" + (f" (err {errs[name]:.1e})" if name in errs else "") for name, t in times.items()),
            flush=True)


if __name__ == "__main__":
    main()
