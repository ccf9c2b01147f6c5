"""matmul -> reduce_scatter(sum)  ==>  commfuse.mm_reduce_scatter

The second half of a row-parallel linear under sequence parallelism (and the input-gradient of a
column-parallel one under it)::

    before:  mm = mm(a, b) | addmm(bias, a, b)
             v  = reshape(mm, shape)                      # zero or more views
             x  = v                                       # scatter along dim 0, or DTensor's form
                | cat(split(v, n, d)[0..world-1], 0)      # for a scatter along dim d
                | clone(permute(v, p))                    # for a scatter along dim d = p[0]
             rs = reduce_scatter_tensor(x, "sum", world, g)
             w  = wait_tensor(rs)  -> users
             (permute(w, inverse of p)                    # the permuted form's usual reader)

    after:   f  = commfuse.mm_reduce_scatter(a, b, bias, shape, d, world, g)  -> users of w
             (permute(w, inverse of p)  -> f; any other reader of w -> clone(permute(f, p)))

The FP8 form, ``_scaled_mm`` in the matmul's place (torchao's float8 row-parallel linear under
sequence parallelism), becomes ``commfuse.scaled_mm_reduce_scatter(a, b, scale_a, scale_b, bias,
out_dtype, use_fast_accum, shape, d, world, g)`` (tensor-wise scales only).

The permuted form is torchtitan's sequence-parallel reduce-scatter: a scatter along the sequence
dimension of [B, S, D] written as a scatter along dim 0 of the contiguous [S, B, D] copy, with the
result permuted back. The copy (``clone``, in any memory format: it changes no value) is optional.

Skipped, with the reason recorded: reduce ops other than sum, an input that is not a matmul
(through views, DTensor's split/cat and the permuted copy), a partial with other users, a scatter
along the last dimension, and the common guards (dtype, size threshold, excluded modules).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from torch.fx.experimental.symbolic_shapes import statically_known_true

from .common import (
    SCALED_MM,
    Scaled,
    Skip,
    arg,
    fused_op,
    aten,
    c10d,
    check_fusable,
    fused_args,
    insert_call,
    PostScale,
    is_call,
    matmul_operands,
    product_through_views,
    require_sum,
    normalize_dim,
    scaled_operands,
    single_wait_users,
    split_then_cat,
    val,
)

NAME = "mm_reduce_scatter"
#: The op (and report name) of the FP8 form.
FP8_NAME = "scaled_mm_reduce_scatter"
#: The op (and report name) of the row-wise FP8 form.
ROWWISE_NAME = "rowwise_scaled_mm_reduce_scatter"
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


def unpermute(x: fx.Node) -> tuple[fx.Node, list[int] | None, list[fx.Node]]:
    """(tensor before ``clone(permute(., p))``, p, the clone/permute nodes) or (x, None, []).

    Chunking dim 0 of ``permute(v, p)`` chunks dim ``p[0]`` of ``v``: the reduce-scatter of the
    permuted copy is the permuted reduce-scatter of ``v`` along ``p[0]``. Each node must have no
    other reader, or the unpermuted partial would still be needed."""
    nodes = []
    if is_call(x, (aten.clone.default,)) and len(x.users) == 1:
        nodes.append(x)
        x = x.args[0]
    if is_call(x, (aten.permute.default,)) and len(x.users) == 1:
        source = x.args[0]
        perm = [normalize_dim(d, source) for d in arg(x, 1, "dims")]
        return source, perm, [*nodes, x]
    return (nodes[0] if nodes else x), None, []


def inverts(node: fx.Node, perm: list[int]) -> bool:
    """Whether ``node`` is ``permute(., q)`` with ``q`` undoing ``perm``."""
    if not is_call(node, (aten.permute.default,)):
        return False
    q = [normalize_dim(d, node.args[0]) for d in arg(node, 1, "dims")]
    return [perm[i] for i in q] == list(range(len(perm)))


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
    perm: list[int] | None  # the permutation of the permuted-copy form (None: not that form)
    scaled: Scaled | None = None  # the FP8 form's scales and output
    post: PostScale | None = None  # the row-wise backward's scaling after the product

    @property
    def op(self):
        return fused_op(self.scaled, (NAME, FP8_NAME, ROWWISE_NAME))

    @classmethod
    def from_anchor(cls, rs: fx.Node, settings) -> "MmReduceScatterMatch":
        require_sum(rs)
        world = arg(rs, 2, "group_size")
        x, dim, layout = unsplit(rs.args[0], world)
        perm = None
        if not layout:
            x, perm, layout = unpermute(rs.args[0])
            dim = perm[0] if perm else 0
        mm, views, post = product_through_views(x, "reduce_scatter")
        try:
            a, b, bias = matmul_operands(mm)
            scaled = scaled_operands(mm, rowwise_ok=True, post=post) if is_call(mm, (SCALED_MM,)) else None
            # Symbolic sizes must not enter the graph as raw SymInts: one becomes -1 (as in view).
            shape = [size if isinstance(size, int) else -1 for size in val(x).shape]
            if shape.count(-1) > 1:
                raise Skip("the scattered view has more than one dynamic dimension")
            if dim >= len(shape) - 1:
                raise Skip(f"scatters along dim {dim}, the matmul's N dimension")
            if not statically_known_true(val(x).shape[-1] == val(b).shape[1]):
                raise Skip("the scattered view does not keep the matmul's N as its last dimension")
            waits = single_wait_users(rs, "reduce_scatter")
            check_fusable(mm, a, b, bias, settings, scaled=scaled)
        except Skip as exc:
            raise Skip(str(exc), mm=mm) from None
        return cls(rs, waits, layout, views, mm, a, b, bias, shape, dim, perm, scaled, post)

    def replace(self, graph: fx.Graph) -> fx.Node:
        rs = self.reduce_scatter
        rest = (self.shape, self.scatter_dim, arg(rs, 2, "group_size"), arg(rs, 3, "group_name"))
        out = insert_call(graph, rs, self.op, fused_args(self.a, self.b, self.bias, self.scaled, rest), self.mm)
        for wait in self.waits:
            if self.perm is None:
                wait.replace_all_uses_with(out)
            else:
                self._unpermute_readers(graph, wait, out)
        post = list(self.post.nodes) if self.post else []
        for node in [*self.waits, rs, *self.layout, *self.views, *post, self.mm]:  # consumers first
            graph.erase_node(node)
        if self.post is not None and not self.post.scale.users:  # the scales' product: the op multiplies them
            graph.erase_node(self.post.scale)
        return out

    def _unpermute_readers(self, graph: fx.Graph, wait: fx.Node, out: fx.Node) -> None:
        """``wait`` holds ``permute(out, perm)`` in a contiguous copy: readers that permute it back
        read ``out``; any other (a forward output saved for the backward) reads such a copy, so
        its values and strides stay the ones the graph was traced with."""
        copy = None
        for user in list(wait.users):
            if inverts(user, self.perm):
                user.replace_all_uses_with(out)
                graph.erase_node(user)
                continue
            if copy is None:
                rs = self.reduce_scatter
                permuted = insert_call(graph, rs, aten.permute.default, (out, self.perm), wait)
                with graph.inserting_before(rs):
                    copy = graph.call_function(aten.clone.default, (permuted,),
                                               {"memory_format": torch.contiguous_format})
                copy.meta.update(wait.meta)  # the same shape, strides and provenance
            user.replace_input_with(wait, copy)


MATCH = MmReduceScatterMatch
