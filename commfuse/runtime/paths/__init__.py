"""Every path of every op, by name: the registry the policy, the tuner, ``COMMFUSE_ALGO`` and the
report use. A path is one object in one module of this package (``base.py`` has the contract)."""

from __future__ import annotations

from . import (after_gemm, ag_overlap, ag_pull, ce_all_reduce, graph_lane, nccl, rs_overlap, rs_pull, split_k,
               tile_all_gather, tile_all_reduce, tile_reduce_scatter)
from .base import OPS, Call, Context, Path

#: In each op's order: NCCL first (the unfused computation), then the symmetric paths.
_ALL: tuple[Path, ...] = (
    nccl.MM_ALL_REDUCE, after_gemm.ONE_SHOT, after_gemm.TWO_SHOT, ce_all_reduce.CE_OVERLAP, graph_lane.GRAPH,
    tile_all_reduce.FUSED, split_k.SPLIT_K,
    nccl.ALL_GATHER_MM, ag_pull.SYMM, ag_overlap.OVERLAP, tile_all_gather.FUSED,
    nccl.MM_REDUCE_SCATTER, rs_pull.SYMM, rs_overlap.CE_OVERLAP, tile_reduce_scatter.FUSED,
)

REGISTRY: dict[tuple[str, str], Path] = {(p.op, p.name): p for p in _ALL}


def by_op(op: str) -> list[Path]:
    return [p for p in _ALL if p.op == op]


def names(op: str | None = None) -> list[str]:
    """The path names of ``op`` (of every op without one)."""
    return sorted({p.name for p in _ALL if op is None or p.op == op})


__all__ = ["OPS", "REGISTRY", "Call", "Context", "Path", "by_op", "names"]
