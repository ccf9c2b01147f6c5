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


from .base import Call, Path


class AfterGemm(Path):
    op = "mm_all_reduce"

    def __init__(self, name: str):
        self.name = name

    def workspace_bytes(self, call: Call) -> int:
        return call.m * call.n * call.itemsize


ONE_SHOT = AfterGemm("one_shot")
TWO_SHOT = AfterGemm("two_shot")
