"""What several paths' runs share: finding the group's lane for a call, or stepping aside to the
unfused computation (the graph-lane paths: ``running/ar_graph.py``, ``running/ar_norm.py``'s
``graph``), and the two outputs of the norm ops' runs (``running/ar_norm.py``, ``running/rs_norm.py``)."""

from __future__ import annotations

import torch

from .. import capture, groups
from ..counters import ran_instead
from ..paths.common import warn_once


def lane_for(path, ctx, args, nbytes: int, device, capturing: bool):
    """The group's graph lane for a lane path's call of ``nbytes``: allocated with the group's
    workspace by an eager call (allocation is collective: never inside a capture), marked replayed
    where a capture takes it. None where the group has no lane yet or the call is past it: the
    call then runs its unfused computation (logged once, counted), and a captured one is recorded,
    so that its eager twins run that too."""
    group = ctx.group
    lane = capture.lane(group)
    if lane is None and not capturing:
        groups.workspace(group, nbytes, device)
        lane = capture.lane(group)
    if lane is None or nbytes > lane.data_bytes:
        warn_once(path.op, "no graph lane yet: the group's first call was captured" if lane is None
                  else "larger than the graph lane")
        ran_instead(path.op, path.name, "nccl")
        if capturing:
            capture.record(group, path.op, path.spec.key(args), "nccl")
        return None
    if capturing:
        capture.mark_replayed(group)
    return lane


def norm_outputs(path, ctx, args, rows: int, run_into) -> tuple[torch.Tensor, torch.Tensor]:
    """A norm op's ``(h, n)``: ``rows x N`` outputs allocated (before the call's epoch), filled by
    ``run_into(path, ctx, args, h, n)``, each viewed as the residual (contiguous, as the op's fake
    implementation says)."""
    h = torch.empty((rows, args.b.shape[1]), dtype=args.a.dtype, device=args.a.device)
    out = torch.empty_like(h)
    run_into(path, ctx, args, h, out)
    shape = args.residual.shape
    return h.view(shape), out.view(shape)
