"""Persistent-GEMM building blocks shared by the fused kernels: tile order, one output tile's
K loop through TMA descriptors, and the host side that builds descriptors and picks configs.

``matmul_kernel`` is the GEMM alone on the same helpers: what the fused kernels' GEMM part costs
without any communication (the ops benchmark compares it with cuBLAS).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation

from .launch import run as run_kernel
from .sizes.tiles import TileConfig, cdiv  # noqa: F401  (the kernels' tiling, kept apart: deciding imports no Triton)

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
             BK: tl.constexpr, B_TRANSPOSED: tl.constexpr):
    """fp32 ``A[off_m:+BM, :] @ B[:, off_n:+BN]``. ``B_TRANSPOSED``: the descriptor is over B's
    transpose ``[N, K]`` (a linear layer's weight), loaded as [BN, BK] tiles."""
    return mma_range(a_desc, b_desc, off_m, off_n, 0, tl.cdiv(K, BK), BM, BN, BK, B_TRANSPOSED)


@triton.jit
def mma_range(a_desc, b_desc, off_m, off_n, k_lo, k_hi, BM: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr, B_TRANSPOSED: tl.constexpr):
    """``mma_tile`` over the K blocks ``k_lo`` to ``k_hi`` (exclusive) only: one split-K slice."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(k_lo, k_hi):
        a = a_desc.load([off_m, k * BK])
        if B_TRANSPOSED:
            b = b_desc.load([off_n, k * BK]).T
        else:
            b = b_desc.load([k * BK, off_n])
        acc = tl.dot(a, b, acc)
    return acc


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
def matmul_kernel(a_desc, b_desc, bias, c, M, N, K, stride_bm, stride_bn, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                  B_TRANSPOSED: tl.constexpr, HAS_BIAS: tl.constexpr):
    """``c = a @ b (+ bias)``, persistent: program p takes tiles p, p + grid, ..."""
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    for tile in range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        acc = mma_tile(a_desc, b_desc, pid_m * BM, pid_n * BN, K, BM, BN, BK, B_TRANSPOSED)
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


def descriptor_operands(a: torch.Tensor, b: torch.Tensor, cfg: TileConfig):
    """TMA descriptors of ``a`` [M, K] and ``b`` [K, N] for ``cfg``'s tiles, and whether the
    descriptor of ``b`` is over its transpose. TMA needs unit inner strides, 16-byte aligned rows
    and base; an operand without them (a transposed activation, a view at an odd offset) is
    copied once into a fresh dense tensor."""
    if not _tma_ready(a):
        a = a.clone(memory_format=torch.contiguous_format)
    a_desc = rows_descriptor(a, [cfg.bm, cfg.bk])
    bt = b.t()
    if _tma_ready(bt):  # a linear layer's weight, used transposed: no copy
        return a_desc, rows_descriptor(bt, [cfg.bn, cfg.bk]), True
    if not _tma_ready(b):
        b = b.clone(memory_format=torch.contiguous_format)
    return a_desc, rows_descriptor(b, [cfg.bk, cfg.bn]), False


def bias_strides(bias: torch.Tensor | None, m: int, n: int):
    """The bias broadcast to [m, n] (stride 0 along broadcast dimensions), or a dummy pointer."""
    if bias is None:
        return None, 0, 0
    full = bias.expand(m, n)
    return full, full.stride(0), full.stride(1)


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, cfg: TileConfig,
           out: torch.Tensor | None = None, programs: int | None = None) -> torch.Tensor:
    """The tile kernels' GEMM alone (benchmarks, tests)."""
    m, k = a.shape
    n = b.shape[1]
    out = torch.empty((m, n), dtype=a.dtype, device=a.device) if out is None else out
    a_desc, b_desc, b_t = descriptor_operands(a, b, cfg)
    full_bias, sbm, sbn = bias_strides(bias, m, n)
    tiles = cdiv(m, cfg.bm) * cdiv(n, cfg.bn)
    if programs is None:
        programs = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 4
    run_kernel(matmul_kernel, (max(1, min(tiles, programs)),), a_desc, b_desc,
               full_bias if full_bias is not None else out, out, m, n, k, sbm, sbn, BM=cfg.bm,
               BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m, B_TRANSPOSED=b_t,
               HAS_BIAS=bias is not None, num_warps=cfg.warps, num_stages=cfg.stages)
    return out
