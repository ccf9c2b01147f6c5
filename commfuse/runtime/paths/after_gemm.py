"""``mm_all_reduce`` as cuBLAS into the symmetric workspace, then one exchange kernel that sums the
ranks' partials: ``one_shot`` (every rank reads every peer's whole partial; one wait) or
``two_shot`` (each rank sums one share and pushes it back; two waits, 2 (world - 1) / world of the
bytes per rank, which pays from 3 ranks and large outputs).

    unfused:   mm(a, b) -> all_reduce(partial) -> out
    this path: mm(a, b) into the workspace's half of this call -> exchange kernel -> out

Nothing overlaps: the gain over unfused is the exchange itself (a kernel reading NVLink directly
against NCCL's ring latency), largest where the output is small.
"""

from __future__ import annotations

import torch

from ...kernels import exchange
from ...kernels.sync import OP_MM_ALL_REDUCE
from .base import Call, Context, Path
from .common import exchange as epoch_of, matmul_into, workspace


class AfterGemm(Path):
    op = "mm_all_reduce"

    def __init__(self, name: str):
        self.name = name

    def workspace_bytes(self, call: Call) -> int:
        return call.m * call.n * call.itemsize

    def run(self, ctx: Context, args) -> torch.Tensor:
        a, b, bias = args.a, args.b, args.bias
        m, n = a.shape[0], b.shape[1]
        ws = workspace(ctx, m * n * a.dtype.itemsize, a.device)
        out = torch.empty((m, n), dtype=a.dtype, device=a.device)  # allocations before the epoch
        with epoch_of(ctx, ws, self.op) as (epoch, parity):
            partial = ws.data(parity, (m, n), a.dtype)
            matmul_into(a, b, bias, partial)
            exchange.all_reduce(ws, partial, out, epoch, self.name, OP_MM_ALL_REDUCE)
        return out


ONE_SHOT = AfterGemm("one_shot")
TWO_SHOT = AfterGemm("two_shot")
