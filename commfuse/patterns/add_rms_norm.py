"""matmul -> all_reduce(sum) -> residual add -> RMSNorm  ==>  commfuse.mm_all_reduce_add_rms_norm

A Llama-style block's row-parallel linear (o_proj, down_proj), its residual add and the next
RMSNorm, in a forward graph::

    before:  mm = mm(a, b) | addmm(bias, a, b)
             v  = reshape(mm, ...)                  # zero or more views
             ar = all_reduce(v, "sum", g)           # or the in-place all_reduce_
             r  = wait_tensor(ar)
             h  = add(residual, r)                  # -> other users of h (the next residual add)
             hf = convert_element_type(h, float32)  # absent in fp32
             s  = rsqrt(add(mean(pow(hf, 2), [-1], keepdim), eps))
             n  = mul(weight, convert(mul(hf, s), dtype))      # weight_last: LlamaRMSNorm, the bundled model
                | convert(mul(mul(hf, s), weight), dtype)      # F.rms_norm, nn.RMSNorm (no convert in fp32)
                  -> users of n

    after:   f  = commfuse.mm_all_reduce_add_rms_norm(a, b, bias, residual, weight, eps, weight_last, g)
             h' = f[0]  -> the other users of h
             n' = f[1]  -> users of n

**How it composes with ``mm_all_reduce``.** This pattern runs first and takes the matmul with
it: the op computes the partial itself (on the GPU, cuBLAS straight into the symmetric workspace,
as ``mm_all_reduce``'s one-shot does), so the exchange reads it where it lies and no copy is
added. An all-reduce it does not take (no add + norm after it, a backward graph, an FP8
product, a skip below) is left to ``mm_all_reduce``, which runs next. A chain is one op or the
other's, never both.

**Off by default.** Once the chain is one op, Inductor's own fused add + norm kernel is no longer
a candidate at run time, so the decision is made here, at compile time, from what every rank
shares: the pattern is opt-in (``backend(patterns=[..., "add_rms_norm"])``, a setting the ranks
agree on), or a row of the rules table for the op says so (none yet: the rows are to be measured on
two GPUs). Where the chain cannot gain it stays with Inductor, with the reason recorded: one rank,
a GPU other than sm_90 or ROCm (the kernel was measured on sm_90 only), a hidden size past the
kernel's ``MAX_HIDDEN``, under CUDA graphs a call past the graph lane (``COMMFUSE_GRAPH_BYTES``:
inside a capture it would run the chain op by op; within it the op takes the lane, its ``graph``
path), and ``check_fusable``'s guards (dtype, sizes, launch bound, exclusions).

Skipped too, with the reason: a reduce op other than sum; a reduced sum, add or norm step read by
anything outside the chain (a training forward saves the norm's ``rsqrt`` for the backward: only
the forward of inference fuses); a residual, weight or output of another dtype or shape.

**The sequence-parallel form.** A reduce-scatter in the all-reduce's place, the add and the norm
on each rank's share of the rows, in every form ``mm_reduce_scatter`` matches (along dim 0,
DTensor's split/cat, torchtitan's permuted copy whose reader permutes it back)::

    before:  mm -> views -> [ split/cat | clone(permute(., p)) ] -> reduce_scatter(., "sum", W, g)
             w = wait_tensor(.) [ -> permute(w, inverse of p) ] -> h = add(residual, .) -> RMSNorm -> n

    after:   f  = commfuse.mm_reduce_scatter_add_rms_norm(a, b, bias, residual, weight, eps, weight_last,
                                                          shape, d, W, g)
             h' = f[0], n' = f[1]

It is gated as the all-reduce form is, and under CUDA graphs it always stays with Inductor (it has
no graph-lane path). A reduce-scatter this pattern does not take is left to ``mm_reduce_scatter``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
from torch._inductor import config as inductor_config
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .. import env
from ..kernels.sizes.norm_epilogue import MAX_HIDDEN
from ..runtime import policy
from ..runtime.facts import local_facts
from ..runtime.paths.ar_norm import ARCH
from ..runtime.spec import MM_ALL_REDUCE_ADD_RMS_NORM, MM_REDUCE_SCATTER_ADD_RMS_NORM, Call
from . import mm_reduce_scatter
from .common import (SCALED_MM, Skip, arg, aten, c10d, check_fusable, depends_on, insert_call, insert_getitem, is_call,
                     matmul_operands, prims, product_through_views, require_sum, single_wait_users, target_name,
                     val)

NAME = "add_rms_norm"
#: Not among the patterns a backend runs by default (``config.DEFAULT_PATTERNS``).
OPT_IN = True
ANCHORS = (c10d.all_reduce.default, c10d.all_reduce_.default, c10d.reduce_scatter_tensor.default)

_CONVERT = (prims.convert_element_type.default,)
_MUL = (aten.mul.Tensor,)
_ADDS = (aten.add.Tensor, aten.add.Scalar)


def _only_user(node: fx.Node, targets, what: str) -> fx.Node:
    """The single user of ``node``, a call of one of ``targets``; Skip naming ``what`` otherwise."""
    users = list(node.users)
    if len(users) != 1:
        raise Skip(f"the norm's {what} has {len(users)} users: only a chain read by nothing else fuses (a "
                   "training forward keeps its steps for the backward)")
    if not is_call(users[0], targets):
        raise Skip(f"the norm's {what} is read by {target_name(users[0])}, not an RMSNorm step")
    return users[0]


def _other(node: fx.Node, one: fx.Node):
    """The argument of binary ``node`` that is not ``one`` (None if neither, or both, are)."""
    x, y = node.args[:2]
    return y if x is one and y is not one else x if y is one and x is not one else None


@dataclasses.dataclass
class Norm:
    """An RMSNorm of ``h`` as the graph decomposed it: its nodes (consumers first; ``out`` the
    first), weight, eps and rounding."""

    nodes: list[fx.Node]
    weight: fx.Node
    eps: float
    weight_last: bool

    @property
    def out(self) -> fx.Node:
        return self.nodes[0]


def rms_norm_of(h: fx.Node) -> Norm:
    """The RMSNorm that reads ``h`` (module docstring), or Skip with why not."""
    vh = val(h)
    dtype = vh.dtype
    # the float32 copies of h (the bundled model's inference graph casts it twice, one for the
    # square, one for the product); h itself in fp32
    sources = [h] if dtype == torch.float32 else [
        u for u in h.users if is_call(u, _CONVERT) and u.args[1] == torch.float32]
    squares = [u for x in sources for u in x.users if is_call(u, (aten.pow.Tensor_Scalar,)) and u.args[1] == 2]
    if len(squares) != 1:
        raise Skip("the residual add is not followed by an RMSNorm (no square of its float32 value)")
    mean = _only_user(squares[0], (aten.mean.dim,), "square")
    dims = arg(mean, 1, "dim")
    if not (isinstance(dims, (list, tuple)) and len(dims) == 1 and dims[0] in (-1, vh.dim() - 1)
            and arg(mean, 2, "keepdim", False)):
        raise Skip(f"the mean of squares is over {dims}, not the last dimension kept")
    add_eps = _only_user(mean, _ADDS, "mean of squares")
    eps = add_eps.args[1]
    if add_eps.args[0] is not mean or not isinstance(eps, float) or add_eps.kwargs:
        raise Skip("the mean of squares is not plus a constant eps")
    rsqrt = _only_user(add_eps, (aten.rsqrt.default,), "mean plus eps")
    normed = _only_user(rsqrt, _MUL, "rsqrt")
    if _other(normed, rsqrt) not in sources:
        raise Skip("the rsqrt does not multiply the residual add's sum")
    casts = list(dict.fromkeys(x for x in (squares[0].args[0], _other(normed, rsqrt)) if x is not h))
    if any(not set(c.users) <= {squares[0], normed} for c in casts):
        raise Skip("the norm's float32 copy of the sum has other users")
    steps = [*casts, squares[0], mean, add_eps, rsqrt, normed]
    after = _only_user(normed, (*_CONVERT, *_MUL), "normalised rows")
    weight_last = is_call(after, _CONVERT)
    if weight_last:  # LlamaRMSNorm: cast, then times the weight
        if after.args[1] != dtype:
            raise Skip(f"the normalised rows are cast to {after.args[1]}, not the sum's {dtype}")
        scaled = _only_user(after, _MUL, "normalised rows cast back")
        weight, out = _other(scaled, after), scaled
        steps += [after, scaled]
    else:  # F.rms_norm: times the weight in float32, then one cast
        weight, out = _other(after, normed), after
        steps.append(after)
        if dtype != torch.float32:
            out = _only_user(after, _CONVERT, "weighted rows")
            steps.append(out)
    vw, vo = val(weight), val(out)
    if not isinstance(weight, fx.Node) or vw is None or vw.dim() != 1 or vw.dtype != dtype:
        raise Skip(f"the norm's weight is not a 1-D {dtype} tensor")
    if vo is None or vo.dtype != dtype or not statically_known_true(vw.shape[0] == vh.shape[-1]):
        raise Skip("the norm's output is not of the sum's dtype, or its weight not of the hidden size")
    return Norm(steps[::-1], weight, eps, weight_last)


def _gated(device: torch.device, call: Call, settings) -> None:
    """Skip unless the chain fuses here (module docstring): from what every rank shares, the
    group's size, the call's sizes and the settings (under CUDA graphs, the graph lane's bytes);
    the GPU's architecture is this rank's, alike wherever the ranks could run a symmetric path (a
    mixed group's calls run the unfused chain)."""
    if call.world < 2:
        raise Skip("one rank: nothing to exchange, the chain stays with Inductor")
    if call.n > MAX_HIDDEN:
        raise Skip(f"hidden size {call.n} is past the norm epilogue's {MAX_HIDDEN}: the chain stays with Inductor")
    lane = env.current().graph_bytes
    if inductor_config.triton.cudagraphs and not call.spec.graph_lane:
        raise Skip("under CUDA graphs the sequence-parallel form has no capturable path: a capture would run the "
                   "chain op by op, so it stays with Inductor")
    if inductor_config.triton.cudagraphs and call.exchanged_bytes > lane:
        raise Skip(f"under CUDA graphs, {call.exchanged_bytes} bytes is past the graph lane's COMMFUSE_GRAPH_BYTES "
                   f"({lane}): a capture would run the chain op by op, so it stays with Inductor")
    facts = None
    if device.type == "cuda":
        facts = local_facts(call.world, provider=env.current().symm_provider)
        if facts.rocm:
            raise Skip("ROCm: the norm epilogue is written for NVIDIA GPUs; the chain stays with Inductor")
        if facts.arch != ARCH:
            raise Skip(f"the norm epilogue is measured on {ARCH} only, not {facts.arch}: the chain stays with Inductor")
    ruled = facts is not None and policy.ruled(call, facts)
    if NAME not in settings.patterns and not ruled:
        raise Skip(f"pattern {NAME} is opt-in and no rule of this GPU's table asks for it")
    if call.world != 2 and not ruled:
        # a one-shot exchange reads every peer's rows: past two ranks its cost grows with the
        # group, and only two ranks are measured
        raise Skip(f"opted in, but measured at 2 ranks only: at {call.world} the chain stays with Inductor "
                   "until a rule of this GPU's table asks for it")


def _replace_chain(graph: fx.Graph, op, args: tuple, mm: fx.Node, add: fx.Node, norm: Norm,
                   before_add: list[fx.Node]) -> fx.Node:
    """``op(*args)`` in place of the chain: its ``h`` read where the residual add was, its ``n``
    where the norm's output was; the norm's steps, the add, then ``before_add`` (consumers first,
    down to the matmul ``mm``) erased."""
    # before the norm's output: every operand is computed before it
    fused = insert_call(graph, norm.out, op, args, mm)
    h = insert_getitem(graph, fused, 0, add)
    n = insert_getitem(graph, fused, 1, norm.out)
    norm.out.replace_all_uses_with(n)
    for node in norm.nodes:  # consumers first
        graph.erase_node(node)
    add.replace_all_uses_with(h)
    for node in [add, *before_add]:
        graph.erase_node(node)
    return fused


@dataclasses.dataclass
class AddRmsNormMatch:
    all_reduce: fx.Node
    wait: fx.Node
    views: list[fx.Node]  # nearest the all_reduce first
    mm: fx.Node
    a: fx.Node
    b: fx.Node
    bias: fx.Node | None
    group_name: str
    add: fx.Node
    residual: fx.Node
    norm: Norm
    scaled: None = None  # (no FP8 form)

    @property
    def op(self):
        return getattr(torch.ops.commfuse, MM_ALL_REDUCE_ADD_RMS_NORM.name).default

    @classmethod
    def from_anchor(cls, ar: fx.Node, settings) -> "AddRmsNormMatch":
        """The match rooted at the all_reduce ``ar``, or Skip with the reason."""
        require_sum(ar)
        waits = single_wait_users(ar, "all_reduce")
        if len(waits) != 1:
            raise Skip("the reduced sum is not read by one residual add alone")
        add, residual, norm = _residual_add(waits[0])
        vh = val(add)
        x, views, post = product_through_views(ar.args[0], "all_reduce")
        if post is not None or is_call(x, (SCALED_MM,)):
            raise Skip("the reduced sum is a scaled (FP8) product: left to the mm_all_reduce pattern")
        if val(x) is None or not statically_known_true(vh.shape[-1] == val(x).shape[-1]):
            raise Skip("a view changes the product's last dimension: the norm's rows are not the product's rows")
        try:
            a, b, bias = matmul_operands(x)
            check_fusable(x, a, b, bias, settings)
            group_name = arg(ar, 2, "group_name")
            m, k, n = val(x).shape[0], val(a).shape[1], val(x).shape[1]
            world = _resolve_process_group(group_name).size()
            call = Call(MM_ALL_REDUCE_ADD_RMS_NORM.name, m, k, n, vh.dtype, world, bias is not None)
            _gated(vh.device, call, settings)
        except Skip as exc:
            raise Skip(str(exc), mm=x) from None
        return cls(ar, waits[0], views, x, a, b, bias, group_name, add, residual, norm)

    def replace(self, graph: fx.Graph) -> fx.Node:
        norm = self.norm
        args = (self.a, self.b, self.bias, self.residual, norm.weight, norm.eps, norm.weight_last, self.group_name)
        return _replace_chain(graph, self.op, args, self.mm, self.add, norm,
                              [self.wait, self.all_reduce, *self.views, self.mm])


def _residual_add(reader: fx.Node) -> tuple[fx.Node, fx.Node, Norm]:
    """(the residual add that alone reads ``reader``, the residual, the RMSNorm of the sum), or
    Skip with why not."""
    users = list(reader.users)
    if len(users) != 1 or not is_call(users[0], (aten.add.Tensor,)) or users[0].kwargs:
        raise Skip("the reduced sum is not read by one residual add alone")
    add = users[0]
    residual = _other(add, reader)
    vr, vs, vh = val(residual), val(reader), val(add)
    if vr is None or vs is None or vh is None or not (vr.shape == vs.shape == vh.shape) or not (
            vr.dtype == vs.dtype == vh.dtype):
        raise Skip("the residual add broadcasts or mixes dtypes")
    norm = rms_norm_of(add)
    if depends_on([norm.weight], {add}):
        raise Skip("the norm's weight is computed from the sum it normalises")
    return add, residual, norm


@dataclasses.dataclass
class ScatterAddRmsNormMatch:
    """The sequence-parallel form (module docstring): ``mm_reduce_scatter``'s match, then the
    residual add and RMSNorm of this rank's share."""

    scatter: mm_reduce_scatter.MmReduceScatterMatch
    unpermute: fx.Node | None  # the permuted form's reader, which permutes the share back
    add: fx.Node
    residual: fx.Node
    norm: Norm
    scaled: None = None  # (no FP8 form)

    @property
    def mm(self) -> fx.Node:
        return self.scatter.mm

    @property
    def op(self):
        return getattr(torch.ops.commfuse, MM_REDUCE_SCATTER_ADD_RMS_NORM.name).default

    @classmethod
    def from_anchor(cls, rs: fx.Node, settings) -> "ScatterAddRmsNormMatch":
        scatter = mm_reduce_scatter.MmReduceScatterMatch.from_anchor(rs, settings)
        if scatter.scaled is not None:
            raise Skip("the reduced sum is a scaled (FP8) product: left to the mm_reduce_scatter pattern",
                       mm=scatter.mm)
        if len(scatter.waits) != 1:
            raise Skip("the reduce-scatter is waited on more than once", mm=scatter.mm)
        reader, unpermute = scatter.waits[0], None
        if scatter.perm is not None:
            users = list(reader.users)
            if len(users) != 1 or not mm_reduce_scatter.inverts(users[0], scatter.perm):
                raise Skip("the permuted share is not read by one permute back alone", mm=scatter.mm)
            reader = unpermute = users[0]
        try:
            add, residual, norm = _residual_add(reader)
            vh, vx = val(add), val(scatter.mm)
            if not statically_known_true(vh.shape[-1] == vx.shape[-1]):
                raise Skip("a view changes the product's last dimension: the norm's rows are not the product's rows")
            world = arg(rs, 2, "group_size")
            m, k, n = vx.shape[0], val(scatter.a).shape[1], vx.shape[1]
            call = Call(MM_REDUCE_SCATTER_ADD_RMS_NORM.name, m, k, n, vh.dtype, world, scatter.bias is not None)
            _gated(vh.device, call, settings)
        except Skip as exc:
            raise Skip(str(exc), mm=scatter.mm) from None
        return cls(scatter, unpermute, add, residual, norm)

    def replace(self, graph: fx.Graph) -> fx.Node:
        sc, norm = self.scatter, self.norm
        rs = sc.reduce_scatter
        args = (sc.a, sc.b, sc.bias, self.residual, norm.weight, norm.eps, norm.weight_last, sc.shape, sc.scatter_dim,
                arg(rs, 2, "group_size"), arg(rs, 3, "group_name"))
        readers = [self.unpermute] if self.unpermute is not None else []
        return _replace_chain(graph, self.op, args, sc.mm, self.add, norm,
                              [*readers, *sc.waits, rs, *sc.layout, *sc.views, sc.mm])


class MATCH:
    """The form by the anchor's collective: the all-reduce's, or sequence parallelism's reduce-scatter."""

    @staticmethod
    def from_anchor(anchor: fx.Node, settings):
        if anchor.target is c10d.reduce_scatter_tensor.default:
            return ScatterAddRmsNormMatch.from_anchor(anchor, settings)
        return AddRmsNormMatch.from_anchor(anchor, settings)
