"""How fast the copy engines move a partial between two GPUs, and what slows them inside the
copy-engine all-reduce: one large copy against chunks back to back, pulls against pushes, a
barrier kernel between chunks (the path's protocol), and chunked cuBLAS GEMMs running beside.
Timing only (the data moved is not checked). Under torchrun with 2 processes:

    torchrun --nproc_per_node=2 benchmarks/ce_rate.py [--chunks 4,8] [--m 8192 --k 2048 --n 4096] [--out F]
"""

from __future__ import annotations

import argparse
import sys

import torch

from commfuse.bench import sweep_finish, sweep_setup, time_us
from commfuse.kernels import exchange, symm
from commfuse.kernels.sync import OP_MM_ALL_REDUCE


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=8192)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--chunks", default="4,8")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    chunk_counts = [int(c) for c in args.chunks.split(",")]
    if any(c < 1 or args.m % c for c in chunk_counts):
        p.error(f"--m {args.m} must split into each of --chunks {args.chunks}")
    group, rank = sweep_setup()
    dev = torch.device("cuda", torch.cuda.current_device())
    m, k, n = args.m, args.k, args.n
    nbytes = m * n * 2
    ws = symm.workspace(group.group_name, 2 * nbytes, dev)
    peer = 1 - rank
    mine = ws.data(0, (m, n), torch.bfloat16)  # what the peer pulls
    landing = ws.data(0, (m, n), torch.bfloat16, nbytes)  # where the peer pushes
    theirs = ws.peer_data(peer, 0, (2 * m, n), torch.bfloat16)
    peer_src, peer_dst = theirs[:m], theirs[m:]
    local = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    mine.copy_(local)
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=dev, dtype=torch.bfloat16).t()
    side = torch.cuda.Stream(dev)
    main = torch.cuda.current_stream(dev)
    records = []

    def run(name, fn, moved):
        us = time_us(fn)
        rec = dict(name=name, us=us, gbps=moved / us / 1e3 if moved else None)
        records.append(rec)
        if rank == 0:
            rate = f", {rec['gbps']:.0f} GB/s each way" if moved else ""
            print(f"{name}: {us:.1f} us{rate}", flush=True)

    def copies(chunks, push, barrier=False, gemm=False):
        rows = m // chunks
        src = (local if push else peer_src).split(rows)
        dst = (peer_dst if push else landing).split(rows)
        a_rows, out_rows = a.split(rows), mine.split(rows)

        def fn():
            side.wait_stream(main)
            done = []
            if gemm:
                for a_i, o_i in zip(a_rows, out_rows):
                    torch.mm(a_i, b, out=o_i)
                    done.append(main.record_event())
            epoch = ws.next_epoch()[0] if barrier else 0
            with torch.cuda.stream(side):
                for i in range(chunks):
                    if gemm:
                        side.wait_event(done[i])
                    if barrier:
                        exchange.barrier(ws, epoch, OP_MM_ALL_REDUCE, slot=i)
                    dst[i].copy_(src[i], non_blocking=True)
            main.wait_stream(side)
        return fn

    run("gemm alone (one GEMM)", lambda: torch.mm(a, b, out=mine), 0)
    for chunks in chunk_counts:
        rows = m // chunks
        run(f"gemm alone ({chunks} chunks)", lambda: [torch.mm(x, b, out=o) for x, o in zip(a.split(rows), mine.split(rows))], 0)
    run("pull one copy", lambda: landing.copy_(peer_src), nbytes)
    run("push one copy", lambda: peer_dst.copy_(local), nbytes)
    for chunks in chunk_counts:
        for push in (False, True):
            way = "push" if push else "pull"
            run(f"{way} {chunks} chunks back to back", copies(chunks, push), nbytes)
            run(f"{way} {chunks} chunks, a barrier before each", copies(chunks, push, barrier=True), nbytes)
            run(f"{way} {chunks} chunks beside the chunked GEMM", copies(chunks, push, gemm=True), nbytes)
            run(f"{way} {chunks} chunks beside the chunked GEMM, a barrier before each",
                copies(chunks, push, barrier=True, gemm=True), nbytes)
    out = torch.empty_like(local)
    run("one-shot all-reduce alone (SM loads)",
        lambda: exchange.all_reduce(ws, mine, out, ws.next_epoch()[0], "one_shot", OP_MM_ALL_REDUCE), nbytes)
    return sweep_finish(records, args.out)


if __name__ == "__main__":
    sys.exit(main())
