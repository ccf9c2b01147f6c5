"""A small Llama-style decoder stack (RMSNorm, GQA attention, SwiGLU MLP) and two ways to split it
for tensor parallelism: DTensor plans (optionally sequence-parallel) and gpt-fast-style hooks.

It is the model ``python -m commfuse explain`` traces, and what the tests and examples build on.
The stack takes hidden states (no embedding), so with sequence parallelism its input and output are
each rank's sequence shard.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass
class Config:
    dim: int = 256
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_dim: int = 512
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.tp = 1  # set by the parallelize functions: heads per rank = heads / tp
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.register_buffer("k_cache", None, persistent=False)  # set by setup_cache
        self.register_buffer("v_cache", None, persistent=False)

    def setup_cache(self, batch: int, max_seq: int, device, dtype) -> None:
        """KV cache for decoding, this rank's heads only (call after parallelizing)."""
        shape = (batch, self.cfg.n_kv_heads // self.tp, max_seq, self.cfg.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, device=device, dtype=dtype), persistent=False)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        hd, heads, kv_heads = self.cfg.head_dim, self.cfg.n_heads // self.tp, self.cfg.n_kv_heads // self.tp
        q = self.wq(x).view(bsz, seq, heads, hd).transpose(1, 2)
        k = self.wk(x).view(bsz, seq, kv_heads, hd).transpose(1, 2)
        v = self.wv(x).view(bsz, seq, kv_heads, hd).transpose(1, 2)
        mask, causal = None, True
        if input_pos is not None:  # write this step's keys/values, attend over the cache so far
            self.k_cache.index_copy_(2, input_pos, k)
            self.v_cache.index_copy_(2, input_pos, v)
            k, v = self.k_cache, self.v_cache
            positions = torch.arange(k.shape[2], device=x.device)
            mask, causal = positions[None, :] <= input_pos[:, None], False
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, heads * hd))


class FeedForward(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        # (positional input_pos only when decoding: DTensor's PrepareModuleInput counts inputs)
        attn_in = (self.attention_norm(x),) if input_pos is None else (self.attention_norm(x), input_pos)
        h = x + self.attention(*attn_in)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))

    def setup_cache(self, batch: int, max_seq: int, device, dtype) -> None:
        for layer in self.layers:
            layer.attention.setup_cache(batch, max_seq, device, dtype)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """``input_pos``: positions of ``x``'s tokens in the KV cache (decoding), or None."""
        for layer in self.layers:
            x = layer(x, input_pos)
        return x


def sized_config(small: bool, layers: int, world: int) -> Config:
    """Tiny sizes (CPU runs, tests) or 8B-class ones (Llama-3-8B: hidden 4096, FFN 14336, 32 heads,
    8 KV heads), with ``layers`` decoder layers."""
    if small:
        return Config(dim=256, n_layers=layers, n_heads=8, n_kv_heads=max(4, world), ffn_dim=512)
    return Config(dim=4096, n_layers=layers, n_heads=32, n_kv_heads=8, ffn_dim=14336)


def _check_divisible(cfg: Config, tp: int) -> None:
    for name in ("n_heads", "n_kv_heads", "ffn_dim"):
        if getattr(cfg, name) % tp:
            raise ValueError(f"{name}={getattr(cfg, name)} is not divisible by the TP size {tp}")


def parallelize_dtensor(model: Transformer, mesh, sequence_parallel: bool = False,
                        fp8: str | bool | None = None) -> Transformer:
    """Megatron-style TP with DTensor: Q/K/V and w1/w3 column-wise, wo and w2 row-wise.

    With ``sequence_parallel`` the norms run on sequence shards (dim 1): an all-gather precedes the
    column-wise matmuls and a reduce-scatter follows the row-wise ones. With ``fp8`` (a model
    made by ``demo.fp8.float8_training``; ``True`` or ``"tensorwise"``) torchao's float8 styles
    take their place, as torchtitan's float8 plan does: the attention and MLP inputs cast to FP8
    before they are gathered. With ``fp8="rowwise"`` torch's styles stay (torchao's take
    tensor-wise scales only), as in torchtitan's row-wise plan: the inputs are gathered in bf16
    and each ``Float8Linear`` quantises them row-wise after the gather.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if fp8 and fp8 != "rowwise":
        from .fp8 import tp_styles

        styles = tp_styles()
        ColwiseParallel, RowwiseParallel = styles["colwise"], styles["rowwise"]  # noqa: N806
        PrepareModuleInput = functools.partial(styles["prepare"], float8_dtype=torch.float8_e4m3fn)  # noqa: N806
    tp = mesh.size()
    _check_divisible(model.cfg, tp)
    for block in model.layers:
        block.attention.tp = tp
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
        }
        if sequence_parallel:
            plan.update({
                "attention_norm": SequenceParallel(),
                "ffn_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            })
        else:
            plan.update({"attention.wo": RowwiseParallel(), "feed_forward.w2": RowwiseParallel()})
        parallelize_module(block, mesh, plan)
    return model


def _shard_linear(linear: nn.Linear, dim: int, rank: int, world: int) -> None:
    weight = linear.weight.detach().chunk(world, dim=dim)[rank].clone()
    linear.weight = nn.Parameter(weight, requires_grad=linear.weight.requires_grad)
    if dim == 0:
        linear.out_features = weight.shape[0]
    else:
        linear.in_features = weight.shape[1]


def parallelize_hooks(model: Transformer, group: dist.ProcessGroup | None = None) -> Transformer:
    """gpt-fast-style TP: shard plain weights in place; wo and w2 all-reduce from a forward hook.

    Compiled, each row-parallel linear becomes exactly mm -> all_reduce -> wait_tensor.
    """
    group = group or dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    _check_divisible(model.cfg, world)

    def all_reduce_hook(module, inputs, output):
        return funcol.all_reduce(output, "sum", group)

    for block in model.layers:
        block.attention.tp = world
        for lin in (block.attention.wq, block.attention.wk, block.attention.wv,
                    block.feed_forward.w1, block.feed_forward.w3):
            _shard_linear(lin, 0, rank, world)
        for lin in (block.attention.wo, block.feed_forward.w2):
            _shard_linear(lin, 1, rank, world)
            lin.register_forward_hook(all_reduce_hook)
    return model
