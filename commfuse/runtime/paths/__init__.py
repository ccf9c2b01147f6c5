"""Every path of every op, by name: the registry the policy, the tuner, ``COMMFUSE_ALGO`` and the
report use. A path is one object in one module of this package (``base.py`` has the contract), which
decides; its module of ``running/`` runs it."""

from __future__ import annotations

from . import (after_gemm, ag_ce_overlap, ag_fused, ag_pull, ar_ce_overlap, ar_fused, ar_graph, ar_norm, nccl,
               rs_ce_overlap, rs_fused, rs_norm, rs_pull, split_k)
from .base import OPS, Call, Context, Path

#: In each op's order: NCCL first (the unfused computation), then the symmetric paths.
_ALL: tuple[Path, ...] = (
    nccl.MM_ALL_REDUCE, after_gemm.ONE_SHOT, after_gemm.TWO_SHOT, ar_ce_overlap.CE_OVERLAP, ar_graph.GRAPH,
    ar_fused.FUSED, split_k.SPLIT_K,
    nccl.ALL_GATHER_MM, ag_pull.PULL, ag_ce_overlap.CE_OVERLAP, ag_fused.FUSED,
    nccl.MM_REDUCE_SCATTER, rs_pull.PULL, rs_ce_overlap.CE_OVERLAP, rs_fused.FUSED,
    nccl.SCALED_MM_ALL_REDUCE, after_gemm.SCALED_ONE_SHOT, after_gemm.SCALED_TWO_SHOT, ar_graph.SCALED_GRAPH,
    ar_fused.SCALED_FUSED, split_k.SCALED_SPLIT_K,
    nccl.ALL_GATHER_SCALED_MM, ag_pull.SCALED_PULL, ag_fused.SCALED_FUSED,
    nccl.SCALED_MM_REDUCE_SCATTER, rs_pull.SCALED_PULL, rs_fused.SCALED_FUSED,
    nccl.ROWWISE_SCALED_MM_ALL_REDUCE, after_gemm.ROWWISE_ONE_SHOT, after_gemm.ROWWISE_TWO_SHOT, ar_fused.ROWWISE_FUSED,
    split_k.ROWWISE_SPLIT_K,
    nccl.ALL_GATHER_ROWWISE_SCALED_MM, ag_pull.ROWWISE_PULL, ag_fused.ROWWISE_FUSED,
    nccl.ROWWISE_SCALED_MM_REDUCE_SCATTER, rs_pull.ROWWISE_PULL, rs_fused.ROWWISE_FUSED,
    nccl.MM_ALL_REDUCE_ADD_RMS_NORM, ar_norm.ONE_SHOT, ar_norm.GRAPH,
    nccl.MM_REDUCE_SCATTER_ADD_RMS_NORM, rs_norm.PULL,
)

REGISTRY: dict[tuple[str, str], Path] = {(p.op, p.name): p for p in _ALL}


def by_op(op: str) -> list[Path]:
    return [p for p in _ALL if p.op == op]


def names(op: str | None = None) -> list[str]:
    """The path names of ``op`` (of every op without one)."""
    return sorted({p.name for p in _ALL if op is None or p.op == op})


__all__ = ["OPS", "REGISTRY", "Call", "Context", "Path", "by_op", "names"]
