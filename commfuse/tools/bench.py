"""``torchrun --nproc_per_node=N -m commfuse bench ops``: time commfuse's ops against the unfused
cuBLAS + NCCL computation and peers, in one run per shape.

For every shape it times (median of CUDA-event timings of back-to-back calls, max over ranks,
``tools/timing.py``): the unfused matmul + NCCL collective; commfuse's default (the rules' path)
and each path that supports the call forced (``commfuse.env.override(algo=...)``); the pieces
alone: cuBLAS mm, the NCCL collective, commfuse's exchange kernels on the group's workspace, and
for ``mm_all_reduce`` torch symmetric memory's one-shot and two-shot all-reduce; peers: torch's
own fused ops where they exist, Iris's ``matmul_all_reduce`` with ``--iris``. Unfused and
commfuse's default are timed twice more in alternating rounds, each the median of its three
timings, so clock drift between them does not pick the winner.

* ``unfused`` = cuBLAS + NCCL; ``best unfused`` = cuBLAS + the faster of NCCL and torch
  symmetric memory's one-/two-shot all-reduce (``mm_all_reduce``; the other ops: cuBLAS + NCCL);
* ``floor`` = max(mm alone, fastest exchange alone).

``--tuned``: per shape the rules' choice and the tuned choice (``runtime.tuning.Tuner`` run on the
group for the shape's signature, every candidate timed and checked, the answers kept in a
temporary cache unless ``--cache``), both timed in alternating rounds beside unfused.

Prints a markdown table (a progress line per shape on stderr) and writes
``benchmarks/results/<machine>/ops.json`` (``--out``). ``table``/``plot`` read such a file;
``model``, ``model-table`` and ``model-plot`` are the model benchmark's (``bench_model.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from commfuse import env

from .bench_model import MODEL_DEFAULTS
from .timing import commit, time_us

MM_AR_SHAPES = [(m, k, n) for m in (16, 128, 1024, 4096, 8192)
                for k, n in ((14336, 8192), (4096, 8192), (7168, 4096), (2048, 4096))]
AG_MM_SHAPES = [(1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (4096, 8192, 5120),
                (8192, 8192, 28672), (2048, 4096, 7168), (16384, 4096, 7168)]
OPS = ("mm_all_reduce", "all_gather_mm", "mm_reduce_scatter")
#: The FP8 ops timed through their specs (``bench_spec_shape``), each on its base op's shapes.
FP8_OPS = ("scaled_mm_all_reduce", "all_gather_scaled_mm", "scaled_mm_reduce_scatter",
           "rowwise_scaled_mm_all_reduce", "all_gather_rowwise_scaled_mm", "rowwise_scaled_mm_reduce_scatter")
#: The opt-in add + RMSNorm ops (``bench_norm_shape``): against their collective's op plus
#: Inductor's compiled add + norm, on their collective's shapes (hidden sizes the kernel holds).
NORM_OPS = ("mm_all_reduce_add_rms_norm", "mm_reduce_scatter_add_rms_norm")


def shapes_of(op: str, which: str = "default", limit: int = 0) -> list[tuple[int, int, int]]:
    """The benchmark's shapes of ``op`` (``square``: M=K=N from 256 to 4096 in steps of 128;
    the reduce-scatter mirrors the all-gather's), the first ``limit`` if given."""
    if which == "square":
        shapes = [(s, s, s) for s in range(256, 4097, 128)]
    else:
        shapes = MM_AR_SHAPES if op.endswith("mm_all_reduce") or op.startswith("mm_all_reduce") else AG_MM_SHAPES
        if op in NORM_OPS:
            shapes = [s for s in shapes if s[2] <= 8192]  # (the norm epilogue's largest row)
    return shapes[:limit] if limit else shapes


def _forced(algo: str | None):
    """The path ``algo`` forced for the block (``None``: the rules decide), as ``COMMFUSE_ALGO``
    would; plans kept under other settings are dropped on entry and exit."""
    return env.override(algo=algo)


def _rank0(text: str) -> None:
    if dist.get_rank() == 0:
        print(text, file=sys.stderr, flush=True)


def _try(fn):
    try:
        return time_us(fn)
    except Exception as exc:  # a peer that fails on this shape is reported, not fatal
        _rank0(f"    (peer failed: {type(exc).__name__}: {str(exc)[:120]})")
        torch.cuda.synchronize()
        return None


_iris = None


def _iris_peer(a, b):
    """Iris's own fused ``matmul_all_reduce`` on operands copied to its heap (``--iris``)."""
    global _iris
    try:
        if _iris is None:
            import iris  # optional: only with --iris

            _iris = iris.iris(env.current().iris_heap_bytes)
        ia = _iris.zeros(a.shape, dtype=a.dtype)
        ib = _iris.zeros(b.shape, dtype=b.dtype)
        ic = _iris.zeros((a.shape[0], b.shape[1]), dtype=a.dtype)
        ia.copy_(a)
        ib.copy_(b)
    except Exception as exc:
        _rank0(f"    (iris peer unavailable: {type(exc).__name__}: {str(exc)[:120]})")
        return None
    return _try(lambda: _iris.ops.matmul_all_reduce(ic, ia, ib))


#: Extra alternating rounds of unfused and commfuse's default per shape: their first timings are
#: seconds apart, and a GEMM-bound shape's clocks drift a few % in between (enough to show a shape
#: whose default is the unfused computation as 5% slower than itself).
SETTLE_ROUNDS = 2


def _settle(t: dict, runs: dict) -> None:
    """Re-time each of ``runs`` (key -> (function, forced path or None); ``t[key]`` holds its first
    time) in ``SETTLE_ROUNDS`` alternating rounds; each becomes the median of its timings (all
    kept in ``t[key + "_rounds"]``)."""
    rounds = {key: [t[key]] for key in runs}
    for _ in range(SETTLE_ROUNDS):
        for key, (fn, algo) in runs.items():
            with _forced(algo):
                rounds[key].append(time_us(fn))
    for key, times in rounds.items():
        t[f"{key}_rounds"] = times
        t[key] = statistics.median(times)


class Case:
    """One shape of one op on the WORLD group: its operands, its call, the group's run-time state
    and agreed facts, and the op call of commfuse and of the unfused computation."""

    def __init__(self, op: str, m: int, k: int, n: int, dtype: torch.dtype, group):
        from commfuse.runtime import groups
        from commfuse.runtime.paths.base import Call

        self.op, self.m, self.k, self.n, self.dtype, self.group = op, m, k, n, dtype, group
        self.gname, self.world = group.group_name, group.size()
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.state = groups.get(self.gname)
        self.facts = groups.group_facts(self.state, self.device, False)
        self.call = Call(op, m, k, n, dtype, self.world)
        self.b = torch.randn(k, n, device="cuda", dtype=dtype) / k ** 0.5
        if op == "all_gather_mm":
            self.shard = torch.randn(m // self.world, k, device="cuda", dtype=dtype)
            self.a = torch.randn(m, k, device="cuda", dtype=dtype)  # the gathered rows' size, for mm alone
        else:
            self.a = torch.randn(m, k, device="cuda", dtype=dtype)

    def commfuse(self):
        ops, g, w = torch.ops.commfuse, self.gname, self.world
        if self.op == "mm_all_reduce":
            return ops.mm_all_reduce(self.a, self.b, None, g)
        if self.op == "all_gather_mm":
            return ops.all_gather_mm(self.shard, self.b, None, 0, w, g, False)
        return ops.mm_reduce_scatter(self.a, self.b, None, [self.m, self.n], 0, w, g)

    def collective(self, x):
        if self.op == "mm_all_reduce":
            return funcol.all_reduce(x, "sum", self.group)
        if self.op == "all_gather_mm":
            return funcol.all_gather_tensor(x, 0, self.group)
        return funcol.reduce_scatter_tensor(x, "sum", 0, self.group)

    def unfused(self):
        if self.op == "all_gather_mm":
            return torch.mm(funcol.wait_tensor(self.collective(self.shard)), self.b)
        return funcol.wait_tensor(self.collective(torch.mm(self.a, self.b)))

    def paths(self) -> list[str]:
        """The symmetric paths that support the call on this group, in the registry's order."""
        from commfuse.runtime import policy

        return [p.name for p in policy.candidates(self.call, self.facts) if p.name != "nccl"]

    def rules(self) -> str:
        from commfuse.runtime import policy

        return policy.rules_choice(self.call, self.facts).name

    def workspace(self, nbytes: int):
        from commfuse.runtime import groups

        return groups.workspace(self.state, nbytes, self.device)


#: The timings of an exchange alone (NCCL's, commfuse's kernels', torch symmetric memory's) that the
#: floor takes the fastest of, those a shape has.
EXCHANGES_ALONE = ("nccl_ar", "nccl_ag", "nccl_rs", "one_shot_ar", "two_shot_ar", "symm_ag", "symm_rs",
                   "torch_symm_one_shot_ar", "torch_symm_two_shot_ar")


def _exchange_alone(t: dict, op: str, m: int, k: int, n: int, dtype, world: int, workspace) -> None:
    """commfuse's exchange kernels alone on the group's workspace (``workspace(nbytes)``), no
    matmul, on the exchanged tensor's ``dtype``: the all-reduce's one-shot and two-shot, the
    all-gather's pull, the reduce-scatter's pull (``op``: the base op of the one timed)."""
    from commfuse.kernels import exchange
    from commfuse.kernels.codes import OP_ALL_GATHER_MM, OP_MM_ALL_REDUCE, OP_MM_REDUCE_SCATTER

    if op == "mm_all_reduce":
        ws = workspace(m * n * dtype.itemsize)
        out = torch.empty(m, n, device="cuda", dtype=dtype)
        for algo in ("one_shot", "two_shot"):
            def exch(algo=algo):
                epoch, parity = ws.next_epoch()
                exchange.all_reduce(ws, ws.data(parity, (m, n), dtype), out, epoch, algo, OP_MM_ALL_REDUCE)
            t[f"{algo}_ar"] = time_us(exch)
    elif op == "all_gather_mm":
        rows = m // world
        ws = workspace(rows * k * dtype.itemsize)
        gathered = torch.empty(m, k, device="cuda", dtype=dtype)

        def exch():
            epoch, parity = ws.next_epoch()
            exchange.gather(ws, ws.data(parity, (rows, k), dtype), gathered, 1, rows * k, epoch, OP_ALL_GATHER_MM)
        t["symm_ag"] = time_us(exch)
    else:
        ws = workspace(m * n * dtype.itemsize)
        out = torch.empty(m // world, n, device="cuda", dtype=dtype)

        def exch():
            epoch, parity = ws.next_epoch()
            exchange.reduce_scatter(ws, ws.data(parity, (m, n), dtype), out, 1, m * n // world, epoch,
                                    OP_MM_REDUCE_SCATTER)
        t["symm_rs"] = time_us(exch)
    from commfuse.runtime import errors

    errors.check_errors()  # a timed-out wait above is an error here, not a fast time


def _torch_symm_all_reduce(case: Case, t: dict, peers: dict) -> None:
    """torch symmetric memory's one-shot and two-shot all-reduce, alone (into ``t``) and after
    cuBLAS (the unfused alternatives to NCCL, into ``peers``)."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        sbuf = symm_mem.empty((case.m, case.n), dtype=case.dtype, device="cuda")
        symm_mem.rendezvous(sbuf, case.gname)
        torch.mm(case.a, case.b, out=sbuf)
    except Exception as exc:
        _rank0(f"    (torch symmetric memory unavailable: {type(exc).__name__}: {str(exc)[:120]})")
        return
    g = case.gname
    one = lambda: torch.ops.symm_mem.one_shot_all_reduce(sbuf, "sum", g)  # noqa: E731
    two = lambda: torch.ops.symm_mem.two_shot_all_reduce_(sbuf, "sum", g)  # noqa: E731
    t["torch_symm_one_shot_ar"] = _try(one)
    t["torch_symm_two_shot_ar"] = _try(two)

    def mm_then(exchange):
        def run():
            torch.mm(case.a, case.b, out=sbuf)
            return exchange()
        return run
    peers["torch_symm_one_shot"] = _try(mm_then(one))
    peers["torch_symm_two_shot"] = _try(mm_then(two))


def bench_shape(op: str, m: int, k: int, n: int, dtype, group, iris: bool = False) -> dict:
    """Every timing of one shape of ``op`` (module docstring) as one record."""
    case = Case(op, m, k, n, dtype, group)
    t, peers = {}, {}
    if op == "all_gather_mm":
        t["mm"] = time_us(lambda: torch.mm(case.a, case.b))
        t["nccl_ag"] = time_us(lambda: funcol.wait_tensor(case.collective(case.shard)))
    else:
        t["mm"] = time_us(lambda: torch.mm(case.a, case.b))
        partial = torch.mm(case.a, case.b)
        t["nccl_ar" if op == "mm_all_reduce" else "nccl_rs"] = time_us(
            lambda: funcol.wait_tensor(case.collective(partial)))
    t["unfused"] = time_us(case.unfused)
    _exchange_alone(t, op, m, k, n, dtype, case.world, case.workspace)
    paths = case.paths()
    if op == "mm_all_reduce" and "fused" in paths:  # the tile kernels' GEMM alone, against cuBLAS's
        from commfuse.kernels import tiles
        from commfuse.runtime.paths import ar_fused

        out = torch.empty(m, n, device="cuda", dtype=dtype)
        cfg = ar_fused.tile_config(case.call, scatter=False)
        t["tile_mm"] = time_us(lambda: tiles.matmul(case.a, case.b, None, cfg, out=out,
                                                    programs=case.facts.sms))
    with _forced(None):
        t["commfuse_default"] = time_us(case.commfuse)
    for algo in paths:
        with _forced(algo):
            t[f"commfuse_{algo}"] = time_us(case.commfuse)
    if op == "mm_all_reduce":
        _torch_symm_all_reduce(case, t, peers)
        if iris:
            peers["iris_matmul_all_reduce"] = _iris_peer(case.a, case.b)
    elif op == "all_gather_mm":
        peers["torch_fused_all_gather_matmul"] = _try(
            lambda: torch.ops.symm_mem.fused_all_gather_matmul(case.shard, [case.b], 0, case.gname))
    else:
        peers["torch_fused_matmul_reduce_scatter"] = _try(
            lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(case.a, case.b, "sum", 0, case.gname))
    _settle(t, {"unfused": (case.unfused, None), "commfuse_default": (case.commfuse, None)})
    exchanges = [t[key] for key in EXCHANGES_ALONE if t.get(key)]
    for where, key in BEST_UNFUSED.get(op, ()):  # one not measured here is recorded as failed
        (peers if where == "peers" else t).setdefault(key, None)
    rec = dict(op=op, M=m, K=k, N=n, dtype=str(dtype).replace("torch.", ""), world=case.world,
               path=case.rules(), unfused_us=t["unfused"], commfuse_us=t["commfuse_default"],
               floor_us=max(t["mm"], min(exchanges)), parts=t, peers=peers)
    rec["best_unfused_us"] = best_unfused_us(rec) or t["unfused"]
    return rec


def bench_spec_shape(op: str, m: int, k: int, n: int, dtype, group, device: torch.device | None = None) -> dict:
    """One shape of an op timed through its spec (the FP8 ops): its synthetic operands
    (``OpSpec.inputs``: FP8 operands, unit scales), the unfused computation (its NCCL path: the
    graph's ``_scaled_mm``, then the functional collective), commfuse's default and each symmetric
    path forced, and the pieces alone: the product (``OpSpec.product``), the NCCL collective and
    commfuse's exchange kernel on the exchanged tensor (FP8 bytes for the gather). ``dtype``: the
    product's (the gather's shard is FP8)."""
    from commfuse.runtime import groups, policy, reference
    from commfuse.runtime.spec import SPECS, Call

    spec = SPECS[op]
    world, gname = group.size(), group.group_name
    device = device or torch.device("cuda", torch.cuda.current_device())
    gathers = spec.pattern == "all_gather_mm"
    call = Call(op, m, k, n, torch.float8_e4m3fn if gathers else dtype, world)
    gen = torch.Generator(device=device)
    gen.manual_seed(m + k + n)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen, device=device) / 4).to(call.dtype)

    args = spec.inputs(call, gname, rand)  # a reduced product's out_dtype is the call's dtype
    state = groups.get(gname)
    facts = groups.group_facts(state, device, False)
    fn = getattr(torch.ops.commfuse, op)
    t = {}
    rows = args.shard.reshape(-1, k) if gathers else args.a
    full = torch.cat([rows.view(torch.uint8)] * world).view(rows.dtype) if gathers else rows
    product = torch.empty(m, n, device=device, dtype=spec.product_dtype(args))
    t["mm"] = time_us(lambda: spec.product_into(args, full, product))
    if gathers:
        t["nccl_ag"] = time_us(lambda: reference.all_gather(args.shard, args.gather_dim, world, gname))
    elif spec.pattern == "mm_all_reduce":
        t["nccl_ar"] = time_us(lambda: reference.all_reduce(product, gname))
    else:
        t["nccl_rs"] = time_us(lambda: reference.reduce_scatter(product, list(args.shape), args.scatter_dim, world,
                                                                gname))
    t["unfused"] = time_us(lambda: spec.run_nccl(args))
    _exchange_alone(t, spec.pattern, m, k, n, call.dtype if gathers else product.dtype, world,
                    lambda nbytes: groups.workspace(state, nbytes, device))
    _time_paths(t, call, facts, fn, args, lambda: spec.run_nccl(args))
    exchanges = [t[key] for key in EXCHANGES_ALONE if t.get(key)]
    rec = dict(op=op, M=m, K=k, N=n, dtype=str(call.dtype).replace("torch.", ""), world=world,
               path=policy.rules_choice(call, facts).name, unfused_us=t["unfused"], commfuse_us=t["commfuse_default"],
               floor_us=max(t["mm"], min(exchanges)), parts=t, peers={})
    rec["best_unfused_us"] = t["unfused"]  # no unfused alternative to NCCL is timed for the FP8 ops
    return rec


def _time_paths(t: dict, call, facts, fn, args, unfused) -> None:
    """Into ``t``: the op ``fn(*args)`` by default and with each of its symmetric paths that
    can take ``call`` forced; then ``unfused`` and the default re-timed in alternating rounds."""
    from commfuse.runtime import policy

    with _forced(None):
        t["commfuse_default"] = time_us(lambda: fn(*args))
    for algo in [p.name for p in policy.candidates(call, facts) if p.name != "nccl"]:
        with _forced(algo):
            t[f"commfuse_{algo}"] = time_us(lambda: fn(*args))
    _settle(t, {"unfused": (unfused, None), "commfuse_default": (lambda: fn(*args), None)})


def _add_rms_norm(x, y, w, eps: float):
    """The unfused chain's second kernel, as the bundled model writes it (``LlamaRMSNorm``)."""
    h = x + y
    hf = h.float()
    return h, w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


_ADD_RMS_NORM = None


def bench_norm_shape(op: str, m: int, k: int, n: int, dtype, group, device: torch.device | None = None) -> dict:
    """One shape of an add + RMSNorm op: unfused is what the graph runs without the opt-in pattern,
    the collective's own commfuse op (its default path) then Inductor's compiled add + norm; the
    eager chain on NCCL beside it; commfuse's op by default and each symmetric path forced. The
    floor is the collective's op alone: the chain without its add + norm."""
    global _ADD_RMS_NORM
    from commfuse.runtime import groups, policy
    from commfuse.runtime.spec import SPECS, Call

    if _ADD_RMS_NORM is None:
        _ADD_RMS_NORM = torch.compile(_add_rms_norm, dynamic=False)
    spec = SPECS[op]
    world, gname = group.size(), group.group_name
    device = device or torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device)
    gen.manual_seed(m + k + n)
    call = Call(op, m, k, n, dtype, world)  # (a reduce-scatter's share: one block of rows)
    args = spec.inputs(call, gname, lambda *shape: (torch.randn(*shape, generator=gen, device=device) / 4).to(dtype))
    state = groups.get(gname)
    facts = groups.group_facts(state, device, False)
    fn = getattr(torch.ops.commfuse, op)
    if spec.cuts_rows:
        def collective():
            return torch.ops.commfuse.mm_reduce_scatter(args.a, args.b, args.bias, args.shape, args.scatter_dim, world,
                                                        gname)
    else:
        def collective():
            return torch.ops.commfuse.mm_all_reduce(args.a, args.b, args.bias, gname)

    def unfused():
        return _ADD_RMS_NORM(args.residual, collective().view(args.residual.shape), args.weight, args.eps)

    t = {"collective": time_us(collective), "unfused": time_us(unfused), "nccl_chain": time_us(lambda: spec.run_nccl(args))}
    _time_paths(t, call, facts, fn, args, unfused)
    rec = dict(op=op, M=m, K=k, N=n, dtype=str(dtype).replace("torch.", ""), world=world,
               path=policy.choose(call, facts, quiet=True).name, unfused_us=t["unfused"],
               commfuse_us=t["commfuse_default"], floor_us=t["collective"], parts=t, peers={})
    rec["best_unfused_us"] = min(t["unfused"], t["nccl_chain"])
    return rec


def bench_tuned(op: str, m: int, k: int, n: int, dtype, group, tuner) -> dict:
    """The rules' choice and the tuned choice of one shape, side by side: the tuner times every
    candidate of the shape's signature on this group and keeps its answer; then the two choices
    (forced) and unfused are timed in alternating rounds, each the median of its rounds."""
    from commfuse.runtime.tuning import Signature

    case = Case(op, m, k, n, dtype, group)
    began = time.perf_counter()
    entry = tuner.tune(Signature.of(case.call))
    spent = time.perf_counter() - began
    runs = {"unfused": (case.unfused, None), "rules": (case.commfuse, entry.rules),
            "tuned": (case.commfuse, entry.choice)}
    t = {}
    for key, (fn, algo) in runs.items():
        with _forced(algo):
            t[key] = time_us(fn)
    _settle(t, runs)
    return dict(op=op, M=m, K=k, N=n, dtype=str(dtype).replace("torch.", ""), world=case.world,
                rules=entry.rules, tuned=entry.choice, rules_us=t["rules"], tuned_us=t["tuned"],
                unfused_us=t["unfused"], tuning_s=spent, candidates_us=entry.times_us, failed=entry.failed,
                margin=entry.margin, parts=t)


def _geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


#: What every record of an ops file needs for the table.
_FIELDS = ("op", "M", "K", "N", "unfused_us", "commfuse_us", "floor_us", "peers", "parts")
#: The unfused alternatives to cuBLAS + NCCL per op: (where, key) of each, all after cuBLAS: torch
#: symmetric memory's one-/two-shot all-reduce and commfuse's own one-shot (its ``one_shot`` path
#: forced: the matmul, then the exchange). The other ops have none measured.
BEST_UNFUSED = {"mm_all_reduce": (("peers", "torch_symm_one_shot"), ("peers", "torch_symm_two_shot"),
                                  ("parts", "commfuse_one_shot"))}


def best_unfused_us(rec: dict) -> float | None:
    """The fastest unfused computation of a record: cuBLAS + NCCL or an alternative of
    ``BEST_UNFUSED`` (one measured as failed, ``None``, is left out); None for an op without
    alternatives. ``ValueError`` if the record lacks one of them: a file from before they were
    recorded cannot give the figure, and unfused alone would overstate the speed-up."""
    alternatives = BEST_UNFUSED.get(rec["op"])
    if alternatives is None:
        return None
    missing = [f"{where}.{key}" for where, key in alternatives if key not in rec[where]]
    if missing:
        raise ValueError(f"{_name(rec)} has no {', '.join(missing)}, which the best unfused needs: a file from "
                         "before those were timed (re-run bench ops)")
    return min([rec["unfused_us"]] + [rec[where][key] for where, key in alternatives if rec[where][key]])


def _name(rec: dict) -> str:
    return f"the record of {rec.get('op')} {rec.get('M')}x{rec.get('K')}x{rec.get('N')}"


def _checked(records) -> list[dict]:
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ValueError("not a list of bench ops records")
    for rec in records:
        missing = [f for f in _FIELDS if f not in rec]
        if missing:
            raise ValueError(f"{_name(rec)} has no {', '.join(missing)}: not a bench ops record")
    return records


def _table(records) -> str:
    if records and "tuned" in records[0]:
        return _tuned_table(records)
    records = _checked(records)
    lines = ["| op | M | K | N | path | unfused µs | best unfused µs | commfuse µs | floor µs | speed-up "
             "| vs best unfused | of floor | best peer | fastest |", "|---" * 14 + "|"]
    best_of = {id(r): best_unfused_us(r) for r in records}
    for r in records:
        peers = {k: v for k, v in r["peers"].items() if v}
        best = min(peers.items(), key=lambda kv: kv[1]) if peers else None
        best_s = f"{best[0]} {best[1]:.0f} ({r['unfused_us'] / best[1]:.2f}x)" if best else "-"
        fastest = min({"unfused": r["unfused_us"], "commfuse": r["commfuse_us"], **peers}.items(),
                      key=lambda kv: kv[1])[0]
        best_unfused = best_of[id(r)]
        vs_best = (f"{best_unfused:.0f} | " if best_unfused else "- | ",
                   f"{best_unfused / r['commfuse_us']:.2f}x" if best_unfused else "-")
        lines.append(f"| {r['op']} | {r['M']} | {r['K']} | {r['N']} | {r.get('path', '-')} | {r['unfused_us']:.0f} | "
                     f"{vs_best[0]}{r['commfuse_us']:.0f} | {r['floor_us']:.0f} | "
                     f"{r['unfused_us'] / r['commfuse_us']:.2f}x | {vs_best[1]} | "
                     f"{r['commfuse_us'] / r['floor_us']:.2f} | {best_s} | {fastest} |")
    for op in sorted({r["op"] for r in records}):
        rs = [r for r in records if r["op"] == op]
        ratios = [r["unfused_us"] / r["commfuse_us"] for r in rs]
        near = sum(r["commfuse_us"] / r["floor_us"] <= 1.2 for r in rs)
        over_best = ""
        if op in BEST_UNFUSED:
            best = [best_of[id(r)] / r["commfuse_us"] for r in rs]
            over_best = f"; over the best unfused {_geomean(best):.3f}x (min {min(best):.3f}x)"
        lines.append(f"\n{op}: geomean speed-up {_geomean(ratios):.3f}x over {len(ratios)} shapes, min "
                     f"{min(ratios):.3f}x, max {max(ratios):.3f}x{over_best}; "
                     f"{near} of {len(rs)} within 1.2x of the floor")
    return "\n".join(lines)


def _tuned_table(records) -> str:
    lines = ["| op | M | K | N | rules | µs | tuned | µs | tuned / rules | unfused µs | tuning s |",
             "|---" * 11 + "|"]
    for r in records:
        lines.append(f"| {r['op']} | {r['M']} | {r['K']} | {r['N']} | {r['rules']} | {r['rules_us']:.1f} | "
                     f"{r['tuned']} | {r['tuned_us']:.1f} | {r['tuned_us'] / r['rules_us']:.3f} | "
                     f"{r['unfused_us']:.0f} | {r['tuning_s']:.1f} |")
    changed = [r for r in records if r["tuned"] != r["rules"]]
    lines.append(f"\ntuned differs from the rules on {len(changed)} of {len(records)} shapes"
                 + (f"; geomean tuned / rules there {_geomean([r['tuned_us'] / r['rules_us'] for r in changed]):.3f}"
                    if changed else ""))
    return "\n".join(lines)


def plot(json_path: str, png_path: str) -> None:
    """Speed-up over unfused per shape (and the floor's bound), one bar group per op."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        records = json.load(f)
    ops = list(dict.fromkeys(r["op"] for r in records))
    fig, axes = plt.subplots(len(ops), 1, figsize=(12, 3.2 * len(ops)), squeeze=False)
    for ax, op in zip(axes[:, 0], ops):
        rs = [r for r in records if r["op"] == op]
        x = range(len(rs))
        ax.bar(x, [r["unfused_us"] / r["commfuse_us"] for r in rs], label="speed-up (unfused / commfuse)")
        ax.plot(x, [r["unfused_us"] / r["floor_us"] for r in rs], "k_", markersize=14, label="floor bound")
        ax.axhline(1.0, color="red", linewidth=0.8)
        ax.set_xticks(list(x), [f"{r['M']}x{r['K']}x{r['N']}" for r in rs], rotation=60, fontsize=7)
        ax.set_ylabel("speed-up")
        ax.set_title(f"{op} (world {rs[0]['world']}, {rs[0]['dtype']}, commit {rs[0].get('commit')})")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)


def table(json_path: str) -> str:
    """The markdown table of an ops file; ``ValueError`` for a file that is not JSON or whose
    records lack what the table shows (never a figure computed from less)."""
    with open(json_path) as f:
        try:
            records = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{json_path} is not JSON ({exc})") from None
    try:
        return _table(records)
    except ValueError as exc:
        raise ValueError(f"{json_path}: {exc}") from None


def _default(option: str) -> str:
    gpu, cpu = MODEL_DEFAULTS["cuda"][option], MODEL_DEFAULTS["cpu"][option]
    return f"default on GPUs {gpu}, on the CPU {cpu}"


def parser(prog: str = "python -m commfuse bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True, metavar="{ops,model,table,plot,model-table,model-plot}",
                           help="COMMAND --help describes each one's options")

    ops = sub.add_parser("ops", help="time the ops against unfused cuBLAS + NCCL (CUDA GPUs, under torchrun)",
                         description="Time commfuse's ops against the unfused cuBLAS + NCCL computation and peers, "
                         "one run per shape (CUDA GPUs, under torchrun --nproc_per_node=N). Prints a markdown table "
                         "and writes the records as JSON.")
    ops.add_argument("--ops", default=",".join(OPS), help=f"comma-separated ops to time (default: {','.join(OPS)}; "
                     f"also the FP8 ops {','.join(FP8_OPS)}, with FP8 operands and --dtype their product's, and "
                     f"the opt-in add + RMSNorm ops {','.join(NORM_OPS)})")
    ops.add_argument("--shapes", choices=["default", "square"], default="default",
                     help="default: each op's standard shapes (the README's table); square: M=K=N from 256 to "
                     "4096 in steps of 128")
    ops.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                     help="operand dtype (default bfloat16)")
    ops.add_argument("--limit", type=int, default=0, help="only the first N shapes per op (smoke runs; 0: all)")
    ops.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<machine>/ops.json, "
                     "ops_tuned.json with --tuned)")
    ops.add_argument("--iris", action="store_true", help="also Iris's own matmul_all_reduce on its heap")
    ops.add_argument("--tuned", action="store_true", help="per shape the rules' choice and the tuned choice (the "
                     "tuner run on the group), both timed, side by side")
    ops.add_argument("--cache", action="store_true", help="with --tuned: keep the tuned answers in this machine's "
                     "tuning cache (default: a temporary directory)")

    model = sub.add_parser("model", help="time a TP model per backend (under torchrun, GPUs or CPU ranks)",
                           description="Time the bundled Llama-style TP model per backend, in alternating rounds "
                           "(under torchrun --nproc_per_node=N; CUDA GPUs, or gloo ranks on the CPU, where the ops "
                           "run the unfused computation). Prints what it will run first, then a line per case. "
                           "Defaults differ on GPUs (the README's runs) and on the CPU (small sizes).")
    model.add_argument("--models", default=None, help="comma-separated TP splits: dtensor, sp (sequence-parallel), "
                       f"hooks (gpt-fast style), hf (transformers' LlamaForCausalLM); {_default('models')}")
    model.add_argument("--modes", default=None, help="comma-separated modes: prefill, decode, decode_cg (decode "
                       "under CUDA graphs, GPUs only), train, loss (loss curves against eager); "
                       f"{_default('modes')}")
    model.add_argument("--decode-batches", default=None, help=f"decode batch sizes; {_default('decode_batches')}")
    model.add_argument("--context", type=int, default=None,
                       help=f"KV-cache length decoding starts at; {_default('context')}")
    model.add_argument("--backends", default=None,
                       help="comma-separated: eager, inductor, inductor_mptp (Inductor's async TP), commfuse, "
                       "commfuse_norm (with the opt-in add_rms_norm pattern), "
                       "floor (collectives replaced by local stand-ins), also commfuse@PATH (a forced path) and "
                       f"commfuse@KEY=VALUE+... (settings, e.g. commfuse@MERGE_SUMS=0); {_default('backends')}")
    model.add_argument("--layers", type=int, default=None, help=f"decoder layers; {_default('layers')}")
    model.add_argument("--batch", type=int, default=None, help=f"prefill and training batch; {_default('batch')}")
    model.add_argument("--seq", type=int, default=None,
                       help=f"prefill and training sequence length; {_default('seq')}")
    model.add_argument("--iters", type=int, default=None,
                       help=f"timed steps per backend, split among the rounds; {_default('iters')}")
    model.add_argument("--rounds", type=int, default=None,
                       help=f"alternating rounds over the backends; {_default('rounds')}")
    model.add_argument("--loss-steps", type=int, default=50, help="training steps of the loss mode (default 50)")
    model.add_argument("--fp8", choices=["rowwise", "tensorwise", "weights"], default=None,
                       help="the bundled stack in an FP8 form (as explain --fp8): tensorwise or rowwise, torchao's "
                       "float8 training (needs torchao); weights: FP8 weights, inference, --models hooks")
    model.add_argument("--small", action="store_true",
                       help="small layer sizes (dim 256) on GPUs too (the CPU always uses them)")
    model.add_argument("--call-times", type=int, default=0, metavar="STEPS",
                       help="after the timed rounds, STEPS more commfuse steps with every commfuse call timed by "
                       "CUDA events, each call's median against the same call alone (GPUs; prefill and train)")
    model.add_argument("--out", default=None, help="JSON path for the records (default: none written)")

    table = sub.add_parser("table", help="an ops JSON file as a markdown table",
                           description="An ops JSON file (bench ops --out) as a markdown table with geomeans.")
    table.add_argument("ops_json", help="the file bench ops wrote")
    plot = sub.add_parser("plot", help="an ops JSON file as a PNG plot",
                          description="Speed-up over unfused per shape (and the floor's bound), one plot per op.")
    plot.add_argument("ops_json", help="the file bench ops wrote")
    plot.add_argument("out_png", help="the PNG to write")
    model_table = sub.add_parser("model-table", help="model JSON files as a markdown table",
                                 description="Model JSON files (bench model --out) as one markdown table.")
    model_table.add_argument("model_json", nargs="+", help="files bench model wrote (a later file's record of a "
                             "case wins)")
    model_plot = sub.add_parser("model-plot", help="model JSON files as a PNG plot",
                                description="Step time of commfuse and of the floor relative to Inductor's, per "
                                "model and mode.")
    model_plot.add_argument("model_json", nargs="+", help="files bench model wrote (a later file's record of a "
                            "case wins)")
    model_plot.add_argument("out_png", help="the PNG to write")
    return p


def main(argv=None, prog: str = "python -m commfuse bench") -> int:
    args = parser(prog).parse_args(argv)
    if args.what in ("ops", "model"):  # GPU and torchrun problems as one line, not a traceback
        from commfuse.demo import exit_unless_launched

        exit_unless_launched(f"{prog} {args.what}", f"-m commfuse bench {args.what}", gpus=args.what == "ops")
    if args.what == "model":
        from . import bench_model

        return bench_model.main(args)
    if args.what == "ops":
        return run_ops(args)
    try:
        if args.what == "plot":
            plot(args.ops_json, args.out_png)
        elif args.what == "model-table":
            from . import bench_model

            print(bench_model.table(args.model_json))
        elif args.what == "model-plot":
            from . import bench_model

            bench_model.plot(args.model_json, args.out_png)
        else:
            print(table(args.ops_json))
    except OSError as exc:  # a missing or unreadable file: one line
        raise SystemExit(f"commfuse bench {args.what}: {exc.strerror or exc}: {exc.filename}") from None
    except ValueError as exc:  # not JSON, or records without the fields the table needs
        raise SystemExit(f"commfuse bench {args.what}: {exc}") from None
    return 0


def _run_shapes(todo, dtype, group, tuner, iris: bool) -> list[dict]:
    records = []
    for i, (op, (m, k, n)) in enumerate(todo):
        start = time.time()
        if tuner is not None:
            rec = bench_tuned(op, m, k, n, dtype, group, tuner)
            line = (f"rules {rec['rules']} {rec['rules_us']:.1f} µs, tuned {rec['tuned']} {rec['tuned_us']:.1f} µs, "
                    f"unfused {rec['unfused_us']:.0f} µs")
        else:
            rec = (bench_spec_shape(op, m, k, n, dtype, group) if op in FP8_OPS
                   else bench_norm_shape(op, m, k, n, dtype, group) if op in NORM_OPS
                   else bench_shape(op, m, k, n, dtype, group, iris=iris))
            line = (f"unfused {rec['unfused_us']:.0f} µs, commfuse {rec['commfuse_us']:.0f} µs "
                    f"({rec['unfused_us'] / rec['commfuse_us']:.2f}x, {rec['path']}), floor {rec['floor_us']:.0f} µs")
        rec["commit"] = commit()
        rec["renamed"] = dict(env.ALGO_ALIASES)  # former path names -> the names these records use
        records.append(rec)
        _rank0(f"[{i + 1}/{len(todo)}] {op} {m}x{k}x{n}: {line} [{time.time() - start:.1f} s]")
    return records


def run_ops(args) -> int:
    import commfuse  # noqa: F401  (the ops)
    from commfuse.runtime import tuning

    from .timing import setup_ranks

    group, rank = setup_ranks()
    dtype = getattr(torch, args.dtype)
    todo = [(op, s) for op in args.ops.split(",") for s in shapes_of(op, args.shapes, args.limit)]
    unknown = sorted({op for op, _ in todo} - set(OPS) - set(FP8_OPS) - set(NORM_OPS))
    if unknown:
        raise SystemExit(f"{' '.join(unknown)}: not an op; choose from {', '.join(OPS + FP8_OPS + NORM_OPS)}")
    if args.tuned and any(op in FP8_OPS or op in NORM_OPS for op, _ in todo):
        raise SystemExit("--tuned times the three base ops only; leave the FP8 and norm ops out of --ops")
    with contextlib.ExitStack() as stack:
        tuner = None
        if args.tuned:
            from commfuse.runtime import groups

            if not args.cache:  # every rank reads an empty directory of its own: the group agrees on it
                tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="commfuse-bench-tuned-"))
                stack.enter_context(env.override(cache_dir=tmp))
            device = torch.device("cuda", torch.cuda.current_device())
            state = groups.get(group.group_name)
            tuner = tuning.Tuner(state, groups.group_facts(state, device, False), device)
        records = _run_shapes(todo, dtype, group, tuner, args.iris)
    if rank == 0:
        machine = f"h200x{dist.get_world_size()}" if "H200" in torch.cuda.get_device_name() else socket.gethostname()
        name = "ops_tuned.json" if args.tuned else "ops.json"
        out = args.out or os.path.join("benchmarks", "results", machine, name)
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(records, f, indent=1)
        print(_table(records))
        print(f"\nwrote {out}")
    from commfuse.demo import shutdown

    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
