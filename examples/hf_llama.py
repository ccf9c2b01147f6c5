"""A transformers ``LlamaForCausalLM`` (random weights from a config, no download), split by its own
tensor-parallel plan, compiled with ``backend="commfuse"`` and checked against eager.

    torchrun --nproc_per_node=2 examples/hf_llama.py             # 8B-class sizes on GPUs
    torchrun --nproc_per_node=2 examples/hf_llama.py --small     # tiny sizes (the default on CPU)

The plan is the model's own ``config.base_model_tp_plan`` (``"colwise"`` for q/k/v and gate/up,
``"rowwise"`` for o_proj and down_proj), applied with DTensor's ``ColwiseParallel`` /
``RowwiseParallel``. transformers' loading-time TP (``from_pretrained(..., tp_plan="auto")`` or its
``DistributedConfig``) needs a checkpoint and changes between releases; the plan itself is the same.
Needs ``pip install transformers``. Rank 0 prints what fused and the logits' error against eager.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import commfuse

STYLES = {"colwise": "ColwiseParallel", "rowwise": "RowwiseParallel"}


def parallelize_by_own_plan(model, mesh):
    """Apply ``model.config.base_model_tp_plan`` to the decoder (``model.model``) with DTensor."""
    from torch.distributed.tensor import parallel

    plan = {}
    for pattern, style in model.config.base_model_tp_plan.items():
        if style not in STYLES:
            raise ValueError(f"TP style {style!r} of {pattern!r} is not one this example maps to DTensor")
        plan[pattern] = getattr(parallel, STYLES[style])()
    parallel.parallelize_module(model.model, mesh, plan)
    return model


def build(small: bool, layers: int, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    if small:
        config = LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=8,
                             num_key_value_heads=4, num_hidden_layers=layers, vocab_size=1024)
    else:  # Llama-3-8B shapes, fewer layers
        config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                             num_key_value_heads=8, num_hidden_layers=layers, vocab_size=32000)
    torch.manual_seed(0)  # the same weights on every rank before the split
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--small", action="store_true", help="small sizes (the default on CPU)")
    args = p.parse_args()
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise SystemExit("examples/hf_llama.py needs transformers: pip install transformers")
    from torch.distributed.device_mesh import init_device_mesh

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build(args.small or not cuda, args.layers, device, dtype)
    model = parallelize_by_own_plan(model, init_device_mesh(device.type, (dist.get_world_size(),)))
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=device)
    commfuse.clear_report()
    with torch.no_grad():
        want = model(ids).logits.float()
        got = torch.compile(model, backend="commfuse")(ids).logits.float()
    err = ((got - want).norm() / want.norm()).item()
    if dist.get_rank() == 0:
        print(commfuse.report())
        print(f"logits relative error against eager: {err:.2e}")
    dist.destroy_process_group()
    if err > (2e-2 if dtype == torch.bfloat16 else 1e-4):
        raise SystemExit(f"compiled logits differ from eager: {err:.2e}")


if __name__ == "__main__":
    main()
