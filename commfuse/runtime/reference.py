"""Unfused implementations of the commfuse ops: the matmul, then the functional collective.

These are the semantics every faster path must reproduce. They run on any device and any process
group that the functional collectives support (gloo, NCCL, the fake test backend).
"""

from __future__ import annotations

import math

import torch

_c10d = torch.ops._c10d_functional


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b (+ bias)`` exactly as the matched ``mm``/``addmm`` node computed it (into ``out``)."""
    if bias is None:
        return torch.mm(a, b, out=out)
    return torch.addmm(bias, a, b, out=out)


def scaled_matmul(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                  bias: torch.Tensor | None, out_dtype: torch.dtype | None, use_fast_accum: bool) -> torch.Tensor:
    """The FP8 product exactly as the matched ``_scaled_mm`` node computed it."""
    return torch._scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype, use_fast_accum=use_fast_accum)


def all_reduce(partial: torch.Tensor, group_name: str) -> torch.Tensor:
    return _c10d.wait_tensor(_c10d.all_reduce(partial, "sum", group_name))


def mm_all_reduce(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group_name: str
) -> torch.Tensor:
    return all_reduce(matmul(a, b, bias), group_name)


def scaled_mm_all_reduce(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, group_name: str) -> torch.Tensor:
    return all_reduce(scaled_matmul(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum), group_name)


#: Element types the collectives and ``cat`` may not take (FP8): they move these as bytes.
_AS_BYTES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def all_gather(shard: torch.Tensor, gather_dim: int, world_size: int, group_name: str) -> torch.Tensor:
    """Gather ``shard`` from every rank and concatenate along ``gather_dim`` (rank order); FP8
    as its bytes, which every backend gathers and ``cat`` joins (the values are the same bits)."""
    dtype = shard.dtype
    if dtype in _AS_BYTES:
        shard = shard.view(torch.uint8)
    gathered = _c10d.wait_tensor(
        _c10d.all_gather_into_tensor(shard.contiguous(), world_size, group_name)
    )
    if gather_dim != 0:
        gathered = torch.cat(gathered.chunk(world_size, dim=0), dim=gather_dim)
    return gathered.view(dtype)


def all_gather_mm(
    shard: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    gather_dim: int,
    world_size: int,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    gathered = all_gather(shard, gather_dim, world_size, group_name)
    out = matmul(gathered.reshape(-1, gathered.shape[-1]), b, bias)
    return out, gathered


def all_gather_scaled_mm(shard, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, gather_dim: int,
                         world_size: int, group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    gathered = all_gather(shard, gather_dim, world_size, group_name)
    out = scaled_matmul(gathered.reshape(-1, gathered.shape[-1]), b, scale_a, scale_b, bias, out_dtype,
                        use_fast_accum)
    return out, gathered


def resolve_shape(shape, numel) -> list:
    """``shape`` with its one ``-1`` (a dynamic size, as in ``view``) worked out from ``numel``."""
    if -1 not in shape:
        return list(shape)
    known = math.prod(s for s in shape if s != -1)
    return [numel // known if s == -1 else s for s in shape]


def mm_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    shape: list[int],
    scatter_dim: int,
    world_size: int,
    group_name: str,
) -> torch.Tensor:
    return reduce_scatter(matmul(a, b, bias), shape, scatter_dim, world_size, group_name)


def scaled_mm_reduce_scatter(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, shape: list[int],
                             scatter_dim: int, world_size: int, group_name: str) -> torch.Tensor:
    partial = scaled_matmul(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum)
    return reduce_scatter(partial, shape, scatter_dim, world_size, group_name)


def reduce_scatter(product: torch.Tensor, shape: list[int], scatter_dim: int, world_size: int,
                   group_name: str) -> torch.Tensor:
    """``product`` viewed as ``shape``, summed over the group, rank r's share along ``scatter_dim``."""
    partial = product.view(shape)
    if scatter_dim != 0:  # rank r's share along scatter_dim must be the r-th block along dim 0
        partial = torch.cat(partial.chunk(world_size, dim=scatter_dim), dim=0)
    return _c10d.wait_tensor(_c10d.reduce_scatter_tensor(partial.contiguous(), "sum", world_size, group_name))
