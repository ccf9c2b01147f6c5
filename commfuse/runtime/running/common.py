"""What several paths' runs share: finding the group's lane for a call, or stepping aside to the
unfused computation (the graph-lane paths: ``running/ar_graph.py``, ``running/ar_norm.py``'s
``graph``), the two outputs of the norm ops' runs (``running/ar_norm.py``, ``running/rs_norm.py``),
and an FP8 call's scales and bias as the tile kernels take them (``running/ar_fused.py``,
``running/split_k.py``)."""

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


def tile_scales(path, args):
    """``(scales, bias, None)`` for the tile kernels: an FP8 op's scales as one float32 each or as
    a row's ``[M]`` and a column's ``[N]``, with the bias they add after scaling (a plain op:
    ``(None, bias, None)``); or ``(None, None, why)`` where the kernel cannot take them.

    Every factor the graph scales the product by is folded into the row or the column factor by
    its shape, in whatever order the graph multiplied them: ``_scaled_mm``'s scales and, in the
    row-wise backward's form, the post-scales (``reference.rowwise_scaled_matmul``), which scale
    the bias too, so the bias is scaled here as the graph scales it. A tensor-wise scale beside a
    row-wise one is expanded: the kernel reads a row's and a column's scale or neither."""
    if not hasattr(args, "scale_a"):
        return None, args.bias, None
    post = [f for f in (getattr(args, "post_scale_a", None), getattr(args, "post_scale_b", None)) if f is not None]
    if not post and args.scale_a.numel() == 1 and args.scale_b.numel() == 1:
        return (args.scale_a, args.scale_b), args.bias, None
    m, n = args.a.shape[0], args.b.shape[1]
    row = torch.ones(m, dtype=torch.float32, device=args.a.device)
    col = torch.ones(n, dtype=torch.float32, device=args.a.device)
    for factor in (args.scale_a, args.scale_b, *post):
        f = factor.float()
        if f.numel() == 1:
            row = row * f.reshape(())
        elif tuple(f.shape) == (m, 1):
            row = row * f.reshape(m)
        elif f.numel() == n and (f.dim() == 1 or tuple(f.shape) == (1, n)):
            col = col * f.reshape(n)
        else:
            why = f"a scale of shape {tuple(f.shape)} is neither a row's nor a column's (the tile kernels)"
            warn_once(path.op, why)
            ran_instead(path.op, path.name, "nccl")
            return None, None, why
    bias = args.bias
    if bias is not None and post:  # the graph scales the bias with the post-scales
        scale = post[0].float()
        for factor in post[1:]:
            scale = scale * factor.float()
        bias = (bias.float() * scale).expand(m, n)
    return (row, col), bias, None
