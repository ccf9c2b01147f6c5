"""Which path wins per shape, with run-to-run noise measured, and the rules table that follows.

For every shape of the chosen ops, the candidates are the paths the policy would consider on this
group (``runtime.policy.candidates(call, facts)``: NCCL and every symmetric path whose ``supports``
takes the call), each at its default configuration and, where it has one, at the configurations of
the sweep (``--tilings`` of the tile kernels, ``--chunks`` of the copy-engine all-reduce,
``--rs-chunks`` of the copy-engine reduce-scatter, ``--splits`` of the split-K kernel, the
all-gather kernel's ``--pushers`` and copy-engine ``--ag-ce-chunks``), handed to the path as its
``Context(call, facts, group, config)``. Each is run directly (no plan, no policy), checked once
against an fp32 reference on fresh data with its output's memory NaN-poisoned first (and, for the
all-reduce, every rank's output bit-equal), then timed in interleaved rounds (round r times every
candidate once, beside unfused cuBLAS + NCCL and commfuse's default through the op), so drift of
clocks or of the NVLink state hits all alike. Prints per candidate the median and spread of its
rounds. Under torchrun:

    torchrun --nproc_per_node=2 benchmarks/path_sweep.py [--ops ar,ag,rs] [--rounds 5] [--out F]
        [--rules RULES.json]

``--rules RULES.json`` (with ``--out``) turns the winners into a rules table of this GPU's
architecture in the ``runtime/rules/<arch>.json`` format: per op, one rule per shape naming the
winning path (a winning configuration other than the path's default is said in the rule's note:
rules choose paths, the paths their configurations), each rule's evidence the sweep's output file
at this commit, ending with NCCL; ops the sweep did not time (``mm_all_reduce@capture``, an op
left out) are carried over from the current table. Review it, generalise the conditions, then
copy it over ``commfuse/runtime/rules/<arch>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

OPS = {"ar": "mm_all_reduce", "ag": "all_gather_mm", "rs": "mm_reduce_scatter"}
#: Tilings the tile kernels are also timed with, besides their default.
TILINGS = "128x128x64s4w8g8r0o1,64x128x64s4w4g8r0o1"
#: A candidate counts as correct within this relative error against fp32 (bf16 products, fp32 sums).
TOLERANCE = 2e-2


def variants(path, call, facts, args) -> dict:
    """Name -> configuration of each way the sweep runs ``path`` on ``call``: its default
    (``path.config``; None for NCCL) and the sweep's configurations of it."""
    from commfuse.kernels import fused_split_k
    from commfuse.kernels.tiles import TileConfig
    from commfuse.runtime.paths import ar_ce_overlap, rs_ce_overlap, ag_fused, ar_fused

    default = path.config(call, facts, None) if path.symmetric else None
    out = {path.name: default}
    tilings = [TileConfig.parse(t) for t in args.tilings.split(",") if t]
    key = (path.op, path.name)
    if key in (("mm_all_reduce", "fused"), ("mm_reduce_scatter", "fused")):
        for tile in tilings:
            out[f"{path.name}@{tile}"] = ar_fused.FusedConfig(tile, default.options)
    elif key == ("mm_all_reduce", "ce_overlap"):
        for chunks in _ints(args.chunks):
            out[f"{path.name}@chunks{chunks}"] = ar_ce_overlap.CeConfig(ar_ce_overlap.chunk_rows(call.m, chunks),
                                                                        default.graphs)
    elif key == ("mm_all_reduce", "split_k"):
        for split in _ints(args.splits):
            out[f"{path.name}@split{split}"] = fused_split_k.config(call.m, call.k, call.n, facts.sms, split=split)
    elif key == ("mm_reduce_scatter", "ce_overlap"):
        rows = call.m // call.world // max(call.slabs, 1)
        for chunks in _ints(args.rs_chunks):
            out[f"{path.name}@chunks{chunks}"] = rs_ce_overlap.RsOverlapConfig(
                rs_ce_overlap.chunks(rows, call.world, max(call.slabs, 1), chunks))
    elif key == ("all_gather_mm", "fused"):
        for pushers in _ints(args.pushers):
            out[f"{path.name}@sm{pushers}"] = ag_fused.AgFusedConfig(default.tile, "sm", pushers)
        for chunks in _ints(args.ag_ce_chunks):
            out[f"{path.name}@ce{chunks}"] = ag_fused.AgFusedConfig(default.tile, "ce", ce_chunks=chunks)
        for tile in tilings:
            out[f"{path.name}@{tile}"] = ag_fused.AgFusedConfig(tile, default.push, default.pushers,
                                                                       default.ce_chunks)
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


class Problem:
    """One shape of one op on the WORLD group: the call, fresh operands on demand, the op's
    arguments, the fp32 reference of given operands, and unfused cuBLAS + NCCL."""

    def __init__(self, op: str, m: int, k: int, n: int, group, batch: int = 1):
        from commfuse.runtime.paths.base import Call, row_slabs, rows_dim

        self.op, self.m, self.k, self.n, self.group = op, m, k, n, group
        self.world, self.rank, self.gname = group.size(), dist.get_rank(), group.group_name
        self.dim = 1 if batch > 1 and op != "mm_all_reduce" else 0
        self.batch = batch if self.dim else 1
        dt = torch.bfloat16
        if op == "all_gather_mm":
            self.shape = [self.batch, m // self.world // self.batch, k] if self.dim else [m // self.world, k]
            rd = rows_dim(self.shape, self.dim)
        elif op == "mm_reduce_scatter":
            self.shape = [self.batch, m // self.batch, n] if self.dim else [m, n]
            rd = rows_dim(self.shape, self.dim)
        else:
            self.shape, rd = [m, k], 0
        self.call = Call(op, m, k, n, dt, self.world, False, rd, row_slabs(self.shape, rd) if rd else 1)
        torch.manual_seed(99)  # the same weight on every rank: a linear layer's W.t()
        self.b = (torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5).t()
        self.operand = self.fresh()

    def fresh(self) -> torch.Tensor:
        """New data of the call's first operand, different on every rank."""
        rows = self.shape if self.op == "all_gather_mm" else [self.m, self.k]
        return torch.randn(*rows, device="cuda", dtype=torch.bfloat16)

    def args(self, x: torch.Tensor):
        from commfuse.runtime.paths.base import AllGatherMmArgs, MmAllReduceArgs, MmReduceScatterArgs

        if self.op == "mm_all_reduce":
            return MmAllReduceArgs(x, self.b, None, self.gname)
        if self.op == "all_gather_mm":
            return AllGatherMmArgs(x, self.b, None, self.dim, self.world, self.gname, False)
        return MmReduceScatterArgs(x, self.b, None, self.shape, self.dim, self.world, self.gname)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 result of the unfused computation on ``x``, in the op's output layout (rows x N)."""
        if self.op == "all_gather_mm":
            parts = [torch.empty_like(x) for _ in range(self.world)]
            dist.all_gather(parts, x, group=self.group)
            return torch.cat(parts, self.dim).reshape(-1, self.k).float() @ self.b.float()
        ref = x.float() @ self.b.float()
        dist.all_reduce(ref, group=self.group)
        if self.op == "mm_reduce_scatter":
            ref = ref.view(self.shape).chunk(self.world, self.dim)[self.rank].reshape(-1, self.n)
        return ref

    def default(self):
        ops, x = torch.ops.commfuse, self.operand
        if self.op == "mm_all_reduce":
            return ops.mm_all_reduce(x, self.b, None, self.gname)
        if self.op == "all_gather_mm":
            return ops.all_gather_mm(x, self.b, None, self.dim, self.world, self.gname, False)[0]
        return ops.mm_reduce_scatter(x, self.b, None, self.shape, self.dim, self.world, self.gname)

    def unfused(self):
        x = self.operand
        if self.op == "all_gather_mm":
            gathered = funcol.wait_tensor(funcol.all_gather_tensor(x, 0, self.group))
            if self.dim:  # funcol gathers along dim 0
                gathered = torch.cat(gathered.chunk(self.world), self.dim)
            return torch.mm(gathered.reshape(-1, self.k), self.b)
        if self.op == "mm_all_reduce":
            return funcol.wait_tensor(funcol.all_reduce(torch.mm(x, self.b), "sum", self.group))
        return funcol.wait_tensor(funcol.reduce_scatter_tensor(torch.mm(x, self.b).view(self.shape), "sum",
                                                               self.dim, self.group))


def _output(result) -> torch.Tensor:
    return result[0] if isinstance(result, tuple) else result


def check(problem: Problem, run) -> float:
    """Relative error of ``run(args)`` against fp32 on fresh data, its output's memory poisoned
    with NaN first (the caching allocator hands the freed block to the candidate's output);
    ``inf`` if the all-reduce's ranks disagree in any bit."""
    from commfuse.runtime import errors

    x = problem.fresh()
    ref = problem.reference(x)
    poison = torch.full((2 * ref.numel(),), float("nan"), device="cuda", dtype=torch.bfloat16)
    del poison
    out = _output(run(problem.args(x)))
    torch.cuda.synchronize()
    errors.check_errors()
    err = ((out.float().reshape(ref.shape) - ref).norm() / ref.norm()).item()
    if problem.op == "mm_all_reduce":
        same = out.clone()
        dist.broadcast(same, 0, group=problem.group)
        if not torch.equal(same, out):
            return float("inf")
    return err


def sweep_shape(problem: Problem, facts, state, args, only) -> dict:
    """Check every candidate of one shape, then time the correct ones in interleaved rounds."""
    from commfuse.runtime import policy, running
    from commfuse.runtime.paths.base import Context

    from commfuse.tools.timing import time_us

    runs, errs = {"unfused": problem.unfused, "default": problem.default}, {}
    for path in policy.candidates(problem.call, facts):
        for name, config in variants(path, problem.call, facts, args).items():
            if only is not None and name not in only:
                continue
            ctx = Context(problem.call, facts, state, config)

            def run(a, path=path, ctx=ctx):
                return running.run(path, ctx, a)
            try:
                errs[name] = check(problem, run)
            except Exception as exc:  # a configuration that does not fit the call: recorded
                errs[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
                torch.cuda.synchronize()
                continue
            if errs[name] <= TOLERANCE:
                args_ = problem.args(problem.operand)
                runs[name] = (lambda run=run, a=args_: run(a))
    times = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            times[name].append(time_us(fn))
    med = {name: statistics.median(v) for name, v in times.items()}
    rules = policy.rules_choice(problem.call, facts).name
    return dict(op=problem.op, M=problem.m, K=problem.k, N=problem.n, batch=problem.batch,
                rows_dim=problem.call.rows_dim, rules=rules, times=times, median=med, errors=errs)


def winner(rec: dict) -> tuple[str, float] | None:
    """The fastest correct candidate of a sweep record (not ``unfused`` nor ``default``, which
    are an op call), or None."""
    ok = {name: t for name, t in rec["median"].items() if name not in ("unfused", "default")}
    return min(ok.items(), key=lambda kv: kv[1]) if ok else None


def _rule_data(rule) -> dict:
    """A parsed rule (``runtime.rules.Rule``) as the data it was read from."""
    data = {"path": rule.path}
    if rule.when:
        data["when"] = {name: list(bound) if isinstance(bound, tuple) else bound for name, bound in rule.when}
    if rule.variant:
        data["variant"] = dict(rule.variant)
    if rule.evidence:
        data["evidence"] = list(rule.evidence)
    if rule.note:
        data["note"] = rule.note
    return data


def rules_from(records: list[dict], arch: str, world: int, gpu: str, evidence: str, current=None) -> dict:
    """A rules file (``runtime/rules/<arch>.json`` format) from sweep records: per op, one rule per
    swept shape naming its winner's path, then NCCL; ops of ``current`` (the table in force for
    this GPU and world size) that the sweep did not time, carried over."""
    ops: dict[str, list] = {}
    for rec in sorted(records, key=lambda r: (r["op"], r["M"], r["K"], r["N"])):
        best = winner(rec)
        if best is None:
            continue
        name, us = best
        path, _, config = name.partition("@")
        when = {"m": [rec["M"], rec["M"]], "k": [rec["K"], rec["K"]], "n": [rec["N"], rec["N"]]}
        if rec.get("rows_dim"):
            when["rows_dim"] = rec["rows_dim"]
        note = f"{us:.1f} us against unfused {rec['median']['unfused']:.1f} us"
        if config:
            note += f"; fastest as {name}, a configuration the path does not choose by itself"
        ops.setdefault(rec["op"], []).append({"path": path, "when": when, "note": note, "evidence": [evidence]})
    for rules in ops.values():
        rules.append({"path": "nccl", "note": "shapes the sweep did not time: the unfused computation",
                      "evidence": [evidence]})
    carried = sorted(set(current.ops) - set(ops)) if current is not None else []
    for op in carried:
        ops[op] = [_rule_data(rule) for rule in current.rules(op)]
    note = f"generated by benchmarks/path_sweep.py --rules from {evidence}"
    if carried:
        note += f"; {', '.join(carried)} carried over from the table in force ({current.label()})"
    return {"arch": arch, "about": f"Rules measured on {world}x {gpu}; each rule's evidence is the sweep's "
            "output, path@commit.",
            "tables": [{"world": [world], "measured": f"{world}x {gpu}", "note": note, "ops": ops}]}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default="ar,ag,rs", help="ar, ag, rs (comma-separated)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    p.add_argument("--ar-min-m", type=int, default=1024, help="all-reduce shapes of the ops benchmark from this "
                   "many rows (0: all)")
    p.add_argument("--batch", type=int, default=1, help="all-gather / reduce-scatter along dim 1 of a "
                   "[batch, rows / batch, ...] tensor (sequence parallel with a batch)")
    p.add_argument("--shapes", default=None, help="these MxKxN instead of the ops benchmark's (comma-separated)")
    p.add_argument("--only", default=None, help="only these candidates (comma-separated names, e.g. "
                   "fused,ce_overlap@chunks4)")
    p.add_argument("--tilings", default=TILINGS, help="the tile kernels' tilings besides their default")
    p.add_argument("--chunks", default="2,4,8", help="the copy-engine all-reduce's chunk counts")
    p.add_argument("--rs-chunks", default="1,2,4", help="the copy-engine reduce-scatter's chunks per share")
    p.add_argument("--splits", default="1,2,4", help="the split-K kernel's K slices")
    p.add_argument("--pushers", default="8,32", help="the fused all-gather's pushing programs")
    p.add_argument("--ag-ce-chunks", default="1,4", help="the fused all-gather's copy-engine push chunks")
    p.add_argument("--out", default=None, help="the sweep's records (JSON)")
    p.add_argument("--rules", default=None, metavar="RULES.json",
                   help="also write a rules table from the winners (needs --out: the rules' evidence)")
    return p


def main() -> int:
    args = parser().parse_args()
    if args.rules and not args.out:
        raise SystemExit("path_sweep: --rules needs --out (every rule cites the sweep's output file)")
    import commfuse  # noqa: F401  (the ops)
    from commfuse.runtime import groups, rules
    from commfuse.tools.bench import AG_MM_SHAPES, MM_AR_SHAPES
    from commfuse.tools.timing import commit, finish, setup_ranks

    group, rank = setup_ranks()
    device = torch.device("cuda", torch.cuda.current_device())
    state = groups.get(group.group_name)
    facts = groups.group_facts(state, device, False)
    given = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")] if args.shapes else None
    only = set(args.only.split(",")) if args.only else None
    records = []
    for short in args.ops.split(","):
        op = OPS[short]
        shapes = ([s for s in MM_AR_SHAPES if s[0] >= args.ar_min_m] if op == "mm_all_reduce" else AG_MM_SHAPES)
        for m, k, n in given or shapes:
            batch = 1 if op == "mm_all_reduce" else args.batch
            if m % (batch * group.size()):
                if rank == 0:
                    print(f"{short} {m}x{k}x{n}: skipped, {m} rows do not split into {batch} x {group.size()}",
                          flush=True)
                continue
            rec = sweep_shape(Problem(op, m, k, n, group, batch), facts, state, args, only)
            records.append(rec)
            if rank == 0:
                med, times = rec["median"], rec["times"]
                line = ", ".join(f"{name} {v:.1f} ({med['unfused'] / v:.3f}x, "
                                 f"+-{(max(times[name]) - min(times[name])) / 2:.1f})" for name, v in med.items())
                bad = {name: e for name, e in rec["errors"].items() if not isinstance(e, float) or e > TOLERANCE}
                best = winner(rec)
                print(f"{short} {m}x{k}x{n}: {line} | rules {rec['rules']} | best {best[0] if best else '-'}"
                      + (f" | BAD {bad}" if bad else ""), flush=True)
    if args.rules and rank == 0:
        table = rules.table(facts.arch, facts.world, facts.name, facts.sms)
        data = rules_from(records, facts.arch, facts.world, facts.name, f"{args.out}@{commit()}", table)
        rules.parse(data, args.rules)  # the file the run-time would read: malformed is an error here
        with open(args.rules, "w") as f:
            json.dump(data, f, indent=1)
        print(f"wrote {args.rules}", flush=True)
    return finish(records, args.out)


if __name__ == "__main__":
    sys.exit(main())
