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
                  bias: torch.Tensor | None, out_dtype: torch.dtype | None, use_fast_accum: bool,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """The FP8 product exactly as the matched ``_scaled_mm`` node computed it (into ``out``)."""
    return torch._scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype, use_fast_accum=use_fast_accum,
                            out=out)


def all_reduce(partial: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum of ``partial`` over the group, in place: every caller passes a product it just
    made, as Inductor's code does (``all_reduce_``); the out-of-place collective would copy it
    into a fresh tensor first."""
    return _c10d.wait_tensor(_c10d.all_reduce_(partial, "sum", group_name))


def mm_all_reduce(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group_name: str
) -> torch.Tensor:
    return all_reduce(matmul(a, b, bias), group_name)


def rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float, weight_last: bool) -> torch.Tensor:
    """``rmsnorm(h) * weight`` as the matched graph computed it: the mean of squares and the
    normalisation in fp32, then either (``weight_last``: transformers' ``LlamaRMSNorm``, the bundled
    model) cast to ``h``'s dtype and multiplied by the weight, or (``F.rms_norm``, ``nn.RMSNorm``)
    multiplied by the weight in fp32 and cast once."""
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    if weight_last:
        return weight * normed.to(h.dtype)
    return (normed * weight).to(h.dtype)


def mm_all_reduce_add_rms_norm(a, b, bias, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                               weight_last: bool, group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + all_reduce(a @ b + bias)`` (the reduced product viewed as the residual) and
    ``n = rms_norm(h, weight)``: the unfused chain, step for step."""
    return _add_rms_norm(residual, mm_all_reduce(a, b, bias, group_name), weight, eps, weight_last)


def _add_rms_norm(residual: torch.Tensor, reduced: torch.Tensor, weight: torch.Tensor, eps: float,
                  weight_last: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, rms_norm(h))`` with ``h = residual + reduced`` (viewed as the residual)."""
    # contiguous like the op's declared outputs (its fake): a strided residual would give ``h``
    # its strides, which the compiled graph does not expect
    h = (residual + reduced.view(residual.shape)).contiguous()
    return h, rms_norm(h, weight, eps, weight_last).contiguous()


def mm_reduce_scatter_add_rms_norm(a, b, bias, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                                   weight_last: bool, shape: list[int], scatter_dim: int, world_size: int,
                                   group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequence-parallel form: ``h = residual + mm_reduce_scatter(a, b, bias, shape, ...)``
    (this rank's share, viewed as the residual) and ``n = rms_norm(h, weight)``."""
    return _add_rms_norm(residual, mm_reduce_scatter(a, b, bias, shape, scatter_dim, world_size, group_name), weight,
                         eps, weight_last)


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


def quantise_rows(x: torch.Tensor, float8_dtype: torch.dtype, eps: float,
                  pow2_scales: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's row-wise dynamic quantisation of ``x`` (a row: the last dimension), step for step
    as its post-grad graph computes it, so the FP8 values and scales are the same bits: the row's
    absolute maximum in float64, floored at ``eps``; the multiplier ``fmax / amax`` in float32,
    rounded down to a power of two when ``pow2_scales``; ``x * multiplier`` clamped to the FP8
    range and cast. Returns ``(FP8 rows, multipliers [..., 1])``: ``_scaled_mm`` takes their
    reciprocals. Each row is its own, so quantising a shard's rows gives the gathered tensor's."""
    fmax = torch.finfo(float8_dtype).max
    amax = x.abs().amax(-1, keepdim=True).to(torch.float64).clamp_min(eps)
    multiplier = (amax.reciprocal() * fmax).to(torch.float32)
    if pow2_scales:
        multiplier = torch.exp2(torch.floor(torch.log2(multiplier)))
    q = (x.to(torch.float32) * multiplier).clamp_min(-fmax).clamp_max(fmax).to(float8_dtype)
    return q, multiplier


def rowwise_scaled_matmul(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, post_scale_a=None,
                          post_scale_b=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """A row-wise FP8 product as the graph computed it: ``_scaled_mm`` with its scales, then, in
    the backward's form, the row and column scales multiplied in (in float32) and the product
    cast back to ``out_dtype`` (into ``out``)."""
    scale_a, scale_b = _unit_stride(scale_a), _unit_stride(scale_b)
    if post_scale_a is None:
        return scaled_matmul(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, out)
    product = scaled_matmul(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum)
    scaled = product * (post_scale_a * post_scale_b)
    if out is None:
        return scaled.to(out_dtype)
    return out.copy_(scaled)  # the cast to out's dtype, rounded once as .to() rounds


def _unit_stride(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` with a last stride of 1, which ``_scaled_mm`` asks of a row-wise scale: Inductor
    may lay a ``[M, 1]`` scale out with any stride on its size-1 dimension."""
    return scale if scale.dim() < 2 or scale.stride(-1) == 1 else scale.clone(memory_format=torch.contiguous_format)


def rowwise_scaled_mm_all_reduce(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, post_scale_a, post_scale_b,
                                 group_name: str) -> torch.Tensor:
    return all_reduce(rowwise_scaled_matmul(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, post_scale_a,
                                            post_scale_b), group_name)


def rowwise_scaled_mm_reduce_scatter(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, post_scale_a,
                                     post_scale_b, shape: list[int], scatter_dim: int, world_size: int,
                                     group_name: str) -> torch.Tensor:
    partial = rowwise_scaled_matmul(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum, post_scale_a,
                                    post_scale_b)
    return reduce_scatter(partial, shape, scatter_dim, world_size, group_name)


def all_gather_rowwise_scaled_mm(shard, b, scale_b, bias, out_dtype, use_fast_accum, float8_dtype, eps: float,
                                 pow2_scales: bool, gather_dim: int, world_size: int, group_name: str,
                                 return_gathered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise the shard's rows, gather the FP8 rows (as bytes) and their multipliers, multiply:
    the gather moves FP8, not bf16. When the graph still reads the bf16 gathered tensor
    (``return_gathered``: training quantises it column-wise too, for the weight's gradient) that
    is gathered instead and quantised after the gather (the same rows, so the same bits): one
    gather, not two. The choice reads an argument every rank holds alike."""
    if return_gathered:
        gathered = all_gather(shard, gather_dim, world_size, group_name)
        q, multiplier = quantise_rows(gathered, float8_dtype, eps, pow2_scales)
    else:
        q, multiplier = quantise_rows(shard, float8_dtype, eps, pow2_scales)
        q = all_gather(q, gather_dim, world_size, group_name)
        multiplier = all_gather(multiplier, gather_dim, world_size, group_name)
        gathered = shard.new_empty((0,))
    return rows_times(q, multiplier, b, scale_b, bias, out_dtype, use_fast_accum), gathered


def rows_times(q: torch.Tensor, multiplier: torch.Tensor, b, scale_b, bias, out_dtype, use_fast_accum,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Quantised rows ``q`` (``[..., K]``) times ``b``, each row scaled by its multiplier's
    reciprocal (``quantise_rows``' outputs), into ``out``."""
    return scaled_matmul(q.reshape(-1, q.shape[-1]), b, multiplier.reshape(-1, 1).reciprocal(), scale_b, bias,
                         out_dtype, use_fast_accum, out)


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
