"""matmul -> all_reduce(sum)  ==>  commfuse.mm_all_reduce

The second half of a row-parallel linear (and the input-gradient of a column-parallel one)::

    before:  mm = mm(a, b) | addmm(bias, a, b)
             v  = reshape(mm, ...)            # zero or more views (3-D F.linear input)
             ar = all_reduce(v, "sum", g)     # or the in-place all_reduce_
             w  = wait_tensor(ar)  -> users

    after:   f  = commfuse.mm_all_reduce(a, b, bias, g)
             v' = reshape(f, ...)             # the same views, applied to the reduced result
                  -> users of w

Skipped, with the reason recorded: reduce ops other than sum, an all_reduce whose input is not a
matmul (through views), a matmul or view with other users (its partial would be lost), an
``addmm`` with alpha/beta, a result read without ``wait_tensor``, dtypes other than fp16/bf16/fp32,
M*N*K under the threshold, and matmuls inside excluded modules.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .common import (
    Skip,
    arg,
    c10d,
    check_fusable,
    insert_call,
    matmul_operands,
    matmul_through_views,
    require_sum,
    single_wait_users,
)

NAME = "mm_all_reduce"
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

    @classmethod
    def from_anchor(cls, ar: fx.Node, settings) -> "MmAllReduceMatch":
        """The match rooted at the all_reduce ``ar``, or Skip with the reason."""
        require_sum(ar)
        x, views = matmul_through_views(ar.args[0], "all_reduce")
        try:
            a, b, bias = matmul_operands(x)
            waits = single_wait_users(ar, "all_reduce")
            check_fusable(x, a, b, bias, settings, graph_lane=True)
        except Skip as exc:
            raise Skip(str(exc), mm=x) from None
        return cls(ar, waits, views, x, a, b, bias, arg(ar, 2, "group_name"))

    def replace(self, graph: fx.Graph) -> fx.Node:
        out = insert_call(
            graph, self.all_reduce, torch.ops.commfuse.mm_all_reduce.default,
            (self.a, self.b, self.bias, self.group_name), self.mm,
        )
        for view in reversed(self.views):  # re-apply the views to the reduced result
            out = insert_call(graph, self.all_reduce, view.target, (out, *view.args[1:]), view)
        for wait in self.waits:
            wait.replace_all_uses_with(out)
        for node in [*self.waits, self.all_reduce, *self.views, self.mm]:  # consumers first
            graph.erase_node(node)
        return out


MATCH = MmAllReduceMatch
