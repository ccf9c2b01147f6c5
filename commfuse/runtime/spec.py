"""What an op is, stated once: ``OpSpec``, one per op, read by the op library, the graph pass, the
run-time's entry, the NCCL path, the tuner and the report. Imports no Triton.

A spec holds

* the **argument layout** (``Arg``: a name and a schema type per argument, ``site`` excluded: every
  op ends with it) and the **outputs** (their names; more than one is a tuple), from which the
  **schema** and the argument tuple (``spec.Args``) are made;
* the **unfused reference** (``reference(args)``: the matmul, then the functional collective) and
  the **NCCL equivalent** the NCCL path runs (the same computation unless an op says otherwise);
* the **pattern** that makes it (a module of ``patterns/``, by name: the graph pass imports it);
* what the run-time reads of a call: its sizes (``call(args, world)``: a ``Call``), its signature
  (``key``), the rank-local size an unevenly sharded layer may make differ (``own_size``), what every
  rank shares of it (``shared``, for ``COMMFUSE_VERIFY``), the bytes a rank exposes
  (``exchanged_bytes``) and whether it has a graph lane;
* the **synthetic inputs** the tuner times (``inputs``) and the rows a tuned call's M is a
  multiple of (``rows_unit``).

The layout's types are the schema's: ``Tensor``, ``Tensor?``, ``int``, ``int[]``, ``float``,
``bool``, ``str``, ``ScalarType?``, so an op with a residual and a norm weight (two ``Tensor``
outputs, a ``float eps``, a ``bool`` flag) or FP8 operands (``Tensor scale_a``, ``Tensor scale_b``,
``ScalarType? out_dtype``, ``bool use_fast_accum``) is one more spec, not another branch.

``Call`` (what a path may read of a call) and the row-slab helpers live here too: the sizes are
the op's.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from . import reference

#: At most this many row slabs (``row_slabs``) for the copy-engine overlaps: each slab costs one
#: more GEMM and copy per rank block, launches that a larger batch would multiply.
MAX_ROW_SLABS = 8


@dataclasses.dataclass(frozen=True)
class Call:
    """What a path may read of one op call: the product's sizes and how the collective cuts it.

    ``m`` is the product's rows (for ``all_gather_mm``: the gathered rows, every rank's), ``k``
    and ``n`` its inner and outer sizes. For ``all_gather_mm`` and ``mm_reduce_scatter``,
    ``rows_dim`` is 0 when each rank's block is one block of the product's rows, and ``slabs``
    how many slabs of rows each rank's block is cut into otherwise (a batch of sequences gathered
    along the sequence; 0: unknown or too many)."""

    op: str
    m: int
    k: int
    n: int
    dtype: torch.dtype
    world: int
    bias: bool = False
    rows_dim: int = 0
    slabs: int = 1

    @property
    def spec(self) -> "OpSpec":
        return SPECS[self.op]

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def exchanged_bytes(self) -> int:
        """The bytes one rank exposes (``OpSpec.exchanged``)."""
        return SPECS[self.op].exchanged(self) * self.itemsize

    @property
    def shard_mnk(self) -> int:
        """GEMM work per rank's block of rows: what an overlap can hide the exchange behind."""
        return (self.m // max(self.world, 1)) * self.k * self.n

    def short(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        extra = f" dim{self.rows_dim}x{self.slabs}" if self.rows_dim else ""
        return f"{self.op} {self.m}x{self.k}x{self.n} {dtype} w{self.world}{' +bias' if self.bias else ''}{extra}"


def rows_dim(shape, dim: int) -> int:
    """0 when every dimension before ``dim`` has size 1 (a sequence-parallel ``[1, S, H]``
    gathered or scattered along S): the collective then moves the same blocks of rows as one
    along dim 0, so the row-splitting paths take it; else ``dim``."""
    return 0 if row_slabs(shape, dim) == 1 else dim


def row_slabs(shape, dim: int) -> int:
    """Into how many slabs of rows a collective along ``dim`` of ``shape`` (the rows being every
    dimension but the last) cuts every rank's block: 1 along the rows (``rows_dim`` 0), else the
    product of the dimensions before ``dim`` (a batch of sequences gathered along the sequence);
    0 when that is unknown or above ``MAX_ROW_SLABS``."""
    if dim == 0:
        return 1
    lead = shape[:dim]
    if not all(isinstance(s, int) and s > 0 for s in lead):
        return 0
    slabs = 1
    for s in lead:
        slabs *= s
    return slabs if slabs <= MAX_ROW_SLABS else 0


@dataclasses.dataclass(frozen=True)
class Arg:
    """One argument of an op: its name and its schema type; ``default`` as the schema writes it."""

    name: str
    type: str
    default: str | None = None

    def schema(self) -> str:
        return f"{self.type} {self.name}" + (f"={self.default}" if self.default is not None else "")


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One op (module docstring). Functions take the op's argument tuple (``Args``)."""

    name: str
    args: tuple[Arg, ...]
    outputs: tuple[str, ...]
    #: The unfused computation every path reproduces: ``reference(args)``.
    reference: Callable[[Any], Any]
    #: The module of ``patterns/`` whose matches make this op.
    pattern: str
    #: The call's sizes: ``call(args, world) -> Call``.
    call: Callable[[Any, int], Call]
    #: The call's signature beyond the op and group: shapes, dtype, the collective's arguments.
    key: Callable[[Any], tuple]
    #: The rank-local size of an unevenly sharded layer (``shards.py``).
    own_size: Callable[[Any], int]
    #: What every rank shares of a call, for ``COMMFUSE_VERIFY`` (``verify.same_call``'s keywords).
    shared: Callable[[Any], dict]
    #: Elements one rank exposes: the partial, or the gathered operand.
    exchanged: Callable[[Call], int]
    #: The tuner's inputs for ``call`` on this rank: ``inputs(call, group_name, rand) -> Args``,
    #: ``rand(*shape)`` making a random tensor of the call's dtype.
    inputs: Callable[[Call, str, Callable], Any]
    #: The rows a timed call's M is a multiple of (every rank's block, and each of its slabs).
    rows_unit: Callable[[Call], int]
    #: The NCCL equivalent the NCCL path runs (None: the reference).
    nccl: Callable[[Any], Any] | None = None
    #: Whether the collective cuts the product's rows into per-rank blocks (``Call.rows_dim`` and
    #: ``Call.slabs`` apply).
    cuts_rows: bool = False
    #: Whether captured calls may take the group's graph lane.
    graph_lane: bool = False
    #: The bytes a call would place in the graph lane, read on every call (no ``Call`` made).
    lane_bytes: Callable[[Any], int] | None = None
    #: The unfused equivalent, as the op library's docstring shows it.
    unfused: str = ""
    #: The path a call outside a capture takes where no rule of the group's table applies (empty:
    #: NCCL). For an op that is in a graph only because the user asked for it (an opt-in pattern),
    #: where a rule row is what would make it fuse by default. Inside a capture such an op's
    #: default is its graph-lane path, if it has one (``policy.rules_choice``).
    default_path: str = ""
    #: The op's product of the rows ``a`` (its own left operand, or the gathered shards) written
    #: into ``out``, exactly as the unfused graph computes it: ``product(args, a, out)``. None: the
    #: plain matmul (``reference.matmul`` with ``args.b`` and ``args.bias``). What the paths that run
    #: a library GEMM before or after their exchange call (``product_into``).
    product: Callable[[Any, torch.Tensor, torch.Tensor], Any] | None = None

    #: The argument tuple, made from ``args`` (a named tuple of the op's arguments, ``site`` excluded).
    Args: type = dataclasses.field(init=False, repr=False, compare=False)
    #: Where the arguments say the collective's world size (``world_size``), or None.
    world_at: int | None = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        names = [a.name for a in self.args]
        title = "".join(part.title() for part in self.name.split("_")) + "Args"
        object.__setattr__(self, "Args", collections.namedtuple(title, names))
        object.__setattr__(self, "world_at", names.index("world_size") if "world_size" in names else None)

    def world_size(self, args) -> int:
        """The world size the call's arguments name (0: they name none; the group's is used)."""
        return 0 if self.world_at is None else args[self.world_at]

    @property
    def schema(self) -> str:
        outs = "Tensor" if len(self.outputs) == 1 else "(" + ", ".join("Tensor" for _ in self.outputs) + ")"
        return f"{self.name}({', '.join(a.schema() for a in self.args)}, int site=0) -> {outs}"

    def run_nccl(self, args):
        return (self.nccl or self.reference)(args)

    def product_into(self, args, a: torch.Tensor, out: torch.Tensor) -> None:
        """The op's product of rows ``a`` into ``out`` (``product``)."""
        if self.product is None:
            reference.matmul(a, args.b, args.bias, out=out)
        else:
            self.product(args, a, out)

    @staticmethod
    def product_dtype(args) -> torch.dtype:
        """The dtype of the op's product (what an after-GEMM path exchanges or returns)."""
        return _product_dtype(args)


# ---------------------------------------------------------------------------------------------
# The ops


def _product_dtype(args) -> torch.dtype:
    """The dtype of the product: an FP8 op's ``out_dtype``, else its operands' (for the gathering
    ops the shard's)."""
    return getattr(args, "out_dtype", None) or (args.shard if hasattr(args, "shard") else args.a).dtype


def _ar_call(args, world: int, op: str = "mm_all_reduce") -> Call:
    a, b = args.a, args.b
    return Call(op, a.shape[0], a.shape[1], b.shape[1], _product_dtype(args), world, args.bias is not None)


def _ag_call(args, world: int, op: str = "all_gather_mm") -> Call:
    shard, k = args.shard, args.shard.shape[-1]
    rows = shard.numel() // k * args.world_size if k else 0
    dim = rows_dim(shard.shape, args.gather_dim)  # 0: each rank's rows are one block
    return Call(op, rows, k, args.b.shape[1], shard.dtype, args.world_size, args.bias is not None, dim,
                row_slabs(shard.shape, dim))


def _rs_call(args, world: int, op: str = "mm_reduce_scatter") -> Call:
    a, b = args.a, args.b
    shape = reference.resolve_shape(args.shape, a.shape[0] * b.shape[1])
    dim = rows_dim(shape, args.scatter_dim)  # 0: each rank's share is one block of rows
    return Call(op, a.shape[0], a.shape[1], b.shape[1], _product_dtype(args), args.world_size,
                args.bias is not None, dim, row_slabs(shape, dim))


def _slabbed(call: Call) -> tuple[int, int]:
    """(slabs, dim) of a tuned call's operand: ``[slabs, rows, ...]`` cut along dim 1 where the
    collective cuts every rank's rows into slabs (a batch of sequences), else rows along dim 0."""
    slabs = call.slabs if call.rows_dim else 1
    return slabs, 1 if slabs > 1 else 0


def _ag_inputs(call: Call, group_name: str, rand):
    slabs, dim = _slabbed(call)
    rows = call.m // call.world
    shard = rand(slabs, rows // slabs, call.k) if dim else rand(rows, call.k)
    return ALL_GATHER_MM.Args(shard, rand(call.k, call.n), rand(call.n) if call.bias else None, dim, call.world,
                           group_name, False)


def _rs_inputs(call: Call, group_name: str, rand):
    slabs, dim = _slabbed(call)
    shape = [slabs, call.m // slabs, call.n] if dim else [call.m, call.n]  # the product's view
    return MM_REDUCE_SCATTER.Args(rand(call.m, call.k), rand(call.k, call.n), rand(call.n) if call.bias else None,
                               shape, dim, call.world, group_name)


def _blocks(call: Call) -> int:
    return call.world * (call.slabs if call.rows_dim else 1)


MM_ALL_REDUCE = OpSpec(
    name="mm_all_reduce",
    args=(Arg("a", "Tensor"), Arg("b", "Tensor"), Arg("bias", "Tensor?"), Arg("group_name", "str")),
    outputs=("out",),
    reference=lambda x: reference.mm_all_reduce(x.a, x.b, x.bias, x.group_name),
    pattern="mm_all_reduce",
    call=_ar_call,
    key=lambda x: (tuple(x.a.shape), tuple(x.b.shape), x.a.dtype),
    own_size=lambda x: x.a.shape[1],  # K: the rank's own share of the reduced dimension
    shared=lambda x: dict(rows=x.a.shape[0], n=x.b.shape[1], dtype=x.a.dtype, bias=x.bias),
    exchanged=lambda c: c.m * c.n,
    inputs=lambda c, g, rand: MM_ALL_REDUCE.Args(rand(c.m, c.k), rand(c.k, c.n), rand(c.n) if c.bias else None, g),
    rows_unit=lambda c: 1,
    graph_lane=True,
    lane_bytes=lambda x: x.a.shape[0] * x.b.shape[1] * x.a.dtype.itemsize,
    unfused='all_reduce(a @ b + bias, "sum", g)',
)

ALL_GATHER_MM = OpSpec(
    name="all_gather_mm",
    args=(Arg("shard", "Tensor"), Arg("b", "Tensor"), Arg("bias", "Tensor?"), Arg("gather_dim", "int"),
          Arg("world_size", "int"), Arg("group_name", "str"), Arg("return_gathered", "bool")),
    outputs=("out", "gathered"),
    reference=lambda x: reference.all_gather_mm(x.shard, x.b, x.bias, x.gather_dim, x.world_size, x.group_name),
    pattern="all_gather_mm",
    call=_ag_call,
    key=lambda x: (tuple(x.shard.shape), tuple(x.b.shape), x.shard.dtype, x.gather_dim),
    own_size=lambda x: x.b.shape[1],  # N: the rank's own columns of a column-parallel weight
    # N may differ between ranks: of the bias, its rank and dtype only
    shared=lambda x: dict(shard=x.shard, k=x.b.shape[0], dtype=x.b.dtype, gather_dim=x.gather_dim,
                          bias=None if x.bias is None else f"{x.bias.dtype} {x.bias.dim()}-D"),
    exchanged=lambda c: c.m * c.k,  # the gathered operand: every rank's shard
    inputs=_ag_inputs,
    rows_unit=_blocks,
    cuts_rows=True,
    unfused="(cat(all_gather(x, g), dim=d).flatten(0, -2) @ b + bias, the gathered x if r else empty)",
)

MM_REDUCE_SCATTER = OpSpec(
    name="mm_reduce_scatter",
    args=(Arg("a", "Tensor"), Arg("b", "Tensor"), Arg("bias", "Tensor?"), Arg("shape", "int[]"),
          Arg("scatter_dim", "int"), Arg("world_size", "int"), Arg("group_name", "str")),
    outputs=("out",),
    reference=lambda x: reference.mm_reduce_scatter(x.a, x.b, x.bias, x.shape, x.scatter_dim, x.world_size,
                                                    x.group_name),
    pattern="mm_reduce_scatter",
    call=_rs_call,
    key=lambda x: (tuple(x.a.shape), tuple(x.b.shape), x.a.dtype, tuple(x.shape), x.scatter_dim),
    own_size=lambda x: x.a.shape[1],  # K
    shared=lambda x: dict(rows=x.a.shape[0], n=x.b.shape[1], dtype=x.a.dtype, bias=x.bias, shape=list(x.shape),
                          scatter_dim=x.scatter_dim),
    exchanged=lambda c: c.m * c.n,
    inputs=_rs_inputs,
    rows_unit=_blocks,
    cuts_rows=True,
    unfused='reduce_scatter((a @ b + bias).view(shape), "sum", dim=d, g)',
)

# ---------------------------------------------------------------------------------------------
# The FP8 ops: each the op above with an FP8 ``_scaled_mm`` (tensor-wise scales: one float32 per
# operand) in its matmul's place. The scales, the output dtype and fast accumulation come after
# ``a, b`` and the bias, as ``_scaled_mm`` takes them; the rest is the op's own. Their ``Call``'s
# dtype is the exchanged tensor's: the output dtype of a reduced product, FP8 for a gathered shard.

#: The arguments every FP8 op adds, in its layout's order around ``bias``.
_SCALES = (Arg("scale_a", "Tensor"), Arg("scale_b", "Tensor"))
_FP8_OUT = (Arg("out_dtype", "ScalarType?"), Arg("use_fast_accum", "bool"))


def _fp8(rand, *shape) -> torch.Tensor:
    """A random e4m3 tensor for the tuner's FP8 operands (``rand`` makes the call's dtype)."""
    return rand(*shape).float().to(torch.float8_e4m3fn)


def _scale(like: torch.Tensor) -> torch.Tensor:
    return like.new_ones((), dtype=torch.float32)


def _fp8_weight(rand, k: int, n: int) -> torch.Tensor:
    """A ``[k, n]`` FP8 weight laid out column-major, as ``_scaled_mm`` takes its right operand."""
    return _fp8(rand, n, k).t()


def _scaled_ar_inputs(c: Call, g: str, rand):
    a, b = _fp8(rand, c.m, c.k), _fp8_weight(rand, c.k, c.n)
    # cuBLAS takes no bias with an fp32 FP8 output (the patterns leave that form unfused)
    bias = rand(c.n) if c.bias and c.dtype != torch.float32 else None
    return SCALED_MM_ALL_REDUCE.Args(a, b, _scale(a), _scale(a), bias, c.dtype, False, g)


def _scaled_ag_inputs(c: Call, g: str, rand):
    x = _ag_inputs(c, g, rand)
    b = _fp8_weight(rand, c.k, c.n)
    bias = rand(c.n).float().to(torch.bfloat16) if c.bias else None
    return ALL_GATHER_SCALED_MM.Args(x.shard, b, _scale(b), _scale(b), bias, torch.bfloat16, False, x.gather_dim,
                                     x.world_size, g, False)


def _scaled_rs_inputs(c: Call, g: str, rand):
    x = _rs_inputs(c, g, rand)
    a, b = _fp8(rand, c.m, c.k), _fp8_weight(rand, c.k, c.n)
    bias = x.bias if c.dtype != torch.float32 else None  # as above: no bias with an fp32 FP8 output
    return SCALED_MM_REDUCE_SCATTER.Args(a, b, _scale(a), _scale(a), bias, c.dtype, False, x.shape, x.scatter_dim,
                                         x.world_size, g)


def _scaled_product(args, a: torch.Tensor, out: torch.Tensor) -> None:
    reference.scaled_matmul(a, args.b, args.scale_a, args.scale_b, args.bias, args.out_dtype, args.use_fast_accum,
                            out=out)


def _quantised_product(args, a: torch.Tensor, out: torch.Tensor) -> None:
    """The row-wise gather's product of gathered high-precision rows ``a``: quantised row by row,
    then multiplied (``reference.all_gather_rowwise_scaled_mm`` after its gather)."""
    q, multiplier = reference.quantise_rows(a, args.float8_dtype, args.eps, args.pow2_scales)
    reference.rows_times(q, multiplier, args.b, args.scale_b, args.bias, args.out_dtype, args.use_fast_accum, out)


def _rowwise_product(args, a: torch.Tensor, out: torch.Tensor) -> None:
    reference.rowwise_scaled_matmul(a, args.b, args.scale_a, args.scale_b, args.bias, args.out_dtype,
                                    args.use_fast_accum, args.post_scale_a, args.post_scale_b, out=out)


def _fp8_spec(base: OpSpec, name: str, reference: Callable, call: Callable, inputs: Callable, unfused: str,
              extra: tuple[Arg, ...] = (), product: Callable = _scaled_product, lane: bool = False) -> OpSpec:
    """``base`` with an FP8 ``_scaled_mm`` in its matmul's place: its layout with the FP8 arguments
    added (and ``extra`` after them), its sizes read alike, its signature and shared arguments
    with the FP8 ones. ``lane``: captured calls may take the group's graph lane (the product,
    of the output dtype, through it)."""
    return OpSpec(
        name=name,
        args=(*base.args[:2], *_SCALES, base.args[2], *_FP8_OUT, *extra, *base.args[3:]),
        outputs=base.outputs,
        reference=reference,
        pattern=base.pattern,
        call=lambda x, world: call(x, world, name),
        key=lambda x: (*base.key(x), x.b.dtype, x.out_dtype, x.use_fast_accum),
        own_size=base.own_size,
        shared=lambda x: dict(base.shared(x), b_dtype=x.b.dtype, out_dtype=x.out_dtype,
                              use_fast_accum=x.use_fast_accum),
        exchanged=base.exchanged,
        inputs=inputs,
        rows_unit=base.rows_unit,
        cuts_rows=base.cuts_rows,
        unfused=unfused,
        product=product,
        graph_lane=lane,
        lane_bytes=(lambda x: x.a.shape[0] * x.b.shape[1] * _product_dtype(x).itemsize) if lane else None,
    )


# (each reference takes the op's arguments in order; the all-gather's but its return_gathered)
SCALED_MM_ALL_REDUCE = _fp8_spec(
    MM_ALL_REDUCE, "scaled_mm_all_reduce", lambda x: reference.scaled_mm_all_reduce(*x), _ar_call, _scaled_ar_inputs,
    'all_reduce(_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype=o, use_fast_accum=f), "sum", g)', lane=True)
ALL_GATHER_SCALED_MM = _fp8_spec(
    ALL_GATHER_MM, "all_gather_scaled_mm", lambda x: reference.all_gather_scaled_mm(*x[:-1]), _ag_call,
    _scaled_ag_inputs, "(_scaled_mm(cat(all_gather(x, g), dim=d).flatten(0, -2), b, scale_a, scale_b, bias, "
    "out_dtype=o, use_fast_accum=f), the gathered x if r else empty)")
SCALED_MM_REDUCE_SCATTER = _fp8_spec(
    MM_REDUCE_SCATTER, "scaled_mm_reduce_scatter", lambda x: reference.scaled_mm_reduce_scatter(*x), _rs_call,
    _scaled_rs_inputs, 'reduce_scatter(_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype=o, '
    'use_fast_accum=f).view(shape), "sum", dim=d, g)')

# ---------------------------------------------------------------------------------------------
# The row-wise FP8 ops (torchao's row-wise recipe). A reduced product takes its scales as they are
# ([M, 1] for ``a``, [1, N] for ``b``), and, for the backward's form (``_scaled_mm`` with scales of
# one, then the row and column scales multiplied in and the product cast back), ``post_scale_a``
# and ``post_scale_b``: each rank scales its own partial before the exchange, as the graph did.
# The gathered operand is the bf16 shard: the op quantises it row-wise (the recipe's FP8 dtype,
# ``eps``, power-of-two scales or not), so it can gather FP8 rows and their scales, not bf16.

_POST_SCALES = (Arg("post_scale_a", "Tensor?"), Arg("post_scale_b", "Tensor?"))


def _rowwise_ar_inputs(c: Call, g: str, rand):
    x = _scaled_ar_inputs(c, g, rand)
    return ROWWISE_SCALED_MM_ALL_REDUCE.Args(*x[:2], _row_scale(x.a, c.m, 1), _row_scale(x.a, 1, c.n), *x[4:7], None, None,
                                             x.group_name)


def _rowwise_rs_inputs(c: Call, g: str, rand):
    x = _scaled_rs_inputs(c, g, rand)
    return ROWWISE_SCALED_MM_REDUCE_SCATTER.Args(*x[:2], _row_scale(x.a, c.m, 1), _row_scale(x.a, 1, c.n), *x[4:7], None, None,
                                                 *x[7:])


def _row_scale(like: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Unit row-wise scales on ``like``'s device (the tuner's inputs live on the GPU)."""
    return like.new_ones((rows, cols), dtype=torch.float32)


def _rowwise_ag_call(args, world: int) -> Call:
    """As the all-gather's, with the exchanged dtype the FP8 rows' (their scales: 4 bytes a row more)."""
    return dataclasses.replace(_ag_call(args, world, ALL_GATHER_ROWWISE_SCALED_MM.name), dtype=args.float8_dtype)


def _rowwise_ag_inputs(c: Call, g: str, rand):
    x = _ag_inputs(c, g, lambda *shape: rand(*shape).float().to(torch.bfloat16))
    b = _fp8_weight(rand, c.k, c.n)
    return ALL_GATHER_ROWWISE_SCALED_MM.Args(x.shard, b, _row_scale(b, 1, c.n), None, torch.bfloat16, True, c.dtype,
                                             1e-12, True, x.gather_dim, x.world_size, g, False)


ROWWISE_SCALED_MM_ALL_REDUCE = _fp8_spec(
    MM_ALL_REDUCE, "rowwise_scaled_mm_all_reduce", lambda x: reference.rowwise_scaled_mm_all_reduce(*x), _ar_call,
    _rowwise_ar_inputs, 'all_reduce(rowwise(a, b, scale_a, scale_b, bias, o, f, pa, pb), "sum", g)', _POST_SCALES,
    _rowwise_product)
ROWWISE_SCALED_MM_REDUCE_SCATTER = _fp8_spec(
    MM_REDUCE_SCATTER, "rowwise_scaled_mm_reduce_scatter", lambda x: reference.rowwise_scaled_mm_reduce_scatter(*x),
    _rs_call, _rowwise_rs_inputs, 'reduce_scatter(rowwise(a, b, scale_a, scale_b, bias, o, f, pa, pb).view(shape), '
    '"sum", dim=d, g)', _POST_SCALES, _rowwise_product)
ALL_GATHER_ROWWISE_SCALED_MM = OpSpec(
    name="all_gather_rowwise_scaled_mm",
    args=(Arg("shard", "Tensor"), Arg("b", "Tensor"), Arg("scale_b", "Tensor"), Arg("bias", "Tensor?"), *_FP8_OUT,
          Arg("float8_dtype", "ScalarType"), Arg("eps", "float"), Arg("pow2_scales", "bool"),
          *ALL_GATHER_MM.args[3:]),
    outputs=ALL_GATHER_MM.outputs,
    reference=lambda x: reference.all_gather_rowwise_scaled_mm(*x),
    pattern=ALL_GATHER_MM.pattern,
    call=_rowwise_ag_call,
    key=lambda x: (*ALL_GATHER_MM.key(x), x.b.dtype, x.out_dtype, x.use_fast_accum, x.float8_dtype, x.eps,
                   x.pow2_scales),
    own_size=ALL_GATHER_MM.own_size,
    shared=lambda x: dict(ALL_GATHER_MM.shared(x), b_dtype=x.b.dtype, out_dtype=x.out_dtype,
                          use_fast_accum=x.use_fast_accum, float8_dtype=x.float8_dtype, eps=x.eps,
                          pow2_scales=x.pow2_scales),
    exchanged=ALL_GATHER_MM.exchanged,
    inputs=_rowwise_ag_inputs,
    rows_unit=ALL_GATHER_MM.rows_unit,
    cuts_rows=True,
    unfused="(_scaled_mm(q, b, 1/s, scale_b, bias, out_dtype=o, use_fast_accum=f), the gathered x if r else empty) "
            "with q, s = quantise_rows(cat(all_gather(x, g), dim=d)).flatten(0, -2)",
    product=_quantised_product,
)

# ---------------------------------------------------------------------------------------------
# The row-parallel matmul's all-reduce with the residual add and RMSNorm after it (the
# ``add_rms_norm`` pattern, opt-in): two outputs, ``h`` (the residual stream) and ``n`` (its norm),
# each shaped as the residual (the reduced product viewed so).


#: The arguments the norm ops add after the product's bias, before the collective's own.
_NORM_ARGS = (Arg("residual", "Tensor"), Arg("weight", "Tensor"), Arg("eps", "float"), Arg("weight_last", "bool"))


def _norm_spec(base: OpSpec, name: str, reference: Callable, call: Callable, inputs: Callable, unfused: str,
               default_path: str) -> OpSpec:
    """``base`` with the residual add and RMSNorm after its collective: its layout with the norm's
    arguments after the bias, two outputs ``h`` and ``n`` shaped as the residual, its sizes, lane
    and rows read alike, its signature and shared arguments with the norm's."""
    return OpSpec(
        name=name,
        args=(*base.args[:3], *_NORM_ARGS, *base.args[3:]),
        outputs=("h", "n"),
        reference=reference,
        pattern="add_rms_norm",
        call=lambda x, world: call(x, world, name),
        key=lambda x: (*base.key(x), tuple(x.residual.shape), x.weight_last),
        own_size=base.own_size,
        shared=lambda x: dict(base.shared(x), residual=x.residual, weight=x.weight, eps=x.eps,
                              weight_last=x.weight_last),
        exchanged=base.exchanged,
        inputs=inputs,
        rows_unit=base.rows_unit,
        cuts_rows=base.cuts_rows,
        graph_lane=base.graph_lane,
        lane_bytes=base.lane_bytes,
        unfused=unfused,
        default_path=default_path,
    )


def _norm_inputs(c: Call, g: str, rand):
    return MM_ALL_REDUCE_ADD_RMS_NORM.Args(rand(c.m, c.k), rand(c.k, c.n), rand(c.n) if c.bias else None,
                                           rand(c.m, c.n), rand(c.n), 1e-6, True, g)


def _rs_norm_inputs(c: Call, g: str, rand):
    rs = _rs_inputs(c, g, rand)
    share = list(rs.shape)
    share[rs.scatter_dim] //= c.world
    return MM_REDUCE_SCATTER_ADD_RMS_NORM.Args(rs.a, rs.b, rs.bias, rand(*share), rand(c.n), 1e-6, True, rs.shape,
                                               rs.scatter_dim, rs.world_size, g)


MM_ALL_REDUCE_ADD_RMS_NORM = _norm_spec(
    MM_ALL_REDUCE, "mm_all_reduce_add_rms_norm", lambda x: reference.mm_all_reduce_add_rms_norm(*x), _ar_call,
    _norm_inputs, '(h, rms_norm(h, weight, eps, weight_last)) with h = residual + all_reduce(a @ b + bias, "sum", g)',
    "one_shot")
# The sequence-parallel form: a reduce-scatter in the all-reduce's place, the add and the norm on
# this rank's share of the rows; ``h`` and ``n`` shaped as the residual (the share's shape).
MM_REDUCE_SCATTER_ADD_RMS_NORM = _norm_spec(
    MM_REDUCE_SCATTER, "mm_reduce_scatter_add_rms_norm", lambda x: reference.mm_reduce_scatter_add_rms_norm(*x),
    _rs_call, _rs_norm_inputs, '(h, rms_norm(h, weight, eps, weight_last)) with '
    'h = residual + reduce_scatter((a @ b + bias).view(shape), "sum", dim=d, g)', "pull")

#: Every op, by name, in the order the registry and the report list them.
SPECS: dict[str, OpSpec] = {s.name: s for s in (MM_ALL_REDUCE, ALL_GATHER_MM, MM_REDUCE_SCATTER, SCALED_MM_ALL_REDUCE,
                                                 ALL_GATHER_SCALED_MM, SCALED_MM_REDUCE_SCATTER,
                                                 ROWWISE_SCALED_MM_ALL_REDUCE, ALL_GATHER_ROWWISE_SCALED_MM,
                                                 ROWWISE_SCALED_MM_REDUCE_SCATTER, MM_ALL_REDUCE_ADD_RMS_NORM,
                                                 MM_REDUCE_SCATTER_ADD_RMS_NORM)}
OPS = tuple(SPECS)

#: Each op's argument tuple by its own name (what paths, tools and tests construct).
MmAllReduceArgs, AllGatherMmArgs, MmReduceScatterArgs = MM_ALL_REDUCE.Args, ALL_GATHER_MM.Args, MM_REDUCE_SCATTER.Args

__all__ = ["ALL_GATHER_MM", "ALL_GATHER_ROWWISE_SCALED_MM", "ALL_GATHER_SCALED_MM", "Arg", "Call", "MAX_ROW_SLABS", "MM_ALL_REDUCE",
           "MM_ALL_REDUCE_ADD_RMS_NORM", "MM_REDUCE_SCATTER", "MM_REDUCE_SCATTER_ADD_RMS_NORM", "OPS", "OpSpec", "ROWWISE_SCALED_MM_ALL_REDUCE",
           "ROWWISE_SCALED_MM_REDUCE_SCATTER", "SCALED_MM_ALL_REDUCE", "SCALED_MM_REDUCE_SCATTER", "SPECS",
           "AllGatherMmArgs", "MmAllReduceArgs", "MmReduceScatterArgs", "row_slabs", "rows_dim"]
