"""A transformers ``LlamaForCausalLM`` built from a config (random weights, no download) and split by
the model's own tensor-parallel plan, for ``examples/hf_llama.py`` and ``commfuse.bench model --models hf``.

The plan is ``config.base_model_tp_plan`` (``"colwise"`` for q/k/v and gate/up, ``"rowwise"`` for
o_proj and down_proj), applied to the decoder with DTensor's ``ColwiseParallel`` / ``RowwiseParallel``.
transformers' loading-time TP (``from_pretrained(..., tp_plan="auto")``) needs a checkpoint and its
API changes between releases; the plan is the same. Needs ``pip install transformers``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

STYLES = {"colwise": "ColwiseParallel", "rowwise": "RowwiseParallel"}


def require_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise SystemExit("the transformers Llama model needs transformers: pip install transformers") from None


def build(dim: int, layers: int, heads: int, kv_heads: int, ffn_dim: int, vocab: int, device, dtype):
    """``LlamaForCausalLM`` with these sizes; the same weights on every rank (seeded)."""
    require_transformers()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=dim, intermediate_size=ffn_dim, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, num_hidden_layers=layers, vocab_size=vocab)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype)


def parallelize_by_own_plan(model, mesh):
    """Apply ``model.config.base_model_tp_plan`` to the decoder (``model.model``) with DTensor."""
    from torch.distributed.tensor import parallel

    plan = {}
    for pattern, style in model.config.base_model_tp_plan.items():
        if style not in STYLES:
            raise ValueError(f"TP style {style!r} of {pattern!r} has no DTensor mapping here")
        plan[pattern] = getattr(parallel, STYLES[style])()
    parallel.parallelize_module(model.model, mesh, plan)
    return model


class Logits(nn.Module):
    """``ids -> logits``: the causal LM as a plain tensor-to-tensor module (for benchmarking)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(ids).logits
