"""How each path runs a call, apart from how it is decided (``paths/``): one module per path
module (and ``common.py``, what the graph-lane runs share), importing its kernels (and Triton) when
it is imported, so no import happens on a call's way and nothing that decides needs Triton.

``run(path, ctx, args)`` runs ``path`` (a ``paths.Path``) for one call of its op; ``runner(path)``
is the function it calls, which the run-time's plans keep.
"""

from __future__ import annotations

from collections.abc import Callable

from .. import paths
from . import (after_gemm, ag_ce_overlap, ag_fused, ag_pull, ar_ce_overlap, ar_fused, ar_graph, ar_norm, nccl,
               rs_ce_overlap, rs_fused, rs_norm, rs_pull, split_k)

#: What runs each path of ``paths.REGISTRY``: ``fn(path, ctx, args)``. Every op's NCCL path runs
#: its spec's unfused computation, so an op added with only that path runs too.
RUNS: dict[paths.Path, Callable] = {
    **{p: nccl.run for p in paths.REGISTRY.values() if isinstance(p, paths.nccl.Nccl)},
    paths.after_gemm.ONE_SHOT: after_gemm.run, paths.after_gemm.TWO_SHOT: after_gemm.run,
    paths.ar_ce_overlap.CE_OVERLAP: ar_ce_overlap.run, paths.ar_graph.GRAPH: ar_graph.run,
    paths.ar_fused.FUSED: ar_fused.run, paths.split_k.SPLIT_K: split_k.run,
    paths.ag_pull.PULL: ag_pull.run, paths.ag_ce_overlap.CE_OVERLAP: ag_ce_overlap.run,
    paths.ag_fused.FUSED: ag_fused.run,
    paths.rs_pull.PULL: rs_pull.run, paths.rs_ce_overlap.CE_OVERLAP: rs_ce_overlap.run,
    paths.rs_fused.FUSED: rs_fused.run, paths.ar_norm.ONE_SHOT: ar_norm.run,
    paths.ar_norm.GRAPH: ar_norm.run_graph, paths.rs_norm.PULL: rs_norm.run,
    # the FP8 ops' paths: the same runs, the op's own product (``OpSpec.product``)
    paths.after_gemm.SCALED_ONE_SHOT: after_gemm.run, paths.after_gemm.SCALED_TWO_SHOT: after_gemm.run,
    paths.after_gemm.ROWWISE_ONE_SHOT: after_gemm.run, paths.after_gemm.ROWWISE_TWO_SHOT: after_gemm.run,
    paths.ag_pull.SCALED_PULL: ag_pull.run, paths.ag_pull.ROWWISE_PULL: ag_pull.run_rowwise,
    paths.rs_pull.SCALED_PULL: rs_pull.run, paths.rs_pull.ROWWISE_PULL: rs_pull.run,
    paths.ar_fused.SCALED_FUSED: ar_fused.run, paths.rs_fused.SCALED_FUSED: rs_fused.run,
    paths.ag_fused.SCALED_FUSED: ag_fused.run, paths.ar_graph.SCALED_GRAPH: ar_graph.run,
    paths.ag_fused.ROWWISE_FUSED: ag_fused.run_rowwise, paths.ar_fused.ROWWISE_FUSED: ar_fused.run,
    paths.rs_fused.ROWWISE_FUSED: rs_fused.run, paths.split_k.SCALED_SPLIT_K: split_k.run,
    paths.split_k.ROWWISE_SPLIT_K: split_k.run,
}


def runner(path: paths.Path) -> Callable:
    return RUNS[path]


def run(path: paths.Path, ctx, args):
    """Run ``path`` for one call (``ctx``: ``paths.base.make_context``'s)."""
    return RUNS[path](path, ctx, args)
