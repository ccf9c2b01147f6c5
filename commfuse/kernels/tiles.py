"""Persistent-GEMM building blocks shared by the fused kernels: tile order, one output tile's
K loop through TMA descriptors, and the host side that builds descriptors and picks configs.

``matmul_kernel`` is the GEMM alone on the same helpers: what the fused kernels' GEMM part costs
without any communication (the ops benchmark compares it with cuBLAS), on bf16/fp16 operands or on
FP8 ones with ``_scaled_mm``'s scales (``scaled_matmul``, against ``torch._scaled_mm``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation

from .launch import LAYOUT_ATTR, descriptor_layout, run as run_kernel
from .sizes.tiles import FP8_DTYPES, TileConfig, cdiv  # noqa: F401  (the kernels' tiling, kept apart: deciding imports no Triton)

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception:  # pragma: no cover - older Triton: no path offers a tile kernel (GroupFacts.tma)
    TensorDescriptor = None


@triton.jit
def tile_coords(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M row-blocks share each column sweep, so B's columns stay in L2."""
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % size_m
    pid_n = (tile % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def mma_tile(a_desc, b_desc, off_m, off_n, K, BM: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, B_TRANSPOSED: tl.constexpr, IMPRECISE: tl.constexpr = None):
    """fp32 ``A[off_m:+BM, :] @ B[:, off_n:+BN]``. ``B_TRANSPOSED``: the descriptor is over B's
    transpose ``[N, K]`` (a linear layer's weight), loaded as [BN, BK] tiles. ``IMPRECISE``
    (FP8 operands): ``tl.dot``'s ``max_num_imprecise_acc`` (``fp8_accumulation``)."""
    return mma_range(a_desc, b_desc, off_m, off_n, 0, tl.cdiv(K, BK), BM, BN, BK, B_TRANSPOSED, IMPRECISE)


@triton.jit
def mma_range(a_desc, b_desc, off_m, off_n, k_lo, k_hi, BM: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr, B_TRANSPOSED: tl.constexpr, IMPRECISE: tl.constexpr = None):
    """``mma_tile`` over the K blocks ``k_lo`` to ``k_hi`` (exclusive) only: one split-K slice."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(k_lo, k_hi):
        a = a_desc.load([off_m, k * BK])
        if B_TRANSPOSED:
            b = b_desc.load([off_n, k * BK]).T
        else:
            b = b_desc.load([k * BK, off_n])
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=IMPRECISE)
    return acc


@triton.jit
def scale_tile(acc, scale_a, scale_b, rows, cols, M, N, ROWWISE: tl.constexpr):
    """``acc`` times the operands' scales, as ``_scaled_mm`` applies them before its bias:
    tensor-wise one float32 each, row-wise ``scale_a[M]`` and ``scale_b[N]`` (rows and cols past
    the product read 1)."""
    if ROWWISE:
        sa = tl.load(scale_a + rows, mask=rows < M, other=1.0)
        sb = tl.load(scale_b + cols, mask=cols < N, other=1.0)
        return acc * sa[:, None] * sb[None, :]
    return acc * (tl.load(scale_a) * tl.load(scale_b))


@triton.jit
def tile_epilogue(acc, bias, off_m, off_n, M, N, stride_bm, stride_bn, BM: tl.constexpr,
                  BN: tl.constexpr, HAS_BIAS: tl.constexpr):
    """(rows, cols, mask, acc + bias): a tile's coordinates and its biased fp32 values."""
    rows = off_m + tl.arange(0, BM)
    cols = off_n + tl.arange(0, BN)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if HAS_BIAS:
        acc += tl.load(bias + rows[:, None] * stride_bm + cols[None, :] * stride_bn, mask=mask).to(tl.float32)
    return rows, cols, mask, acc


@triton.jit
def matmul_kernel(a_desc, b_desc, bias, c, M, N, K, stride_bm, stride_bn, scale_a, scale_b, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                  B_TRANSPOSED: tl.constexpr, HAS_BIAS: tl.constexpr, SCALED: tl.constexpr = False,
                  ROWWISE: tl.constexpr = False, IMPRECISE: tl.constexpr = None):
    """``c = a @ b (+ bias)``, persistent: program p takes tiles p, p + grid, ... ``SCALED``: FP8
    operands, ``c = (a @ b) * scales (+ bias)`` as ``_scaled_mm`` (``scale_tile``)."""
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    for tile in range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        acc = mma_tile(a_desc, b_desc, pid_m * BM, pid_n * BN, K, BM, BN, BK, B_TRANSPOSED, IMPRECISE)
        if SCALED:
            acc = scale_tile(acc, scale_a, scale_b, pid_m * BM + tl.arange(0, BM), pid_n * BN + tl.arange(0, BN),
                             M, N, ROWWISE)
        rows, cols, mask, acc = tile_epilogue(acc, bias, pid_m * BM, pid_n * BN, M, N, stride_bm,
                                              stride_bn, BM, BN, HAS_BIAS)
        tl.store(c + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(c.dtype.element_ty), mask=mask)


@triton.jit
def claim(ticket, base):
    """The next position of this rank's tile order: claimed in increasing order from an atomic
    ticket by whichever programs run, so a claimed position always belongs to a running program
    (no wait depends on one that has not started). ``base``: the ticket's value at the launch."""
    return (tl.atomic_add(ticket, 1, sem="relaxed", scope="gpu") - base).to(tl.int32)


def ensure_allocator() -> None:
    """Kernels that make TMA descriptors on the device need global scratch memory, which Triton
    asks an allocator for at each launch; set one (the current stream's caching allocator)
    unless the process already has its own."""
    current = _allocation._allocator  # a ContextVar: this thread's allocator
    if isinstance(current.get() if hasattr(current, "get") else current, _allocation.NullAllocator):
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8,
                                                                         device="cuda"))


def resident_programs(kernel, device: torch.device) -> int:
    """How many programs of a compiled ``kernel`` fit on one SM at once (registers, shared memory,
    threads): a grid of at most that many per SM is entirely resident, so programs may spin-wait
    on each other's progress across GPUs without starving anyone."""
    props = torch.cuda.get_device_properties(device)
    threads = kernel.metadata.num_warps * 32
    regs = max(1, kernel.n_regs) * threads
    smem = kernel.metadata.shared + 1024  # the driver reserves 1 KiB per block
    smem_per_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    regs_per_sm = getattr(props, "regs_per_multiprocessor", 65536)
    return max(0, min(regs_per_sm // regs, smem_per_sm // smem, 2048 // threads))


#: What the tile kernels take (``runtime.paths.base.tile_support`` says why a call cannot go there).
FUSABLE_DTYPES = (torch.float16, torch.bfloat16)


def _row_stride(t: torch.Tensor) -> int:
    """Elements between rows; a single row's stride is arbitrary in torch, so use the dense one."""
    return t.shape[1] if t.shape[0] == 1 else t.stride(0)


def _tma_ready(t: torch.Tensor) -> bool:
    """Rows TMA can walk: unit inner stride, rows that do not overlap (an expanded operand has row
    stride 0), 16-byte aligned rows and base."""
    return (t.stride(-1) == 1 and _row_stride(t) >= t.shape[1]
            and (_row_stride(t) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0)


def rows_descriptor(a: torch.Tensor, block: list[int]):
    """A TMA descriptor over a TMA-ready [rows, cols] operand (``_tma_ready``), ``block`` tiles."""
    return TensorDescriptor(a, list(a.shape), [_row_stride(a), 1], block)


#: Operand layouts seen (``descriptor_operands``, ``weight_descriptor``): (which operand, shape,
#: strides, dtype, block) -> the fields of its descriptor without the base (and for a weight,
#: whether the descriptor is over its transpose). Only layouts that needed no copy are kept;
#: cleared when full.
_LAYOUTS: dict[tuple, tuple] = {}
LAYOUT_LIMIT = 1024
#: Descriptors are made from a kept layout's fields where Triton's is a plain dataclass (its checks
#: ran once, for the layout); any other descriptor class is constructed every time.
_COPYABLE = TensorDescriptor is not None and "__dict__" in dir(TensorDescriptor) and not hasattr(
    TensorDescriptor, "__slots__")


def _fields(desc) -> dict:
    fields = {k: v for k, v in vars(desc).items() if k != "base"}
    fields[LAYOUT_ATTR] = descriptor_layout(desc)
    return fields


def _from_fields(base: torch.Tensor, fields: dict):
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(fields)
    desc.base = base
    return desc


def _keep(key: tuple, value: tuple) -> None:
    if _COPYABLE:
        if len(_LAYOUTS) >= LAYOUT_LIMIT:
            _LAYOUTS.clear()
        _LAYOUTS[key] = value


# Whether an operand is TMA-ready depends on its shape, strides and dtype, and on its address only
# through the base's alignment: a layout seen before makes its descriptor from the kept fields once
# the base is aligned, without checking it again.

def activation_descriptor(a: torch.Tensor, cfg: TileConfig):
    """The TMA descriptor of ``a`` [M, K] for ``cfg``'s tiles (``descriptor_operands``)."""
    key = ("a", a.shape, a.stride(), a.dtype, cfg.bm, cfg.bk)
    kept = _LAYOUTS.get(key)
    if kept is not None and a.data_ptr() % 16 == 0:
        return _from_fields(a, kept[0])
    if not _tma_ready(a):
        return rows_descriptor(a.clone(memory_format=torch.contiguous_format), [cfg.bm, cfg.bk])
    desc = rows_descriptor(a, [cfg.bm, cfg.bk])
    _keep(key, (_fields(desc),))
    return desc


def weight_descriptor(b: torch.Tensor, cfg: TileConfig):
    """``(descriptor, over its transpose)`` of ``b`` [K, N] for ``cfg``'s tiles
    (``descriptor_operands``)."""
    key = ("b", b.shape, b.stride(), b.dtype, cfg.bn, cfg.bk)
    kept = _LAYOUTS.get(key)
    if kept is not None and b.data_ptr() % 16 == 0:
        fields, b_t = kept
        return _from_fields(b.t() if b_t else b, fields), b_t
    bt = b.t()
    if _tma_ready(bt):  # a linear layer's weight, used transposed: no copy
        desc, b_t = rows_descriptor(bt, [cfg.bn, cfg.bk]), True
    elif _tma_ready(b):
        desc, b_t = rows_descriptor(b, [cfg.bk, cfg.bn]), False
    else:
        return rows_descriptor(b.clone(memory_format=torch.contiguous_format), [cfg.bk, cfg.bn]), False
    _keep(key, (_fields(desc), b_t))
    return desc, b_t


def descriptor_operands(a: torch.Tensor, b: torch.Tensor, cfg: TileConfig):
    """TMA descriptors of ``a`` [M, K] and ``b`` [K, N] for ``cfg``'s tiles, and whether the
    descriptor of ``b`` is over its transpose. TMA needs unit inner strides, 16-byte aligned rows
    and base; an operand without them (a transposed activation, a view at an odd offset) is
    copied once into a fresh dense tensor."""
    b_desc, b_t = weight_descriptor(b, cfg)
    return activation_descriptor(a, cfg), b_desc, b_t


def bias_strides(bias: torch.Tensor | None, m: int, n: int):
    """The bias broadcast to [m, n] (stride 0 along broadcast dimensions), or a dummy pointer."""
    if bias is None:
        return None, 0, 0
    full = bias.expand(m, n)
    return full, full.stride(0), full.stride(1)


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, cfg: TileConfig,
           out: torch.Tensor | None = None, programs: int | None = None) -> torch.Tensor:
    """The tile kernels' GEMM alone (benchmarks, tests)."""
    out = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device) if out is None else out
    _launch(a, b, bias, cfg, out, programs)
    return out


def _launch(a, b, bias, cfg: TileConfig, out: torch.Tensor, programs: int | None, scales=None,
            imprecise=None) -> None:
    """``matmul_kernel`` over ``out``, persistent on at most ``programs`` programs (one per SM);
    ``scales``: the FP8 form's ``(scale_a, scale_b, rowwise)``."""
    m, k = a.shape
    n = b.shape[1]
    a_desc, b_desc, b_t = descriptor_operands(a, b, cfg)
    full_bias, sbm, sbn = bias_strides(bias, m, n)
    tiles = cdiv(m, cfg.bm) * cdiv(n, cfg.bn)
    if programs is None:
        programs = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 4
    scale_a, scale_b, rowwise = scales if scales is not None else (out, out, False)
    run_kernel(matmul_kernel, (max(1, min(tiles, programs)),), a_desc, b_desc,
               full_bias if full_bias is not None else out, out, m, n, k, sbm, sbn, scale_a, scale_b, BM=cfg.bm,
               BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m, B_TRANSPOSED=b_t, HAS_BIAS=bias is not None,
               SCALED=scales is not None, ROWWISE=rowwise, IMPRECISE=imprecise, num_warps=cfg.warps,
               num_stages=cfg.stages)


def fp8_accumulation(use_fast_accum: bool, bk: int):
    """``tl.dot``'s ``max_num_imprecise_acc`` for ``_scaled_mm``'s ``use_fast_accum`` with K
    blocks of ``bk``. Triton's default on sm_90 (None) keeps every FP8 product in the tensor
    cores' reduced-precision accumulator for the whole K loop, as cuBLAS's fast accumulation does;
    without it, at most ``FP8_PROMOTE`` products (four FP8 MMAs, a K block's worth) are summed
    there before joining the fp32 accumulator. (0 would not mean "every MMA": Triton then
    converts the FP8 operands to fp16 for the older MMA instructions.)"""
    return None if use_fast_accum else min(bk, FP8_PROMOTE)


#: Products summed in the tensor cores' accumulator before each fp32 add without fast accumulation.
FP8_PROMOTE = 128


def fp8_scales(scales, m: int, n: int, use_fast_accum: bool, bk: int, unread: torch.Tensor):
    """A tile kernel's scale arguments for an ``m x n`` product: ``(scale_a, scale_b, fp8)``, the
    scales as flat float32 (one each, or a row's ``[m]`` and a column's ``[n]``: ``scale_tile``
    reads both or neither) and ``fp8 = (row-wise, fp8_accumulation)``; for operands that are not
    FP8 (``scales`` None), ``unread`` (a pointer the kernel never reads) twice and None."""
    if scales is None:
        return unread, unread, None
    scale_a, scale_b = (s.float().contiguous().reshape(-1) for s in scales)
    rowwise = scale_a.numel() != 1 or scale_b.numel() != 1
    if rowwise and (scale_a.numel() != m or scale_b.numel() != n):
        raise ValueError(f"commfuse: row-wise scales must be [{m}, 1] and [1, {n}], not {tuple(scales[0].shape)} "
                         f"and {tuple(scales[1].shape)}")
    return scale_a, scale_b, (rowwise, fp8_accumulation(use_fast_accum, bk))


def scaled_matmul(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                  bias: torch.Tensor | None, out_dtype: torch.dtype, use_fast_accum: bool, cfg: TileConfig,
                  out: torch.Tensor | None = None, programs: int | None = None) -> torch.Tensor:
    """The tile kernels' GEMM alone on FP8 operands: ``torch._scaled_mm(a, b, scale_a, scale_b,
    bias, out_dtype=out_dtype, use_fast_accum=use_fast_accum)`` with tensor-wise (one float32
    each) or row-wise (``[M, 1]`` and ``[1, N]``) scales (benchmarks, tests)."""
    m, n = a.shape[0], b.shape[1]
    if a.dtype not in FP8_DTYPES or b.dtype not in FP8_DTYPES:
        raise ValueError(f"commfuse: scaled_matmul multiplies FP8 operands, not {a.dtype} x {b.dtype}")
    out = torch.empty((m, n), dtype=out_dtype, device=a.device) if out is None else out
    sa, sb, (rowwise, imprecise) = fp8_scales((scale_a, scale_b), m, n, use_fast_accum, cfg.bk, out)
    _launch(a, b, bias, cfg, out, programs, (sa, sb, rowwise), imprecise)
    return out
