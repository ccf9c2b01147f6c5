"""A transformers causal LM (Llama by default; Qwen2, Qwen3, Mistral, Gemma 3) built from a config
(random weights, no download) and split by the model's own tensor-parallel plan, for
``examples/hf_llama.py`` and ``python -m commfuse bench model --models hf``.

The plan is ``config.base_model_tp_plan``, applied to the decoder with DTensor. Its styles in these
models' plans: ``"colwise"`` (q/k/v, gate/up: ``ColwiseParallel``), ``"rowwise"`` (o_proj,
down_proj: ``RowwiseParallel``) and ``"replicated_with_grad_allreduce"`` (Qwen3's and Gemma 3's
per-head q_norm/k_norm: the weights stay replicated, and as each rank's gradient covers its own
heads only, a hook sums it over the mesh after accumulation). Any other style raises, naming it.
transformers' loading-time TP (``from_pretrained(..., distributed_config=DistributedConfig(tp_size=N))``)
applies the same plan to a checkpoint (README shows it). Needs ``pip install transformers``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

STYLES = {"colwise": "ColwiseParallel", "rowwise": "RowwiseParallel"}
#: The styles whose parameters stay plain replicated tensors, gradients summed over the mesh.
GRAD_SUMMED = ("replicated_with_grad_allreduce",)
#: ``--arch`` -> the transformers config class (its ``*ForCausalLM`` is built from it).
ARCHS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "mistral": "MistralConfig",
         "gemma3": "Gemma3TextConfig"}


def require_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise SystemExit("the transformers Llama model needs transformers: pip install transformers") from None


def vocab_size(cfg) -> int:
    """Llama's 32000 at real sizes, a small vocabulary for tiny ones."""
    return 32000 if cfg.dim >= 1024 else 1024


def build(cfg, device, dtype, arch: str = "llama"):
    """The ``arch`` causal LM with the sizes of ``cfg`` (a ``commfuse.demo.transformer.Config``);
    the same weights on every rank (seeded)."""
    require_transformers()
    import transformers
    from transformers import AutoModelForCausalLM

    config = getattr(transformers, ARCHS[arch])(
        hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.dim // cfg.n_heads, num_hidden_layers=cfg.n_layers,
        vocab_size=vocab_size(cfg))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype)


def parallelize_by_own_plan(model, mesh):
    """Apply ``model.config.base_model_tp_plan`` to the decoder (``model.model``) with DTensor."""
    import fnmatch

    from torch.distributed.tensor import parallel

    plan, grad_summed = {}, []
    for pattern, style in model.config.base_model_tp_plan.items():
        if style in GRAD_SUMMED:
            grad_summed.append(pattern)
        elif style in STYLES:
            plan[pattern] = getattr(parallel, STYLES[style])()
        else:
            raise ValueError(f"TP style {style!r} of {pattern!r} is not one this example maps "
                             f"(it maps {', '.join([*STYLES, *GRAD_SUMMED])})")
    parallel.parallelize_module(model.model, mesh, plan)
    group = mesh.get_group()

    def sum_grad(param):
        torch.distributed.all_reduce(param.grad, group=group)

    for name, module in model.model.named_modules():
        if any(fnmatch.fnmatchcase(name, p) for p in grad_summed):
            for param in module.parameters(recurse=False):
                param.register_post_accumulate_grad_hook(sum_grad)
    return model


class Logits(nn.Module):
    """``ids -> logits``: the causal LM as a plain tensor-to-tensor module (for benchmarking)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(ids).logits
