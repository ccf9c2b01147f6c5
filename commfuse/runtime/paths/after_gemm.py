"""``mm_all_reduce`` as cuBLAS into the symmetric workspace, then one exchange kernel that sums the
ranks' partials: ``one_shot`` (every rank reads every peer's whole partial; one wait) or
``two_shot`` (each rank sums one share and pushes it back; two waits, 2 (world - 1) / world of the
bytes per rank, which pays from 3 ranks and large outputs).

    unfused:   mm(a, b) -> all_reduce(partial) -> out
    this path: mm(a, b) into the workspace's half of this call -> exchange kernel -> out

Nothing overlaps: the gain over unfused is the exchange itself (a kernel reading NVLink directly
against NCCL's ring latency), largest where the output is small.

The FP8 all-reduces (``scaled_mm_all_reduce``, ``rowwise_scaled_mm_all_reduce``) run the same way,
their product the graph's own ``_scaled_mm`` (``OpSpec.product``: cuBLAS writes its bf16 or fp32
output into the workspace), the exchange on that output: nothing of the GEMM changes, so these paths
run wherever the unfused graph's ``_scaled_mm`` runs.
"""

from __future__ import annotations


from .base import Call, Path


class AfterGemm(Path):
    def __init__(self, name: str, op: str = "mm_all_reduce"):
        self.name, self.op = name, op

    def workspace_bytes(self, call: Call) -> int:
        return call.m * call.n * call.itemsize


ONE_SHOT = AfterGemm("one_shot")
TWO_SHOT = AfterGemm("two_shot")
SCALED_ONE_SHOT = AfterGemm("one_shot", "scaled_mm_all_reduce")
SCALED_TWO_SHOT = AfterGemm("two_shot", "scaled_mm_all_reduce")
ROWWISE_ONE_SHOT = AfterGemm("one_shot", "rowwise_scaled_mm_all_reduce")
ROWWISE_TWO_SHOT = AfterGemm("two_shot", "rowwise_scaled_mm_all_reduce")
