"""commfuse's own host work per call, on the CPU: every step of a fused call from the op's CUDA
kernel function to the kernel launch, with what needs a GPU stood in.

    python benchmarks/host_python.py [--calls 2000] [--profile CASE,...] [--parts] [--out F.json]

A call here runs what it runs on a GPU: the op's checks, the entry (group, capture, agreement,
kept plan), the path's run, the kernels' ``prepare``, the exchange's epoch and the kept launch
(``launch.Bound``) up to the compiled kernel's launcher. Stood in, because they need a GPU: the
group's workspace (a CPU buffer), the agreed facts (an H200 pair's), each kernel's first compile
(``warmup``) and its residency query, the compiled kernel's launcher (a function that returns),
the current device and stream. The GEMM of the paths that run ``torch.mm`` beside their exchange
kernels is left out (a GPU runs it asynchronously; here it would be computed).

What this shows is the Python commfuse adds to a call: the function calls per call (cProfile's
count, builtins included) and the time per call, median of ``--rounds`` runs of ``--calls``
back-to-back calls. It does not show the launch itself (Triton's launcher and the driver), the
CUDA runtime's stream queries, or the host's caches between calls inside a model: a GPU's figures
come from ``host_time.py``, which times the same calls beside the unfused ones.

``--parts`` also times the split-K case's parts alone, each in a loop of its own (minimum of the
rounds): the op's checks, the entry with the path's run stood in by a function that returns, the
path's run, and within it the output's allocation, the kernel's ``prepare``, the exchange around
the launch and the launch alone (``commfuse.tools.host_parts``; ``host_time.py --parts`` times
the same parts on a GPU).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

#: (name, op, path, M, K, N): ``host_time.py``'s shapes, but with fewer rows where a CPU would spend
#: time on them (the fused all-reduce's output, mapped fresh at 8192 rows; the gathers' shard, which
#: is copied into the workspace, asynchronously on a GPU). A call's Python does not depend on M.
CASES = [
    ("ar_fused", "mm_all_reduce", "fused", 1024, 2048, 4096),
    ("ar_split_k", "mm_all_reduce", "split_k", 32, 2048, 4096),
    ("ar_one_shot", "mm_all_reduce", "one_shot", 2048, 2048, 4096),
    ("rs_fused", "mm_reduce_scatter", "fused", 2048, 2048, 2048),
    ("rs_pull", "mm_reduce_scatter", "pull", 2048, 2048, 2048),
    ("ag_fused", "all_gather_mm", "fused", 64, 2048, 2048),
    ("ag_pull", "all_gather_mm", "pull", 64, 2048, 2048),
]
WORLD = 2


def stand_ins():
    """Replace what needs a GPU (module docstring); returns the group's name."""
    import torch
    import torch.distributed as dist
    from triton.runtime.jit import JITFunction
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from commfuse.kernels import fused_all_gather, fused_all_reduce, fused_split_k, launch
    from commfuse.runtime import counters, facts, groups, reference
    from commfuse.runtime import workspace as wsmod
    from commfuse.runtime.facts import GroupFacts
    from commfuse.runtime.paths import common

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    name = dist.group.WORLD.group_name
    held = []

    def workspace(group, nbytes, device):  # grown as the run-time grows it: a new buffer, plans decided anew
        if not held or held[0].data_bytes < nbytes:
            held[:] = [wsmod.Workspace(name, 0, WORLD, torch.zeros(wsmod.HEADER_BYTES + 2 * nbytes, dtype=torch.uint8),
                                       torch.zeros(WORLD, dtype=torch.int64), nbytes)]
            counters.bump()
        group.workspace = held[0]
        return held[0]

    groups.workspace = workspace
    facts.agree = lambda pg, device, provider, lane_bytes: GroupFacts.simulated(WORLD, provider=provider,
                                                                                  lane_bytes=lane_bytes)

    class Resident(dict):  # every configuration fits once per SM
        def __contains__(self, key):
            return True

        def __getitem__(self, key):
            return 1

    class Compiled(set):  # every specialisation compiled already
        def __contains__(self, key):
            return True

    fused_all_reduce._resident = Resident()
    fused_all_gather._resident = Resident()
    fused_split_k._compiled = Compiled()

    class Kernel:  # what Triton's first launch of a specialisation returns: its launcher per grid
        packed_metadata = None

        def __getitem__(self, grid):
            return _launcher

    def run(self, *args, grid, warmup=False, **kwargs):  # Triton's launch: compile, then launch
        LAUNCHES[0] += 1
        return Kernel()

    JITFunction.run = run
    launch._device = lambda: 0
    launch._raw_stream = lambda device: 0
    common.matmul_into = lambda a, b, bias, out: None  # the GEMM (module docstring)
    reference.matmul = lambda a, b, bias, out=None: out
    groups.Group.side_streams = lambda self, device, count=3: (_Stream(),) * count
    torch.cuda.current_stream = lambda device=None: _Stream()
    torch.cuda.stream = lambda stream: _Nothing()
    return name


LAUNCHES = [0]


def _launcher(*values, stream):
    LAUNCHES[0] += 1


class _Stream:
    def wait_stream(self, other):
        pass

    def record_event(self, event=None):
        return None

    def wait_event(self, event):
        pass


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def make_call(case, group_name):
    """A function making one call of ``case`` through the op's CUDA kernel function."""
    import torch

    from commfuse.ops import library

    _, op, _, m, k, n = case
    dt = torch.bfloat16
    weight = torch.randn(n, k, dtype=dt)  # nn.Linear's, used transposed
    if op == "mm_all_reduce":
        a = torch.randn(m, k, dtype=dt)
        return lambda: library._mm_all_reduce_cuda(a, weight.t(), None, group_name)
    if op == "mm_reduce_scatter":
        a = torch.randn(m, k, dtype=dt)
        return lambda: library._mm_reduce_scatter_cuda(a, weight.t(), None, [m, n], 0, WORLD, group_name)
    shard = torch.randn(m // WORLD, k, dtype=dt)
    return lambda: library._all_gather_mm_cuda(shard, weight.t(), None, 0, WORLD, group_name, True)


def measure(case, group_name, calls: int, rounds: int, profile: bool) -> dict:
    from commfuse import env
    from commfuse.runtime import counters, entry

    name, op, path = case[:3]
    call = make_call(case, group_name)
    with env.override(algo=path, verify=False, ce_graphs=False):
        entry.forget()
        counters.PATHS.clear()
        for _ in range(5):
            call()
        ran = [k.split(":")[1] for k, v in counters.PATHS.items() if k.startswith(op + ":") and v]
        counters.PATHS.clear()
        launches = LAUNCHES[0]
        call()
        per_call_launches = LAUNCHES[0] - launches
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(calls):
                call()
            times.append((time.perf_counter() - start) / calls * 1e6)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(100):
            call()
        prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    record = {"case": name, "op": op, "path": path, "shape": list(case[3:]), "ran": ran,
              "launches_per_call": per_call_launches, "us_per_call": statistics.median(times),
              "us_rounds": times, "python_calls_per_call": stats.total_calls / 100}
    if profile:
        stats.sort_stats("cumulative").print_stats(45)
        record["profile"] = out.getvalue()
    return record


def parts(group_name: str, calls: int, rounds: int) -> dict:
    """The split-K case's parts, µs per call each (``commfuse.tools.host_parts``)."""
    import timeit

    import torch

    from commfuse import env
    from commfuse.ops import library
    from commfuse.runtime import entry
    from commfuse.tools.host_parts import split_k_parts

    _, _, path, m, k, n = next(c for c in CASES if c[0] == "ar_split_k")
    a = torch.randn(m, k, dtype=torch.bfloat16)
    b = torch.randn(n, k, dtype=torch.bfloat16).t()
    with env.override(algo=path, verify=False, ce_graphs=False):
        entry.forget()
        for _ in range(5):
            library._mm_all_reduce_cuda(a, b, None, group_name)
        return {name: min(timeit.repeat(fn, number=calls, repeat=rounds)) / calls * 1e6
                for name, fn in split_k_parts(group_name, a, b).items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000, help="back-to-back calls per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    p.add_argument("--profile", default="", help="comma-separated case names: print a cProfile of 100 calls")
    p.add_argument("--parts", action="store_true", help="also time the split-K case's parts alone "
                   "(commfuse.tools.host_parts)")
    p.add_argument("--label", default="")
    p.add_argument("--out", default="")
    args = p.parse_args()
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    import torch

    torch.set_num_threads(1)
    group_name = stand_ins()
    wanted = [c for c in args.cases.split(",") if c]
    profiled = [c for c in args.profile.split(",") if c]
    records = []
    for case in CASES:
        if wanted and case[0] not in wanted:
            continue
        rec = measure(case, group_name, args.calls, args.rounds, case[0] in profiled)
        rec["label"] = args.label
        records.append(rec)
        wrong = "" if rec["ran"] == [case[2]] else f"  NOTE: ran {rec['ran']}"
        print(f"{rec['case']:12} {rec['us_per_call']:7.1f} us/call  {rec['python_calls_per_call']:6.1f} "
              f"Python calls/call  {rec['launches_per_call']} launches{wrong}", flush=True)
        if "profile" in rec:
            print(rec["profile"])
    timed = parts(group_name, args.calls, args.rounds) if args.parts else None
    if timed:
        print("split-K parts, us per call: " + ", ".join(f"{k} {v:.1f}" for k, v in timed.items()), flush=True)
    if args.out:
        meta = {"commit": os.environ.get("COMMFUSE_COMMIT", ""), "torch": torch.__version__,
                "python": sys.version.split()[0], "label": args.label}
        try:
            import triton

            meta["triton"] = triton.__version__
        except ImportError:
            pass
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "records": records, "split_k_parts": timed}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
