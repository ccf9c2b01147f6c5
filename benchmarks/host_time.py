"""Host time of one commfuse call per op and path, beside the unfused calls as Inductor's generated
code makes them, on one GPU (a group of one rank, each path forced past the policy).

    python benchmarks/host_time.py --out host.json [--batches 30]

Every case runs in turn in each batch behind a GPU sleep, so the host's work is what is timed
(the GPU never waits for the host) and each call meets caches the other cases used, as inside a
model step. The unfused baselines call ``aten.mm``, then ``_c10d_functional.all_reduce_`` (or
``all_gather_into_tensor`` / ``reduce_scatter_tensor``) and ``wait_tensor`` directly, as Inductor's
generated code does. Each fused case is checked against fp32 first.

The script runs against whichever commfuse is importable (``PYTHONPATH``): the tree before the
path objects (``commfuse.kernels.dispatch``) or after (``commfuse.runtime``), so one device call
can time both in alternating processes (``--label``).

``--commfuse`` asks whether commfuse slows the ops it does not touch: ``absent`` times the unfused
calls in a process that never imports commfuse, ``imported`` imports it (and registers its ops)
without calling it, ``used`` (the default) times them among the fused cases, ``warmed`` runs every
fused case first (kernels compiled, workspaces allocated) and then times the unfused calls alone,
``released`` does the same after ``commfuse.release_all()``. ``--parts`` adds the unfused calls' parts
as cases of their own (the output's allocation, the GEMM, the collective and its wait), so a
difference between modes can be placed; with commfuse used it also adds the split-K call's parts
(``commfuse.tools.host_parts``: the op's checks, the entry, the path's run, and within it the
output, ``prepare``, the exchange and the launch), so the fused call's excess over the unfused
calls can be placed too. ``--back-to-back`` times each case in
a run of its own calls instead of in turn with the others (warm caches), and prints how often the
caching allocator went to the device (``cudaMalloc``, ``cudaFree``, retries) per call;
``--sleep-ms 0`` leaves the GPU idle when each call starts, which separates a call slowed by a
busy GPU from one slowed by what ran before it. In turn, the cases' order is shuffled from batch
to batch (one fixed seed), so no case is always the first after the GPU sleep (the first call
after it costs the host most) nor always follows the same case (with the order only rotated a
case's neighbours never changed, and a case could read twice its back-to-back time).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist

#: (op, path, M, K, N, weight layout): the DTensor model's row-parallel calls at 8B-class sizes and
#: the other ops' standard shapes; "T": the weight a transposed view (nn.Linear's), "N": dense. (The
#: reduce-scatter's copy-engine overlap needs a peer: one rank has no share to pull.)
CASES = [
    ("mm_all_reduce", "fused", 8192, 2048, 4096, "T"), ("mm_all_reduce", "ce_overlap", 8192, 7168, 4096, "T"),
    ("mm_all_reduce", "one_shot", 2048, 2048, 4096, "T"), ("mm_all_reduce", "two_shot", 2048, 2048, 4096, "T"),
    ("mm_all_reduce", "split_k", 32, 2048, 4096, "T"), ("mm_all_reduce", "nccl", 8192, 2048, 4096, "T"),
    ("all_gather_mm", "pull", 2048, 2048, 2048, "T"), ("all_gather_mm", "ce_overlap", 4096, 4096, 4096, "T"),
    ("all_gather_mm", "fused", 2048, 2048, 2048, "T"), ("all_gather_mm", "nccl", 2048, 2048, 2048, "T"),
    ("mm_reduce_scatter", "pull", 2048, 2048, 2048, "T"), ("mm_reduce_scatter", "fused", 2048, 2048, 2048, "T"),
    ("mm_reduce_scatter", "nccl", 2048, 2048, 2048, "T"),
]
#: The paths' former names (``COMMFUSE_ALGO``'s aliases), for timing a tree from before the renames.
FORMER = {"pull": "symm", "ce_overlap": "overlap"}
UNFUSED = [("mm_all_reduce", 8192, 2048, 4096), ("mm_all_reduce", 32, 2048, 4096),
           ("all_gather_mm", 2048, 2048, 2048), ("mm_reduce_scatter", 2048, 2048, 2048)]


def _force_old(forced: dict) -> str:
    """Before the path objects: replace the dispatch functions (this process only)."""
    from commfuse.kernels import dispatch

    for op in ("mm_all_reduce", "all_gather_mm", "mm_reduce_scatter"):
        real = getattr(dispatch, op)
        setattr(dispatch, op, lambda *a, _op=op, _real=real, **k: forced.get(_op) or _real(*a, **k))
    return "old"


def _force_new(forced: dict) -> str:
    """After: replace the policy's choice (a group of one rank runs NCCL otherwise)."""
    from commfuse.runtime import entry, policy
    from commfuse.runtime.paths import REGISTRY

    real = policy.choose

    def choose(call, facts, **kw):
        name = forced.get(call.op)
        if not name:
            return real(call, facts, **kw)
        # a tree from before the paths' renames knows them by their former names
        path = REGISTRY.get((call.op, name)) or REGISTRY[(call.op, FORMER.get(name, name))]
        variant = {"split_k": True} if name == "graph" and call.m <= 128 else None
        return policy.Decision(path, variant, "forced")

    policy.choose = choose
    decide = entry._decide

    def decide_forced(group, op, key, *rest):
        # the run-time keeps one plan per call signature: cases alike in op and shapes (the
        # all-gather's pull, fused and nccl cases) would otherwise all run the path decided first
        return decide(group, op, key + (forced.get(op),), *rest)

    entry._decide = decide_forced
    entry.forget()
    return "new"


def _split_k_parts(cases: list, forced: dict, group: str) -> list:
    """The split-K case's parts as cases (``commfuse.tools.host_parts``), those through the entry
    forcing the path as the fused cases do; none where this commfuse has no such tool or no
    split-K case ran."""
    try:
        from commfuse.tools.host_parts import split_k_parts
    except ImportError:
        return []
    found = [(a, b) for name, _, a, b in cases if name.startswith("mm_all_reduce split_k ")]
    if not found:
        return []
    a, b = found[0]

    def force():
        forced.clear()
        forced["mm_all_reduce"] = "split_k"

    def forcing(fn):
        def part():
            force()
            return fn()
        return part

    force()
    # (only the parts that pass through the entry decide a path; the others time no forcing)
    parts = [(f"part: split_k {name}", forcing(fn) if name in ("op", "call", "entry") else fn, a, b)
             for name, fn in split_k_parts(group, a, b).items()]
    for _, fn, _, _ in parts:
        fn()
    return parts


def _ran_paths() -> dict:
    """``op:path`` -> calls so far (the run-time's count of the path each call took), or {}."""
    try:
        from commfuse.runtime import counters
    except ImportError:  # commfuse absent, or a tree without the count
        return {}
    return dict(counters.PATHS)


def _allocator_counts() -> dict:
    """The caching allocator's counts of device allocations, frees and retries (a retry frees
    cached blocks and synchronises the device) so far."""
    stats = torch.cuda.memory_stats()
    return {k: stats.get(k, 0) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=30)
    p.add_argument("--sleep-ms", type=float, default=60.0)
    p.add_argument("--label", default="")
    p.add_argument("--out", default="")
    p.add_argument("--commfuse", choices=("absent", "imported", "used", "warmed", "released"), default="used",
                   help="absent: never import commfuse (unfused cases only); imported: import it, time the "
                   "unfused cases only; used: every case, fused among unfused; warmed: run the fused cases, "
                   "then time the unfused ones alone; released: the same after commfuse.release_all()")
    p.add_argument("--parts", action="store_true", help="also time the unfused calls' parts alone (the "
                   "output's allocation, the GEMM, the collective with its wait) and, with commfuse used, the "
                   "split-K call's (commfuse.tools.host_parts)")
    p.add_argument("--back-to-back", action="store_true",
                   help="time each case in a run of its own calls, not in turn with the other cases")
    p.add_argument("--fused", default="", help="comma-separated substrings: only the fused cases whose name has "
                   "one (with --commfuse warmed: which fused calls ran before the unfused ones are timed)")
    p.add_argument("--profile", default="", help="comma-separated case names (substrings): a cProfile of 50 "
                   "calls of each, behind a GPU sleep")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("host_time: needs a CUDA GPU", file=sys.stderr)
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    forced: dict = {}
    tree = "none"
    if args.commfuse != "absent":
        import commfuse

        tree = _force_new(forced) if hasattr(commfuse, "release_all") else _force_old(forced)
    group = dist.group.WORLD.group_name
    c10d = torch.ops._c10d_functional
    uses = args.commfuse in ("used", "warmed", "released")
    ops = torch.ops.commfuse if uses else None
    torch.manual_seed(0)

    def operands(op, m, k, n, layout):
        dt = torch.bfloat16
        a = torch.randn(m, k, device="cuda", dtype=dt)
        w = torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5
        b = w.t() if layout == "T" else w.t().contiguous()
        return a, b

    def fused(op, path, a, b):
        forced.clear()
        forced[op] = path
        if op == "mm_all_reduce":
            return ops.mm_all_reduce.default(a, b, None, group)
        if op == "all_gather_mm":
            return ops.all_gather_mm.default(a, b, None, 0, 1, group, False)[0]
        return ops.mm_reduce_scatter.default(a, b, None, [a.shape[0], b.shape[1]], 0, 1, group)

    def unfused(op, a, b):
        if op == "mm_all_reduce":
            return c10d.wait_tensor(c10d.all_reduce_(torch.ops.aten.mm(a, b), "sum", group))
        if op == "all_gather_mm":
            return torch.ops.aten.mm(c10d.wait_tensor(c10d.all_gather_into_tensor(a, 1, group)), b)
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(torch.ops.aten.mm(a, b), "sum", 1, group))

    cases = []
    wanted = [w for w in args.fused.split(",") if w]
    for op, path, m, k, n, layout in CASES if uses else ():
        if wanted and not any(w in f"{op} {path} {m}x{k}x{n}" for w in wanted):
            continue
        a, b = operands(op, m, k, n, layout)
        cases.append((f"{op} {path} {m}x{k}x{n}", lambda op=op, path=path, a=a, b=b: fused(op, path, a, b), a, b))
    for op, m, k, n in UNFUSED:
        a, b = operands(op, m, k, n, "T")
        cases.append((f"{op} unfused (aten + c10d) {m}x{k}x{n}", lambda op=op, a=a, b=b: unfused(op, a, b), a, b))
    if args.parts:  # checked by the unfused case they make up; run here only for their time
        a, b = operands("all_gather_mm", 2048, 2048, 2048, "T")
        out = torch.empty(2048, 2048, device="cuda", dtype=torch.bfloat16)
        parts = [("part: torch.empty 2048x2048 bf16", lambda: torch.empty(2048, 2048, device="cuda",
                                                                          dtype=torch.bfloat16)),
                 ("part: aten.mm 2048x2048x2048", lambda: torch.ops.aten.mm(a, b)),
                 ("part: all_reduce_ + wait 2048x2048", lambda: c10d.wait_tensor(c10d.all_reduce_(out, "sum", group))),
                 ("part: all_gather_into_tensor + wait 2048x2048",
                  lambda: c10d.wait_tensor(c10d.all_gather_into_tensor(a, 1, group)))]
        for name, fn in parts:
            fn()
        cases += [(name, fn, a, b) for name, fn in parts]
    ran = {}  # the fused cases: the path each one's checked call took
    for name, fn, a, b in cases:  # compile, allocate, first launches; then a check against fp32
        for _ in range(3):
            fn()
        before = _ran_paths()
        out = fn().float()
        after = _ran_paths()
        took = sorted(k for k in after if after[k] > before.get(k, 0))
        if uses and " unfused " not in name and not name.startswith("part:"):
            ran[name] = took
            op, path = name.split()[:2]
            if took and not {f"{op}:{path}", f"{op}:{FORMER.get(path, path)}"} & set(took):
                print(f"host_time: NOTE {name} ran {took}, not the path it names", flush=True)
        if name.startswith("part:"):
            continue
        ref = a.float() @ b.float()
        err = ((out - ref).norm() / ref.norm()).item()
        if not err < 2e-2:
            raise RuntimeError(f"host_time: {name} is wrong (relative error {err})")
    if args.parts and args.commfuse == "used" and tree == "new":
        cases += _split_k_parts(cases, forced, group)
    torch.cuda.synchronize()
    if args.commfuse in ("warmed", "released"):  # the fused cases have run: time the unfused ones alone
        cases = [case for case in cases if "unfused" in case[0] or case[0].startswith("part:")]
        if args.commfuse == "released":
            commfuse.release_all()
    cycles = int(args.sleep_ms * (getattr(torch.cuda.get_device_properties(0), "clock_rate", 0) or 1_980_000))
    host = {name: [] for name, *_ in cases}
    mallocs = {}  # back to back: the caching allocator's device allocations and frees per call
    if args.back_to_back:
        for name, fn, _, _ in cases:
            before = _allocator_counts()
            for _ in range(args.batches):
                if cycles:
                    torch.cuda._sleep(cycles // 8)
                start = time.perf_counter()
                fn()
                host[name].append((time.perf_counter() - start) * 1e6)
                torch.cuda.synchronize()
            after = _allocator_counts()
            mallocs[name] = {k: (after[k] - before[k]) / args.batches for k in after}
    else:
        order, shuffle = list(range(len(cases))), random.Random(0).shuffle
        for batch in range(args.batches):
            torch.cuda._sleep(cycles)
            shuffle(order)
            for name, fn, _, _ in (cases[i] for i in order):
                start = time.perf_counter()
                fn()
                host[name].append((time.perf_counter() - start) * 1e6)
            torch.cuda.synchronize()
    medians = {name: statistics.median(t) for name, t in host.items()}
    for want in filter(None, args.profile.split(",")):
        import cProfile
        import io
        import pstats

        for name, fn, _, _ in cases:
            if want in name:
                torch.cuda.synchronize()
                torch.cuda._sleep(cycles)
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(50):
                    fn()
                prof.disable()
                torch.cuda.synchronize()
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(28)
                print(f"--- cProfile of 50 calls: {name}\n{text.getvalue()}", flush=True)
    print(f"host us per call, {tree} tree, commfuse {args.commfuse}"
          f"{', back to back' if args.back_to_back else ''} {args.label} (median of {args.batches} batches, one rank, "
          f"{'GPU kept busy' if cycles else 'GPU idle at each call'}):")
    for name, us in medians.items():
        counts = mallocs.get(name)
        extra = ("  cudaMalloc/call {num_device_alloc:.2f}, cudaFree/call {num_device_free:.2f}, "
                 "retries/call {num_alloc_retries:.2f}").format(**counts) if counts else ""
        print(f"  {name:52s} {us:8.1f}  (min {min(host[name]):.1f}){extra}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"tree": tree, "commfuse": args.commfuse, "back_to_back": args.back_to_back,
                       "label": args.label, "batches": args.batches, "median_us": medians,
                       "min_us": {k: min(v) for k, v in host.items()}, "allocator_per_call": mallocs,
                       "ran": ran,
                       "sleep_ms": args.sleep_ms, "device": torch.cuda.get_device_name(0),
                       "torch": torch.__version__}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
