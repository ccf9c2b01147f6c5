"""Record the answers of the hand-written dispatch (``commfuse/kernels/dispatch.py``, which
``runtime/policy.py`` and the rules replaced) as a golden file. It imports that dispatch and its
workspace module (``commfuse.kernels.symm``), so it runs only on a checkout that still has them:
the golden file's header names the commit it was recorded at.

For every enumerated call it stores the path the dispatch picks, the per-parity workspace bytes
the planner functions (``*_workspace_bytes``) would ask for, and, for ``mm_all_reduce``, whether
the graph lane would run the split-K kernel (``dispatch.graph_split_k``) and with which config.
A refactor of the dispatch must reproduce every row. Default settings only: no ``COMMFUSE_*``
variable may be set. Run from anywhere (CPU only, no GPU needed):

    python tests/data/record_dispatch.py

It writes ``tests/data/dispatch_golden.json`` next to itself and prints summary counts. Layout
(kept near 2 MB): one row per (op, m, k, n, dtype, world) holding the answers of all its calls
(the variants of lane_bytes / capture, or dim / slabs / capture) and the planners' bytes; the
header's "layout" says how, and ``calls(doc)`` expands a loaded document into one tuple per call.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import pathlib
import shlex
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's commfuse, whatever the working directory

SET = sorted(k for k in os.environ if k.startswith("COMMFUSE_"))
assert not SET, f"default settings only: unset {SET}"

import torch  # noqa: E402
import triton  # noqa: E402

import commfuse  # noqa: E402
from commfuse.kernels import dispatch, symm, tiles  # noqa: E402

assert pathlib.Path(commfuse.__file__).resolve().is_relative_to(ROOT), commfuse.__file__

OUT = HERE / "dispatch_golden.json"

ROWS = (1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129, 255, 256, 257, 511,
        512, 513, 1000, 1023, 1024, 1025, 1536, 2047, 2048, 2049, 3072, 4095, 4096, 4097, 6144,
        8191, 8192, 8193, 12288, 16383, 16384, 16385, 24576, 32768)
# (K, N): the ops benchmark's shapes (commfuse/tools/bench.py), then odd ones; every op takes them all.
KN = ((14336, 8192), (4096, 8192), (7168, 4096), (2048, 4096),  # MM_AR_SHAPES
      (1024, 1024), (2048, 2048), (4096, 4096), (8192, 5120), (8192, 28672), (4096, 7168),  # AG_MM_SHAPES
      (1000, 3000), (4100, 8190), (33, 17), (16384, 16384), (14336, 4096), (128, 128), (3, 5),
      (4096, 16384))
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
WORLDS = (2, 4, 8)
LANE_BYTES = (0, symm.graph_data_bytes())  # 0: no captured call yet; else the lane's default size
# (rows_dim, slabs) as cuda_paths derives them (dispatch.rows_dim / row_slabs): (0, 1) a collective
# along the rows; (1, 0) along another dimension with unknown or more than MAX_ROW_SLABS slabs;
# (1, 2), (1, 4) a batch of 2 or 4 sequences gathered / scattered along the sequence.
DIM_SLABS = ((0, 1), (1, 0), (1, 2), (1, 4))
# capture rows of all_gather_mm / mm_reduce_scatter (always NCCL today): a subset
CAPTURE_SUBSET = {"world": 2, "dtype": "bf16", "dim_slabs": (0, 1)}

#: The H200's SM count: the graph lane's ``max_programs`` (min(SMs, symm.GRAPH_SLOTS)).
SMS = 132

OPS = {"ar": "mm_all_reduce", "ag": "all_gather_mm", "rs": "mm_reduce_scatter"}
#: One row per (op, shape, dtype, world); each of its calls (a variant of the remaining inputs)
#: has its answer at the same index of the row's "answers" list. "workspace_bytes" holds the
#: planner's answer for each of PLANS[op] (the planners take no lane, capture or slabs: one call
#: for mm_all_reduce, one per dim for the others); a non-capture call's planned bytes are those of
#: the plan with its dim (``calls`` below pairs them).
VARIANT_FIELDS = {"ar": ["lane_bytes", "capture"], "ag": ["dim", "slabs", "capture"],
                  "rs": ["dim", "slabs", "capture"]}
VARIANTS = {"ar": [[lane_bytes, capture] for capture in (False, True) for lane_bytes in LANE_BYTES],
            "ag": [[dim, slabs, False] for dim, slabs in DIM_SLABS] + [[0, 1, True]]}
VARIANTS["rs"] = VARIANTS["ag"]
PLAN_FIELDS = {"ar": [], "ag": ["dim"], "rs": ["dim"]}
PLANS = {"ar": [[]], "ag": [[0], [1]], "rs": [[0], [1]]}
PLANNERS = {"ar": dispatch.all_reduce_workspace_bytes, "ag": dispatch.gather_workspace_bytes,
            "rs": dispatch.scatter_workspace_bytes}
FIELDS = ["op", "m", "k", "n", "dtype", "world", "answers", "workspace_bytes", "graph_split_k",
          "graph_split_k_config"]


def lane(world: int) -> symm.GraphLane:
    """A stand-in graph lane (CPU buffer, the real layout and properties): what
    ``fused_split_k.misfit`` reads (world, flags, tile_counters, data_bytes) is as on a device."""
    data = symm.graph_data_bytes()
    return symm.GraphLane("golden", 0, world, torch.zeros(symm.GRAPH_FLAG_BYTES + 2 * data, dtype=torch.uint8),
                          torch.zeros(world, dtype=torch.int64), data, min(SMS, symm.GRAPH_SLOTS))


def call(fn, *args):
    """fn(*args), or the exception it raised as {"error": type, "message": text}."""
    try:
        return fn(*args)
    except Exception as exc:  # recorded, never skipped
        return {"error": type(exc).__name__, "message": str(exc)}


class Capturing:
    """Make ``dispatch.capturing()`` answer True (it reads torch.cuda), restored after."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        self.saved = dispatch.capturing
        if self.on:
            dispatch.capturing = lambda: True

    def __exit__(self, *exc):
        dispatch.capturing = self.saved


def split_rows(world: int) -> list[int]:
    """Rows of a gather / scatter call (all ranks): each of ROWS rounded up to a multiple of
    ``world``, and each of ROWS as a shard (times ``world``) up to 32768 rows."""
    rows = {-(-m // world) * world for m in ROWS} | {s * world for s in ROWS if s * world <= 32768}
    return sorted(rows)


DISPATCH = {"ar": dispatch.mm_all_reduce, "ag": dispatch.all_gather_mm, "rs": dispatch.mm_reduce_scatter}


def answer(op, m, k, n, dtype, world, variant):
    """The path one call takes (``variant``: its inputs past world, capture last)."""
    with Capturing(variant[-1]):
        return call(DISPATCH[op], m, k, n, dtype, world, *variant[:-1])


def record() -> list[list]:
    rows = []
    lanes = {w: lane(w) for w in WORLDS}
    for world in WORLDS:
        for name, dtype in DTYPES.items():
            for k, n in KN:
                for op in OPS:
                    for m in ROWS if op == "ar" else split_rows(world):
                        paths = [answer(op, m, k, n, dtype, world, v) for v in VARIANTS[op]]
                        plans = [call(PLANNERS[op], m, k, n, dtype, world, *p) for p in PLANS[op]]
                        gsk = gsk_cfg = None
                        if op == "ar":  # shape and lane only: the same for every variant
                            cfg = call(dispatch.graph_split_k, m, k, n, dtype, lanes[world])
                            gsk, gsk_cfg = (cfg, cfg) if isinstance(cfg, dict) else (
                                cfg is not None, None if cfg is None else str(cfg))
                        rows.append([op, m, k, n, name, world, paths, plans, gsk, gsk_cfg])
    return rows


def calls(doc: dict):
    """Each recorded call of a loaded golden document: (op name, m, k, n, dtype name, world,
    {variant field: value}, answer, workspace_bytes or None, graph_split_k, graph_split_k_config)."""
    for op, m, k, n, dtype, world, answers, plans, gsk, gsk_cfg in doc["rows"]:
        planned = {tuple(p): b for p, b in zip(doc["plans"][op], plans)}
        for variant, path in zip(doc["variants"][op], answers):
            inputs = dict(zip(doc["variant_fields"][op], variant))
            plan = None if inputs["capture"] else planned[tuple(inputs[f] for f in doc["plan_fields"][op])]
            yield doc["ops"][op], m, k, n, dtype, world, inputs, path, plan, gsk, gsk_cfg


def git(*args) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()


ASSUMPTIONS = (
    "Today's dispatch decides from (op, shape, dtype, world, rows_dim, slabs, lane_bytes, capture) alone "
    "and assumes implicitly: every rank of the group is on one host with peer access to every other "
    "(symmetric memory, NVLink-class links); symmetric memory from torch's provider "
    "(COMMFUSE_SYMM_PROVIDER unset = 'torch'; the dispatch does not read it); TMA available: "
    "tiles.TensorDescriptor is importable (triton.tools.tensor_descriptor on this machine), otherwise "
    "fused_unsupported refuses every tile kernel (fused, split_k) and those rows would differ; an "
    "sm_90-class device (H200) whose SM count (132) is the graph lane's max_programs "
    "(min(SMs, symm.GRAPH_SLOTS)) used by graph_split_k; the graph lane's data is "
    "symm.graph_data_bytes() = 4 MiB per parity; the workspace header constants of symm.py "
    "(TILE_FLAG_SLOTS, COUNTER_BYTES, FLAG_BYTES, BASES_BYTES) bound the fused and split-K kernels; "
    "all ranks have the same GPU and agree on shapes (cuda_paths sends disagreeing own sizes to NCCL "
    "before the dispatch). Capture is simulated by replacing dispatch.capturing with a function "
    "returning True. The graph lane for graph_split_k is a symm.GraphLane on a CPU buffer of the real "
    "layout (world ranks, 4 MiB per parity, 132 programs). m is the call's rows: for all_gather_mm the "
    "gathered rows (shard rows * world), for mm_reduce_scatter the product's rows (a multiple of "
    "world); dim/slabs are the rows_dim and row_slabs cuda_paths passes. workspace_bytes is "
    "dispatch.all_reduce_workspace_bytes / gather_workspace_bytes(dim) / scatter_workspace_bytes(dim) "
    "(which call the dispatch with lane 0, no capture and, for gather/scatter, slabs 0), recorded on "
    "non-capture calls only. graph_split_k is per shape (the lane's world, 132 programs, 4 MiB): it "
    "does not depend on lane_bytes or capture; cuda_paths consults it only for calls whose answer is "
    "'graph' (and whose output fits the lane). A value {error, message} is an exception that call raised.")


def main() -> None:
    rows = record()
    head = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--", "commfuse")
    doc = {
        "recorded_at_commit": head,
        "commfuse_tree_clean": not dirty,
        "command": f"cd {shlex.quote(str(ROOT))} && /work/venv/bin/python tests/data/record_dispatch.py",
        "script": "tests/data/record_dispatch.py",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "tensor_descriptor": tiles.TensorDescriptor is not None,
        "assumptions": ASSUMPTIONS,
        "ops": OPS,
        "dtypes": {k: str(v) for k, v in DTYPES.items()},
        "fields": FIELDS,
        "layout": ("one row per (op, m, k, n, dtype, world); 'answers'[i] is the path of the call whose "
                   "remaining inputs are variants[op][i] (named by variant_fields[op]): calls = rows x "
                   "variants; 'workspace_bytes'[j] is the op's planner (all_reduce_workspace_bytes, "
                   "gather_workspace_bytes, scatter_workspace_bytes) called with plans[op][j] (named by "
                   "plan_fields[op]; the planners take no lane_bytes, capture or slabs), i.e. the bytes "
                   "planned for every non-capture call with that dim; graph_split_k (bool) and "
                   "graph_split_k_config (str or null): mm_all_reduce rows only, null elsewhere. "
                   "record_dispatch.calls(doc) expands rows into calls"),
        "variant_fields": VARIANT_FIELDS,
        "variants": VARIANTS,
        "plan_fields": PLAN_FIELDS,
        "plans": PLANS,
        "calls": sum(len(VARIANTS[r[0]]) for r in rows),
        "rows": rows,
    }
    with open(OUT, "w") as f:
        f.write("{\n")
        items = list(doc.items())
        for key, value in items[:-1]:
            f.write(f"{json.dumps(key)}: {json.dumps(value)},\n")
        f.write('"rows": [\n')
        f.write(",\n".join(json.dumps(r, separators=(",", ":")) for r in rows))
        f.write("\n]\n}\n")
    summarize(doc)
    print(f"wrote {len(rows)} rows, {OUT.stat().st_size} bytes to {OUT}")


def label(answer) -> str:
    return answer if isinstance(answer, str) else f"error:{answer['error']}"


def summarize(doc: dict) -> None:
    def show(title, counter):
        print(title + ": " + ", ".join(f"{k}={v}" for k, v in sorted(counter.items(), key=str)))

    every = list(calls(doc))
    print(f"{len(doc['rows'])} rows (shapes), {len(every)} calls")
    show("calls per op", collections.Counter(c[0] for c in every))
    show("calls per world", collections.Counter(c[5] for c in every))
    show("calls per answer", collections.Counter(label(c[7]) for c in every))
    for op in OPS.values():
        show(f"  {op}", collections.Counter(label(c[7]) for c in every if c[0] == op))
        for capture in (False, True):
            for world in WORLDS:
                show(f"    world {world} capture {int(capture)}", collections.Counter(
                    label(c[7]) for c in every if c[0] == op and c[5] == world and c[6]["capture"] == capture))
    show("mm_all_reduce shapes by graph_split_k",
         collections.Counter(str(r[8]) for r in doc["rows"] if r[0] == "ar"))
    errors = [c for c in every if any(isinstance(v, dict) for v in (c[7], c[8], c[9]))]
    print(f"calls with an exception: {len(errors)}")


if __name__ == "__main__":
    logging.disable(logging.WARNING)  # the dispatch's once-per-reason fallback warnings
    main()
