"""``python -m commfuse tune``: measured dispatch on this machine (``runtime/tuning.py``).

    torchrun --nproc_per_node=N -m commfuse tune -- SCRIPT [ARGS...]
    torchrun --nproc_per_node=N -m commfuse tune --model dtensor|sp|hooks
    python -m commfuse tune --show [--gpus N] [--gpu ARCH]
    python -m commfuse tune --clear [--all] [--gpus N] [--gpu ARCH]

``-- SCRIPT``: runs SCRIPT as ``__main__`` (as ``python SCRIPT ARGS`` would, in this process, under
the caller's torchrun) with ``COMMFUSE_TUNE=first-use``: every call signature the model makes is
tuned on its first call, every rank together, and kept in this machine's cache; then prints how
many signatures were tuned and the time tuning took. ``--model``: the same over the bundled
Llama-style stack (``commfuse.demo``): a prefill, a training step and decode steps of every
``--decode-batches`` size (not for the sequence-parallel split). Both need CUDA GPUs.

``--show``: this machine's tuning cache as a table per world size (signature, the candidates'
times, the choice, the rules' choice, the margin); ``--clear``: removes this machine's cache files
(``--all``: every cache file in the directory). The machine is this one's GPUs, or with ``--gpu
ARCH`` a simulated GPU of that architecture (``--gpus``: its world size). They run anywhere; on a
machine without CUDA GPUs and without ``--gpu`` they say so. The directory is
``COMMFUSE_CACHE_DIR`` (default ``~/.cache/commfuse``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import runpy
import sys
import time

PROG = "python -m commfuse tune"
MODELS = ("dtensor", "sp", "hooks")
DECODE_BATCHES = "1,2,4,8,16,32,64,128,256"


def parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group()
    what.add_argument("--show", action="store_true", help="print this machine's tuning cache")
    what.add_argument("--clear", action="store_true", help="remove this machine's tuning cache files")
    what.add_argument("--model", choices=MODELS, help="tune every call of the bundled model (under torchrun)")
    p.add_argument("--all", action="store_true", help="--clear: every cache file in the directory")
    p.add_argument("--gpus", type=int, default=None, help="--show / --clear: only this world size")
    p.add_argument("--gpu", default=None, metavar="ARCH|GPU",
                   help="--show / --clear: a simulated GPU instead of this machine's: an architecture (sm_80, "
                   "sm_86, sm_89, sm_90, sm_100) or a GPU (A100, A10, L40S, H100, 'H100 PCIe', H200, B200)")
    p.add_argument("--layers", type=int, default=2, help="--model: decoder layers")
    p.add_argument("--batch", type=int, default=4, help="--model: prefill and training batch")
    p.add_argument("--seq", type=int, default=2048, help="--model: prefill and training sequence length")
    p.add_argument("--context", type=int, default=2048, help="--model: KV-cache length decoding starts at")
    p.add_argument("--decode-batches", default=DECODE_BATCHES, help="--model: decode batch sizes")
    p.add_argument("--small", action="store_true", help="--model: small sizes")
    p.add_argument("script", nargs="?", help="after --: the script to run with tuning on")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    return p


# ---------------------------------------------------------------------------------------------
# The cache of this machine


def _facts(world: int, arch: str | None):
    from . import machine

    return machine.simulated(world, arch) if arch else machine.local(world)


def _files(worlds: set[int] | None, arch: str | None) -> tuple[list, int]:
    """(path, key, facts) of each cache file made for this machine (at ``worlds`` only, if given),
    and how many other cache files the directory holds."""
    from commfuse.runtime import tuning

    mine, others = [], 0
    for path in sorted(tuning.cache_dir().glob("tuned-*.json")):
        try:
            key = json.loads(path.read_text()).get("key", {})
            world = int(key["world"])
        except Exception:  # noqa: BLE001 - unreadable: not this machine's
            others += 1
            continue
        facts = _facts(world, arch) if worlds is None or world in worlds else None
        if facts is not None and tuning.machine_key(facts) == key:
            mine.append((path, key, facts))
        else:
            others += 1
    return mine, others


def _time(us: float) -> str:
    return "failed" if math.isinf(us) else f"{us:.1f}"


def table(path: pathlib.Path, key: dict) -> str:
    """One cache file's entries as a markdown table."""
    from commfuse.runtime import tuning

    entries = tuning.read(path, key)
    count = f"{len(entries)} signature{'s' if len(entries) != 1 else ''}"
    lines = [f"{path} ({key['gpu']}, world {key['world']}, {count})", "",
             "| signature | choice | rules | margin | choice / rules | candidates µs |", "|---" * 6 + "|"]
    for sig, e in entries.items():
        ratio = (f"{e.times_us[e.choice] / e.times_us[e.rules]:.3f}"
                 if e.rules in e.times_us and e.choice in e.times_us and math.isfinite(e.times_us[e.rules])
                 and math.isfinite(e.times_us[e.choice]) and e.times_us[e.rules] > 0 else "-")
        times = ", ".join(f"{name} {'timed out' if name in e.transient else _time(us)}"
                          for name, us in e.times_us.items())
        if e.retry():
            times += f" (tuned again in a later run: try {e.tries} of {tuning.TRANSIENT_TRIES})"
        lines.append(f"| {sig} | {e.choice} | {e.rules} | {e.margin:g} | {ratio} | {times} |")
    return "\n".join(lines)


def _no_gpu(args) -> bool:
    if args.gpu is None and _facts(2, None) is None:
        print("commfuse tune: this machine has no CUDA GPU: its calls run the unfused ops and are never tuned "
              "(--gpu ARCH --gpus N: the cache of a simulated GPU on this machine's software)")
        return True
    return False


def show(args) -> int:
    from commfuse.runtime import tuning

    if _no_gpu(args):
        return 0
    worlds = {args.gpus} if args.gpus else None
    mine, others = _files(worlds, args.gpu)
    where = tuning.cache_dir()
    if not mine:
        print(f"commfuse tune: no tuning cache for this machine in {where}"
              + (f" ({others} files for other machines, versions or settings)" if others else ""))
        return 0
    print("\n\n".join(table(path, key) for path, key, _ in mine))
    if others:
        print(f"\n({others} more cache files in {where} for other machines, versions or settings)")
    return 0


def clear(args) -> int:
    from commfuse.runtime import tuning

    where = tuning.cache_dir()
    if args.all:
        paths = sorted(where.glob("tuned-*.json"))
    else:
        if _no_gpu(args):
            return 0
        paths = [path for path, _, _ in _files({args.gpus} if args.gpus else None, args.gpu)[0]]
    for path in paths:
        path.unlink(missing_ok=True)
        path.with_suffix(".lock").unlink(missing_ok=True)
    print(f"commfuse tune: removed {len(paths)} cache file{'s' if len(paths) != 1 else ''} from {where}")
    return 0


# ---------------------------------------------------------------------------------------------
# Tuning a script or the bundled model


class Tally:
    """Counts the signatures the tuners of this process tune (and the seconds they take) while on."""

    def __init__(self):
        self.signatures: list[tuple[str, float]] = []

    def __enter__(self):
        from commfuse.runtime import tuning

        self._real = real = tuning.Tuner.tune
        tally = self

        def tune(tuner, sig):
            began = time.perf_counter()
            try:
                return real(tuner, sig)
            finally:
                tally.signatures.append((sig.text(), time.perf_counter() - began))

        tuning.Tuner.tune = tune
        return self

    def __exit__(self, *exc):
        from commfuse.runtime import tuning

        tuning.Tuner.tune = self._real

    def summary(self, what: str) -> str:
        seconds = sum(s for _, s in self.signatures)
        captures = sum("@capture" in text for text, _ in self.signatures)
        extra = f" ({captures} of them for CUDA-graph captures)" if captures else ""
        return (f"commfuse tune: {what}: {len(self.signatures)} call signatures tuned{extra} in {seconds:.1f} s; "
                "kept in this machine's cache (python -m commfuse tune --show)")


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def run_script(script: str, script_args: list[str]) -> int:
    from commfuse import env

    if not os.path.isfile(script):
        print(f"commfuse tune: no script {script!r}", file=sys.stderr)
        return 2
    os.environ["COMMFUSE_TUNE"] = "first-use"  # the script's own reads (and its children's) see it too
    env.reload()
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as ``python SCRIPT`` would
    code = 0
    with Tally() as tally:
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    if _rank() == 0:
        print(tally.summary(script), flush=True)
    return code


def run_model(args) -> int:
    import torch
    import torch.distributed as dist

    from commfuse import env
    from commfuse.demo import init_distributed, shutdown
    from commfuse.demo import transformer as demo

    from .bench_model import _allow_many_compiles, _build, _compile, _make_step

    device, dtype = init_distributed()
    world = dist.get_world_size()
    cfg = demo.sized_config(args.small, args.layers, world)
    torch._inductor.config.fx_graph_cache = False  # the pass runs (and its workspaces are planned)
    _allow_many_compiles()
    kind = args.model
    seq = args.seq // world if kind == "sp" else args.seq
    torch.manual_seed(100 + (dist.get_rank() if kind == "sp" else 0))

    def run(mode: str, batch: int, pos=None):
        model = _build(kind, cfg, device, dtype)
        if pos is not None:
            model.setup_cache(batch, args.context + 16, device, dtype)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4, foreach=False) if mode == "train" else None
        x = torch.randn(batch, 1 if pos is not None else seq, cfg.dim, device=device, dtype=dtype)
        _make_step(mode, _compile("commfuse", model), x, pos, opt, False)()
        torch.cuda.synchronize()
        if _rank() == 0:
            print(f"commfuse tune: {kind} {mode} batch {batch} done", flush=True)

    with env.override(tune="first-use"), Tally() as tally:
        run("prefill", args.batch)
        run("train", args.batch)
        if kind != "sp":  # one token per sequence cannot be split along the sequence
            for batch in (int(b) for b in args.decode_batches.split(",") if b):
                run("decode", batch, torch.tensor([args.context], device=device))
    if _rank() == 0:
        print(tally.summary(f"the bundled model ({kind})"), flush=True)
    shutdown()
    return 0


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if "--" in argv:  # everything after -- is the script's, its options included
        at = argv.index("--")
        argv, script_args = argv[:at], argv[at + 1:]
    p = parser(prog)
    args = p.parse_args(argv)
    if script_args and (args.script or args.show or args.clear or args.model):
        p.error("give either -- SCRIPT [ARGS...] or one of --show, --clear, --model")
    for name in ("gpus", "layers", "batch", "seq", "context"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"commfuse tune: --{name} must be at least 1, got {value}")
    if args.gpu is not None:
        from . import machine

        try:
            machine.resolve(args.gpu)
        except ValueError as exc:
            raise SystemExit(f"commfuse tune: --gpu {exc}") from None
    if args.show:
        return show(args)
    if args.clear:
        return clear(args)
    if args.script and not script_args:
        script_args = [args.script, *args.args]
    if not script_args and not args.model:
        p.error("give -- SCRIPT [ARGS...], --model, --show or --clear")
    from commfuse.demo import exit_unless_launched

    launch = f"-m commfuse tune --model {args.model}" if args.model else "-m commfuse tune -- SCRIPT [ARGS...]"
    exit_unless_launched(prog, launch, gpus=True)
    if args.model:
        return run_model(args)
    return run_script(script_args[0], script_args[1:])


if __name__ == "__main__":
    sys.exit(main())
