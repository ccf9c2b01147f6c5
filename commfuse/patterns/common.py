"""Helpers shared by the pattern modules: reading nodes, the common guards, inserting new nodes."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._inductor import config as inductor_config
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils._pytree import tree_map

from ..exclusion import excluded_by

aten = torch.ops.aten
prims = torch.ops.prims
c10d = torch.ops._c10d_functional

VIEW_OPS = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)
MATMUL_OPS = (aten.mm.default, aten.addmm.default)
FUSABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: The FP8 matmul the FP8 ops take: ``_scaled_mm(a, b, scale_a, scale_b, bias, scale_result,
#: out_dtype, use_fast_accum)``, with tensor-wise scales (one float32 per operand) or, for the
#: row-wise ops, one per row of ``a`` and one per column of ``b``.
SCALED_MM = aten._scaled_mm.default
#: Scaled matmuls no pattern takes, so the report says why: ``_scaled_mm_v2`` describes each
#: operand's scaling by a recipe list (row-wise, block-wise, MX alike), a form not matched yet.
UNMATCHED_SCALED = tuple(getattr(aten, name).default for name in ("_scaled_mm_v2",) if hasattr(aten, name))
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Meta that says where a node came from; copied onto the nodes that replace it.
_PROVENANCE = ("stack_trace", "nn_module_stack", "fwd_nn_module_stack", "custom", "seq_nr")


class Skip(Exception):
    """A candidate that stays unfused; the message is the reason users see.

    ``mm`` is the matmul of the candidate when one was found, so the report can name it.
    """

    def __init__(self, reason: str, mm: fx.Node | None = None):
        super().__init__(reason)
        self.mm = mm


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def is_call(node: Any, targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def target_name(node: Any) -> str:
    if not isinstance(node, fx.Node):
        return type(node).__name__
    if node.op != "call_function":
        return f"{node.op} {node.target}"
    return getattr(node.target, "__name__", str(node.target))


def matmul_operands(mm: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None]:
    """``(a, b, bias)`` of an ``mm``, ``addmm`` or ``_scaled_mm`` node; Skip for scaled ``addmm``."""
    if mm.target is aten.mm.default:
        return mm.args[0], mm.args[1], None
    if mm.target is SCALED_MM:
        return mm.args[0], mm.args[1], arg(mm, 4, "bias")
    if mm.target is not aten.addmm.default:
        raise Skip(f"{target_name(mm)} is not a matmul the patterns take")
    beta, alpha = mm.kwargs.get("beta", 1), mm.kwargs.get("alpha", 1)
    if beta != 1 or alpha != 1:
        raise Skip(f"addmm with beta={beta}, alpha={alpha} is not a plain bias add")
    return mm.args[1], mm.args[2], mm.args[0]


@dataclasses.dataclass(frozen=True)
class Scaled:
    """What an FP8 ``_scaled_mm`` adds to a matmul's operands: the fused op takes them as they are.
    ``rowwise``: the row-wise op's form (row-wise scales, or the backward's post scales)."""

    scale_a: fx.Node
    scale_b: fx.Node
    out_dtype: torch.dtype
    use_fast_accum: bool
    rowwise: bool = False
    post_scale_a: fx.Node | None = None
    post_scale_b: fx.Node | None = None


def fused_op(scaled: Scaled | None, names: tuple[str, str, str]):
    """The commfuse op a match makes: ``names`` is (plain, tensor-wise FP8, row-wise FP8)."""
    plain, tensorwise, rowwise = names
    name = plain if scaled is None else rowwise if scaled.rowwise else tensorwise
    return getattr(torch.ops.commfuse, name).default


def fused_args(a: Any, b: Any, bias: Any, scaled: Scaled | None, rest: tuple) -> tuple:
    """A fused op's arguments: ``(a, b, bias, *rest)``, or for its FP8 form (``scaled``)
    ``(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, *rest)``, the row-wise form's with
    ``post_scale_a, post_scale_b`` before ``rest`` (``runtime/spec.py``)."""
    if scaled is None:
        return (a, b, bias, *rest)
    post = (scaled.post_scale_a, scaled.post_scale_b) if scaled.rowwise else ()
    return (a, b, scaled.scale_a, scaled.scale_b, bias, scaled.out_dtype, scaled.use_fast_accum, *post, *rest)


@dataclasses.dataclass(frozen=True)
class PostScale:
    """The backward's row-wise form after ``_scaled_mm`` (scales of one):
    ``convert(mul(_scaled_mm, mul(row scale, column scale)), out_dtype)``; ``nodes`` the convert
    and the outer mul, consumers first."""

    nodes: tuple[fx.Node, ...]
    scale: fx.Node  # the product of the two scales
    dtype: torch.dtype


def post_scale(x: Any) -> tuple[fx.Node, PostScale] | None:
    """``(the _scaled_mm, its PostScale)`` when ``x`` is the backward's row-wise form, else None."""
    if not (is_call(x, (prims.convert_element_type.default,)) and is_call(x.args[0], (aten.mul.Tensor,))):
        return None
    mul = x.args[0]
    products = [a for a in mul.args if is_call(a, (SCALED_MM,))]
    if len(products) != 1 or len(mul.args) != 2:
        return None
    mm = products[0]
    scale = mul.args[1] if mul.args[0] is mm else mul.args[0]
    return mm, PostScale((x, mul), scale, x.args[1])


def is_rowwise(mm: Any) -> bool:
    """Whether ``_scaled_mm`` node ``mm`` is of a row-wise op's form (what the report names it by)."""
    scales = [val(arg(mm, 2, "scale_a")), val(arg(mm, 3, "scale_b"))]
    if any(v is not None and v.dtype == torch.float32 and v.dim() == 2 and not statically_known_true(v.numel() == 1)
           for v in scales):
        return True
    users = list(mm.users)
    return len(users) == 1 and post_scale(next(iter(users[0].users), None)) is not None


def _scale_kind(scale: Any, rows: Any, cols: Any) -> str | None:
    """None for a tensor-wise scale (one float32); else what it is, in the report's words."""
    v = val(scale)
    if v is None:
        return "a scale without meta['val']"
    if v.dtype != torch.float32:
        return f"{v.dtype} scales (MX block scales)" if "e8m0" in str(v.dtype) else f"{v.dtype} scales"
    if statically_known_true(v.numel() == 1):
        return None
    if v.dim() == 2 and (statically_known_true(v.shape[0] == rows) or statically_known_true(v.shape[1] == cols)):
        return "row-wise scales"
    return "block-wise scales"


def scaled_operands(mm: fx.Node, rowwise_ok: bool = False, post: PostScale | None = None) -> Scaled:
    """The FP8 arguments of ``_scaled_mm`` node ``mm``, or Skip with why the FP8 ops cannot take it:
    tensor-wise scales (``rowwise_ok``: or one float32 per row of ``a`` and per column of ``b``),
    e4m3/e5m2 operands, a bf16/fp16/fp32 output and no output scale. ``post``: the backward's
    row-wise scales multiplied in after the product (``post_scale``)."""
    a, b, bias = matmul_operands(mm)
    va, vb = val(a), val(b)
    if va is None or vb is None:
        raise Skip("matmul operands carry no meta['val'] (not a traced post-grad graph)")
    if va.dtype not in FP8_DTYPES or vb.dtype not in FP8_DTYPES:
        raise Skip(f"_scaled_mm of {va.dtype} and {vb.dtype}: only float8_e4m3fn and float8_e5m2 operands fuse")
    rowwise = False
    for scale, rows, cols in ((arg(mm, 2, "scale_a"), va.shape[0], None), (arg(mm, 3, "scale_b"), None, vb.shape[1])):
        kind = _scale_kind(scale, rows, cols)
        if kind == "row-wise scales" and rowwise_ok and _one_per(val(scale), rows, cols):
            rowwise = True
        elif kind is not None:
            allowed = "tensor-wise or row-wise scales" if rowwise_ok else "tensor-wise scales (one float32 per operand)"
            raise Skip(f"_scaled_mm with {kind}: only {allowed} fuse")
    if arg(mm, 5, "scale_result") is not None:
        raise Skip("_scaled_mm with scale_result (an FP8 output): only bf16, fp16 or fp32 outputs fuse")
    out_dtype = arg(mm, 6, "out_dtype")
    if out_dtype is None or out_dtype not in FUSABLE_DTYPES:
        raise Skip(f"_scaled_mm with out_dtype {out_dtype}: only bf16, fp16 or fp32 outputs fuse "
                   "(partials are summed in the output dtype)")
    if bias is not None and out_dtype == torch.float32:
        raise Skip("_scaled_mm with fp32 output and a bias: cuBLAS takes no bias with an fp32 FP8 output, "
                   "so there is no unfused form to fuse")
    if bias is not None and (val(bias) is None or val(bias).dtype != out_dtype):
        raise Skip("_scaled_mm's bias is not of its output dtype")
    pa = pb = None
    if post is not None:
        pa, pb = _post_factors(post, va.shape[0], vb.shape[1], out_dtype)
        rowwise = True
    return Scaled(arg(mm, 2, "scale_a"), arg(mm, 3, "scale_b"), out_dtype, bool(arg(mm, 7, "use_fast_accum", False)),
                  rowwise, pa, pb)


def _one_per(v, rows, cols) -> bool:
    """A row-wise scale as ``_scaled_mm`` takes it: ``[M, 1]`` for ``a``, ``[1, N]`` for ``b``."""
    if rows is not None:
        return statically_known_true(v.shape[0] == rows) and statically_known_true(v.shape[1] == 1)
    return statically_known_true(v.shape[0] == 1) and statically_known_true(v.shape[1] == cols)


def _post_factors(post: PostScale, rows, cols, out_dtype) -> tuple[fx.Node, fx.Node]:
    """The row and column scales of the backward's form, each float32 and broadcasting to the product."""
    if post.dtype != out_dtype:
        raise Skip(f"the scaled product is cast to {post.dtype}, not its output dtype {out_dtype}")
    scale = post.scale
    if not (is_call(scale, (aten.mul.Tensor,)) and len(scale.args) == 2
            and all(isinstance(f, fx.Node) for f in scale.args)):
        raise Skip(f"the scaled product is multiplied by {target_name(scale)}, not by a row scale times a column "
                   "scale (the row-wise backward's form)")
    for factor in scale.args:
        v = val(factor)
        if v is None or v.dtype != torch.float32 or v.dim() != 2 or not (
                _one_per(v, rows, None) or _one_per(v, None, cols)):
            raise Skip("the scaled product's post scales are not a float32 [M, 1] and [1, N]")
    if len(scale.users) != 1:
        raise Skip("the product of the post scales has other users")
    return scale.args[0], scale.args[1]


def require_sum(collective: fx.Node) -> None:
    """Only a sum reduces partial matmul results into the matmul of the whole."""
    reduce_op = arg(collective, 1, "reduceOp")
    if str(reduce_op).lower() != "sum":
        raise Skip(f"reduce op {reduce_op!r} is not sum")


def matmul_through_views(x: Any, collective: str) -> tuple[fx.Node, list[fx.Node]]:
    """The mm/addmm that produced ``x`` through views only, with those views (nearest ``x``
    first); each must have no other user, or the matmul's partial result would be lost."""
    mm, views, post = product_through_views(x, collective)
    if post is not None:
        raise Skip(f"{collective} input comes from a scaled product multiplied after it, a form only the reduce "
                   "patterns take", mm=mm)
    return mm, views


def product_through_views(x: Any, collective: str) -> tuple[fx.Node, list[fx.Node], PostScale | None]:
    """As ``matmul_through_views``, and through the row-wise backward's post scales
    (``post_scale``): ``(the matmul, the views, the PostScale or None)``."""
    views: list[fx.Node] = []
    while is_call(x, VIEW_OPS):
        views.append(x)
        x = x.args[0]
    found = post_scale(x)
    post = None
    if found is not None:
        x, post = found
    if is_call(x, UNMATCHED_SCALED):
        raise Skip(f"{collective} input comes from {target_name(x)} (per-operand scaling recipes), a form no "
                   "pattern takes yet: only _scaled_mm with tensor-wise or row-wise scales fuses", mm=x)
    if not is_call(x, (*MATMUL_OPS, SCALED_MM)):
        raise Skip(f"{collective} input comes from {target_name(x)}, not mm/addmm/_scaled_mm (through views)")
    for producer in [x, *(post.nodes if post else ()), *views]:
        if len(producer.users) != 1:
            raise Skip(f"the partial {producer.name} has other users", mm=x)
    return x, views, post


def depends_on(nodes, targets: set) -> bool:
    """Whether any of ``nodes`` is, or is computed from, one of ``targets``."""
    seen: set = set()
    stack = [n for n in nodes if isinstance(n, fx.Node)]
    while stack:
        node = stack.pop()
        if node in targets:
            return True
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return False


def split_then_cat(split: Any, cat: Any, world: int, through_bytes: bool = False) -> bool:
    """Whether ``cat`` concatenates all ``world`` pieces of ``split``, in order, and nothing else
    reads them: DTensor's way of moving a shard dimension to dim 0 and back. The split must make
    exactly ``world`` pieces: a cat of the first ``world`` of more (the rest unused, so gone from
    the graph) is a slice of the tensor, not all of it. ``through_bytes``: each piece may reach
    the cat through a ``view.dtype`` (``bytes_view``: DTensor concatenates FP8 pieces as bytes)."""
    if not (is_call(split, (aten.split.Tensor,)) and is_call(cat, (aten.cat.default,))):
        return False
    pieces = val(split)
    if not isinstance(pieces, (list, tuple)) or len(pieces) != world:
        return False
    items = sorted(split.users, key=lambda n: n.args[1] if n.op == "call_function" else -1)
    inputs = [bytes_view(n) or n if through_bytes else n for n in items]
    if len(items) != world or any(
        getattr(n.target, "__name__", "") != "getitem" or n.args[1] != i or list(piece.users) != [cat]
        or (piece is not n and list(n.users) != [piece])
        for i, (n, piece) in enumerate(zip(items, inputs))
    ):
        return False
    return list(cat.args[0]) == inputs


def bytes_view(node: fx.Node) -> fx.Node | None:
    """The lone reader of ``node`` when it is a ``view.dtype`` (a reinterpretation of the same
    bytes), else None."""
    users = list(node.users)
    return users[0] if len(users) == 1 and is_call(users[0], (aten.view.dtype,)) else None


def normalize_dim(dim: int, node: fx.Node) -> int:
    return dim + val(node).dim() if dim < 0 else dim


def single_wait_users(collective: fx.Node, what: str) -> list[fx.Node]:
    waits = list(collective.users)
    if not waits or not all(is_call(w, (c10d.wait_tensor.default,)) for w in waits):
        raise Skip(f"{what} result is used without wait_tensor")
    return waits


def left_operand(mm: fx.Node) -> fx.Node:
    return mm.args[1] if mm.target is aten.addmm.default else mm.args[0]


def mnk(a: fx.Node, b: fx.Node) -> tuple:
    va, vb = val(a), val(b)
    return (va.shape[0], va.shape[1], vb.shape[1])


#: What the size rules count the dimension a rank's shard may size differently from its peers'
#: as (K of an all-reduced or reduce-scattered product, N of an all-gathered one: a dimension
#: sharded unevenly, 33 in-features on 2 ranks, is 17 on one rank and 16 on the other). A rule
#: that read the rank's own size could fuse on one rank and not on another, and the ranks would
#: then run different collectives (a hang, or a sum paired with the wrong call). Every other size
#: in the rules is one all ranks share.
SHARDED_DIM = 64


def check_fusable(mm: fx.Node, a: fx.Node, b: fx.Node, bias: fx.Node | None, settings,
                  graph_lane: bool = False, sharded: str = "k", scaled: Scaled | None = None) -> None:
    """The guards every pattern applies: dtype, size, opt-out. Raises Skip with the reason.
    ``graph_lane``: the op has a CUDA-graph path (only those fuse launch-bound sizes under graphs).
    ``sharded``: which of the product's dimensions may differ between ranks, ``"k"`` (the
    all-reduce and reduce-scatter, whose exchanged tensor is the [M, N] product) or ``"n"`` (the
    all-gather, whose exchanged tensor is the gathered [M, K] operand): the size rules use only
    the others (``SHARDED_DIM``), so every rank decides alike. ``scaled``: the FP8 arguments of a
    ``_scaled_mm`` (``scaled_operands`` checked their dtypes), whose product is exchanged in its
    output dtype and whose gathered operand in FP8."""
    va, vb = val(a), val(b)
    if va is None or vb is None:
        raise Skip("matmul operands carry no meta['val'] (not a traced post-grad graph)")
    if scaled is None and va.dtype not in FUSABLE_DTYPES:
        raise Skip(f"dtype {va.dtype} is not fp16, bf16 or fp32")
    if scaled is None and (vb.dtype != va.dtype or (bias is not None and val(bias).dtype != va.dtype)):
        raise Skip("matmul operands have mixed dtypes")
    m, k, n = mnk(a, b)
    shared = m * n if sharded == "k" else m * k  # the exchanged tensor's elements
    size = shared * SHARDED_DIM
    if statically_known_true(size < settings.min_mnk):
        dims = "M*N" if sharded == "k" else "M*K"
        raise Skip(f"{dims}*{SHARDED_DIM}={size} is below the size threshold min_mnk={settings.min_mnk} "
                   f"(the {'K' if sharded == 'k' else 'N'} a rank's shard may size alike or not counts as "
                   f"{SHARDED_DIM})")
    exchanged = shared * (scaled.out_dtype if scaled is not None and sharded == "k" else va.dtype).itemsize
    what = "output" if sharded == "k" else "gathered operand"
    bound = settings.launch_bound()
    if bound > 0 and statically_known_true(exchanged <= bound):
        if not _cudagraphs():
            hint = '; mode="reduce-overhead" fuses it' if graph_lane else ""
            raise Skip(f"{what} of {exchanged} bytes is launch-bound without CUDA graphs (at most "
                       f"launch_bound_bytes={bound}): the unfused ops cost less host time{hint}")
        if not graph_lane:
            raise Skip(f"{what} of {exchanged} bytes is launch-bound, and inside CUDA graphs this op "
                       "has no graph-lane path (it would run NCCL): left to Inductor")
    reason = excluded_by(mm, settings)
    if reason:
        raise Skip(reason)


def _cudagraphs() -> bool:
    """Whether this compile runs its graphs as CUDA graphs (``mode="reduce-overhead"``)."""
    return bool(inductor_config.triton.cudagraphs)


def _fake_value(target, args: tuple) -> Any:
    vals = tree_map(val, args)
    flat = [v for v in torch.utils._pytree.tree_leaves(vals) if isinstance(v, torch.Tensor)]
    mode = detect_fake_mode(flat)
    if mode is not None:
        with mode:
            return target(*vals)
    return target(*tree_map(lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v, vals))


def insert_call(graph: fx.Graph, before: fx.Node, target, args: tuple, like: fx.Node) -> fx.Node:
    """Insert ``target(*args)`` before ``before``, with meta['val'] and ``like``'s provenance."""
    with graph.inserting_before(before):
        node = graph.call_function(target, args)
    node.meta["val"] = _fake_value(target, args)
    for key in _PROVENANCE:
        if key in like.meta:
            node.meta[key] = like.meta[key]
    return node


def insert_getitem(graph: fx.Graph, tuple_node: fx.Node, index: int, like: fx.Node) -> fx.Node:
    with graph.inserting_after(tuple_node):
        node = graph.call_function(operator.getitem, (tuple_node, index))
    node.meta["val"] = tuple_node.meta["val"][index]
    for key in _PROVENANCE:
        if key in like.meta:
            node.meta[key] = like.meta[key]
    return node


def graph_label(graph: fx.Graph, number: int) -> str:
    backward = any(n.op == "placeholder" and str(n.target).startswith("tangents") for n in graph.nodes)
    return f"{'backward' if backward else 'forward'}#{number}"
