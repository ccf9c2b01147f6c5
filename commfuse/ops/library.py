"""The ``torch.ops.commfuse`` operator library: schemas, fake implementations, argument checks.

Compiled graphs call these ops by name, so importing this module (which any import of ``commfuse``
does) must happen before cached compiled code runs. Each op takes its process group as a ``str
group_name`` resolved at run time, never a hard-coded WORLD. The fake implementations state exact
shapes, dtypes and (contiguous) strides. The real ones validate their arguments, then run the
unfused computation (``runtime/reference.py``) on any device, or on CUDA the run-time's entry
(``runtime/entry.py``), which picks a path.

Every op ends with ``int site=0``: the call site, a number the graph pass gives each fused call
(the same on every rank for the same program; 0 where unknown: hand-written calls, graphs compiled
before the argument existed). It changes no result: ``COMMFUSE_VERIFY`` and the pairing check
compare it, so a rank that skipped a call meets a peer's call of another site and raises, even
where the two calls look alike (``runtime/verify.py``, ``runtime/paths/base.pairing_tag``).

Each op's unfused equivalent::

    mm_all_reduce(a, b, bias, g)          == all_reduce(a @ b + bias, "sum", g)
    all_gather_mm(x, b, bias, d, W, g, r) == (cat(all_gather(x, g), dim=d).flatten(0, -2) @ b + bias,
                                              the gathered x if r else empty)
    mm_reduce_scatter(a, b, bias, shape, d, W, g)
                                          == reduce_scatter((a @ b + bias).view(shape), "sum", dim=d, g)
    mm_all_reduce_add_rms_norm(a, b, bias, residual, weight, eps, weight_last, g)
                                          == (h, rms_norm(h, weight, eps, weight_last))
                                             with h = residual + mm_all_reduce(a, b, bias, g)
    mm_reduce_scatter_add_rms_norm(a, b, bias, residual, weight, eps, weight_last, shape, d, W, g)
                                          == (h, rms_norm(h, weight, eps, weight_last))
                                             with h = residual + mm_reduce_scatter(a, b, bias, shape, d, W, g)
"""

from __future__ import annotations

import math

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from ..runtime import reference
from ..runtime.counters import CALLS
from ..runtime.spec import (ALL_GATHER_MM, ALL_GATHER_ROWWISE_SCALED_MM, ALL_GATHER_SCALED_MM, MM_ALL_REDUCE,
                            MM_ALL_REDUCE_ADD_RMS_NORM, MM_REDUCE_SCATTER, MM_REDUCE_SCATTER_ADD_RMS_NORM,
                            ROWWISE_SCALED_MM_ALL_REDUCE,
                            ROWWISE_SCALED_MM_REDUCE_SCATTER, SCALED_MM_ALL_REDUCE, SCALED_MM_REDUCE_SCATTER, SPECS)

_FUSABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: Signatures whose arguments were checked already (a call's checks depend on nothing else): a
#: repeated call skips them. Cleared when full.
_checked: set[tuple] = set()
CHECKED_LIMIT = 4096


def _signature(op: str, *args) -> tuple:
    """What a call's checks read: shapes, dtypes, and the other arguments."""
    return (op, *[(x.shape, x.dtype) if isinstance(x, torch.Tensor) else tuple(x) if isinstance(x, list) else x
                  for x in args])


def _once(key: tuple, check) -> None:
    if key in _checked:
        return
    check()
    if len(_checked) >= CHECKED_LIMIT:
        _checked.clear()
    _checked.add(key)


def _check_matmul_args(op: str, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                       rows: int | None = None) -> None:
    """``rows``: the product's rows when they are not ``a``'s (the all-gather's gathered rows)."""
    rows = a.shape[0] if rows is None else rows
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: f"commfuse.{op}: a and b must be 2-D, got {tuple(a.shape)} and {tuple(b.shape)}")
    torch._check(a.shape[1] == b.shape[0], lambda: f"commfuse.{op}: inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    torch._check(a.dtype == b.dtype, lambda: f"commfuse.{op}: a is {a.dtype} but b is {b.dtype}")
    torch._check(a.dtype in _FUSABLE_DTYPES, lambda: f"commfuse.{op}: dtype {a.dtype} is not one of fp16, bf16, fp32")
    _check_bias(op, bias, a.dtype, "a", rows, b.shape[1])


def _check_bias(op: str, bias: torch.Tensor | None, dtype: torch.dtype, of: str, rows, cols) -> None:
    """``bias`` (if any) is of ``dtype`` (the dtype of ``of``) and broadcasts to ``(rows, cols)``."""
    if bias is None:
        return
    torch._check(bias.dtype == dtype, lambda: f"commfuse.{op}: bias is {bias.dtype} but {of} is {dtype}")
    torch._check(bias.dim() <= 2, lambda: f"commfuse.{op}: bias must be 1-D or 2-D, got {tuple(bias.shape)}")
    rows_ok = bias.dim() < 2 or bias.shape[0] == 1 or bias.shape[0] == rows
    cols_ok = bias.dim() == 0 or bias.shape[-1] == 1 or bias.shape[-1] == cols
    torch._check(rows_ok and cols_ok, lambda: f"commfuse.{op}: bias {tuple(bias.shape)} does not broadcast to ({rows}, {cols})")


def _no_gradient(op: str, *tensors) -> None:
    """Refuse an eager call that autograd would record: the ops have no gradient formula (they run
    in compiled graphs, where grad mode is off and backward is a graph of its own), and a recorded
    call would give its inputs no gradient, silently."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError(f"commfuse.{op} has no gradient formula: call it under torch.no_grad(), or let "
                           "torch.compile(backend='commfuse') place it in a compiled graph")


def _group_size(op: str, group_name: str) -> int:
    try:
        return _resolve_process_group(group_name).size()
    except Exception as exc:  # a bad name must say which op and which name
        raise RuntimeError(f"commfuse.{op}: cannot resolve process group {group_name!r}: {exc}") from exc


#: The ops' library. Defined at this level (schema, then a kernel per dispatch key), not through
#: ``torch.library.custom_op``: its Python wrappers (autograd, output checks, a dynamo guard) add
#: host work to every call, which a decode step pays per layer. The ops have no autograd formula:
#: they run inside compiled graphs, whose backward is a graph of its own (``_no_gradient``).
_LIB = torch.library.Library("commfuse", "DEF")
_TAGS = (torch.Tag.pt2_compliant_tag,)
for _spec in SPECS.values():  # each op's schema, made from its spec's argument layout
    _LIB.define(_spec.schema, tags=_TAGS)


def mm_all_reduce(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group_name: str, site: int = 0
) -> torch.Tensor:
    """``all_reduce_sum(a @ b + bias)`` over ``group_name``; every rank returns the reduced sum.

    ``bias`` is added on every rank before the sum, exactly like the ``addmm -> all_reduce`` it
    replaces (DTensor pre-divides a row-parallel bias by the world size for this reason).
    """
    _validate_mm_all_reduce(a, b, bias, group_name)
    args = MM_ALL_REDUCE.Args(a, b, bias, group_name)
    return _entry().reference_call(MM_ALL_REDUCE, args, lambda: MM_ALL_REDUCE.reference(args), site)


def _mm_all_reduce_cuda(a, b, bias, group_name, site=0):
    _validate_mm_all_reduce(a, b, bias, group_name)
    return _entry().run(MM_ALL_REDUCE, MM_ALL_REDUCE.Args(a, b, bias, group_name), site)


_runtime_entry = None


def _entry():
    """The run-time's entry, imported on the first call: it brings Triton and Iris, which
    ``import commfuse`` does without."""
    global _runtime_entry
    if _runtime_entry is None:
        from ..runtime import entry  # (kept out of ``import commfuse``: Triton and Iris)

        _runtime_entry = entry
    return _runtime_entry


def _validate_mm_all_reduce(a, b, bias, group_name) -> None:
    _once(_signature("mm_all_reduce", a, b, bias, group_name), lambda: (
        _check_matmul_args("mm_all_reduce", a, b, bias), _group_size("mm_all_reduce", group_name)))
    _no_gradient("mm_all_reduce", a, b, bias)
    CALLS["mm_all_reduce"] += 1


@torch.library.register_fake("commfuse::mm_all_reduce")
def _(a, b, bias, group_name, site=0):
    _check_matmul_args("mm_all_reduce", a, b, bias)
    return a.new_empty((a.shape[0], b.shape[1]))


def _gathered_shape(shard: torch.Tensor, gather_dim: int, world_size: int) -> list:
    shape = list(shard.shape)
    shape[gather_dim] = shape[gather_dim] * world_size
    return shape


def _check_gather_args(shard: torch.Tensor, b: torch.Tensor, gather_dim: int, world_size: int,
                       op: str = "all_gather_mm") -> None:
    torch._check(shard.dim() >= 2, lambda: f"commfuse.{op}: shard must be at least 2-D, got {tuple(shard.shape)}")
    torch._check(0 <= gather_dim < shard.dim() - 1, lambda: f"commfuse.{op}: gather_dim {gather_dim} must name a leading dimension of a {shard.dim()}-D shard")
    torch._check(world_size >= 1, lambda: f"commfuse.{op}: world_size must be positive, got {world_size}")
    torch._check(b.dim() == 2 and shard.shape[-1] == b.shape[0], lambda: f"commfuse.{op}: shard {tuple(shard.shape)} does not multiply b {tuple(b.shape)}")


def all_gather_mm(
    shard: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    gather_dim: int,
    world_size: int,
    group_name: str,
    return_gathered: bool,
    site: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather ``shard`` along ``gather_dim`` over ``group_name``, flatten the leading dimensions
    and multiply by ``b`` (plus ``bias``).

    Returns ``(out, gathered)``: ``out`` is ``[prod(gathered.shape[:-1]), N]``; ``gathered`` is the
    gathered tensor when ``return_gathered`` is set (the graph still uses it, e.g. for backward),
    otherwise an empty tensor.
    """
    _validate_all_gather_mm(shard, b, bias, gather_dim, world_size, group_name)
    args = ALL_GATHER_MM.Args(shard, b, bias, gather_dim, world_size, group_name, return_gathered)
    out, gathered = _entry().reference_call(ALL_GATHER_MM, args, lambda: ALL_GATHER_MM.reference(args), site)
    return out, gathered if return_gathered else shard.new_empty((0,))


def _all_gather_mm_cuda(shard, b, bias, gather_dim, world_size, group_name, return_gathered, site=0):
    _validate_all_gather_mm(shard, b, bias, gather_dim, world_size, group_name)
    out, gathered = _entry().run(
        ALL_GATHER_MM, ALL_GATHER_MM.Args(shard, b, bias, gather_dim, world_size, group_name, return_gathered), site)
    return out, gathered if return_gathered else shard.new_empty((0,))


def _check_world(op: str, group_name: str, world_size: int) -> None:
    size = _group_size(op, group_name)
    if size != world_size:
        raise RuntimeError(
            f"commfuse.{op}: the graph's collective spans {world_size} ranks but group "
            f"{group_name!r} has {size}"
        )


def _validate_all_gather_mm(shard, b, bias, gather_dim, world_size, group_name) -> None:
    def check():
        _check_gather_args(shard, b, gather_dim, world_size)
        _check_world("all_gather_mm", group_name, world_size)
        _check_matmul_args("all_gather_mm", shard.reshape(-1, shard.shape[-1]), b, bias,
                           math.prod(_gathered_shape(shard, gather_dim, world_size)[:-1]))

    _once(_signature("all_gather_mm", shard, b, bias, gather_dim, world_size, group_name), check)
    _no_gradient("all_gather_mm", shard, b, bias)
    CALLS["all_gather_mm"] += 1


@torch.library.register_fake("commfuse::all_gather_mm")
def _(shard, b, bias, gather_dim, world_size, group_name, return_gathered, site=0):
    _check_gather_args(shard, b, gather_dim, world_size)
    shape = _gathered_shape(shard, gather_dim, world_size)
    rows = math.prod(shape[:-1])
    _check_matmul_args("all_gather_mm", shard.reshape(-1, shard.shape[-1]), b, bias, rows)
    out = shard.new_empty((rows, b.shape[1]))
    gathered = shard.new_empty(shape) if return_gathered else shard.new_empty((0,))
    return out, gathered


def _check_scatter_args(a, b, shape, scatter_dim: int, world_size: int, name: str = "mm_reduce_scatter") -> None:
    op = f"commfuse.{name}"
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: f"{op}: a and b must be 2-D")
    torch._check(list(shape).count(-1) <= 1, lambda: f"{op}: shape {list(shape)} has more than one -1")
    torch._check(all(s >= 0 or s == -1 for s in shape),
                 lambda: f"{op}: shape {list(shape)} has a negative size other than one -1")
    torch._check(-1 not in shape or math.prod(s for s in shape if s != -1) != 0,
                 lambda: f"{op}: shape {list(shape)} has a -1 beside a 0, which leaves it undetermined")
    shape = reference.resolve_shape(shape, a.shape[0] * b.shape[1])
    torch._check(len(shape) >= 2 and math.prod(shape) == a.shape[0] * b.shape[1] and shape[-1] == b.shape[1],
                 lambda: f"{op}: shape {list(shape)} is not a view of the {a.shape[0]}x{b.shape[1]} product")
    torch._check(0 <= scatter_dim < len(shape) - 1,
                 lambda: f"{op}: scatter_dim {scatter_dim} must name a leading dimension of {list(shape)}")
    torch._check(world_size >= 1 and shape[scatter_dim] % world_size == 0,
                 lambda: f"{op}: dim {scatter_dim} of {list(shape)} does not split into {world_size} shares")


def _scattered_shape(shape, scatter_dim: int, world_size: int, numel) -> list:
    out = reference.resolve_shape(shape, numel)
    out[scatter_dim] = out[scatter_dim] // world_size
    return out


def mm_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    shape: list[int],
    scatter_dim: int,
    world_size: int,
    group_name: str,
    site: int = 0,
) -> torch.Tensor:
    """``(a @ b + bias)`` viewed as ``shape`` (one ``-1`` allowed, as in ``view``), summed over
    ``group_name`` and split along ``scatter_dim``: rank r returns share r of the sum (``shape``
    with that dim divided by the world size), as the ``mm -> reduce_scatter`` it replaces did."""
    _validate_mm_reduce_scatter(a, b, bias, shape, scatter_dim, world_size, group_name)
    args = MM_REDUCE_SCATTER.Args(a, b, bias, shape, scatter_dim, world_size, group_name)
    return _entry().reference_call(MM_REDUCE_SCATTER, args, lambda: MM_REDUCE_SCATTER.reference(args), site)


def _mm_reduce_scatter_cuda(a, b, bias, shape, scatter_dim, world_size, group_name, site=0):
    _validate_mm_reduce_scatter(a, b, bias, shape, scatter_dim, world_size, group_name)
    shape = reference.resolve_shape(shape, a.shape[0] * b.shape[1])  # (the run-time keys its plans by it)
    return _entry().run(MM_REDUCE_SCATTER, MM_REDUCE_SCATTER.Args(a, b, bias, shape, scatter_dim, world_size,
                                                                  group_name), site)


def _validate_mm_reduce_scatter(a, b, bias, shape, scatter_dim, world_size, group_name) -> None:
    def check():
        _check_matmul_args("mm_reduce_scatter", a, b, bias)
        _check_scatter_args(a, b, shape, scatter_dim, world_size)
        _check_world("mm_reduce_scatter", group_name, world_size)

    _once(_signature("mm_reduce_scatter", a, b, bias, shape, scatter_dim, world_size, group_name), check)
    _no_gradient("mm_reduce_scatter", a, b, bias)
    CALLS["mm_reduce_scatter"] += 1


@torch.library.register_fake("commfuse::mm_reduce_scatter")
def _(a, b, bias, shape, scatter_dim, world_size, group_name, site=0):
    _check_matmul_args("mm_reduce_scatter", a, b, bias)
    _check_scatter_args(a, b, shape, scatter_dim, world_size)
    return a.new_empty(_scattered_shape(shape, scatter_dim, world_size, a.shape[0] * b.shape[1]))


# ---- The FP8 ops: an FP8 ``_scaled_mm`` with tensor-wise scales in the matmul's place -------------
#
#     scaled_mm_all_reduce(a, b, sa, sb, bias, o, f, g)
#         == all_reduce(_scaled_mm(a, b, sa, sb, bias, out_dtype=o, use_fast_accum=f), "sum", g)
#     all_gather_scaled_mm(x, b, sa, sb, bias, o, f, d, W, g, r)  (likewise, all_gather_mm's gather)
#     scaled_mm_reduce_scatter(a, b, sa, sb, bias, o, f, shape, d, W, g)  (likewise)
#
# On CUDA the run-time runs them by the same policy as the bf16 ops: the graph's own ``_scaled_mm``
# after or before the exchange kernels where a rule or the tuner picks those paths, else that
# unfused computation.

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _check_scaled_args(op: str, a, b, scale_a, scale_b, bias, out_dtype, rows=None, rowwise: bool = False) -> None:
    """``a @ b`` scaled by one float32 per operand into ``out_dtype`` (``_scaled_mm``'s own checks
    run with it; these name the op, and refuse what the FP8 ops do not take). ``rowwise``: the
    scales may be one per row of ``a`` and one per column of ``b`` instead."""
    rows = a.shape[0] if rows is None else rows
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: f"commfuse.{op}: a and b must be 2-D, got {tuple(a.shape)} and {tuple(b.shape)}")
    torch._check(a.shape[1] == b.shape[0], lambda: f"commfuse.{op}: inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    torch._check(a.dtype in _FP8_DTYPES and b.dtype in _FP8_DTYPES,
                 lambda: f"commfuse.{op}: a and b must be float8_e4m3fn or float8_e5m2, got {a.dtype} and {b.dtype}")
    for name, scale, axis in (("scale_a", scale_a, (rows, 1)), ("scale_b", scale_b, (1, b.shape[1]))):
        if rowwise and scale.numel() != 1:  # a row-wise scale: one float32 per row of a, per column of b
            torch._check(scale.dtype == torch.float32 and tuple(scale.shape) == axis,
                         lambda: f"commfuse.{op}: {name} must be one float32 or a float32 {axis} (row-wise), got "
                         f"{scale.dtype} {tuple(scale.shape)}")
            continue
        torch._check(scale.dtype == torch.float32 and scale.numel() == 1,
                     lambda: f"commfuse.{op}: {name} must be one float32 (a tensor-wise scale), got {scale.dtype} "
                     f"{tuple(scale.shape)}")
    torch._check(out_dtype in _FUSABLE_DTYPES, lambda: f"commfuse.{op}: out_dtype {out_dtype} is not one of fp16, bf16, fp32")
    _check_bias(op, bias, out_dtype, "out_dtype", rows, b.shape[1])


#: The row-wise FP8 ops whose product is reduced: their scales may be row-wise, and they take post scales.
_ROWWISE_REDUCED = (ROWWISE_SCALED_MM_ALL_REDUCE, ROWWISE_SCALED_MM_REDUCE_SCATTER)


def _check_post_scales(op: str, args) -> None:
    """The backward's row and column scales: both or neither, float32, each broadcasting to the product."""
    pa, pb = args.post_scale_a, args.post_scale_b
    torch._check((pa is None) == (pb is None), lambda: f"commfuse.{op}: post_scale_a and post_scale_b go together")
    for name, scale in (("post_scale_a", pa), ("post_scale_b", pb)):
        if scale is not None:
            _check_bias(op, scale, torch.float32, f"{name}'s float32", args.a.shape[0], args.b.shape[1])


def _check_rowwise_gather_args(args) -> None:
    """The shard is what the op quantises (a float dtype), the weight FP8 with a tensor-wise or
    column-wise scale, the recipe's dtype FP8."""
    op = ALL_GATHER_ROWWISE_SCALED_MM.name
    shard = args.shard
    _check_gather_args(shard, args.b, args.gather_dim, args.world_size, op)
    torch._check(shard.dtype in _FUSABLE_DTYPES,
                 lambda: f"commfuse.{op}: the shard is quantised here: it must be fp16, bf16 or fp32, got {shard.dtype}")
    torch._check(args.float8_dtype in _FP8_DTYPES,
                 lambda: f"commfuse.{op}: float8_dtype must be float8_e4m3fn or float8_e5m2, got {args.float8_dtype}")
    rows = math.prod(_gathered_shape(shard, args.gather_dim, args.world_size)[:-1])
    a = shard.new_empty((rows, shard.shape[-1]), dtype=args.float8_dtype)
    _check_scaled_args(op, a, args.b, a.new_ones((rows, 1), dtype=torch.float32), args.scale_b, args.bias,
                       args.out_dtype, rows, rowwise=True)


def _validate_scaled(spec, args) -> None:
    """A call's checks (once per signature), its gradient guard and count."""
    op = spec.name

    def check():
        if spec is ALL_GATHER_ROWWISE_SCALED_MM:
            _check_rowwise_gather_args(args)
            _check_world(op, args.group_name, args.world_size)
            return
        if spec is ALL_GATHER_SCALED_MM:
            _check_gather_args(args.shard, args.b, args.gather_dim, args.world_size, op)
            _check_world(op, args.group_name, args.world_size)
            rows = math.prod(_gathered_shape(args.shard, args.gather_dim, args.world_size)[:-1])
            a = args.shard.reshape(-1, args.shard.shape[-1])
        else:
            a, rows = args.a, None
        _check_scaled_args(op, a, args.b, args.scale_a, args.scale_b, args.bias, args.out_dtype, rows,
                           rowwise=spec in _ROWWISE_REDUCED)
        if spec in _ROWWISE_REDUCED:
            _check_post_scales(op, args)
        if spec in (SCALED_MM_REDUCE_SCATTER, ROWWISE_SCALED_MM_REDUCE_SCATTER):
            _check_scatter_args(args.a, args.b, args.shape, args.scatter_dim, args.world_size, op)
            _check_world(op, args.group_name, args.world_size)
        elif spec in (SCALED_MM_ALL_REDUCE, ROWWISE_SCALED_MM_ALL_REDUCE):
            _group_size(op, args.group_name)

    _once(_signature(op, *args), check)
    _no_gradient(op, args[0], args.b, args.bias)
    CALLS[op] += 1


def _spec_kernels(spec, validate=_validate_scaled):
    """The op's kernels: any device runs the unfused computation, CUDA the run-time's entry.
    ``values``: the schema's arguments in order, the call site last; ``validate(spec, args)``: the
    call's checks."""
    width = len(spec.args)

    def finish(args, out):
        if spec in (ALL_GATHER_SCALED_MM, ALL_GATHER_ROWWISE_SCALED_MM):  # the gathered tensor only when read
            return out[0], out[1] if args.return_gathered else args.shard.new_empty((0,))
        return out

    def generic(*values):
        args, site = spec.Args(*values[:width]), (values[width:] or (0,))[0]
        validate(spec, args)
        return finish(args, _entry().reference_call(spec, args, lambda: spec.reference(args), site))

    def cuda(*values):
        args, site = spec.Args(*values[:width]), (values[width:] or (0,))[0]
        validate(spec, args)
        return finish(args, _entry().run(spec, args, site))

    return generic, cuda


@torch.library.register_fake("commfuse::scaled_mm_all_reduce")
def _(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, group_name, site=0):
    _check_scaled_args("scaled_mm_all_reduce", a, b, scale_a, scale_b, bias, out_dtype)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@torch.library.register_fake("commfuse::all_gather_scaled_mm")
def _(shard, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, gather_dim, world_size, group_name,
      return_gathered, site=0):
    op = "all_gather_scaled_mm"
    _check_gather_args(shard, b, gather_dim, world_size, op)
    shape = _gathered_shape(shard, gather_dim, world_size)
    rows = math.prod(shape[:-1])
    _check_scaled_args(op, shard.reshape(-1, shard.shape[-1]), b, scale_a, scale_b, bias, out_dtype, rows)
    out = shard.new_empty((rows, b.shape[1]), dtype=out_dtype)
    return out, shard.new_empty(shape) if return_gathered else shard.new_empty((0,))


@torch.library.register_fake("commfuse::scaled_mm_reduce_scatter")
def _(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, shape, scatter_dim, world_size, group_name, site=0):
    op = "scaled_mm_reduce_scatter"
    _check_scaled_args(op, a, b, scale_a, scale_b, bias, out_dtype)
    _check_scatter_args(a, b, shape, scatter_dim, world_size, op)
    return a.new_empty(_scattered_shape(shape, scatter_dim, world_size, a.shape[0] * b.shape[1]), dtype=out_dtype)


@torch.library.register_fake("commfuse::rowwise_scaled_mm_all_reduce")
def _(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, post_scale_a, post_scale_b, group_name, site=0):
    op = "rowwise_scaled_mm_all_reduce"
    _check_scaled_args(op, a, b, scale_a, scale_b, bias, out_dtype, rowwise=True)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@torch.library.register_fake("commfuse::rowwise_scaled_mm_reduce_scatter")
def _(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, post_scale_a, post_scale_b, shape, scatter_dim,
      world_size, group_name, site=0):
    op = "rowwise_scaled_mm_reduce_scatter"
    _check_scaled_args(op, a, b, scale_a, scale_b, bias, out_dtype, rowwise=True)
    _check_scatter_args(a, b, shape, scatter_dim, world_size, op)
    return a.new_empty(_scattered_shape(shape, scatter_dim, world_size, a.shape[0] * b.shape[1]), dtype=out_dtype)


@torch.library.register_fake("commfuse::all_gather_rowwise_scaled_mm")
def _(*values):
    args = ALL_GATHER_ROWWISE_SCALED_MM.Args(*values[:len(ALL_GATHER_ROWWISE_SCALED_MM.args)])
    _check_rowwise_gather_args(args)
    shape = _gathered_shape(args.shard, args.gather_dim, args.world_size)
    out = args.shard.new_empty((math.prod(shape[:-1]), args.b.shape[1]), dtype=args.out_dtype)
    return out, args.shard.new_empty(shape) if args.return_gathered else args.shard.new_empty((0,))


# ---- The all-reduce with the residual add and RMSNorm after it ---------------------------------
#
#     mm_all_reduce_add_rms_norm(a, b, bias, residual, weight, eps, weight_last, g) == (h, n) with
#         h = residual + all_reduce(a @ b + bias, "sum", g).view(residual.shape)
#         n = rmsnorm(h) * weight, in fp32, cast to h's dtype before the weight (weight_last:
#             LlamaRMSNorm's rounding) or after it (F.rms_norm's)


def _check_norm_args(op: str, a, b, bias, residual, weight, shares: int = 1) -> None:
    """The matmul's checks, a residual of the product's dtype whose last dimension is the
    product's N and whose elements are the product's (``shares``: one of that many shares of
    it), and a 1-D weight of that size and dtype."""
    _check_matmul_args(op, a, b, bias)
    n = b.shape[1]
    torch._check(residual.dtype == a.dtype and weight.dtype == a.dtype,
                 lambda: f"commfuse.{op}: residual and weight must be {a.dtype}, "
                 f"got {residual.dtype} and {weight.dtype}")
    torch._check(residual.dim() >= 1 and residual.shape[-1] == n and residual.numel() * shares == a.shape[0] * n,
                 lambda: f"commfuse.{op}: residual {tuple(residual.shape)} is not a view of the "
                 f"{a.shape[0]}x{n} product" + (f"'s share of {shares}" if shares > 1 else ""))
    torch._check(weight.dim() == 1 and weight.shape[0] == n,
                 lambda: f"commfuse.{op}: weight must be [{n}], got {tuple(weight.shape)}")


def _validate_norm(spec, args) -> None:
    """A norm op's checks (once per signature; the sequence-parallel form's on the share and the
    scatter), its gradient guard and count."""
    op = spec.name

    def check():
        if spec.cuts_rows:
            _check_scatter_norm_args(args)
            _check_world(op, args.group_name, args.world_size)
        else:
            _check_norm_args(op, args.a, args.b, args.bias, args.residual, args.weight)
            _group_size(op, args.group_name)

    _once(_signature(op, *args), check)
    _no_gradient(op, args.a, args.b, args.bias, args.residual, args.weight)
    CALLS[op] += 1


@torch.library.register_fake("commfuse::mm_all_reduce_add_rms_norm")
def _(a, b, bias, residual, weight, eps, weight_last, group_name, site=0):
    _check_norm_args(MM_ALL_REDUCE_ADD_RMS_NORM.name, a, b, bias, residual, weight)
    return residual.new_empty(residual.shape), residual.new_empty(residual.shape)


_generic, _cuda = _spec_kernels(MM_ALL_REDUCE_ADD_RMS_NORM, _validate_norm)
_LIB.impl(MM_ALL_REDUCE_ADD_RMS_NORM.name, _generic, "CompositeExplicitAutograd")
_LIB.impl(MM_ALL_REDUCE_ADD_RMS_NORM.name, _cuda, "CUDA")


def _check_scatter_norm_args(args) -> None:
    """The norm's checks on this rank's share, the reduce-scatter's on the product, and a residual
    shaped as the share."""
    op = MM_REDUCE_SCATTER_ADD_RMS_NORM.name
    _check_norm_args(op, args.a, args.b, args.bias, args.residual, args.weight, max(args.world_size, 1))
    _check_scatter_args(args.a, args.b, args.shape, args.scatter_dim, args.world_size, op)
    share = _scattered_shape(args.shape, args.scatter_dim, args.world_size, args.a.shape[0] * args.b.shape[1])
    torch._check(list(args.residual.shape) == share,
                 lambda: f"commfuse.{op}: residual {tuple(args.residual.shape)} is not shaped as this rank's share "
                 f"{share}")


@torch.library.register_fake("commfuse::mm_reduce_scatter_add_rms_norm")
def _(*values):
    args = MM_REDUCE_SCATTER_ADD_RMS_NORM.Args(*values[:len(MM_REDUCE_SCATTER_ADD_RMS_NORM.args)])
    _check_scatter_norm_args(args)
    return args.residual.new_empty(args.residual.shape), args.residual.new_empty(args.residual.shape)


_generic, _cuda = _spec_kernels(MM_REDUCE_SCATTER_ADD_RMS_NORM, _validate_norm)
_LIB.impl(MM_REDUCE_SCATTER_ADD_RMS_NORM.name, _generic, "CompositeExplicitAutograd")
_LIB.impl(MM_REDUCE_SCATTER_ADD_RMS_NORM.name, _cuda, "CUDA")

for _spec in (SCALED_MM_ALL_REDUCE, ALL_GATHER_SCALED_MM, SCALED_MM_REDUCE_SCATTER, ROWWISE_SCALED_MM_ALL_REDUCE,
              ALL_GATHER_ROWWISE_SCALED_MM, ROWWISE_SCALED_MM_REDUCE_SCATTER):
    _generic, _cuda = _spec_kernels(_spec)
    _LIB.impl(_spec.name, _generic, "CompositeExplicitAutograd")
    _LIB.impl(_spec.name, _cuda, "CUDA")

for _name, _generic, _cuda in (("mm_all_reduce", mm_all_reduce, _mm_all_reduce_cuda),
                               ("all_gather_mm", all_gather_mm, _all_gather_mm_cuda),
                               ("mm_reduce_scatter", mm_reduce_scatter, _mm_reduce_scatter_cuda)):
    _LIB.impl(_name, _generic, "CompositeExplicitAutograd")  # any device: the unfused computation
    _LIB.impl(_name, _cuda, "CUDA")
