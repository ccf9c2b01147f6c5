"""All-reduce + residual add + RMSNorm in one kernel, where a program can own whole rows: the
one-shot exchange of a partial already in the symmetric workspace, and the graph lane's staged
one-shot (epochs on the device, so a CUDA graph may replay it). The sequence-parallel form, a
reduce-scatter in the all-reduce's place, is the one-shot over this rank's share of the rows only.

For each row a program owns it sums every rank's partial in fp32 (rank order, as ``exchange.py``),
adds the residual ``x``, stores ``h`` in the activation dtype, then stores
``n = rmsnorm(h) * weight``. The norm reads ``h`` as stored (rounded to the dtype), as the
unfused chain's norm kernel reads it back from memory, in one of the two roundings models write:

* ``weight_last`` (transformers' ``LlamaRMSNorm``, the bundled model): ``h * rsqrt(mean(h²) + eps)``
  cast to the activation dtype, then multiplied by the weight;
* otherwise (``F.rms_norm``, ``nn.RMSNorm``): multiplied by the weight in fp32, one cast.

One row is one block of ``next_power_of_2(hidden)`` elements (masked), so ``hidden`` is at most
``MAX_HIDDEN``. The signalling is the one-shot's (``sync.py``); a late or mismatched peer leaves
NaN in this program's rows of ``h`` and ``n``, never a sum with whatever its half held.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .codes import flag_value
from .exchange import MAX_PROGRAMS, sum_over_peers
from .launch import run as run_kernel
from .sizes.norm_epilogue import MAX_HIDDEN
from .sync import TAG_SHIFT, require_iris, signal_peers, wait_peers


def _block(hidden: int) -> tuple[int, int]:
    """(block, warps) for rows of ``hidden`` elements: one row per block, at most ~16 elements a
    thread. The grid is capped at one program per SM (every rank launches the same grid), so the
    warps of one program are all the loads an SM has in flight: rows of 2048 and more take 16."""
    if hidden > MAX_HIDDEN:
        raise ValueError(f"commfuse: the norm epilogue holds rows of at most {MAX_HIDDEN} elements, not {hidden}")
    block = triton.next_power_of_2(hidden)
    return block, max(1, min(16, block // 128))


@triton.jit
def scattered_row(row, chunk, rank, WORLD: tl.constexpr):
    """The row of the full product that row ``row`` of this rank's share holds: a reduce-scatter
    along a dimension of the product's ``[outer, rows, ...]`` view gives each rank ``chunk``
    consecutive rows of each slab of ``WORLD * chunk`` (one slab when it cuts the rows
    themselves)."""
    row64 = tl.cast(row, tl.int64)
    return (row64 // chunk) * (chunk * WORLD) + rank * chunk + row64 % chunk


@triton.jit
def add_rms_norm_rows(src, x, weight, h, n, rows, cols, eps, start, step, late, rank, heap_bases, chunk,
                      WORLD: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr, WEIGHT_LAST: tl.constexpr,
                      SCATTER: tl.constexpr):
    """Rows ``start, start + step, ...`` of ``h = x + sum over ranks of src`` and
    ``n = rmsnorm(h) * weight`` (module docstring), or NaN in both if a peer came ``late``.
    ``SCATTER``: ``x``, ``h`` and ``n`` hold this rank's share of a reduce-scatter of ``src``'s
    rows, ``chunk`` rows of each slab of ``WORLD * chunk`` (``scattered_row``)."""
    offs = tl.arange(0, BLOCK)
    mask = offs < cols
    if late != 0:
        nan = tl.full((BLOCK,), float("nan"), tl.float32)
        for row in range(start, rows, step):
            at = tl.cast(row, tl.int64) * cols + offs
            tl.store(h + at, nan.to(h.dtype.element_ty), mask=mask)
            tl.store(n + at, nan.to(n.dtype.element_ty), mask=mask)
    else:
        w = tl.load(weight + offs, mask=mask, other=0.0).to(tl.float32)
        for row in range(start, rows, step):
            at = tl.cast(row, tl.int64) * cols + offs
            if SCATTER:
                acc = sum_over_peers(src + scattered_row(row, chunk, rank, WORLD) * cols + offs, mask, rank,
                                     heap_bases, WORLD, VEC)
            else:
                acc = sum_over_peers(src + at, mask, rank, heap_bases, WORLD, VEC)
            hv = (tl.load(x + at, mask=mask, other=0.0).to(tl.float32) + acc).to(h.dtype.element_ty)
            tl.store(h + at, hv, mask=mask)
            # masked lanes of a peer load hold anything: keep them out of the sum of squares
            hf = tl.where(mask, hv.to(tl.float32), 0.0)
            normed = hf * tl.rsqrt(tl.sum(hf * hf, axis=0) / cols + eps)
            if WEIGHT_LAST:
                out = normed.to(h.dtype.element_ty).to(tl.float32) * w
            else:
                out = normed * w
            tl.store(n + at, out.to(n.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["rank", "slot_base", "epoch"])
def one_shot_add_rms_norm_kernel(partial, x, weight, h, n, rows, cols, eps, slot_base, flags, heap_bases, epoch,
                                 rank, err, timeout, chunk, OP: tl.constexpr, WORLD: tl.constexpr,
                                 BLOCK: tl.constexpr, VEC: tl.constexpr, WEIGHT_LAST: tl.constexpr,
                                 SCATTER: tl.constexpr):
    """``exchange.one_shot_kernel``'s signal and wait, then whole rows (``add_rms_norm_rows``):
    program p owns rows p, p + grid, ... of the output."""
    pid = tl.program_id(0)
    signal_peers(flags, slot_base + pid, epoch, rank, heap_bases, WORLD)
    late = wait_peers(flags, slot_base + pid, epoch, rank, err, timeout, OP, WORLD)
    add_rms_norm_rows(partial, x, weight, h, n, rows, cols, eps, pid, tl.num_programs(0), late, rank, heap_bases,
                      chunk, WORLD, BLOCK, VEC, WEIGHT_LAST, SCATTER)


@triton.jit(do_not_specialize=["rank", "epoch"])
def staged_add_rms_norm_kernel(src, x, weight, h, n, data, rows, cols, half_elems, eps, flags, counter, heap_bases,
                               epoch, rank, err, timeout, OP: tl.constexpr, WORLD: tl.constexpr,
                               BLOCK: tl.constexpr, VEC: tl.constexpr, SLOTS: tl.constexpr,
                               WEIGHT_LAST: tl.constexpr):
    """The graph lane's form (``exchange.staged_one_shot_kernel``'s epochs: the count from
    ``counter``, advanced in every slot at the end): program p stages its rows of the local
    ``src`` into this rank's half of the count's parity, signals, then reads the same rows of
    every rank's half (``add_rms_norm_rows``)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    count = tl.load(counter + pid) + 1
    epoch = (count << TAG_SHIFT) | epoch
    half = data + (count % 2) * half_elems
    offs = tl.arange(0, BLOCK)
    for row in range(pid, rows, nprog):
        at = tl.cast(row, tl.int64) * cols + offs
        tl.store(half + at, tl.load(src + at, mask=offs < cols), mask=offs < cols)
    signal_peers(flags, pid, epoch, rank, heap_bases, WORLD)
    late = wait_peers(flags, pid, epoch, rank, err, timeout, OP, WORLD)
    add_rms_norm_rows(half, x, weight, h, n, rows, cols, eps, pid, nprog, late, rank, heap_bases, rows, WORLD, BLOCK,
                      VEC, WEIGHT_LAST, False)
    for slot in range(pid, SLOTS, nprog):
        tl.store(counter + slot, count)


def _rows_of(src: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, h: torch.Tensor,
             n: torch.Tensor) -> tuple[int, int]:
    """(rows, hidden) of contiguous ``[rows, hidden]`` operands; raises on anything else."""
    rows, cols = x.shape
    for name, t in (("partial", src), ("x", x), ("h", h), ("n", n)):
        if t.shape != (rows, cols) or not t.is_contiguous():
            raise ValueError(f"commfuse: the norm epilogue's {name} must be a contiguous {rows}x{cols}, "
                             f"not {tuple(t.shape)}")
    if weight.shape != (cols,) or not weight.is_contiguous():
        raise ValueError(f"commfuse: the norm epilogue's weight must be a contiguous [{cols}]")
    return rows, cols


def _vec(t: torch.Tensor, cols: int) -> int:
    """1 if every row of ``t`` starts 16-byte aligned (peer loads may vectorise), else 0."""
    return int(t.data_ptr() % 16 == 0 and cols * t.element_size() % 16 == 0)


def all_reduce_add_rms_norm(ws, partial: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, h: torch.Tensor,
                            n: torch.Tensor, eps: float, epoch: int, op_code: int, weight_last: bool = True,
                            max_programs: int = MAX_PROGRAMS, slot_base: int = 0) -> None:
    """``h = x + sum over the group of partial``, ``n = rmsnorm(h) * weight``, one kernel.
    ``partial`` is in ``ws`` at the same offset on every rank; one program per row up to the
    grid's cap (every rank launches the same grid: program p waits for program p of each peer)."""
    require_iris()
    rows, cols = _rows_of(partial, x, weight, h, n)
    _one_shot(ws, partial, x, weight, h, n, rows, cols, eps, epoch, op_code, weight_last, max_programs, slot_base,
              rows, False)


def reduce_scatter_add_rms_norm(ws, partial: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, h: torch.Tensor,
                                n: torch.Tensor, chunk: int, eps: float, epoch: int, op_code: int,
                                weight_last: bool = True, max_programs: int = MAX_PROGRAMS,
                                slot_base: int = 0) -> None:
    """The sequence-parallel form: ``h = x + this rank's share of the reduce-scatter of partial``
    and ``n = rmsnorm(h) * weight``, one kernel. ``partial`` ``[world * rows, hidden]`` is in
    ``ws`` at the same offset on every rank; ``x``, ``h`` and ``n`` are ``[rows, hidden]``, row i
    of them the product's row ``scattered_row(i)``: ``chunk`` rows of each slab of
    ``world * chunk`` (``chunk == rows`` where the scatter cuts the product's rows)."""
    require_iris()
    rows, cols = _rows_of(x, x, weight, h, n)
    world = ws.world
    if partial.shape != (rows * world, cols) or not partial.is_contiguous():
        raise ValueError(f"commfuse: the norm epilogue's partial must be a contiguous {rows * world}x{cols} "
                         f"(every rank's rows), not {tuple(partial.shape)}")
    if chunk < 1 or rows % chunk:
        raise ValueError(f"commfuse: {rows} rows per rank are not whole slabs of {chunk}")
    _one_shot(ws, partial, x, weight, h, n, rows, cols, eps, epoch, op_code, weight_last, max_programs, slot_base,
              chunk, True)


def _one_shot(ws, partial, x, weight, h, n, rows: int, cols: int, eps: float, epoch: int, op_code: int,
              weight_last: bool, max_programs: int, slot_base: int, chunk: int, scatter: bool) -> None:
    block, warps = _block(cols)
    grid = (max(1, min(rows, max_programs, ws.max_programs)),)
    if (slot_base + grid[0]) * ws.world > ws.flags.numel():
        raise RuntimeError("commfuse: not enough flag slots for this launch")
    run_kernel(one_shot_add_rms_norm_kernel, grid, partial, x, weight, h, n, rows, cols, float(eps), slot_base,
               ws.flags, ws.heap_bases, epoch, ws.rank, ws.err, ws.timeout_ns, chunk, OP=op_code, WORLD=ws.world,
               BLOCK=block, VEC=_vec(partial, cols), WEIGHT_LAST=weight_last, SCATTER=scatter, num_warps=warps)


def staged_add_rms_norm(lane, src: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, h: torch.Tensor,
                        n: torch.Tensor, eps: float, op_code: int, weight_last: bool = True, tag: int = 0) -> None:
    """``all_reduce_add_rms_norm`` of a local ``src`` through the graph lane: safe to capture in a
    CUDA graph (``exchange.staged_all_reduce``'s conditions; ``src`` fits one half). ``tag``: the
    call's pairing tag (``codes.py``), fixed in a captured launch."""
    require_iris()
    rows, cols = _rows_of(src, x, weight, h, n)
    if rows * cols > lane.half_elems(src.dtype):
        raise RuntimeError(f"commfuse: the graph lane's half holds {lane.half_elems(src.dtype)} elements, "
                           f"not {rows * cols}")
    block, warps = _block(cols)
    grid = (max(1, min(rows, lane.max_programs, lane.flags.numel() // lane.world, lane.counter.numel())),)
    data = lane.data(src.dtype)
    vec = _vec(data, cols) if lane.data_bytes % 16 == 0 else 0  # (the second half's start too)
    run_kernel(staged_add_rms_norm_kernel, grid, src, x, weight, h, n, data, rows, cols, lane.half_elems(src.dtype),
               float(eps), lane.flags, lane.counter, lane.heap_bases, flag_value(0, tag), lane.rank, lane.err, lane.timeout_ns,
               OP=op_code, WORLD=lane.world, BLOCK=block, VEC=vec, SLOTS=lane.counter.numel(),
               WEIGHT_LAST=weight_last, num_warps=warps)
