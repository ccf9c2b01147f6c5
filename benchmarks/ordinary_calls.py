"""Do ordinary torch calls cost the host more in a process that uses commfuse, and from which step on?

    python benchmarks/ordinary_calls.py [--out F] [--samples 2000]

One process, one GPU, a group of one rank. A few ordinary calls (a CUDA ``torch.empty`` from the
caching allocator, a CPU ``torch.empty``, a small ``aten.mm``, a pure Python call, an all-reduce and an all-gather as
Inductor's code calls them) are timed on the
host in tight loops (the GPU idle, so nothing waits for it) at the start and again after each step
a process using commfuse goes through: importing it, importing Triton and Iris, importing the
kernels, the group's facts, its workspace, then one call of each path (forced past the policy).
After each step it also prints what could make every later call slower: the torch function and
dispatch mode stacks, a trace or profile function, ``sys.monitoring`` tools, live threads, the
current stream, which native threads used the CPU while the calls were timed (a thread spinning
on the main thread's sibling hyper-thread slows it) and the CPU the main thread last ran on. The
second step makes NCCL's communicator with torch's own collective, before commfuse is imported:
the control for what NCCL's threads do. The step after which the calls' minima rise is where to
look. Steps that do nothing (``--controls``, after the others) show how much the same calls vary
with no step between them: a rise no larger than theirs is the host's, not a step's. ``--pin``
keeps the main thread on one CPU (the one it started on), so a move between CPUs cannot vary
them; threads started later inherit that CPU.
``--provider-first torch|iris`` allocates a symmetric buffer from torch's symmetric memory (and
rendezvouses on it) or from an Iris heap before commfuse is imported, the provider alone: whether
a slowdown at commfuse's workspace step is the provider's. ``--funcol-first`` imports torch's
functional collectives first (which torch's symmetric memory imports): the rise that import causes
(``funcol_dispatch.py``) then comes before every other step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist

#: (op, path, M, K, N): one call each, forced, in this order (as ``host_time.py``'s cases).
PATH_STEPS = [
    ("mm_all_reduce", "nccl", 2048, 2048, 2048), ("mm_all_reduce", "one_shot", 2048, 2048, 2048),
    ("mm_all_reduce", "two_shot", 2048, 2048, 2048), ("mm_all_reduce", "split_k", 32, 2048, 4096),
    ("mm_all_reduce", "fused", 2048, 2048, 4096), ("mm_all_reduce", "ce_overlap", 4096, 7168, 4096),
    ("all_gather_mm", "pull", 2048, 2048, 2048), ("all_gather_mm", "fused", 2048, 2048, 2048),
    ("all_gather_mm", "ce_overlap", 4096, 4096, 4096), ("mm_reduce_scatter", "pull", 2048, 2048, 2048),
    ("mm_reduce_scatter", "fused", 2048, 2048, 2048),
]


def _nothing():
    return None


def probes(group: str):
    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    c10d = torch.ops._c10d_functional
    return {
        "torch.empty cuda 2048x2048": lambda: torch.empty(2048, 2048, device="cuda", dtype=torch.bfloat16),
        "torch.empty cpu 64": lambda: torch.empty(64),
        "aten.mm cuda 64x64": lambda: torch.ops.aten.mm(a, a),
        "python call": _nothing,
        # the collectives as Inductor's code calls them (one rank: the host's work, little GPU work)
        "all_reduce_ + wait": lambda: c10d.wait_tensor(c10d.all_reduce_(x, "sum", group)),
        "all_gather_into_tensor + wait": lambda: c10d.wait_tensor(c10d.all_gather_into_tensor(x, 1, group)),
    }


def time_probes(calls: dict, samples: int, warmup: int = 50, sync=torch.cuda.synchronize) -> dict:
    """Host µs (min, median) of each call, ``samples`` times in a tight loop after ``warmup``;
    ``sync`` every 256 calls keeps the device's queue short (``funcol_dispatch.py`` uses this too)."""
    out = {}
    for name, fn in calls.items():
        for _ in range(warmup):
            fn()
        sync()
        t = []
        for i in range(samples):
            start = time.perf_counter_ns()
            fn()
            t.append((time.perf_counter_ns() - start) / 1e3)
            if i % 256 == 255:
                sync()
        sync()
        out[name] = {"min": min(t), "median": statistics.median(t)}
    return out


def thread_cpu() -> dict:
    """CPU seconds per native thread of this process (Linux ``/proc``), keyed ``tid:name``."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            out[f"{tid}:{name}"] = (int(fields[11]) + int(fields[12])) / tick
    except OSError:
        pass
    return out


def state() -> dict:
    monitoring = getattr(sys, "monitoring", None)
    tools = [monitoring.get_tool(i) for i in range(6)] if monitoring else []
    return {
        "function_modes": torch._C._len_torch_function_stack(),
        "dispatch_modes": torch._C._len_torch_dispatch_stack(),
        "trace": repr(sys.gettrace()), "profile": repr(sys.getprofile()),
        "monitoring_tools": [t for t in tools if t],
        "threads": sorted(t.name for t in threading.enumerate()),
        "stream": torch.cuda.current_stream().cuda_stream,
        "grad": torch.is_grad_enabled(),
        "autograd_profiler": torch.autograd.profiler._is_profiler_enabled,
        "cpu": last_cpu(),
        # (its import puts Python autograd kernels on the functional collectives: funcol_dispatch.py)
        "functional_collectives_imported": "torch.distributed._functional_collectives" in sys.modules,
    }


def last_cpu() -> int | None:
    """The CPU this process's main thread last ran on (Linux ``/proc``), or None."""
    try:
        with open("/proc/thread-self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--out", default="")
    p.add_argument("--controls", type=int, default=3, help="steps that do nothing, after the others")
    p.add_argument("--funcol-first", action="store_true", help="before anything else, import "
                   "torch.distributed._functional_collectives (torch alone; benchmarks/funcol_dispatch.py)")
    p.add_argument("--provider-first", choices=("torch", "iris"), default=None, help="before importing commfuse, "
                   "allocate a symmetric buffer from torch's symmetric memory (and rendezvous on it) or from an "
                   "Iris heap, the provider alone")
    p.add_argument("--pin", action="store_true", help="keep the main thread on the CPU it started on (threads "
                   "started later, NCCL's and the compilers', inherit it and share that CPU)")
    args = p.parse_args()
    if args.pin and hasattr(os, "sched_setaffinity"):
        allowed = os.sched_getaffinity(0)
        here = last_cpu()
        os.sched_setaffinity(0, {here if here in allowed else min(allowed)})
    if not torch.cuda.is_available():
        print("ordinary_calls: needs a CUDA GPU", file=sys.stderr)
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    group = dist.group.WORLD.group_name
    calls = probes(group)
    records = []

    def step(name: str, fn=None):
        if fn is not None:
            fn()
            torch.cuda.synchronize()
        cpu0, wall0 = thread_cpu(), time.perf_counter()
        times = time_probes(calls, args.samples)
        cpu1, wall = thread_cpu(), time.perf_counter() - wall0
        # the threads that used the CPU while the probes ran (a thread spinning beside the main one
        # can slow it: hyper-threads share a core)
        busy = {k: round(100 * (v - cpu0.get(k, 0.0)) / wall) for k, v in cpu1.items()
                if v - cpu0.get(k, 0.0) > 0.02 * wall}
        rec = {"step": name, "times_us": times, "state": {**state(), "busy_threads_pct": busy,
                                                         "native_threads": len(cpu1)}}
        records.append(rec)
        mins = "  ".join(f"{k} {v['min']:.1f}/{v['median']:.1f}" for k, v in rec["times_us"].items())
        print(f"{name:40s} min/median µs: {mins}", flush=True)
        print(f"{'':40s} state: {rec['state']}", flush=True)

    step("start (torch, a one-rank NCCL group)")
    x = torch.ones(1024, device="cuda")
    step("torch's own all_reduce (NCCL's communicator made)", lambda: dist.all_reduce(x))
    kept = []
    if args.funcol_first:  # torch alone: what importing its functional collectives costs them
        step("torch: import its functional collectives", lambda: __import__("torch.distributed._functional_collectives"))
    if args.provider_first == "torch":  # torch alone: does a symmetric buffer of its own slow the calls?
        import torch.distributed._symmetric_memory as symm_mem

        step("torch: symm_mem.empty 64 MiB", lambda: kept.append(symm_mem.empty(64 << 20, dtype=torch.uint8,
                                                                                 device="cuda")))
        step("torch: symm_mem.rendezvous", lambda: kept.append(symm_mem.rendezvous(kept[0], group)))
    elif args.provider_first == "iris":  # Iris alone (its heap on the CUDA driver's virtual memory)
        step("iris: a 256 MiB heap, 64 MiB of it", lambda: kept.append(
            __import__("iris").iris(256 << 20, allocator_type="vmem_chunked").zeros(64 << 20, dtype=torch.uint8)))
    step("import commfuse", lambda: __import__("commfuse"))
    step("import triton", lambda: __import__("triton"))
    step("import iris", lambda: __import__("iris"))
    step("import the run-time's kernels", lambda: __import__("commfuse.runtime.running"))

    from commfuse.runtime import entry, groups, policy
    from commfuse.runtime.paths import REGISTRY

    def workspace():
        groups.workspace(groups.get(group), 64 << 20, torch.device("cuda", 0))

    step("the group's facts", lambda: groups.group_facts(groups.get(group), torch.device("cuda", 0), False))
    step("the group's workspace", workspace)
    forced = {}
    real = policy.choose

    def choose(call, facts, **kw):
        path = REGISTRY.get((call.op, forced.get(call.op, "")))
        return policy.Decision(path, None, "forced") if path else real(call, facts, **kw)

    policy.choose = choose
    decide = entry._decide
    # one plan per call signature: steps alike in op and shapes would otherwise all run the path
    # decided first
    entry._decide = lambda group, op, key, *rest: decide(group, op, key + (forced.get(op),), *rest)
    entry.forget()
    from commfuse.runtime import counters
    ops = torch.ops.commfuse
    for op, path, m, k, n in PATH_STEPS:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t() / k ** 0.5

        def one(op=op, path=path, a=a, b=b):
            forced.clear()
            forced[op] = path
            if op == "mm_all_reduce":
                ops.mm_all_reduce.default(a, b, None, group)
            elif op == "all_gather_mm":
                ops.all_gather_mm.default(a, b, None, 0, 1, group, False)
            else:
                ops.mm_reduce_scatter.default(a, b, None, [m, n], 0, 1, group)

        before = dict(counters.PATHS)
        step(f"{op} {path}", one)
        took = [k for k, v in counters.PATHS.items() if v > before.get(k, 0)]
        records[-1]["ran"] = took
        if f"{op}:{path}" not in took:
            print(f"{'':40s} NOTE: the call ran {took}, not {op}:{path}", flush=True)
    for i in range(args.controls):
        step(f"nothing (control {i + 1})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "samples": args.samples, "pinned": args.pin, "steps": records}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
