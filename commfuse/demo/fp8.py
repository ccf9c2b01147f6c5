"""FP8 forms of the demo stack: the two ways FP8 tensor parallelism reaches a compiled graph.

* **Training with torchao's float8** (``float8_training``): every linear a ``Float8Linear`` with
  tensor-wise dynamic scales (torchao's default recipe), split by torchao's TP styles
  (``Float8ColwiseParallel`` / ``Float8RowwiseParallel``, and ``PrepareFloat8ModuleInput``, which
  casts a sequence shard to FP8 before it is gathered); or with row-wise scales (torchao's
  ``"rowwise"`` recipe), split by torch's own TP styles (torchao's take tensor-wise scales only),
  so a sequence shard is gathered in bf16 and quantised after the gather. torchao is optional:
  imported here only.
* **Inference with FP8 weights** (``Fp8Linear``, ``quantize_linears``): each weight stored as
  ``float8_e4m3fn`` with one scale, each activation quantised tensor-wise as it arrives, the
  product ``torch._scaled_mm`` into the activation's dtype. Made from a model already split (the
  gpt-fast hooks keep working: they move with the module's forward hooks).
"""

from __future__ import annotations

import torch
import torch.nn as nn

#: The largest float8_e4m3fn value: a tensor-wise scale maps a tensor's absolute maximum to it.
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as float8_e4m3fn and the float32 scale that multiplies it back (tensor-wise)."""
    amax = x.detach().abs().max().float().clamp(min=1e-12)
    scale = amax / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


class Fp8Linear(nn.Module):
    """``nn.Linear`` with its weight in FP8 (one scale) and activations quantised per call."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight, scale = quantize(linear.weight.detach())
        self.register_buffer("weight", weight)  # [N, K]: its .t() is the column-major operand
        self.register_buffer("weight_scale", scale)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x8, x_scale = quantize(x.reshape(-1, self.in_features))
        out = torch._scaled_mm(x8, self.weight.t(), x_scale, self.weight_scale, bias=self.bias, out_dtype=x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)


def quantize_linears(model: nn.Module) -> nn.Module:
    """Every ``nn.Linear`` of ``model`` made an ``Fp8Linear`` in place, its forward hooks kept."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            fp8 = Fp8Linear(child)
            fp8._forward_hooks.update(child._forward_hooks)
            setattr(model, name, fp8)
        else:
            quantize_linears(child)
    return model


def float8_training(model: nn.Module, recipe: str = "tensorwise") -> nn.Module:
    """torchao's float8 training: every linear a ``Float8Linear`` (in place), with ``recipe``'s
    scales: ``"tensorwise"`` (torchao's default) or ``"rowwise"``."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # (optional: the test extra)

    config = Float8LinearConfig() if recipe == "tensorwise" else Float8LinearConfig.from_recipe_name(recipe)
    return convert_to_float8_training(model, config=config)


def split_in(model: nn.Module, form: str | None, split, command: str) -> nn.Module:
    """``model`` split for tensor parallelism by ``split(model)``, in FP8 ``form`` (``tensorwise``,
    ``rowwise``, ``weights``; None: as it is): torchao's float8 training converts the linears
    before the split, FP8 weights are quantised after it (the gpt-fast hooks move with each
    module's forward hooks). A missing torchao is one line naming ``command``."""
    if form in ("tensorwise", "rowwise"):
        try:
            float8_training(model, recipe=form)
        except ImportError as exc:
            raise SystemExit(f"{command}: --fp8 {form} needs torchao ({exc})") from None
    model = split(model)
    if form == "weights":
        quantize_linears(model)
    return model


def tp_styles() -> dict:
    """torchao's TP styles in place of torch's, for a model made by ``float8_training`` with
    tensor-wise scales (a row-wise model keeps torch's)."""
    from torchao.float8.float8_tensor_parallel import (  # (optional: the test extra)
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return {"colwise": Float8ColwiseParallel, "rowwise": Float8RowwiseParallel, "prepare": PrepareFloat8ModuleInput}
