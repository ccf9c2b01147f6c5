"""all_gather -> matmul  ==>  commfuse.all_gather_mm

The first half of a column-parallel linear under sequence parallelism (and the input-gradient of a
row-parallel one under it)::

    before:  ag = all_gather_into_tensor(shard, world, g)
             w  = wait_tensor(ag)
             G  = w                                      # gather along dim 0, or DTensor's form
                | cat(split(w, n, 0)[0..world-1], d)     # for a gather along dim d
                | permute(w, inverse of p)               # for a gather along dim d = p[0] when
                                                         # ag's input is permute(shard, p), maybe copied
             r  = reshape(G, [-1, K])                    # when G is not 2-D
             mm = mm(r, b) | addmm(bias, r, b)   -> users
             (other users of G or r, e.g. saved for backward or the Q/K/V siblings)

    after:   f  = commfuse.all_gather_mm(shard, b, bias, d, world, g, return_gathered)
             f[0]                                -> users of mm
             f[1] (the gathered tensor, only when still used) -> other users of G

The FP8 form gathers an FP8 shard (torchao's float8 column-parallel linear under sequence
parallelism, its input cast before the gather): ``_scaled_mm(r, b, scale_a, scale_b, bias, None,
out_dtype, use_fast_accum)`` in the matmul's place, and DTensor's cat, which takes no FP8, done on
the bytes (``view.dtype(uint8)`` of each piece, ``view.dtype`` back after the cat); it becomes
``commfuse.all_gather_scaled_mm(shard, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, d,
world, g, return_gathered)`` (tensor-wise scales only; ``scale_a`` is the gathered operand's).

When several matmuls read the gathered tensor (Q, K and V; w1 and w3), the widest one fuses and
the others read the returned gathered tensor. Skipped, with the reason recorded: no matmul takes the
gathered tensor as its left operand, gathers along the last dimension, results read without a
single wait_tensor, and the common guards (dtype, size threshold, excluded modules; for FP8,
``common.scaled_operands``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from torch.fx.experimental.symbolic_shapes import statically_known_true

from .common import (
    MATMUL_OPS,
    SCALED_MM,
    VIEW_OPS,
    Scaled,
    Skip,
    arg,
    aten,
    bytes_view,
    c10d,
    check_fusable,
    depends_on,
    fused_args,
    insert_call,
    insert_getitem,
    is_call,
    left_operand,
    matmul_operands,
    normalize_dim,
    scaled_operands,
    split_then_cat,
    val,
)

def _fused_after() -> tuple:
    """The ops an earlier pattern puts where a matmul of the gathered tensor fed a collective."""
    ops = torch.ops.commfuse
    return (ops.mm_all_reduce.default, ops.mm_reduce_scatter.default, ops.scaled_mm_all_reduce.default,
            ops.scaled_mm_reduce_scatter.default)


NAME = "all_gather_mm"
#: The op (and report name) of the FP8 form.
FP8_NAME = "all_gather_scaled_mm"
#: The matmuls that may take the gathered tensor as their left operand.
_PRODUCTS = (*MATMUL_OPS, SCALED_MM)
ANCHORS = (c10d.all_gather_into_tensor.default,)


def _permuted(ag: fx.Node, wait: fx.Node) -> tuple[fx.Node, fx.Node, int, list[fx.Node], list[fx.Node]] | None:
    """The mirror image of the reduce-scatter's permuted copy (the backward of torchtitan's
    sequence-parallel reduce-scatter): ``permute(wait(all_gather(clone?(permute(shard, p)))), q)``
    with ``q`` undoing ``p``, maybe copied again, is ``shard`` gathered along ``p[0]``. Returns
    (shard, gathered, p[0], nodes after the wait, nodes before the all-gather), consumers first."""
    from .mm_reduce_scatter import _inverts, unpermute

    shard, perm, before = unpermute(ag.args[0])
    if perm is None or any(len(n.users) != 1 for n in before) or len(wait.users) != 1:
        return None
    (back,) = wait.users
    if not _inverts(back, perm):
        return None
    gathered, after = back, [back]
    if len(back.users) == 1 and is_call(next(iter(back.users)), (aten.clone.default,)):
        gathered = next(iter(back.users))
        after = [gathered, back]
    return shard, gathered, perm[0], after, before


def _split_cat(wait: fx.Node, world_size: int) -> tuple[fx.Node, int, list[fx.Node]] | None:
    """DTensor gathers along dim d as cat(split(wait, n, 0), d), for FP8 on the bytes
    (``view.dtype(cat(view.dtype(piece, uint8)...), fp8)``); return (the gathered tensor, d,
    nodes, consumers first) if so."""
    if len(wait.users) != 1:
        return None
    (split,) = wait.users
    if not is_call(split, (aten.split.Tensor,)) or arg(split, 2, "dim", 0) != 0:
        return None
    getitems = list(split.users)
    first = next(iter(getitems[0].users), None) if getitems else None
    as_bytes = first is not None and bytes_view(getitems[0]) is first
    cat = next(iter(first.users), None) if as_bytes else first
    if not split_then_cat(split, cat, world_size, through_bytes=as_bytes):
        return None
    dim = normalize_dim(arg(cat, 1, "dim", 0), cat)
    if not as_bytes:
        return cat, dim, [cat, *getitems, split]
    back = bytes_view(cat)
    if back is None or val(back).dtype != val(wait).dtype:
        return None
    return back, dim, [back, cat, *cat.args[0], *getitems, split]


@dataclasses.dataclass
class AllGatherMmMatch:
    all_gather: fx.Node
    source: fx.Node  # the shard the fused op gathers (the all-gather's input, unpermuted)
    before: list[fx.Node]  # clone/permute nodes between source and the all-gather (consumers first)
    wait: fx.Node
    gathered: fx.Node  # the node holding the gathered tensor in its final layout
    layout: list[fx.Node]  # split/getitem/cat nodes between wait and gathered (consumers first)
    gather_dim: int
    reshape: fx.Node | None  # 2-D view of gathered feeding the matmul
    mm: fx.Node
    b: fx.Node
    bias: fx.Node | None
    return_gathered: bool
    scaled: Scaled | None = None  # the FP8 form's scales and output

    @property
    def op(self):
        return getattr(torch.ops.commfuse, FP8_NAME if self.scaled else NAME).default

    @classmethod
    def from_anchor(cls, ag: fx.Node, settings) -> "AllGatherMmMatch":
        world_size = arg(ag, 1, "group_size")
        waits = list(ag.users)
        if len(waits) != 1 or not is_call(waits[0], (c10d.wait_tensor.default,)):
            raise Skip("all_gather result is not read through a single wait_tensor")
        wait = waits[0]
        source, before = ag.args[0], []
        found = _split_cat(wait, world_size)
        if found:
            gathered, dim, layout = found
        elif permuted := _permuted(ag, wait):
            source, gathered, dim, layout, before = permuted
        else:
            gathered, dim, layout = wait, 0, []
        if dim >= val(gathered).dim() - 1:
            raise Skip(f"gathers along dim {dim}, the matmul's K dimension")
        k = val(gathered).shape[-1]
        candidates = []  # (mm, reshape or None)
        for user in gathered.users:
            if is_call(user, _PRODUCTS) and left_operand(user) is gathered:
                candidates.append((user, None))
            elif (is_call(user, VIEW_OPS) and val(user).dim() == 2
                  and statically_known_true(val(user).shape[1] == k)):  # flattens leading dims only
                candidates += [(mm, user) for mm in user.users
                               if is_call(mm, _PRODUCTS) and left_operand(mm) is user]
        if not candidates:
            taken = [u for u in gathered.users if getattr(u, "target", None) in _fused_after()]
            if taken:  # all_gather -> mm -> all_reduce: the matmul went with the collective after it
                raise Skip(f"its matmul was already fused with the collective after it ({taken[0].target})")
            raise Skip("no mm/addmm takes the gathered tensor as its left operand")
        candidates.sort(key=lambda c: _static_or(val(c[0]).shape[1], 0), reverse=True)
        first_skip = None
        for mm, reshape in candidates:
            try:
                a, b, bias = matmul_operands(mm)
                scaled = scaled_operands(mm) if is_call(mm, (SCALED_MM,)) else None
                scales = [scaled.scale_a, scaled.scale_b] if scaled else []
                if depends_on([b, bias, *scales], {wait, gathered}):
                    raise Skip("the matmul's right operand, bias or scales are computed from the gathered tensor")
                check_fusable(mm, a, b, bias, settings, sharded="n", scaled=scaled)
            except Skip as exc:
                first_skip = first_skip or Skip(str(exc), mm=mm)
                continue
            needed = {mm} if reshape is None else {reshape}
            return_gathered = set(gathered.users) != needed or (
                reshape is not None and len(reshape.users) > 1
            )
            return cls(ag, source, before, wait, gathered, layout, dim, reshape, mm, b, bias, return_gathered,
                       scaled)
        raise first_skip

    def replace(self, graph: fx.Graph) -> fx.Node:
        """Rewrite; leaves users of the gathered tensor that precede the matmul for a topo sort."""
        ag = self.all_gather
        rest = (self.gather_dim, arg(ag, 1, "group_size"), arg(ag, 2, "group_name"), self.return_gathered)
        fused = insert_call(graph, self.mm, self.op, fused_args(self.source, self.b, self.bias, self.scaled, rest),
                            self.mm)
        self.mm.replace_all_uses_with(insert_getitem(graph, fused, 0, self.mm))
        graph.erase_node(self.mm)
        if self.reshape is not None and not self.reshape.users:
            graph.erase_node(self.reshape)
        if self.return_gathered:
            self.gathered.replace_all_uses_with(insert_getitem(graph, fused, 1, self.gathered))
        for node in [*self.layout, self.wait, ag, *self.before]:
            graph.erase_node(node)
        return fused


MATCH = AllGatherMmMatch


def _static_or(x, default: int) -> int:
    return x if isinstance(x, int) else default
