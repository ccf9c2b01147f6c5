"""mm_all_reduce(a, cat(b1, b2, ...), ...)  ==>  mm_parts_all_reduce(a, [b1, b2, ...], ...)

A merged sum (``merge_sums.py``) multiplies one concatenation of the terms' weights. The
activations' concatenation costs nothing (Inductor writes each gradient straight into its
slice), but the weights are graph inputs, so their concatenation is a copy every step: 117 MB
per layer for the gate and up projections of an 8B-class model at 2 ranks (read and written,
~80 µs of H200 bandwidth). ``mm_parts_all_reduce`` takes the weights as they are; where its
path multiplies with cuBLAS (the copy-engine overlap these GEMM-bound sums take, cuBLAS with a
symmetric exchange, NCCL) each part multiplies its columns of ``a`` into the same output
(``reference.Parts``), and the Triton kernels' paths concatenate them at run time, as the graph
did before.

Applied after the fusion patterns to every fused ``mm_all_reduce`` whose right operand is a
``cat`` along rows read by nothing else; decided from the graph alone, so every rank rewrites
alike. ``COMMFUSE_WEIGHT_PARTS=0`` keeps the concatenation.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..config import weight_parts_allowed
from .common import aten, arg, insert_call, is_call, normalize_dim

NAME = "weight_parts"


def rewrite(graph: fx.Graph) -> int:
    """Rewrite every such call in ``graph``; returns how many."""
    if not weight_parts_allowed():
        return 0
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.commfuse.mm_all_reduce.default:
            continue
        a, cat, bias, group = node.args
        if not is_call(cat, (aten.cat.default,)) or len(cat.users) != 1:
            continue
        parts = list(arg(cat, 0, "tensors"))
        if len(parts) < 2 or normalize_dim(arg(cat, 1, "dim", 0), cat) != 0:
            continue
        new = insert_call(graph, node, torch.ops.commfuse.mm_parts_all_reduce.default,
                          (a, parts, bias, group), node)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        graph.erase_node(cat)
        done += 1
    return done
