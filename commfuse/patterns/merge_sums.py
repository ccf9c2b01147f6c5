"""sum of matmul partials  ==>  one matmul of the concatenated operands, reduced once

A tensor-parallel backward sums the input gradients of the column-parallel linears that read one
input (q/k/v, gate/up). DTensor all-reduces each gradient and adds the results; under sequence
parallelism it adds the partials and reduce-scatters the sum, which no matmul pattern can fuse. As

    a1 @ b1 + a2 @ b2 = cat([a1, a2], 1) @ cat([b1, b2], 0)

the sum can cross the links once, as one fusable matmul -> collective::

    A  add(view(mm(a1, b1)), view(mm(a2, b2)))  -> [views, split/cat] -> reduce_scatter | all_reduce
       ==> view(mm(cat(a), cat(b)))             -> ...  (the collective's own pattern then fuses it)
    B  add(wait(all_reduce(view(mm(a1, b1)), g)), wait(all_reduce(view(mm(a2, b2)), g)), rest...)
       ==> add(wait(all_reduce(view(mm(cat(a), cat(b))), g)), rest...)

The sum is reassociated: the merged terms are accumulated in the matmul (fp32) instead of being
rounded one by one and added, so results differ from the unmerged graph by rounding only. Form B
also moves the add before the reduction: each rank's partials are added first, which can leave
fp16's range where the reduced terms would not (partials that cancel across ranks), so form B is
not applied to fp16 (form A's graph adds the partials first already). Terms
are plain ``mm`` (no bias, no alpha) whose partials have no other user, of one dtype and one
[M, N], each of which the fusion patterns would take alone (dtype, size threshold, launch bound,
opt-out); a term read twice leaves its tree alone. Applied before the fusion patterns, and decided
from the graph alone, so every rank merges alike. ``COMMFUSE_MERGE_SUMS=0`` (or leaving
``merge_sums`` out of ``patterns=``) turns it off; like every commfuse setting it must be set alike
on every rank, or the ranks would run different collectives.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from ..config import merge_sums_allowed
from .common import MATMUL_OPS, VIEW_OPS, Skip, arg, aten, c10d, check_fusable, depends_on
from .common import insert_call, is_call, matmul_through_views, val
from .mm_reduce_scatter import unpermute, unsplit

NAME = "merge_sums"
_ADD = aten.add.Tensor


def enabled(settings) -> bool:
    return NAME in settings.patterns and merge_sums_allowed()


@dataclasses.dataclass
class Term:
    """One summand: ``leaf`` is what the sum reads; for kind B, ``wait``/``collective`` are set."""

    leaf: fx.Node
    mm: fx.Node
    views: list[fx.Node]  # between the mm and the leaf (or the collective), consumer first
    collective: fx.Node | None = None
    wait: fx.Node | None = None

    def __post_init__(self):  # read now: erased nodes lose their arguments
        self.a, self.b = val(self.mm.args[0]), val(self.mm.args[1])
        self.group = None if self.collective is None else arg(self.collective, 2, "group_name")
        self.names = (self.mm.name, None if self.collective is None else self.collective.name)

    def key(self) -> tuple:
        a, b = self.a, self.b
        return (self.group, a.dtype, b.dtype, str(a.shape[0]), str(b.shape[1]), str(tuple(val(self.leaf).shape)))

    def dead(self) -> list[fx.Node]:
        """The nodes the merge leaves without users, consumers first."""
        return [n for n in (self.wait, self.collective) if n is not None] + [*self.views, self.mm]


def _plain_add(node) -> bool:
    if not is_call(node, (_ADD,)) or len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
        return False
    x, y = node.args
    if not (isinstance(x, fx.Node) and isinstance(y, fx.Node)):
        return False
    out, vx, vy = val(node), val(x), val(y)
    return (out is not None and vx is not None and vy is not None and vx.dtype == vy.dtype == out.dtype
            and tuple(vx.shape) == tuple(vy.shape) == tuple(out.shape))  # no broadcasting, no promotion


def _sum_tree(root: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """(leaves in order, the add nodes parent first) of the add tree at ``root``: an inner add is
    part of the tree when the tree is its only reader."""
    leaves, adds = [], []

    def walk(node: fx.Node, top: bool) -> None:
        if _plain_add(node) and (top or len(node.users) == 1):
            adds.append(node)
            for x in node.args:
                walk(x, False)
        else:
            leaves.append(node)

    walk(root, True)
    return leaves, adds


def _distinct(leaves: list[fx.Node]) -> bool:
    """A term read twice (``y + y``) counts twice in the sum; such trees are left alone."""
    return len(set(leaves)) == len(leaves)


def _mm_term(leaf: fx.Node, settings, graph_lane: bool) -> Term | None:
    """A plain ``mm`` partial under ``leaf`` that the fusion patterns could take alone (dtype, size,
    launch-bound and opt-out guards): merging sums the fusion would skip only copies weights."""
    try:
        mm, views = matmul_through_views(leaf, "sum")
        if mm.target is not aten.mm.default or any(val(x) is None or val(x).dim() != 2 for x in mm.args):
            return None
        check_fusable(mm, mm.args[0], mm.args[1], None, settings, graph_lane=graph_lane)
    except Skip:
        return None
    return Term(leaf, mm, views)


def _all_reduce_term(leaf: fx.Node, settings) -> Term | None:
    if not is_call(leaf, (c10d.wait_tensor.default,)) or len(leaf.users) != 1:
        return None
    ar = leaf.args[0]
    if not is_call(ar, (c10d.all_reduce.default,)) or list(ar.users) != [leaf]:
        return None
    if str(arg(ar, 1, "reduceOp")).lower() != "sum":
        return None
    reduced = val(ar.args[0])
    if reduced is None or reduced.dtype == torch.float16:  # the per-rank sum may overflow (docstring)
        return None
    term = _mm_term(ar.args[0], settings, graph_lane=True)
    if term is None:
        return None
    return Term(leaf, term.mm, term.views, ar, leaf)


def _merged_mm(graph: fx.Graph, terms: list[Term], before: fx.Node) -> fx.Node:
    """``mm(cat(a, 1), cat(b, 0))`` over ``terms``, inserted before ``before``."""
    first, operands = terms[0].mm, [t.mm.args[0] for t in terms]
    readers = _rewirable_readers(terms, operands)
    a = insert_call(graph, before, aten.cat.default, (operands, 1), first)
    b = insert_call(graph, before, aten.cat.default, ([t.mm.args[1] for t in terms], 0), first)
    offset = 0
    for t, x, users in zip(terms, operands, readers):
        k = t.a.shape[1]
        if users:
            piece = insert_call(graph, before, aten.slice.Tensor, (a, 1, offset, offset + k), x)
            for user in users:
                user.replace_input_with(x, piece)
        offset += k
    return insert_call(graph, before, aten.mm.default, (a, b), first)


_TRANSPOSES = (aten.permute.default, aten.t.default)


def _rewirable_readers(terms: list[Term], operands: list[fx.Node]) -> list[list[fx.Node]]:
    """Per term, the other readers of its left operand that will read its slice of the
    concatenation instead, so that Inductor writes the operand once, into the concatenation (the
    weight gradient's ``mm(permute(a), x)`` in a backward). Only transposes read solely by
    matmuls qualify (a slice is strided: a view or ``as_strided`` of it would not be the same, a
    mutation would land in the concatenation, an output would change strides), and none that a
    concatenated operand depends on (a cycle); none when two terms share an operand."""
    if len(set(operands)) != len(operands) or not all(isinstance(t.a.shape[1], int) for t in terms):
        return [[] for _ in terms]
    out = []
    for t, x in zip(terms, operands):
        users = [u for u in x.users if u is not t.mm]
        if not users or not all(is_call(u, _TRANSPOSES) and u.users and all(is_call(m, MATMUL_OPS) for m in u.users)
                                for u in users) or depends_on(operands, set(users)):
            users = []
        out.append(users)
    return out


def _view_shape(like: fx.Node) -> list[int] | None:
    """``like``'s shape for a reshape (one symbolic size becomes -1), or None if two are symbolic."""
    shape = [s if isinstance(s, int) else -1 for s in val(like).shape]
    return None if shape.count(-1) > 1 else shape


def _reshape(graph: fx.Graph, x: fx.Node, like: fx.Node, before: fx.Node) -> fx.Node:
    if list(val(x).shape) == list(val(like).shape):
        return x
    return insert_call(graph, before, aten.reshape.default, (x, _view_shape(like)), like)


def _erase(graph: fx.Graph, adds: list[fx.Node], terms: list[Term]) -> None:
    for node in adds:  # parent first (the root's readers were moved): each is then without users
        graph.erase_node(node)
    for term in terms:
        for node in term.dead():
            graph.erase_node(node)


def _collective_inputs(graph: fx.Graph):
    """Each sum-reducing collective's input, seen through views, DTensor's split/cat and the
    permuted copy (as the reduce-scatter pattern sees them)."""
    for node in graph.nodes:
        if is_call(node, (c10d.reduce_scatter_tensor.default, c10d.all_reduce.default)):
            if str(arg(node, 1, "reduceOp")).lower() != "sum":
                continue
            x = node.args[0]
            if node.target is c10d.reduce_scatter_tensor.default:  # as its pattern sees it
                x, _, layout = unsplit(x, arg(node, 2, "group_size"))
                if not layout:
                    x = unpermute(x)[0]
            while is_call(x, VIEW_OPS) and len(x.users) == 1:
                x = x.args[0]
            yield node, x


def _merge_before_collective(graph: fx.Graph, root: fx.Node, settings, graph_lane: bool) -> list[Term] | None:
    """Form A: every summand is a matmul partial of one [M, N]; the sum becomes one matmul."""
    if not _plain_add(root) or len(root.users) != 1:
        return None
    leaves, adds = _sum_tree(root)
    if not _distinct(leaves):
        return None
    terms = [_mm_term(leaf, settings, graph_lane) for leaf in leaves]
    if any(t is None for t in terms) or len({t.key() for t in terms}) != 1 or _view_shape(root) is None:
        return None
    mm = _merged_mm(graph, terms, root)
    root.replace_all_uses_with(_reshape(graph, mm, root, root))
    _erase(graph, adds, terms)
    return terms


def _merge_after_collective(graph: fx.Graph, root: fx.Node, settings) -> list[list[Term]]:
    """Form B: the all-reduced partials of one group and [M, N] in a sum become one all-reduce."""
    leaves, adds = _sum_tree(root)
    if not _distinct(leaves):
        return []
    terms = {leaf: _all_reduce_term(leaf, settings) for leaf in leaves}
    by_key: dict[tuple, list[Term]] = {}
    for term in terms.values():
        if term is not None:
            by_key.setdefault(term.key(), []).append(term)
    merges = [ts for ts in by_key.values() if len(ts) > 1 and _view_shape(ts[0].collective.args[0]) is not None]
    if not merges:
        return []
    replacement: dict[fx.Node, fx.Node | None] = {}
    for ts in merges:
        mm = _merged_mm(graph, ts, root)
        x = _reshape(graph, mm, ts[0].collective.args[0], root)
        ar = ts[0].collective
        reduced = insert_call(graph, root, c10d.all_reduce.default, (x, *ar.args[1:]), ar)
        waited = insert_call(graph, root, c10d.wait_tensor.default, (reduced,), ts[0].wait)
        replacement.update({t.leaf: None for t in ts})
        replacement[ts[0].leaf] = waited
    total = None
    for leaf in leaves:  # the sum in its old order, the merged terms at their first's place
        item = replacement.get(leaf, leaf)
        if item is not None:
            total = item if total is None else insert_call(graph, root, _ADD, (total, item), root)
    root.replace_all_uses_with(total)
    _erase(graph, adds, [t for ts in merges for t in ts])
    return merges


@dataclasses.dataclass
class Merge:
    """Terms made one matmul, reduced by ``collective`` (its name and group, read before any change)."""

    terms: list[Term]
    collective: str
    group: str


def merge(graph: fx.Graph, settings) -> list[Merge]:
    """Apply both forms to ``graph``; returns what was merged (each group of terms is one matmul)."""
    done: list[Merge] = []
    for collective, root in list(_collective_inputs(graph)):
        name, group = collective.name, str(arg(collective, 3 if collective.target is
                                                c10d.reduce_scatter_tensor.default else 2, "group_name"))
        # the all-reduce has a graph lane under CUDA graphs; the reduce-scatter not (as its pattern)
        terms = _merge_before_collective(graph, root, settings, collective.target is c10d.all_reduce.default)
        if terms:
            done.append(Merge(terms, name, group))
    roots = [n for n in graph.nodes if _plain_add(n)
             and not (len(n.users) == 1 and _plain_add(next(iter(n.users))))]
    for root in roots:
        done += [Merge(ts, ts[0].names[1], str(ts[0].group)) for ts in _merge_after_collective(graph, root, settings)]
    return done
