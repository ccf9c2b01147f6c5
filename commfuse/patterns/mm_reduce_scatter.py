"""matmul -> reduce_scatter(sum)  ==>  commfuse.mm_reduce_scatter

The second half of a row-parallel linear under sequence parallelism (and the input-gradient of a
column-parallel one under it)::

    before:  mm = mm(a, b) | addmm(bias, a, b)
             v  = reshape(mm, shape)                      # zero or more views
             x  = v                                       # scatter along dim 0, or DTensor's form
                | cat(split(v, n, d)[0..world-1], 0)      # for a scatter along dim d
             rs = reduce_scatter_tensor(x, "sum", world, g)
             w  = wait_tensor(rs)  -> users

    after:   f  = commfuse.mm_reduce_scatter(a, b, bias, shape, d, world, g)  -> users of w

Skipped, with the reason recorded: reduce ops other than sum, an input that is not a matmul
(through views and DTensor's split/cat), a partial with other users, a scatter along the last
dimension, and the common guards (dtype, size threshold, excluded modules).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from torch.fx.experimental.symbolic_shapes import statically_known_true

from .common import (
    Skip,
    arg,
    aten,
    c10d,
    check_fusable,
    insert_call,
    is_call,
    matmul_operands,
    matmul_through_views,
    require_sum,
    normalize_dim,
    single_wait_users,
    split_then_cat,
    val,
)

NAME = "mm_reduce_scatter"
ANCHORS = (c10d.reduce_scatter_tensor.default,)


def unsplit(x: fx.Node, world: int) -> tuple[fx.Node, int, list[fx.Node]]:
    """(tensor before DTensor's split/cat, scatter dim, the split/cat nodes) or (x, 0, [])."""
    if is_call(x, (aten.cat.default,)) and len(x.users) == 1 and arg(x, 1, "dim", 0) == 0:
        pieces = x.args[0]
        first = pieces[0] if isinstance(pieces, (list, tuple)) and pieces else None
        if isinstance(first, fx.Node) and first.op == "call_function" and first.args:
            split = first.args[0]
            if split_then_cat(split, x, world):
                dim = normalize_dim(arg(split, 2, "dim", 0), split.args[0])
                return split.args[0], dim, [x, *pieces, split]
    return x, 0, []


@dataclasses.dataclass
class MmReduceScatterMatch:
    reduce_scatter: fx.Node
    waits: list[fx.Node]
    layout: list[fx.Node]  # split/getitem/cat nodes, consumers first
    views: list[fx.Node]
    mm: fx.Node
    a: fx.Node
    b: fx.Node
    bias: fx.Node | None
    shape: list[int]
    scatter_dim: int

    @classmethod
    def from_anchor(cls, rs: fx.Node, settings) -> "MmReduceScatterMatch":
        require_sum(rs)
        world = arg(rs, 2, "group_size")
        x, dim, layout = unsplit(rs.args[0], world)
        mm, views = matmul_through_views(x, "reduce_scatter")
        try:
            a, b, bias = matmul_operands(mm)
            # Symbolic sizes must not enter the graph as raw SymInts: one becomes -1 (as in view).
            shape = [size if isinstance(size, int) else -1 for size in val(x).shape]
            if shape.count(-1) > 1:
                raise Skip("the scattered view has more than one dynamic dimension")
            if dim >= len(shape) - 1:
                raise Skip(f"scatters along dim {dim}, the matmul's N dimension")
            if not statically_known_true(val(x).shape[-1] == val(b).shape[1]):
                raise Skip("the scattered view does not keep the matmul's N as its last dimension")
            waits = single_wait_users(rs, "reduce_scatter")
            check_fusable(mm, a, b, bias, settings)
        except Skip as exc:
            raise Skip(str(exc), mm=mm) from None
        return cls(rs, waits, layout, views, mm, a, b, bias, shape, dim)

    def replace(self, graph: fx.Graph) -> fx.Node:
        rs = self.reduce_scatter
        out = insert_call(
            graph, rs, torch.ops.commfuse.mm_reduce_scatter.default,
            (self.a, self.b, self.bias, self.shape, self.scatter_dim, arg(rs, 2, "group_size"),
             arg(rs, 3, "group_name")), self.mm,
        )
        for wait in self.waits:
            wait.replace_all_uses_with(out)
        for node in [*self.waits, rs, *self.layout, *self.views, self.mm]:  # consumers first
            graph.erase_node(node)
        return out


MATCH = MmReduceScatterMatch
