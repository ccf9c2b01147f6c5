"""The tuner's mechanics on real kernels, on one GPU: a group of one rank whose candidates run anyway.

    python benchmarks/tune_one_gpu.py --out DIR

A group of one rank has nothing to exchange, so the run-time sends its calls to NCCL; this tool lets
every candidate path run there (each path's kernels and host work, checked against the unfused
result and timed as the tuner times them), tunes a few signatures of the DTensor model's calls and
writes the cache and a table under DIR. The choices are NOT valid for real groups: no link is
crossed (a remote store is a local one). The cache's key says so (``emulated``), so no real group
reads it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

SIGNATURES = [("mm_all_reduce", 16, 4096, 8192), ("mm_all_reduce", 128, 14336, 8192),
              ("mm_all_reduce", 1024, 4096, 8192), ("mm_all_reduce", 8192, 7168, 4096),
              ("all_gather_mm", 2048, 2048, 2048), ("mm_reduce_scatter", 2048, 2048, 2048)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the cache and the table")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("tune_one_gpu: needs a CUDA GPU", file=sys.stderr)
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    from commfuse import env
    from commfuse.runtime import groups, tuning
    from commfuse.runtime.facts import GroupFacts, local_facts
    from commfuse.runtime.paths.base import Call

    # one rank: the candidates' mechanics only (this tool's exception to "one rank runs NCCL")
    GroupFacts.unsupported = lambda self: None
    key = tuning.machine_key

    def emulated_key(facts):
        return {**key(facts), "emulated": "one rank on one GPU: no link crossed; not valid for real groups"}

    tuning.machine_key = emulated_key
    device = torch.device("cuda", 0)
    with env.override(cache_dir=args.out):
        group = groups.get(dist.group.WORLD.group_name)
        facts = local_facts(1, device)
        group.facts = facts  # (what the group's first call would have agreed)
        tuner = tuning.Tuner(group, facts, device)
        began = time.perf_counter()
        rows = []
        for op, m, k, n in SIGNATURES:
            sig = tuning.Signature.of(Call(op, m, k, n, torch.bfloat16, 1))
            entry = tuner.tune(sig)
            rows.append({"signature": sig.text(), **entry.as_json()})
        total = time.perf_counter() - began
    table = ["| signature | rules | tuned | candidates (µs) |", "|---|---|---|---|"]
    for row in rows:
        times = ", ".join(f"{k} {v}" for k, v in row["times_us"].items())
        table.append(f"| {row['signature']} | {row['rules']} | {row['choice']} | {times} |")
    print("\n".join(table))
    print(f"tuned {len(rows)} signatures in {total:.1f} s; cache: {tuner.path}")
    with open(os.path.join(args.out, "tune_one_gpu.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "emulated": True,
                   "seconds": total, "rows": rows, "cache": str(tuner.path)}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
