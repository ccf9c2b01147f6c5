"""How each path runs a call, apart from how it is decided (``paths/``): one module per path
module, importing its kernels (and Triton) when it is imported, so no import happens on a call's
way and nothing that decides needs Triton.

``run(path, ctx, args)`` runs ``path`` (a ``paths.Path``) for one call of its op; ``runner(path)``
is the function it calls, which the run-time's plans keep.
"""

from __future__ import annotations

from collections.abc import Callable

from .. import paths
from . import (after_gemm, ag_overlap, ag_pull, ce_all_reduce, graph_lane, nccl, rs_overlap, rs_pull, split_k,
               tile_all_gather, tile_all_reduce, tile_reduce_scatter)

#: What runs each path of ``paths.REGISTRY``: ``fn(path, ctx, args)``.
RUNS: dict[paths.Path, Callable] = {
    paths.nccl.MM_ALL_REDUCE: nccl.run, paths.nccl.ALL_GATHER_MM: nccl.run, paths.nccl.MM_REDUCE_SCATTER: nccl.run,
    paths.after_gemm.ONE_SHOT: after_gemm.run, paths.after_gemm.TWO_SHOT: after_gemm.run,
    paths.ce_all_reduce.CE_OVERLAP: ce_all_reduce.run, paths.graph_lane.GRAPH: graph_lane.run,
    paths.tile_all_reduce.FUSED: tile_all_reduce.run, paths.split_k.SPLIT_K: split_k.run,
    paths.ag_pull.SYMM: ag_pull.run, paths.ag_overlap.OVERLAP: ag_overlap.run,
    paths.tile_all_gather.FUSED: tile_all_gather.run,
    paths.rs_pull.SYMM: rs_pull.run, paths.rs_overlap.CE_OVERLAP: rs_overlap.run,
    paths.tile_reduce_scatter.FUSED: tile_reduce_scatter.run,
}


def runner(path: paths.Path) -> Callable:
    return RUNS[path]


def run(path: paths.Path, ctx, args):
    """Run ``path`` for one call (``ctx``: ``paths.base.make_context``'s)."""
    return RUNS[path](path, ctx, args)
