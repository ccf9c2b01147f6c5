"""The unfused computation: the matmul, then the functional collective (NCCL on GPUs).

What every op falls back to, and what every other path must reproduce: a path that cannot take a
call, a group that cannot run symmetric paths, calls inside a CUDA-graph capture that the graph
lane does not take. Needs no workspace and supports every call."""

from __future__ import annotations

from .base import Path


class Nccl(Path):
    name = "nccl"
    symmetric = False
    capture = True

    def __init__(self, op: str):
        self.op = op

    def supports(self, call, facts):
        return None


MM_ALL_REDUCE = Nccl("mm_all_reduce")
ALL_GATHER_MM = Nccl("all_gather_mm")
MM_REDUCE_SCATTER = Nccl("mm_reduce_scatter")
SCALED_MM_ALL_REDUCE = Nccl("scaled_mm_all_reduce")
ALL_GATHER_SCALED_MM = Nccl("all_gather_scaled_mm")
SCALED_MM_REDUCE_SCATTER = Nccl("scaled_mm_reduce_scatter")
ROWWISE_SCALED_MM_ALL_REDUCE = Nccl("rowwise_scaled_mm_all_reduce")
ALL_GATHER_ROWWISE_SCALED_MM = Nccl("all_gather_rowwise_scaled_mm")
ROWWISE_SCALED_MM_REDUCE_SCATTER = Nccl("rowwise_scaled_mm_reduce_scatter")
MM_ALL_REDUCE_ADD_RMS_NORM = Nccl("mm_all_reduce_add_rms_norm")
MM_REDUCE_SCATTER_ADD_RMS_NORM = Nccl("mm_reduce_scatter_add_rms_norm")
