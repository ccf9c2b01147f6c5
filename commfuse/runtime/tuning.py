"""Measured dispatch: time the candidate paths of a call on this machine, agree across ranks, keep
the answer in a cache file.

The rules (``rules.py``) are measured on a few machines; a user's machine may differ (another GPU,
another link, another world size). With tuning on, a call signature (op, M bucket, K, N, dtype,
bias, world size, how the collective cuts the rows) with no kept answer is tuned once, by every
rank of its group together:

1. the ranks check that they tune the same signature (its hash, reduced over the group: a
   mismatch is an error on every rank, never divergent choices);
2. every rank runs the same candidates (the paths whose ``supports`` accepts the call; NCCL
   always), in the same order: first each one once, under the ordinary wait bound, which compiles
   and loads its kernels (a first compile may take one rank far longer than its peer), then a
   barrier, then each for a fixed number of warm-up and timed iterations under the short tuning
   bound (no time budget, which would differ by rank), on synthetic inputs of the call's shapes
   (never the user's tensors), each output checked against the unfused result of the same inputs,
   NaN-poisoned memory under it;
3. one collective reduces the timings (max over ranks) and the failures (any rank's failure or
   timeout excludes the candidate everywhere), and every rank takes the same argmin. A candidate
   whose only failures were timed-out waits (and the failed checks of a phase in which some
   rank's wait timed out: the NaN a timeout leaves) is kept in the cache as *transient*: a later run (a
   new process) tunes the signature again, up to ``TRANSIENT_TRIES`` runs in all, where a
   candidate that failed otherwise stays excluded;
4. the rules' choice is kept unless another candidate beats it by ``COMMFUSE_TUNE_MARGIN``.

Dynamic token counts are bucketed to powers of two and the bucket's largest M is timed, so one
answer serves a bucket; an answer is re-checked against its path's ``supports`` at the actual M.
Inside a CUDA-graph capture nothing is tuned (the cache or the rules answer), and an eager call
that meets a peer's replays (the graph lane, the eager twins of captured calls) never starts a
tuning collective. For ``mm_all_reduce`` calls that fit the graph lane, the candidates a capture
can run (the lane, NCCL) are tuned too, eagerly, so a later capture finds its answer.

The cache is one JSON file per machine key (``machine_key``: GPU, SM count, world size, peer
topology, driver, CUDA, NCCL, torch, Triton and commfuse versions, the provider and the settings
that change paths) under ``COMMFUSE_CACHE_DIR``; the group's rank 0 writes it atomically, merging
under a file lock; every rank reads it and the group agrees on its content hash before using it;
a corrupt or foreign file is ignored with a warning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import pathlib
import platform
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import triton

from .. import env
from ..kernels.codes import ERR_TIMEOUT
from . import capture, counters, errors, groups, running
from .facts import GroupFacts
from .paths import REGISTRY
from .paths.base import (Call, Context, Path, make_context)

log = logging.getLogger("commfuse")

#: The cache file's format: 2 since paths were renamed (``symm`` is ``pull``, the all-gather's
#: ``overlap`` is ``ce_overlap``), so answers kept under the former names are tuned anew.
FORMAT = 2
#: Iterations per candidate, after its first run (which compiles it): warm-up and timed.
WARMUP, ITERS = 3, 10
#: Every wait of a tuning run after the candidates' first runs is bounded by this many seconds
#: (not the real calls' bound): a candidate that times out is excluded on every rank for this run,
#: and the group recovers collectively.
TUNING_TIMEOUT_S = 10.0
#: Runs (processes) that tune a signature whose candidates only timed out, before the exclusion
#: is kept for good: a slow moment (another job on the GPU, a cold file cache) must not exclude a
#: path until ``tune --clear``.
TRANSIENT_TRIES = 3
#: The checked output's largest relative error against the unfused result (fp32 sums of bf16
#: products differ by rounding).
TOLERANCE = {torch.float16: 2e-2, torch.bfloat16: 2e-2, torch.float32: 1e-4}


def bucket(m: int) -> int:
    """The power of two at or above ``m``: every M of a bucket shares its answer."""
    return 1 << max(0, m - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Signature:
    op: str
    m: int  # the bucket
    k: int
    n: int
    dtype: str
    bias: bool
    world: int
    rows_dim: int
    slabs: int
    capture: bool = False

    @classmethod
    def of(cls, call: Call, capture: bool = False) -> "Signature":
        return cls(call.op, bucket(call.m), call.k, call.n, str(call.dtype).replace("torch.", ""), call.bias,
                   call.world, call.rows_dim, call.slabs, capture)

    def text(self) -> str:
        where = f" dim{self.rows_dim}x{self.slabs}" if self.rows_dim else ""
        return (f"{self.op}{'@capture' if self.capture else ''} m<={self.m} k={self.k} n={self.n} {self.dtype}"
                f"{' bias' if self.bias else ''} w{self.world}{where}")

    def call(self) -> Call:
        """The call a tuning run times: the bucket's largest M that the collective can cut (every
        rank's block, and each of its slabs, whole rows)."""
        call = Call(self.op, self.m, self.k, self.n, getattr(torch, self.dtype), self.world, self.bias,
                    self.rows_dim, self.slabs)
        unit = call.spec.rows_unit(call)
        return dataclasses.replace(call, m=max(unit, self.m // unit * unit))

    def digest(self) -> int:
        return int.from_bytes(hashlib.sha256(self.text().encode()).digest()[:7], "little")


@dataclasses.dataclass
class Entry:
    choice: str
    rules: str  # what the rules would pick
    times_us: dict  # candidate -> max-over-ranks median µs (inf: failed somewhere)
    failed: list
    margin: float
    transient: list = dataclasses.field(default_factory=list)  # failed: only timed-out waits, on any rank
    tries: int = 1  # runs that tuned this signature in a row with transient failures

    def as_json(self) -> dict:
        return {"choice": self.choice, "rules": self.rules, "margin": self.margin, "failed": self.failed,
                "transient": self.transient, "tries": self.tries,
                "times_us": {k: (None if math.isinf(v) else round(v, 2)) for k, v in self.times_us.items()}}

    @classmethod
    def from_json(cls, data: dict) -> "Entry":
        times = {k: (math.inf if v is None else float(v)) for k, v in data["times_us"].items()}
        return cls(data["choice"], data["rules"], times, list(data.get("failed", [])), float(data["margin"]),
                   list(data.get("transient", [])), int(data.get("tries", 1)))

    def retry(self) -> bool:
        """Whether a later run tunes this signature again: some candidate failed only by timing out."""
        return bool(self.transient) and self.tries < TRANSIENT_TRIES


# ---------------------------------------------------------------------------------------------
# The machine key and the cache file


def _driver() -> str:
    try:
        return str(torch._C._cuda_getDriverVersion())
    except Exception:  # noqa: BLE001 - a build without the call
        return "unknown"


def _nccl() -> str:
    try:
        return ".".join(str(x) for x in torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001 - no NCCL (the CPU)
        return "none"


def machine_key(facts: GroupFacts) -> dict:
    """What a kept answer is valid for: the GPUs, their links, the software, the settings that
    change which paths run. Never the group's name (a topology's answers serve every group of it)."""
    try:
        version = importlib.metadata.version("commfuse")
    except importlib.metadata.PackageNotFoundError:  # a source tree that was not installed
        version = "source"

    return {
        "gpu": facts.name, "arch": facts.arch, "sms": facts.sms, "world": facts.world,
        "topology": "peer" if facts.peer_access and facts.one_host else "none",
        "driver": _driver(), "cuda": str(torch.version.cuda), "nccl": _nccl(), "torch": torch.__version__,
        "triton": triton.__version__, "commfuse": version, "provider": facts.provider,
        "lane_bytes": facts.lane_bytes, "settings": [list(x) for x in env.current().paths_key()],
        "python": platform.python_version(),
    }


def _key_digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def cache_dir() -> pathlib.Path:
    given = env.current().cache_dir
    if given:
        return pathlib.Path(given).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "commfuse"


def cache_path(key: dict) -> pathlib.Path:
    return cache_dir() / f"tuned-{_key_digest(key)}.json"


def read(path: pathlib.Path, key: dict) -> dict[str, Entry]:
    """The entries of a cache file; {} with a warning if it is corrupt or made for another key."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT or data.get("key") != key:
            log.warning("commfuse: ignoring the tuning cache %s: made for another machine or version", path)
            return {}
        return {sig: Entry.from_json(e) for sig, e in data["entries"].items()}
    except Exception as exc:  # noqa: BLE001 - a corrupt file is ignored, never fatal
        log.warning("commfuse: ignoring the corrupt tuning cache %s (%s: %s)", path, type(exc).__name__, exc)
        return {}


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    import fcntl  # noqa: PLC0415  (POSIX only: the cache is written where it is)

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write(path: pathlib.Path, key: dict, entries: dict[str, Entry]) -> None:
    """Merge ``entries`` into the file under a lock and replace it atomically."""
    with _locked(path):
        merged = read(path, key)
        merged.update(entries)
        body = {"format": FORMAT, "key": key,
                "entries": {sig: e.as_json() for sig, e in sorted(merged.items())}}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(body, f, indent=1)
        os.replace(tmp, path)


def content_hash(entries: dict[str, Entry]) -> int:
    text = json.dumps({k: e.as_json() for k, e in sorted(entries.items())}, sort_keys=True)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


# ---------------------------------------------------------------------------------------------
# Agreement


def _agree_same(group, value: int, device) -> bool:
    """Whether every rank of ``group`` holds ``value`` (one all-reduce of [value, -value])."""
    t = torch.tensor([value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.pg())
    return int(t[0]) == -int(t[1])


def _any(group, flag: bool, device) -> bool:
    """Whether any rank of ``group`` raised ``flag``."""
    if group.world <= 1:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.pg())
    return bool(t.item())


def _any_each(group, flags: tuple[bool, ...], device) -> tuple[bool, ...]:
    """Per flag, whether any rank of ``group`` raised it (one collective)."""
    if group.world <= 1:
        return flags
    t = torch.tensor([int(f) for f in flags], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.pg())
    return tuple(bool(x) for x in t.tolist())


def _reduce_results(group, times: list[float], failed: list[bool], lasting: list[bool], device
                    ) -> tuple[list[float], list[bool], list[bool]]:
    """One collective: the slowest rank's time, any rank's failure and any rank's lasting failure
    (``_Candidate.lasting``), per candidate."""
    big = 1e30
    t = torch.tensor([min(x, big) for x in times] + [float(f) for f in failed] + [float(f) for f in lasting],
                     dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.pg())
    n = len(times)
    worst = [math.inf if x >= big else float(x) for x in t[:n].tolist()]
    return worst, [bool(x) for x in t[n:2 * n].tolist()], [bool(x) for x in t[2 * n:].tolist()]


# ---------------------------------------------------------------------------------------------
# Measuring a candidate on synthetic inputs
#
# A measurement is a generator that yields between its phases (first run, warm-up, check, timing)
# and returns the median µs. The tuner runs every candidate's first phase, then the rest of each
# (``Tuner.tune``). Its phases issue no process-group collective of their own, so a candidate that
# raises on one rank leaves the ranks' collectives paired: the tuner agrees after every phase
# whether any rank failed, and every rank skips the rest of that candidate together. The NCCL
# candidate is the exception: its calls are collectives, and one that fails on one rank midway is
# as fatal to the job as any failed NCCL call. Tests inject measurements that only return a time
# (after an optional compile step).


@dataclasses.dataclass
class Prepared:
    """One signature's synthetic call, made once before its candidates: the inputs, in the
    signature's layout, and the unfused result of them (fp32)."""

    call: Call
    args: object
    want: torch.Tensor


def _inputs(sig: Signature, group, device, seed: int):
    """This rank's inputs of ``sig``'s call; where the collective cuts every rank's rows into slabs
    (a batch of sequences), the gathered shard is ``[slabs, rows, K]`` and the scattered product
    is viewed ``[slabs, rows, N]``, both cut along dim 1, as the paths read them."""
    call = sig.call()
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    dtype = call.dtype

    def rand(*shape):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) / 4).to(dtype)

    return call, call.spec.inputs(call, group.name, rand)


def _output(result) -> torch.Tensor:
    return result[0] if isinstance(result, tuple) else result


def prepare(sig: Signature, group, facts: GroupFacts, device, candidates: list[Path]) -> Prepared | None:
    """Collective: the inputs, the workspace (and graph lane) grown once to what the largest
    candidate needs, so no candidate allocates (collectively) while it is measured, and the NCCL
    result the candidates are checked against. None on every rank if any rank could not make its
    inputs (agreed before any other collective)."""
    try:
        call, args = _inputs(sig, group, device, seed=1000 + group.rank)
        failed = False
    except Exception as exc:  # noqa: BLE001 - out of memory on one rank: no tuning, never a hang
        log.warning("commfuse: tuning %s: the inputs could not be made on this rank (%s: %s)", sig.text(),
                    type(exc).__name__, exc)
        failed = True
    if _any(group, failed, device):
        return None
    need = max([p.workspace_bytes(call) for p in candidates if p.symmetric], default=0)
    if need:
        groups.workspace(group, need, device)
    want = _output(running.run(REGISTRY[(sig.op, "nccl")], Context(call, facts, group), args)).float()
    return Prepared(call, args, want)


def measure(path: Path, prepared: Prepared, group, facts: GroupFacts, device, variant: dict | None = None):
    """Run ``path`` (with a rule's ``variant``) once, which compiles it, warm it up, check its
    output, time it: yields between the phases, returns the median µs of ``ITERS`` calls; raises
    if the output is wrong."""
    call, args, want = prepared.call, prepared.args, prepared.want
    ctx = make_context(call, facts, group, path, variant)
    run = running.runner(path)
    run(path, ctx, args)
    yield
    for _ in range(WARMUP):
        run(path, ctx, args)
    yield
    poison = torch.full((want.numel() * 2,), float("nan"), device=device, dtype=call.dtype)
    del poison  # the caching allocator hands the candidate's output this NaN-filled block
    got = _output(run(path, ctx, args)).float()
    err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    if not err <= TOLERANCE.get(call.dtype, 2e-2):
        raise RuntimeError(f"{path.name} is wrong on this rank (relative error {err:.2e})")
    yield
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(ITERS)]
    torch.cuda.synchronize(device)
    for start, end in events:
        start.record()
        run(path, ctx, args)
        end.record()
    torch.cuda.synchronize(device)
    times = sorted(s.elapsed_time(e) * 1e3 for s, e in events)
    return times[len(times) // 2]


# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _short_waits(group, seconds: float):
    """Bound every wait of the group's buffers by ``seconds`` while tuning."""
    bound = int(seconds * 1e9)
    group.tuning_timeout_ns = bound
    for buf in group.buffers():
        buf.timeout_ns = bound
    try:
        yield
    finally:
        group.tuning_timeout_ns = None
        real = int(env.current().timeout_s * 1e9)
        for buf in group.buffers():
            buf.timeout_ns = real


def _recover(group, device) -> None:
    """After a candidate failed on some rank: wait for every kernel, drop the errors the tuning
    waits wrote (the word held none when tuning began: ``Tuner.tune``), and restart the epochs of
    the workspace and of the graph lane together, so the real calls pair up as before."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier(group=group.pg())
    group.err.zero_()
    if group.workspace is not None:
        group.workspace.broken = None
        group.workspace.restart_epochs(group.pg())
    if group.lane is not None:
        group.lane.restart(group.pg())


def _phase(step) -> tuple[bool, bool, float | None]:
    """Run one phase of a measurement: (done, failed here, µs when done)."""
    try:
        next(step)
        return False, False, None
    except StopIteration as stop:
        return True, False, stop.value
    except Exception as exc:  # noqa: BLE001 - a failed candidate is excluded, never fatal
        log.info("commfuse: tuning: a candidate failed on this rank (%s: %s)", type(exc).__name__, exc)
        return True, True, None


def _injected(timer, compiler, *args):
    """An injected timer as a measurement: its first phase runs ``compiler`` (if any), the second
    the timer (either may raise)."""
    if compiler is not None:
        compiler(*args)
    yield
    return timer(*args)


@dataclasses.dataclass
class _Candidate:
    """One candidate's measurement while a signature is tuned, on this rank."""

    path: Path
    step: object  # the measurement (a generator), None once it ended
    failed: bool = False  # here, in any phase
    lasting: bool = False  # here, in a phase where no rank's wait timed out (or by a mismatch)
    value: float | None = None


class Tuner:
    """One group's tuned answers: the cache's (agreed) and those tuned since.

    ``timer(path, sig, variant)``, for tests: a measurement that returns a time (no prepared
    inputs, no device work), after ``compiler(path, sig, variant)`` for every candidate; by
    default the candidates run on the device (``measure``)."""

    def __init__(self, group, facts: GroupFacts, device, timer: Callable | None = None,
                 compiler: Callable | None = None):
        self.group, self.facts, self.device = group, facts, device
        self.timer, self.compiler = timer, compiler
        self.fresh: set[str] = set()  # signatures tuned by this process (never again in it)
        self.key = machine_key(facts)
        self.path = cache_path(self.key)
        self.entries: dict[str, Entry] = {}
        self.tuned = 0
        self.seconds = 0.0
        self._load()

    def _load(self) -> None:
        entries = read(self.path, self.key)
        if self.group.world > 1 and not _agree_same(self.group, content_hash(entries), self.device):
            log.warning("commfuse: the ranks of group %r read different tuning caches (%s); none is used, and "
                        "signatures are tuned anew", self.group.name, self.path)
            entries = {}
        self.entries = entries

    def answer(self, call: Call, capturing: bool, may_tune: bool) -> str | None:
        """The kept answer for ``call``, tuned now (collective) if ``may_tune`` and none is kept."""
        sig = Signature.of(call, capture=capturing)
        entry = self.entries.get(sig.text())
        # (every rank holds the same entries, agreed, and tunes the same signatures: alike)
        if may_tune and (entry is None or (entry.retry() and sig.text() not in self.fresh)):
            entry = self.tune(sig)
            if capture.fits_lane(call, self.facts):
                self.tune(Signature.of(call, capture=True))  # what a later capture will ask for
        if entry is None:
            return None
        path = REGISTRY.get((call.op, entry.choice))
        if path is None or path.supports(call, self.facts) is not None:
            return None  # the bucket's answer does not take this M: the rules decide
        return entry.choice

    def _clean_start(self) -> None:
        """Every rank together: raise on every rank if any rank's group holds a timed-out wait or a
        failed call from before (``_recover`` clears both, so no earlier record may be in them)."""
        group, device = self.group, self.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ws_broken = group.workspace.broken if group.workspace is not None else None
        mine = bool(group.err_host[0]) or bool(group.broken) or bool(ws_broken)
        if not _any(group, mine, device):
            return
        errors.check(group, "tuning")
        # a clean rank refuses the group too, or a retry would find its peer refusing and wait for it
        group.broken = group.broken or ws_broken or (
            f"commfuse: a peer of group {group.name!r} holds a timed-out wait or a failed call; call "
            "commfuse.release_all() on every rank to start over")
        if group.workspace is not None:
            group.workspace.broken = group.broken
        counters.bump()
        raise RuntimeError(group.broken)

    def _advance(self, sig: Signature, run: _Candidate) -> None:
        """One phase of ``run``'s measurement, then every rank agrees whether any failed in it:
        every rank leaves a candidate after the same phase, so collectives stay paired."""
        group, device = self.group, self.device
        done, failed_here, value = _phase(run.step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        word = int(group.err_host[0])  # a wait that timed out (or met another call) here
        any_fail, any_timeout = _any_each(group, (failed_here or bool(word), word == ERR_TIMEOUT), device)
        run.failed = run.failed or failed_here or bool(word)
        # A timed-out wait leaves NaN where the late peer's data would go, so the check of the
        # same phase fails too, on this rank or on a peer that read this rank's output: with a
        # timeout on any rank in the phase, a failed check is the timeout's, not the candidate's.
        run.lasting = run.lasting or (bool(word) and word != ERR_TIMEOUT) or (failed_here and not any_timeout)
        if done:
            run.value = value
        if done or any_fail:
            run.step.close()
            run.step = None
        if any_fail:  # epochs may be out of step: start them over together
            log.info("commfuse: tuning %s: %s failed on a rank; excluded from this run", sig.text(), run.path.name)
            _recover(group, device)

    def tune(self, sig: Signature) -> Entry:
        """Every rank together: time the candidates of ``sig`` and keep the agreed answer."""
        from . import ce_graphs, policy  # noqa: PLC0415  (policy asks this module for answers: a lazy edge)

        group, device = self.group, self.device
        if not _agree_same(group, sig.digest(), device):
            raise RuntimeError(
                f"commfuse: the ranks of group {group.name!r} are tuning different call signatures (this rank: "
                f"{sig.text()}); every rank must make the same fused calls in the same order")
        self._clean_start()
        began = time.perf_counter()
        call = sig.call()
        candidates = policy.candidates(call, self.facts, capturing=sig.capture)
        rules = policy.rules_choice(call, self.facts, capture=sig.capture).name
        lane = capture.Selection(call, self.facts, 0, lambda: policy.rules_choice(call, self.facts, capture=True))
        prepared = seen = None
        if self.timer is None:
            prepared = prepare(sig, group, self.facts, device, candidates)
            if prepared is None:  # some rank could not make the inputs: the rules decide, untimed
                entry = Entry(rules, rules, {p.name: math.inf for p in candidates}, [p.name for p in candidates],
                              env.current().tune_margin)
                self.entries[sig.text()] = entry  # (this process only: a later run tunes it)
                self.fresh.add(sig.text())
                counters.bump()
                return entry
            seen = ce_graphs.keys(group.workspace) if group.workspace is not None else None
        runs = []
        for path in candidates:
            variant = lane.variant(path)
            if self.timer is not None:
                step = _injected(self.timer, self.compiler, path, sig, variant)
            else:
                step = measure(path, prepared, group, self.facts, device, variant)
            runs.append(_Candidate(path, step))
        # Every candidate's first run (its compile and load, which may take one rank far longer
        # than its peer) under the ordinary wait bound, on every rank, before any bounded wait.
        for run in runs:
            self._advance(sig, run)
        if group.world > 1:
            dist.barrier(group=group.pg())
        with _short_waits(group, TUNING_TIMEOUT_S):
            for run in runs:
                while run.step is not None:
                    self._advance(sig, run)
        if seen is not None and group.workspace is not None:
            ce_graphs.drop_since(group.workspace, seen)
        times = [math.inf if r.failed or r.value is None else float(r.value) for r in runs]
        failed, lasting = [r.failed for r in runs], [r.lasting for r in runs]
        worst, bad, lasting = (_reduce_results(group, times, failed, lasting, device) if group.world > 1
                               else (times, failed, lasting))
        margin = env.current().tune_margin
        ok = {p.name: t for p, t, f in zip(candidates, worst, bad) if not f and math.isfinite(t)}
        best = min(ok, key=ok.get) if ok else "nccl"
        choice = rules if rules in ok and ok[best] >= ok[rules] * (1 - margin) else best
        transient = [p.name for p, f, lf in zip(candidates, bad, lasting) if f and not lf]
        before = self.entries.get(sig.text())
        tries = before.tries + 1 if transient and before is not None and before.transient else 1
        entry = Entry(choice, rules, {p.name: t for p, t in zip(candidates, worst)},
                      [p.name for p, f in zip(candidates, bad) if f], margin, transient, tries)
        if transient:
            log.warning("commfuse: tuning %s: %s timed out on a rank (try %d of %d: tuned again in a later run)",
                        sig.text(), ", ".join(transient), tries, TRANSIENT_TRIES)
        self.fresh.add(sig.text())
        self.entries[sig.text()] = entry
        self.tuned += 1
        spent = time.perf_counter() - began
        self.seconds += spent
        if group.rank == 0:
            shown = ", ".join(f"{k} {v:.1f}" for k, v in ok.items())
            print(f"[commfuse] tuned {self.tuned}: {sig.text()} -> {choice} (rules: {rules}; µs: {shown}) "
                  f"in {spent:.1f} s, {self.seconds:.1f} s so far", flush=True)
            write(self.path, self.key, {sig.text(): entry})
        counters.bump()
        return entry


def mode() -> str:
    return env.current().tune


def for_group(group, facts: GroupFacts, device) -> Tuner:
    """The group's tuner (kept in the group's state, made, and its cache agreed on, at the group's
    first tuned call)."""
    tuner = group.tuner
    if tuner is None:
        tuner = group.tuner = Tuner(group, facts, device)
    return tuner


def answer(group, call: Call, facts: GroupFacts, device, capturing: bool) -> str | None:
    """The tuned path for ``call``, per the tuning mode (``COMMFUSE_TUNE``): None when off."""
    how = mode()
    if how == "off":
        return None
    if capturing and group.tuner is None:
        return None  # a cache is agreed on collectively: never inside a capture
    tuner = for_group(group, facts, device)
    return tuner.answer(call, capturing, may_tune=how == "first-use" and not capturing)


def forget() -> None:
    """Drop every group's tuner (tests; the settings changed)."""
    for group in groups.all_groups():
        group.tuner = None
