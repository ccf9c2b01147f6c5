"""A transformers ``LlamaForCausalLM`` built from a config (random weights, no download) and split by
the model's own tensor-parallel plan, for ``examples/hf_llama.py`` and ``python -m commfuse bench model --models hf``.

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


def vocab_size(cfg) -> int:
    """Llama's 32000 at real sizes, a small vocabulary for tiny ones."""
    return 32000 if cfg.dim >= 1024 else 1024


def build(cfg, device, dtype):
    """``LlamaForCausalLM`` with the sizes of ``cfg`` (a ``commfuse.demo.transformer.Config``);
    the same weights on every rank (seeded)."""
    require_transformers()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
                         num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                         num_hidden_layers=cfg.n_layers, vocab_size=vocab_size(cfg))
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
