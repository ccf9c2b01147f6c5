"""The parts of one fused call's host work, each a function to time alone.

``benchmarks/host_python.py`` times them on the CPU (with what needs a GPU stood in) and
``benchmarks/host_time.py`` on a GPU, beside the unfused calls' parts. Each part is a step of the
whole call (``call``), which nests as::

    op              the op through torch's dispatcher (torch.ops.commfuse), as a graph calls it (GPU)
    call            the op's CUDA kernel function (ops/library.py)
    ├ checks        the op's argument checks
    ├ entry         the run-time's entry, the path's run replaced by a function that returns
    └ path_run      the path's run: output, prepare, exchange, launch
      ├ output      the output's allocation
      ├ prepare     the kernel's prepare (descriptors, kept plan lookup)
      ├ exchange    the call's epoch and stream order around the launch (launch included)
      │ ├ order     the stream order alone (``Workspace.order_current``; GPU)
      │ └ epoch     the next epoch alone (``Workspace.next_epoch``)
      └ launch      the kept launch alone, with the next epoch

and, on a GPU, two queries every launch makes (``device``, ``stream``). A part that includes
another costs at least as much, give or take the timing's spread.
"""

from __future__ import annotations

from typing import Callable


def _plan(group, op: str, path: str, shapes: tuple):
    """The group's current kept plan of ``op`` on ``path`` for operands of ``shapes`` (the spec's
    key)."""
    from ..runtime import counters

    found = [plan for key, plan in group.plans.items()
             if key[0] == op and plan.decision.path.name == path and tuple(key[1:1 + len(shapes)]) == shapes
             and plan.generation == counters.generation]
    if len(found) != 1:
        raise RuntimeError(f"host_parts: expected one current {op}:{path} plan for {shapes}, found {len(found)} "
                           "(force the path for the op's calls first)")
    return found[0]


def split_k_parts(group_name: str, a, b) -> dict[str, Callable[[], object]]:
    """The parts (module docstring) of ``mm_all_reduce(a, b)`` on the split-K path, without bias.
    The caller forces the path for the op's calls (the policy's or the settings' way) while
    this runs and while the parts run; this makes two calls first, so the group keeps a current
    plan of the call (a first call may grow the workspace, which makes plans anew). Every part
    that launches takes the workspace's next epoch, as a call does, so its launches pair like
    calls (``epoch`` takes one and launches nothing, which a group of one rank, the only kind
    these run in, does not notice); none of them checks a result."""
    import torch

    from ..kernels import fused_split_k, launch as launches
    from ..ops import library
    from ..runtime import entry, groups
    from ..runtime.paths.common import exchange
    from ..runtime.spec import MM_ALL_REDUCE

    args = MM_ALL_REDUCE.Args(a, b, None, group_name)
    for _ in range(2):
        library._mm_all_reduce_cuda(a, b, None, group_name)
    group = groups.get(group_name)
    plan = _plan(group, "mm_all_reduce", "split_k", MM_ALL_REDUCE.key(args))
    ws, ctx, path = group.workspace, plan.context, plan.decision.path
    m, n = a.shape[0], b.shape[1]
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    launch = fused_split_k.prepare(ws, a, b, None, out, ctx.config)
    runner = plan.run

    def entry_only():
        plan.run = _returns
        try:
            return entry.run(MM_ALL_REDUCE, args)
        finally:
            plan.run = runner

    def exchanged():
        with exchange(ctx, ws, "mm_all_reduce") as (epoch, parity):
            launch(epoch, parity)

    parts = {
        "call": lambda: library._mm_all_reduce_cuda(a, b, None, group_name),
        "checks": lambda: library._validate_mm_all_reduce(a, b, None, group_name),
        "entry": entry_only,
        "path_run": lambda: runner(path, ctx, args),
        "output": lambda: torch.empty((m, n), dtype=a.dtype, device=a.device),
        "prepare": lambda: fused_split_k.prepare(ws, a, b, None, out, ctx.config),
        "exchange": exchanged,
        "epoch": ws.next_epoch,
        "launch": lambda: launch(*ws.next_epoch()),
    }
    if a.is_cuda:  # (on the CPU the dispatcher would pick the op's CPU kernel)
        parts = {"op": lambda: torch.ops.commfuse.mm_all_reduce.default(a, b, None, group_name), **parts,
                 "order": ws.order_current}
        device = a.device.index
        parts["device"] = torch.cuda.current_device
        parts["stream"] = lambda: launches._raw_stream(device)
    return parts


def _returns(*_):
    return None


__all__ = ["split_k_parts"]
