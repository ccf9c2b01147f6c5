"""Host cost per step of the error check after each run of a compiled graph
(``runtime/errors.py``, ``watch_runs``: the pinned error words of the graph's groups read after
the run, no synchronisation), on one GPU.

    python benchmarks/replay_check_cost.py --out replay_check.json [--groups 1,2,8] [--steps 2000]

Three measurements, each the median over ``--rounds`` rounds of ``--steps`` steps:

* ``check_ns``: ``errors.after_run`` alone, with 1, 2 and 8 groups of the run-time's state
  registered (each with its own pinned error word, as ``groups.get`` makes them) and a watch
  naming them all;
* ``replay_ns`` / ``watched_replay_ns``: the host time of one step of a small model compiled with
  ``mode="reduce-overhead"`` (a CUDA-graph replay each step), Inductor's callable as it is and
  wrapped by ``watch_runs``; the GPU sleeps before each round, so the host never waits for it and
  its own time is what is timed;
* the difference, per step, is what the check costs a decode loop.

On a machine without CUDA the first measurement runs (unpinned words) and the others are skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import weakref

import torch

from commfuse.runtime import errors, groups
from commfuse.runtime.workspace import error_word


class _Anchor:
    """Stands for a process-group object (the group state refers to it weakly)."""


def _register(count: int) -> tuple[list, errors.Watch]:
    anchors, watch = [], errors.Watch()
    for i in range(count):
        anchors.append(_Anchor())
        name = f"bench-{i}"
        groups._groups[(name, "torch")] = groups.Group(name, weakref.ref(anchors[-1]), (0, 1), 0, 2, "torch",
                                                       error_word())
        watch.names.add(name)
    return anchors, watch


def _unregister(count: int) -> None:
    for i in range(count):
        groups._groups.pop((f"bench-{i}", "torch"), None)


def _per_step_ns(fn, steps: int, rounds: int, sleep_cycles: int = 0) -> float:
    times = []
    for _ in range(rounds):
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)  # the GPU stays busy: the host is what is timed
        began = time.perf_counter_ns()
        for _ in range(steps):
            fn()
        times.append((time.perf_counter_ns() - began) / steps)
        if sleep_cycles:
            torch.cuda.synchronize()
    return statistics.median(times)


def _model_steps(steps: int, rounds: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 1024)).cuda().to(torch.bfloat16)
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    returned, seen = [], []

    def backend(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx  # noqa: PLC0415

        returned.append(compile_fx(gm, example_inputs, config_patches={"triton.cudagraphs": True}))

        def recording(*a):  # the inputs Dynamo passes, as it passes them
            seen[:] = [a]
            return returned[-1](*a)

        return recording

    with torch.no_grad():
        compiled = torch.compile(model, backend=backend)
        for _ in range(5):  # warm-up, recording, replays
            compiled(x)
        torch.cuda.synchronize()
        inner, given = returned[-1], seen[0]
        boxed = len(given) == 1 and isinstance(given[0], list)  # a boxed call empties its list

        def call(fn):
            return (lambda: fn(list(given[0]))) if boxed else (lambda: fn(*given))

        _anchors, watch = _register(2)
        watched = errors.watch_runs(inner, watch)
        plain_ns = _per_step_ns(call(inner), steps, rounds, sleep_cycles=200_000_000)
        watched_ns = _per_step_ns(call(watched), steps, rounds, sleep_cycles=200_000_000)
        plain_again_ns = _per_step_ns(call(inner), steps, rounds, sleep_cycles=200_000_000)
        _unregister(2)
    plain_ns = min(plain_ns, plain_again_ns)  # (the first and the last round of the three: drift)
    return {"replay_ns": plain_ns, "watched_replay_ns": watched_ns, "check_in_step_ns": watched_ns - plain_ns}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", default="1,2,8", help="group counts for the check alone")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    result: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                    "torch": torch.__version__, "check_ns": {}}
    for count in (int(c) for c in args.groups.split(",")):
        _anchors, watch = _register(count)
        result["check_ns"][count] = _per_step_ns(lambda: errors.after_run(watch), args.steps, args.rounds)
        _unregister(count)
        print(f"after_run with {count} group(s): {result['check_ns'][count]:.0f} ns per step", flush=True)
    if torch.cuda.is_available():
        # (a few hundred replays queue behind the sleep without filling the launch queue)
        result.update(_model_steps(min(args.steps, 200), args.rounds))
        print(f"a reduce-overhead step: {result['replay_ns'] / 1e3:.2f} µs as Inductor returns it, "
              f"{result['watched_replay_ns'] / 1e3:.2f} µs watched ({result['check_in_step_ns']:.0f} ns more)",
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
