"""``python -m commfuse explain``: which matmul/collective pairs fuse in a TP model, and why not;
and for each fused call, which path the run-time would take on a given GPU.

Runs on the CPU in one process: a fake process group of the chosen world size stands in for the
ranks, the bundled Llama-style stack (``commfuse.demo``) is split for tensor parallelism, compiled
with the commfuse backend, and run forward and backward. Prints every candidate the pass saw, then
per fused call the path the run-time's policy (``runtime/policy.py``) picks on a simulated group
(``--gpu``, ``--gpus``) and where that choice comes from: the rules table of that GPU (``rules``),
a tuned answer in this machine's cache for that GPU (``cache``, with ``COMMFUSE_TUNE`` on), a
signature tuning would time at its first call (``tuned``, ``COMMFUSE_TUNE=first-use``: the rules'
choice until then), ``COMMFUSE_ALGO`` (``forced``), or why the call runs NCCL.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import torch

MODELS = {
    "dtensor": "DTensor ColwiseParallel/RowwiseParallel (mm -> all_reduce)",
    "sp": "DTensor with SequenceParallel (all_gather -> mm, mm -> reduce_scatter)",
    "hooks": "gpt-fast-style sharded weights + all_reduce forward hooks",
}


FP8 = {
    "tensorwise": "torchao float8 training, tensor-wise scales (Float8Linear; with --model dtensor or sp its "
                  "Float8ColwiseParallel / Float8RowwiseParallel plan; needs torchao)",
    "rowwise": "torchao float8 training, row-wise scales (Float8Linear, its 'rowwise' recipe; with --model "
               "dtensor or sp torch's own TP plan, as torchtitan's: the activation is gathered in bf16 and "
               "quantised row-wise after the gather; needs torchao)",
    "weights": "FP8 weights with one scale each, activations quantised tensor-wise per call (inference; "
               "--model hooks)",
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
    p.add_argument("--fp8", choices=sorted(FP8), default=None,
                   help="; ".join(f"{k}: {v}" for k, v in FP8.items()))
    p.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                   help="qualified-name pattern to opt out, e.g. 'layers.0.*' (repeatable)")
    p.add_argument("--min-mnk", type=int, default=None, help="size threshold (default: the backend's)")
    p.add_argument("--launch-bound-bytes", type=int, default=None,
                   help="outputs up to this size stay unfused without CUDA graphs (default: the backend's)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help='decide as a mode="reduce-overhead" compile would (launch-bound sizes fuse)')
    p.add_argument("--gpu", default="sm_90", metavar="ARCH|GPU",
                   help="the simulated GPU whose paths are shown: an architecture (sm_80, sm_86, sm_89, sm_90, "
                   "sm_100) or a GPU (A100, A10, L40S, H100, 'H100 PCIe', H200, B200); default sm_90 (H200). An "
                   "architecture without rules of its own takes the default table")
    p.add_argument("--gpus", type=int, default=None,
                   help="ranks of the simulated group (default: --world-size; the calls keep the shapes the "
                   "--world-size split gives)")
    return p


def _kv_heads(args: argparse.Namespace) -> int:
    return args.kv_heads or min(max(4, args.world_size), args.heads)


def check(args: argparse.Namespace) -> None:
    """Exit in one line for sizes the model cannot take (before the compile, which takes a while)."""
    from commfuse.tools import machine

    sizes = ("world_size", "layers", "dim", "heads", "kv_heads", "ffn_dim", "batch", "seq", "gpus")
    for name in sizes:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"commfuse explain: --{name.replace('_', '-')} must be at least 1, got {value}")
    if args.dim % args.heads:
        raise SystemExit(f"commfuse explain: --dim {args.dim} is not divisible by --heads {args.heads}")
    if args.heads % _kv_heads(args):
        raise SystemExit(f"commfuse explain: --heads {args.heads} is not divisible by the key/value heads "
                         f"{_kv_heads(args)} (--kv-heads)")
    if args.fp8 == "weights" and args.model != "hooks":
        raise SystemExit("commfuse explain: --fp8 weights takes --model hooks (its weights are plain tensors to "
                         "store in FP8)")
    try:
        machine.resolve(args.gpu)
    except ValueError as exc:
        raise SystemExit(f"commfuse explain: --gpu {exc}") from None


def run(args: argparse.Namespace):
    """Build, compile and run the model; return the report of this compile."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import commfuse
    from commfuse.config import DEFAULT_MIN_MNK
    from commfuse.demo import transformer as demo

    check(args)
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    world = dist.get_world_size()
    torch.manual_seed(0)
    kv_heads = _kv_heads(args)
    cfg = demo.Config(dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=kv_heads, ffn_dim=args.ffn_dim)
    dtype = getattr(torch, args.dtype)
    model = demo.Transformer(cfg).to(dtype)
    seq = args.seq
    from commfuse.demo import fp8

    def split(model):
        if args.model == "hooks":
            return demo.parallelize_hooks(model)
        return demo.parallelize_dtensor(model, init_device_mesh("cpu", (world,)), sequence_parallel=args.model == "sp",
                                        fp8=args.fp8)

    try:
        model = fp8.split_in(model, args.fp8, split, "commfuse explain")
    except ValueError as exc:
        raise SystemExit(f"commfuse explain: {exc}") from None
    if args.fp8 == "weights":
        args.inference = True  # the weights are buffers: nothing to train
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
    # Caches off: each fused call's path below is read from the nodes the pass makes (a cached graph
    # brings its decisions back, not its nodes).
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False), _calls_of_fused_nodes() as calls:
        if args.inference:
            with torch.no_grad():
                compiled(x)
        else:
            compiled(x).float().pow(2).mean().backward()
    rep = commfuse.report()
    rep.fused_calls = calls
    return rep


def _site(op: str, mnk, group) -> tuple:
    """What pairs a record with its call (in graph order): an FP8 record's dtype names the
    operand and the output, its call's the exchanged tensor's, so the dtype is not part of it."""
    return (op, tuple(mnk), str(group))


@contextlib.contextmanager
def _calls_of_fused_nodes():
    """While on, each rewritten graph's fused nodes are read as the run-time will see their calls
    (``graph_pass._call``: the sizes, the bias, how the collective cuts the rows); yields a dict
    from ``id(record)`` of each fused record of the report to its ``Call``. Records and nodes of
    one graph pair up by op, sizes, dtype and group, in order."""
    from commfuse.inductor_plugin import graph_pass

    calls: dict[int, object] = {}
    real = graph_pass.rewrite

    def rewrite(graph, settings):
        import commfuse

        before = len(commfuse.report())
        count = real(graph, settings)
        sites: dict[tuple, list] = {}
        for node in graph.nodes:
            if node.op == "call_function" and node.target in graph_pass._FUSED_OPS:
                call = graph_pass._call(node)
                if call is not None:
                    group = node.args[graph_pass._GROUP_ARG[node.target]]
                    key = _site(call.op, (call.m, call.k, call.n), group)
                    sites.setdefault(key, []).append(call)
        for rec in list(commfuse.report())[before:]:
            if rec.fused and not rec.merge and rec.shape:
                found = sites.get(_site(rec.pattern, rec.shape, rec.group))
                if found:
                    calls[id(rec)] = found.pop(0)
        return count

    graph_pass.rewrite = rewrite
    try:
        yield calls
    finally:
        graph_pass.rewrite = real


def _source(decision, tune: str, cached: bool) -> str:
    """Where a decision comes from, in words (module docstring)."""
    if decision.source == "tuned":
        return "cache: tuned on this machine for this GPU"
    if decision.source == "forced":
        return f"forced: {decision.reason}"
    if decision.source in ("unsupported", "fallback", "capture"):
        return f"{decision.source}: {decision.reason}"
    where = f"rules: {decision.reason} ({decision.table})"
    if tune == "first-use" and not cached:
        return "tuned at its first call (COMMFUSE_TUNE=first-use); until then " + where
    return where


def paths(rep, arch: str, world: int) -> list[str]:
    """One line per fused call of ``rep``: its module, its call, the path the policy picks on
    ``world`` simulated GPUs of ``arch`` and where the choice comes from."""
    import dataclasses

    from commfuse import env
    from commfuse.runtime import policy, tuning
    from commfuse.runtime.paths.base import Call

    from . import machine

    facts = machine.simulated(world, arch)
    settings = env.current()
    entries = {}
    if settings.tune != "off":  # the run-time reads the cache only then
        key = tuning.machine_key(facts)
        entries = tuning.read(tuning.cache_path(key), key)
    calls = getattr(rep, "fused_calls", {})
    rows = []
    for rec in rep.fused:
        call = calls.get(id(rec))
        if call is None and rec.shape and all(isinstance(x, int) for x in rec.shape):
            call = Call(rec.pattern, *rec.shape, getattr(torch, rec.dtype.split("->")[-1]), world)
        where = rec.module or rec.collective
        if call is None:
            rows.append((where, f"{rec.pattern} (symbolic sizes)", "-", "decided at the first call"))
            continue
        call = dataclasses.replace(call, world=world)
        entry = entries.get(tuning.Signature.of(call).text())
        decision = policy.choose(call, facts, forced=settings.algo, quiet=True,
                                 tuned=(lambda e=entry: e.choice if e else None) if entries else None)
        rows.append((where, call.short(), decision.name, _source(decision, settings.tune, entry is not None)))
    width = [max((len(r[i]) for r in rows), default=0) for i in range(3)]
    return [f"  {a:<{width[0]}}  {b:<{width[1]}}  -> {c:<{width[2]}}  [{d}]" for a, b, c, d in rows]


def main(argv: list[str] | None = None, prog: str = "python -m commfuse explain") -> int:
    from . import machine

    args = parser(prog).parse_args(argv)
    check(args)
    mode = "inference" if args.inference or args.fp8 == "weights" else "training step (forward + backward)"
    from . import count

    fp8 = f"; FP8: {FP8[args.fp8]}" if args.fp8 else ""
    print(f"commfuse explain: {MODELS[args.model]}; {count(args.layers, 'layer')}, dim {args.dim}, "
          f"{args.dtype}, fake process group of {count(args.world_size, 'rank')} on the CPU; {mode}{fp8}",
          flush=True)
    start = time.time()
    rep = run(args)
    print(f"compiled and ran in {time.time() - start:.1f} s; one line per matmul/collective candidate:\n")
    print(rep)
    gpus = args.gpus or args.world_size
    if rep.fused:
        facts = machine.simulated(gpus, args.gpu)
        print(f"\nPaths on {count(gpus, 'simulated ' + args.gpu + ' GPU')} ({facts.name}, {facts.sms} SMs), "
              "one line per fused call: where it is, the call, the path, where the choice comes from:")
        print("\n".join(paths(rep, args.gpu, gpus)))
    print("\nSet TORCH_LOGS=commfuse (or COMMFUSE_LOG=1) to see these decisions as your own model compiles, "
          "or read commfuse.report() after the first call.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
