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

The row-wise FP8 form (torchao's row-wise recipe, whose activation is gathered in bf16 and quantised
after the gather) moves the quantisation before the gather::

    before:  G  = the gathered tensor (as above), bf16
             X  = G | reshape(G, [-1, K])
             s  = exp2(floor(log2(convert(mul(reciprocal(clamp_min(convert(amax(abs(X), [-1], True),
                      f64), eps)), fmax), f32))))        # the row multipliers (without the
                                                         # exp2/floor/log2 when not power-of-two)
             q  = convert(clamp_max(clamp_min(mul(convert(X, f32), s), -fmax), fmax), fp8)
             mm = _scaled_mm(reshape(q, [-1, K]), b, reciprocal(reshape(s, [-1, 1])), scale_b,
                             bias, None, out_dtype, use_fast_accum)   -> users

    after:   f  = commfuse.all_gather_rowwise_scaled_mm(shard, b, scale_b, bias, out_dtype,
                      use_fast_accum, fp8, eps, power_of_two, d, world, g, return_gathered)
             f[0] -> users of mm; f[1] (bf16, only when still read) -> other users of G

Rows are independent, so quantising each rank's rows before the gather gives the same FP8 rows
and multipliers (``runtime.reference.quantise_rows`` computes them step for step as above). The
quantisation nodes nothing else reads go with the matmul. Skipped, with the reason recorded: a
quantisation that differs from this form in any step, and the backward's form (scales of one in
``_scaled_mm``, the row scales multiplied in after it), not fused yet.

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
    FUSABLE_DTYPES,
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
    prims,
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
#: The op (and report name) of the row-wise FP8 form.
ROWWISE_NAME = "all_gather_rowwise_scaled_mm"
#: The matmuls that may take the gathered tensor as their left operand.
_PRODUCTS = (*MATMUL_OPS, SCALED_MM)
ANCHORS = (c10d.all_gather_into_tensor.default,)


def _permuted(ag: fx.Node, wait: fx.Node) -> tuple[fx.Node, fx.Node, int, list[fx.Node], list[fx.Node]] | None:
    """The mirror image of the reduce-scatter's permuted copy (the backward of torchtitan's
    sequence-parallel reduce-scatter): ``permute(wait(all_gather(clone?(permute(shard, p)))), q)``
    with ``q`` undoing ``p``, maybe copied again, is ``shard`` gathered along ``p[0]``. Returns
    (shard, gathered, p[0], nodes after the wait, nodes before the all-gather), consumers first."""
    from .mm_reduce_scatter import inverts, unpermute

    shard, perm, before = unpermute(ag.args[0])
    if perm is None or any(len(n.users) != 1 for n in before) or len(wait.users) != 1:
        return None
    (back,) = wait.users
    if not inverts(back, perm):
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
        if not candidates and (rowwise := _rowwise_candidates(gathered)):
            return RowwiseGatherMatch.build(ag, source, before, wait, gathered, layout, dim, rowwise, settings)
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


# ---- The row-wise FP8 form ------------------------------------------------------------------------

_CONVERT = prims.convert_element_type.default
#: How far below the gathered tensor the row-wise quantisation's _scaled_mm may sit (its nodes).
_QUANTISE_DEPTH = 16


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A row-wise quantisation, as the op's arguments say it."""

    float8_dtype: torch.dtype
    eps: float
    pow2_scales: bool


def _one(node, target, what: str) -> fx.Node:
    if not is_call(node, (target,)):
        raise Skip(f"the row-wise quantisation differs from torchao's: {what} is {_name(node)}, not {target}")
    return node


def _name(node) -> str:
    return getattr(getattr(node, "target", None), "__name__", type(node).__name__)


def _scalar(node: fx.Node, index: int, want: float, what: str) -> float:
    value = node.args[index] if len(node.args) > index else None
    if not isinstance(value, (int, float)) or (want is not None and float(value) != want):
        raise Skip(f"the row-wise quantisation differs from torchao's: {what} is {value!r}, not {want}")
    return float(value)


def _converted(node, dtype: torch.dtype, what: str) -> fx.Node:
    _one(node, _CONVERT, what)
    if node.args[1] != dtype:
        raise Skip(f"the row-wise quantisation differs from torchao's: {what} casts to {node.args[1]}, not {dtype}")
    return node.args[0]


def rowwise_quantised(mm: fx.Node) -> tuple[fx.Node, Recipe, list[fx.Node]]:
    """``(X, recipe, nodes)`` when ``mm``'s left operand and its scale are torchao's row-wise
    quantisation of ``X`` (the module docstring's form), the nodes between them consumers first;
    else Skip with the step that differs."""
    a, scale_a = mm.args[0], arg(mm, 2, "scale_a")
    nodes = []
    if is_call(a, VIEW_OPS):
        nodes.append(a)
        a = a.args[0]
    float8_dtype = _one(a, _CONVERT, "the FP8 operand").args[1]
    if float8_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise Skip(f"the row-wise quantisation casts to {float8_dtype}")
    fmax = float(torch.finfo(float8_dtype).max)
    hi = _one(a.args[0], aten.clamp_max.default, "the cast's input")
    _scalar(hi, 1, fmax, "the upper clamp")
    lo = _one(hi.args[0], aten.clamp_min.default, "the upper clamp's input")
    _scalar(lo, 1, -fmax, "the lower clamp")
    scaled = _one(lo.args[0], aten.mul.Tensor, "the clamped value")
    xf, multiplier = scaled.args
    x = _converted(xf, torch.float32, "the scaled operand")
    nodes += [a, hi, lo, scaled, xf]
    pow2 = is_call(multiplier, (aten.exp2.default,))
    t = multiplier
    if pow2:
        floor = _one(multiplier.args[0], aten.floor.default, "the exponent")
        log2 = _one(floor.args[0], aten.log2.default, "the exponent's input")
        t = log2.args[0]
        nodes += [multiplier, floor, log2]
    product = _one(_converted(t, torch.float32, "the multiplier"), aten.mul.Tensor, "the float64 multiplier")
    _scalar(product, 1, fmax, "the multiplier's numerator")
    inverse = _one(product.args[0], aten.reciprocal.default, "the multiplier's amax term")
    floored = _one(inverse.args[0], aten.clamp_min.default, "the reciprocal's input")
    eps = _scalar(floored, 1, None, "eps")
    amax = _one(_converted(floored.args[0], torch.float64, "the floored amax"), aten.amax.default, "the amax")
    if list(arg(amax, 1, "dim")) not in ([-1], [val(x).dim() - 1]) or not arg(amax, 2, "keepdim", False):
        raise Skip("the row-wise quantisation's amax is not over the last dimension, kept")
    absolute = _one(amax.args[0], aten.abs.default, "the amax's input")
    if absolute.args[0] is not x:
        raise Skip("the row-wise quantisation's amax reads another tensor than the one it scales")
    nodes += [t, product, inverse, floored, floored.args[0], amax, absolute]
    inv = _one(scale_a, aten.reciprocal.default, "scale_a (the backward's form, the row scales multiplied in "
               "after the product, is not fused yet)")
    rows = inv.args[0]
    scale_nodes = [inv]
    if is_call(rows, VIEW_OPS):
        scale_nodes.append(rows)
        rows = rows.args[0]
    if rows is not multiplier:
        raise Skip("scale_a is not the reciprocal of the row multipliers the operand was quantised with")
    return x, Recipe(float8_dtype, eps, pow2), [*scale_nodes, *nodes]


def _rowwise_candidates(gathered: fx.Node) -> list[fx.Node]:
    """The ``_scaled_mm`` nodes a few steps below ``gathered``: where a row-wise quantisation of it
    may lead."""
    found, seen, frontier = [], set(), [gathered]
    for _ in range(_QUANTISE_DEPTH):
        frontier = [u for n in frontier for u in n.users if u not in seen]
        seen.update(frontier)
        found += [n for n in frontier if is_call(n, (SCALED_MM,)) and n not in found]
    return found


@dataclasses.dataclass
class RowwiseGatherMatch:
    """``all_gather(x) -> row-wise quantise -> _scaled_mm`` (the module docstring)."""

    all_gather: fx.Node
    source: fx.Node
    before: list[fx.Node]
    wait: fx.Node
    gathered: fx.Node
    layout: list[fx.Node]
    gather_dim: int
    mm: fx.Node
    b: fx.Node
    bias: fx.Node | None
    scaled: Scaled
    recipe: Recipe
    dying: list[fx.Node]  # the quantisation's nodes only the matmul reads, consumers first
    return_gathered: bool

    op = property(lambda self: getattr(torch.ops.commfuse, ROWWISE_NAME).default)

    @classmethod
    def build(cls, ag, source, before, wait, gathered, layout, dim, mms, settings) -> "RowwiseGatherMatch":
        first_skip = None
        for mm in mms:
            try:
                x, recipe, nodes = rowwise_quantised(mm)
                if x is not gathered and not (is_call(x, VIEW_OPS) and x.args[0] is gathered
                                              and val(x).dim() == 2):
                    raise Skip("the row-wise quantisation reads another tensor than the gathered one")
                if val(x).dtype not in FUSABLE_DTYPES:
                    raise Skip(f"the gathered tensor is {val(x).dtype}, not fp16, bf16 or fp32")
                _, b, bias = matmul_operands(mm)
                scaled = scaled_operands(mm, rowwise_ok=True)
                if depends_on([b, bias, scaled.scale_b], {wait, gathered}):
                    raise Skip("the matmul's right operand, bias or scales are computed from the gathered tensor")
                check_fusable(mm, mm.args[0], b, bias, settings, sharded="n", scaled=scaled)
            except Skip as exc:
                first_skip = first_skip or Skip(str(exc), mm=mm)
                continue
            dying = {mm}
            for node in nodes:  # consumers first: a node dies when only dying nodes read it
                if set(node.users) <= dying:
                    dying.add(node)
            if x is not gathered and set(x.users) <= dying:
                dying.add(x)
            order = [n for n in [*nodes, x] if n in dying and n is not gathered]
            return_gathered = not set(gathered.users) <= dying
            return cls(ag, source, before, wait, gathered, layout, dim, mm, b, bias, scaled, recipe, order,
                       return_gathered)
        raise first_skip

    def replace(self, graph: fx.Graph) -> fx.Node:
        ag, r = self.all_gather, self.recipe
        args = (self.source, self.b, self.scaled.scale_b, self.bias, self.scaled.out_dtype, self.scaled.use_fast_accum,
                r.float8_dtype, r.eps, r.pow2_scales, self.gather_dim, arg(ag, 1, "group_size"),
                arg(ag, 2, "group_name"), self.return_gathered)
        fused = insert_call(graph, self.mm, self.op, args, self.mm)
        self.mm.replace_all_uses_with(insert_getitem(graph, fused, 0, self.mm))
        graph.erase_node(self.mm)
        for node in dict.fromkeys(self.dying):  # consumers first
            graph.erase_node(node)
        if self.return_gathered:
            self.gathered.replace_all_uses_with(insert_getitem(graph, fused, 1, self.gathered))
        for node in [*self.layout, self.wait, ag, *self.before]:
            graph.erase_node(node)
        return fused


def _static_or(x, default: int) -> int:
    return x if isinstance(x, int) else default
