"""A transformers ``LlamaForCausalLM`` (random weights from a config, no download), split by its own
tensor-parallel plan, compiled with ``backend="commfuse"`` and checked against eager.

    torchrun --nproc_per_node=2 examples/hf_llama.py             # 8B-class sizes on GPUs
    torchrun --nproc_per_node=2 examples/hf_llama.py --small     # tiny sizes (the default on CPU)
    torchrun --nproc_per_node=2 examples/hf_llama.py --arch qwen3   # Qwen2, Qwen3, Mistral, Gemma 3 alike

The plan is the model's own ``config.base_model_tp_plan``, applied with DTensor
(``commfuse/demo/hf_llama.py`` says how and why, and which plan styles it maps: those of the
Llama, Qwen, Mistral and Gemma plans; another style raises, naming it). Needs ``pip install transformers``. Rank 0 prints
what fused and the logits' error against eager; one rank has nothing to exchange, so nothing to
fuse: that run checks the logits and says so.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import commfuse
from commfuse.demo import exit_unless_launched, hf_llama, init_distributed, shutdown
from commfuse.demo.transformer import sized_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--small", action="store_true", help="small sizes (the default on CPU)")
    p.add_argument("--arch", choices=sorted(hf_llama.ARCHS), default="llama", help="the transformers model")
    args = p.parse_args()
    exit_unless_launched("examples/hf_llama.py", "examples/hf_llama.py")
    hf_llama.require_transformers()
    from torch.distributed.device_mesh import init_device_mesh

    device, dtype = init_distributed()
    small = args.small or device.type != "cuda"
    cfg = sized_config(small, args.layers, dist.get_world_size())
    model = hf_llama.build(cfg, device, dtype, args.arch).eval()
    model = hf_llama.parallelize_by_own_plan(model, init_device_mesh(device.type, (dist.get_world_size(),)))
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=device)
    commfuse.clear_report()
    if small:  # small outputs would all be launch-bound: fuse them, so their values are checked
        os.environ.setdefault("COMMFUSE_LAUNCH_BOUND_BYTES", "0")
    with torch.no_grad():
        want = model(ids).logits.float()
        got = torch.compile(model, backend="commfuse")(ids).logits.float()
    err = ((got - want).norm() / want.norm()).item()
    world = dist.get_world_size()
    if dist.get_rank() == 0:
        print(commfuse.report())
        print(f"logits relative error against eager: {err:.2e}")
        if world == 1:
            print("one rank: nothing to exchange, so nothing to fuse; launch two or more to see fusion "
                  "(torchrun --nproc_per_node=2 examples/hf_llama.py)")
    shutdown()  # every rank got here: leave the group in order (commfuse.demo.shutdown says why)
    if err > (2e-2 if dtype == torch.bfloat16 else 1e-4):
        raise SystemExit(f"compiled logits differ from eager: {err:.2e}")
    if world > 1 and not commfuse.report().fused:
        raise SystemExit("nothing fused, so the check compared Inductor with eager")


if __name__ == "__main__":
    main()
