"""GPU time of each commfuse call inside a model, measured without a profiler.

Under ``torch.profiler`` every call that waits for its peer also waits for the host delays the
profiler adds on the other rank, so a profile cannot say whether a call is slower inside a model
than alone (docs/decisions.md, Models). While ``record(True)`` is on, each op's run-time entry
(``runtime/entry.py``, wrapped while recording) records a pair of timing events on the caller's stream around its work, keyed by the op, its
operands' shapes and layout and the path it took; ``collect()`` synchronises and returns the
times. A call's time includes its wait for a late peer and any gap where the GPU, having caught
up with the host, waited for the call's own launches: both are what the model pays and a call
timed alone does not. Calls inside a CUDA-graph capture are not timed (a timing event cannot be
captured).

Two more facts per call say why a call is slower inside a step: whether the caller's stream had
already run dry when the call began (the GPU had caught up with the host, so the call's own
launches pace it), and how long the host spent inside the call.
"""

from __future__ import annotations

import collections
import functools
import time
import warnings
from typing import Callable, NamedTuple

import torch

#: At most this many calls are kept between two ``collect()`` calls (two events each).
LIMIT = 100_000
_on = False
_pending: list = []  # (key, start event, end event, stream idle at entry, host seconds, CPU seconds)
_dropped = 0  # calls past LIMIT, not timed


_originals: dict[str, Callable] = {}


def record(on: bool) -> None:
    """Start (``True``) or stop timing the calls; recorded times stay until ``collect()``. The
    run-time's entry (``runtime/entry.run``) is wrapped while on, and restored after: the
    run-time itself knows nothing of this timing."""
    global _on
    from ..runtime import entry  # (a tool: brings the run-time only when timing starts)
    from ..runtime.counters import PATHS

    _on = on
    if on and "run" not in _originals:
        _originals["run"] = entry.run
        entry.run = timed(PATHS)(_originals["run"])
    elif not on and "run" in _originals:
        entry.run = _originals.pop("run")


def _event():
    return torch.cuda.Event(enable_timing=True)


def _idle(a: torch.Tensor) -> bool:
    """The caller's stream has finished all its work (a query, no wait)."""
    return torch.cuda.current_stream(a.device).query()


class Call(NamedTuple):
    """One timed call: its GPU time on the caller's stream, the host time spent inside it (wall
    clock, and the thread's CPU time: less than the wall time where the host waited, e.g. on a
    full launch queue), and whether the stream was already idle when it began."""
    gpu_us: float
    host_us: float
    idle: bool
    cpu_us: float = 0.0


def _timeable(a: torch.Tensor) -> bool:
    """A CUDA call outside a graph capture."""
    return a.device.type == "cuda" and not torch.cuda.is_current_stream_capturing()


def timed(paths: collections.Counter) -> Callable:
    """Decorator for the ops' CUDA entry ``fn(spec, args, site)``: while recording, time each call
    on the caller's stream (``a`` and ``b``: the op's first two operands). ``paths`` is the per-path call counter the
    entry increments (``runtime.counters.PATHS``): the path whose count went up names the call's path."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(spec, args, *rest, **kwargs):
            global _dropped
            op, a, b = spec.name, args[0], args[1]
            if not _on or not _timeable(a):
                return fn(spec, args, *rest, **kwargs)
            if len(_pending) >= LIMIT:
                _dropped += 1
                return fn(spec, args, *rest, **kwargs)
            before = {k: v for k, v in paths.items() if k.startswith(op + ":")}
            start, end = _event(), _event()
            idle = _idle(a)
            began, cpu = time.perf_counter(), time.thread_time()
            start.record()
            out = fn(spec, args, *rest, **kwargs)
            end.record()
            host, cpu = time.perf_counter() - began, time.thread_time() - cpu
            taken = [k for k, v in paths.items() if k.startswith(op + ":") and v > before.get(k, 0)]
            path = taken[0].partition(":")[2] if len(taken) == 1 else "?"
            b_transposed = b.dim() == 2 and b.shape[0] > 1 and b.stride(0) == 1  # a weight's W.t()
            _pending.append(((op, tuple(a.shape), tuple(b.shape), b_transposed, path), start, end, idle, host,
                             cpu))
            return out
        return call
    return wrap


def collect(detail: bool = False) -> dict[tuple, list]:
    """The recorded calls' GPU times in us (``detail``: ``Call`` records), per (op, a's shape, b's
    shape, whether b is a transposed view, path), in call order; clears them. Synchronises the
    device if there are any."""
    global _dropped
    if _dropped:
        warnings.warn(f"commfuse call_times: {_dropped} calls past the first {LIMIT} were not timed; "
                      "collect() more often")
        _dropped = 0
    times: dict[tuple, list[float]] = {}
    if _pending:
        torch.cuda.synchronize()
    for key, start, end, idle, host, cpu in _pending:
        gpu = start.elapsed_time(end) * 1e3
        times.setdefault(key, []).append(Call(gpu, host * 1e6, bool(idle), cpu * 1e6) if detail else gpu)
    _pending.clear()
    return times
