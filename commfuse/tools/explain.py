"""``python -m commfuse explain``: which matmul/collective pairs fuse in a TP model, and why not.

Runs on the CPU in one process: a fake process group of the chosen world size stands in for the
ranks, the bundled Llama-style stack (``commfuse.demo``) is split for tensor parallelism, compiled
with the commfuse backend, and run forward and backward. Prints every candidate the pass saw.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

MODELS = {
    "dtensor": "DTensor ColwiseParallel/RowwiseParallel (mm -> all_reduce)",
    "sp": "DTensor with SequenceParallel (all_gather -> mm, mm -> reduce_scatter)",
    "hooks": "gpt-fast-style sharded weights + all_reduce forward hooks",
}


def parser(prog: str = "python -m commfuse explain") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2, help="ranks of the fake process group (default 2)")
    p.add_argument("--model", choices=sorted(MODELS), default="dtensor",
                   help="; ".join(f"{k}: {v}" for k, v in MODELS.items()))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None,
                   help="key/value heads (default: 4, or the world size if larger)")
    p.add_argument("--ffn-dim", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512,
                   help="full sequence length (sharded under --model sp); with --batch, the token count M "
                   "(at the defaults 4096 tokens: outputs above the launch-bound size)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    p.add_argument("--inference", action="store_true", help="forward only, under torch.no_grad()")
    p.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                   help="qualified-name pattern to opt out, e.g. 'layers.0.*' (repeatable)")
    p.add_argument("--min-mnk", type=int, default=None, help="size threshold (default: the backend's)")
    p.add_argument("--launch-bound-bytes", type=int, default=None,
                   help="outputs up to this size stay unfused without CUDA graphs (default: the backend's)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help='decide as a mode="reduce-overhead" compile would (launch-bound sizes fuse)')
    return p


def run(args: argparse.Namespace):
    """Build, compile and run the model; return the report of this compile."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import commfuse
    from commfuse.config import DEFAULT_MIN_MNK
    from commfuse.demo import transformer as demo

    if args.world_size < 1:
        raise SystemExit(f"commfuse explain: --world-size must be at least 1, got {args.world_size}")
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    world = dist.get_world_size()
    torch.manual_seed(0)
    kv_heads = args.kv_heads or min(max(4, world), args.heads)
    cfg = demo.Config(dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=kv_heads, ffn_dim=args.ffn_dim)
    dtype = getattr(torch, args.dtype)
    model = demo.Transformer(cfg).to(dtype)
    seq = args.seq
    try:
        if args.model == "hooks":
            demo.parallelize_hooks(model)
        else:
            mesh = init_device_mesh("cpu", (world,))
            demo.parallelize_dtensor(model, mesh, sequence_parallel=args.model == "sp")
    except ValueError as exc:
        raise SystemExit(f"commfuse explain: {exc}") from None
    if args.model == "sp":
        if seq % world:
            raise SystemExit(f"commfuse explain: --seq {seq} is not divisible by --world-size {world}")
        seq //= world
    x = torch.randn(args.batch, seq, cfg.dim, dtype=dtype, requires_grad=not args.inference)
    backend = commfuse.backend(exclude=args.exclude,
                               min_mnk=DEFAULT_MIN_MNK if args.min_mnk is None else args.min_mnk,
                               launch_bound_bytes=args.launch_bound_bytes,
                               inductor_config={"triton.cudagraphs": True} if args.cuda_graphs else None)
    compiled = torch.compile(model, backend=backend)
    commfuse.clear_report()
    # Caches off: a cached graph skips the pass and would leave its decisions out of the report.
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        if args.inference:
            with torch.no_grad():
                compiled(x)
        else:
            compiled(x).float().pow(2).mean().backward()
    return commfuse.report()


def main(argv: list[str] | None = None, prog: str = "python -m commfuse explain") -> int:
    args = parser(prog).parse_args(argv)
    mode = "inference" if args.inference else "training step (forward + backward)"
    print(f"commfuse explain: {MODELS[args.model]}; {args.layers} layers, dim {args.dim}, "
          f"{args.dtype}, fake process group of {args.world_size} ranks on the CPU; {mode}",
          flush=True)
    start = time.time()
    rep = run(args)
    print(f"compiled and ran in {time.time() - start:.1f} s; one line per matmul/collective candidate:\n")
    print(rep)
    print("\nSet TORCH_LOGS=commfuse (or COMMFUSE_LOG=1) to see these decisions as your own model compiles, "
          "or read commfuse.report() after the first call.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
