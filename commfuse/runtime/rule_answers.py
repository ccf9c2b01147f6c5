"""What the shipped rules answer, for a fixed grid of calls: the snapshot a test compares with.

A new sweep that regenerates a table (``benchmarks/path_sweep.py --rules``) changes answers on
purpose; regenerate the snapshot beside it, and the change shows as a data diff, not as tests
to rewrite::

    python -m commfuse.runtime.rule_answers          # writes rules/answers/shipped.json

Each answer is the path ``policy.choose`` picks (with its configuration where the graph lane
runs the split-K kernel) and the workspace the graph pass plans, for every op over a grid of
sizes, dtypes, world sizes, row layouts and the capture state, on the GPUs the tables name
(an H200 group; a B200 group for the default table). Imports no Triton.
"""

from __future__ import annotations

import json
import pathlib
import sys

import torch

from . import policy
from .facts import GroupFacts
from .spec import SPECS, Call

ANSWERS = pathlib.Path(__file__).resolve().parent / "rules" / "answers" / "shipped.json"

#: The groups whose tables are snapshotted: (label, facts of a group of ``world`` ranks).
GPUS = {"H200": lambda world: GroupFacts.simulated(world),
        "B200": lambda world: GroupFacts.simulated(world, arch="sm_100", name="NVIDIA B200", sms=148)}
WORLDS = (2, 4, 8)
MS = (1, 16, 64, 128, 256, 1024, 4096, 8192, 16384, 32768)
KNS = ((4096, 4096), (4096, 14336), (14336, 4096), (1024, 1024))
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
#: The FP8 gathers' calls carry the gathered shard's dtype.
FP8_SHARD = {"fp8": torch.float8_e4m3fn}
#: Row layouts of the gathered / scattered ops: (rows_dim, slabs).
LAYOUTS = ((0, 1), (1, 2))


def _calls():
    for spec in SPECS.values():
        dtypes = FP8_SHARD if spec.name.startswith("all_gather") and "scaled" in spec.name else DTYPES
        for world in WORLDS:
            for dtype in dtypes.values():
                for m in MS:
                    for k, n in KNS:
                        for dim, slabs in LAYOUTS if spec.cuts_rows else ((0, 1),):
                            if spec.cuts_rows and m % (world * slabs):
                                continue
                            yield Call(spec.name, m, k, n, dtype, world, rows_dim=dim, slabs=slabs)


def _answer(call: Call, facts: GroupFacts, capturing: bool) -> str:
    decision = policy.choose(call, facts, capturing=capturing, quiet=True)
    config = decision.path.config(call, facts, decision.variant) if decision.name == "graph" else None
    planned = policy.workspace_bytes(call, facts) if not capturing else 0
    return f"{decision.name}{f' {config}' if config is not None else ''} {planned}"


def answers() -> dict[str, str]:
    """``{"<gpu> <call> [capture]": "<path> [<config>] <planned bytes>"}`` over the grid."""
    out = {}
    for gpu, facts_of in GPUS.items():
        for call in _calls():
            facts = facts_of(call.world)
            out[f"{gpu} {call.short()}"] = _answer(call, facts, False)
            if call.spec.graph_lane:
                out[f"{gpu} {call.short()} capture"] = _answer(call, facts, True)
    return out


def main(argv: list[str]) -> int:
    path = pathlib.Path(argv[0]) if argv else ANSWERS
    path.parent.mkdir(parents=True, exist_ok=True)
    data = answers()
    path.write_text(json.dumps(data, indent=0, sort_keys=True) + "\n")
    print(f"{len(data)} answers written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
