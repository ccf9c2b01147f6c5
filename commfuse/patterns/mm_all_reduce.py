"""matmul -> all_reduce(sum)  ==>  commfuse.mm_all_reduce

The second half of a row-parallel linear (and the input-gradient of a column-parallel one)::

    before:  mm = mm(a, b) | addmm(bias, a, b)
             v  = reshape(mm, ...)            # zero or more views (3-D F.linear input)
             ar = all_reduce(v, "sum", g)     # or the in-place all_reduce_
             w  = wait_tensor(ar)  -> users

    after:   f  = commfuse.mm_all_reduce(a, b, bias, g)
             v' = reshape(f, ...)             # the same views, applied to the reduced result
                  -> users of w

The FP8 form, ``_scaled_mm(a, b, scale_a, scale_b, bias, None, out_dtype, use_fast_accum)`` in
the matmul's place (torchao's float8 row-parallel linear, an FP8-weight model's), becomes
``commfuse.scaled_mm_all_reduce(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, g)``
(tensor-wise scales only: ``common.scaled_operands`` says what else stays unfused and why).

Skipped, with the reason recorded: reduce ops other than sum, an all_reduce whose input is not a
matmul (through views), a matmul or view with other users (its partial would be lost), an
``addmm`` with alpha/beta, a result read without ``wait_tensor``, dtypes other than fp16/bf16/fp32,
M*N*K under the threshold, and matmuls inside excluded modules.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from .common import (
    SCALED_MM,
    Scaled,
    Skip,
    arg,
    fused_op,
    c10d,
    check_fusable,
    fused_args,
    insert_call,
    PostScale,
    is_call,
    matmul_operands,
    product_through_views,
    require_sum,
    scaled_operands,
    single_wait_users,
)

NAME = "mm_all_reduce"
#: The op (and report name) of the FP8 form.
FP8_NAME = "scaled_mm_all_reduce"
#: The op (and report name) of the row-wise FP8 form.
ROWWISE_NAME = "rowwise_scaled_mm_all_reduce"
ANCHORS = (c10d.all_reduce.default, c10d.all_reduce_.default)


@dataclasses.dataclass
class MmAllReduceMatch:
    all_reduce: fx.Node
    waits: list[fx.Node]
    views: list[fx.Node]  # nearest the all_reduce first
    mm: fx.Node
    a: fx.Node
    b: fx.Node
    bias: fx.Node | None
    group_name: str
    scaled: Scaled | None = None  # the FP8 form's scales and output
    post: PostScale | None = None  # the row-wise backward's scaling after the product

    @property
    def op(self):
        return fused_op(self.scaled, (NAME, FP8_NAME, ROWWISE_NAME))

    @classmethod
    def from_anchor(cls, ar: fx.Node, settings) -> "MmAllReduceMatch":
        """The match rooted at the all_reduce ``ar``, or Skip with the reason."""
        require_sum(ar)
        x, views, post = product_through_views(ar.args[0], "all_reduce")
        try:
            a, b, bias = matmul_operands(x)
            scaled = scaled_operands(x, rowwise_ok=True, post=post) if is_call(x, (SCALED_MM,)) else None
            waits = single_wait_users(ar, "all_reduce")
            check_fusable(x, a, b, bias, settings, graph_lane=scaled is None, scaled=scaled)
        except Skip as exc:
            raise Skip(str(exc), mm=x) from None
        return cls(ar, waits, views, x, a, b, bias, arg(ar, 2, "group_name"), scaled, post)

    def replace(self, graph: fx.Graph) -> fx.Node:
        out = insert_call(graph, self.all_reduce, self.op,
                          fused_args(self.a, self.b, self.bias, self.scaled, (self.group_name,)), self.mm)
        for view in reversed(self.views):  # re-apply the views to the reduced result
            out = insert_call(graph, self.all_reduce, view.target, (out, *view.args[1:]), view)
        for wait in self.waits:
            wait.replace_all_uses_with(out)
        post = list(self.post.nodes) if self.post else []
        for node in [*self.waits, self.all_reduce, *self.views, *post, self.mm]:  # consumers first
            graph.erase_node(node)
        if self.post is not None and not self.post.scale.users:  # the scales' product: the op multiplies them
            graph.erase_node(self.post.scale)
        return out


MATCH = MmAllReduceMatch
