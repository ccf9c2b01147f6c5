"""A transformers ``LlamaForCausalLM`` (random weights from a config, no download), split by its own
tensor-parallel plan, compiled with ``backend="commfuse"`` and checked against eager.

    torchrun --nproc_per_node=2 examples/hf_llama.py             # 8B-class sizes on GPUs
    torchrun --nproc_per_node=2 examples/hf_llama.py --small     # tiny sizes (the default on CPU)

The plan is the model's own ``config.base_model_tp_plan``, applied with DTensor
(``commfuse/demo/hf_llama.py`` says how and why). Needs ``pip install transformers``. Rank 0 prints
what fused and the logits' error against eager.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import commfuse
from commfuse.demo import hf_llama


def build(small: bool, layers: int, device, dtype):
    if small:
        return hf_llama.build(256, layers, 8, 4, 512, 1024, device, dtype)
    return hf_llama.build(4096, layers, 32, 8, 14336, 32000, device, dtype)  # Llama-3-8B shapes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--small", action="store_true", help="small sizes (the default on CPU)")
    args = p.parse_args()
    hf_llama.require_transformers()
    from torch.distributed.device_mesh import init_device_mesh

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build(args.small or not cuda, args.layers, device, dtype).eval()
    model = hf_llama.parallelize_by_own_plan(model, init_device_mesh(device.type, (dist.get_world_size(),)))
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
