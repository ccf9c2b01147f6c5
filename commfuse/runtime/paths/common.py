"""Pieces several paths share: the call's epoch, the matmul into a buffer, bias rows, rank-order sums."""

from __future__ import annotations

import contextlib
import logging
import re

import torch

from .. import reference
from .. import groups

log = logging.getLogger("commfuse")
_warned: set[tuple] = set()
#: Reasons remembered at most: past it they are forgotten (and may be logged once more).
WARN_LIMIT = 256


def first_time(seen: set, key: tuple) -> bool:
    """Whether ``key`` (an op and a reason) is new to ``seen``, which then holds it. Numbers in
    the reason do not count (a reason that names a call's bytes is logged once, not once per size)."""
    key = tuple(re.sub(r"\d+", "#", part) if isinstance(part, str) else part for part in key)
    if key in seen:
        return False
    if len(seen) >= WARN_LIMIT:
        seen.clear()
    seen.add(key)
    return True


def warn_once(op: str, why: str) -> None:
    """Log, once per op and kind of reason, that a call runs the unfused NCCL path."""
    if first_time(_warned, (op, why)):
        log.warning("commfuse.%s: this call runs the unfused NCCL path (%s)", op, why)


def workspace(ctx, nbytes: int, device: torch.device):
    """The call's group workspace with at least ``nbytes`` per parity (collective when it grows)."""
    return groups.workspace(ctx.group, nbytes, device)


# The two doors to a group's flags: every launch of a kernel that signals or waits on them is
# inside one (tests/test_one_door.py). A wait passes once its peer's count is at least its own,
# so only the host's order of calls, kept on the device (``Workspace.order``), pairs each call
# with its peers' same call. (Each door orders inline: a nested context manager would add host
# time to every call of a decode step.)

def exchange(ctx, ws, op: str) -> "_Exchange":
    """Start a call's epoch (its count and ``ctx.tag``), after the workspace's previous call on the
    device (``Workspace.order``: two streams calling one group are serialised, as NCCL's
    collectives are); if anything fails once the epoch has begun, the ranks' call counters may
    differ, so the workspace refuses further calls instead of pairing up mismatched epochs.
    ``with exchange(ctx, ws, op) as (epoch, parity): ...``"""
    return _Exchange(ctx, ws, op)


class _Exchange:
    """``exchange``'s context manager: a class, not a generator, as every fused call enters one."""

    __slots__ = ("ctx", "ws", "op", "stream", "record")

    def __init__(self, ctx, ws, op: str):
        self.ctx, self.ws, self.op = ctx, ws, op

    def __enter__(self) -> tuple[int, int]:
        ws = self.ws
        self.stream, self.record = ws.order_current() if ws.buffer.is_cuda else (None, False)
        return ws.next_epoch(lambda: ws.restart_epochs(self.ctx.group.pg()), self.ctx.tag)

    def __exit__(self, kind, exc, tb) -> bool:
        if kind is not None:
            self.ws.broken = (
                f"commfuse.{self.op}: an earlier call on group {self.ws.group_name!r} failed after its exchange "
                f"began ({kind.__name__}: {exc}); the ranks' call counters may differ. Call "
                "commfuse.release_all() on every rank to start over."
            )
            return False
        if self.record:  # after the call's work: side streams rejoined the caller's stream before this
            self.ws.last_event.record(self.stream)
        return False


@contextlib.contextmanager
def lane_exchange(lane, capturing: bool):
    """A graph-lane call (its epochs live on the device, in the lane's counters): eagerly, after
    the lane's previous call (``GraphLane.order``, as ``exchange`` orders the workspace's); in a
    capture, the replays run in the order of the stream they are launched on (a replay has no
    host step: replay one group's graphs from one stream)."""
    stream = torch.cuda.current_stream(lane.buffer.device) if lane.buffer.is_cuda and not capturing else None
    record = lane.order(stream) if stream is not None else False
    yield
    if record:
        lane.last_event.record(stream)


def matmul_into(a, b, bias, out) -> None:
    reference.matmul(a, b, bias, out=out)


def per_row(bias) -> bool:
    """A 2-D bias with a row per output row (sliced with the rows); else broadcast, or none."""
    return bias is not None and bias.dim() >= 2 and bias.shape[0] != 1


def bias_rows(bias, lo: int, hi: int):
    """The bias for output rows lo:hi (a per-row 2-D bias is sliced; a broadcast one is not)."""
    return bias[lo:hi] if per_row(bias) else bias


def row_chunks(bias, rows: list) -> list:
    """``bias_rows`` of each chunk of the output, the chunks of ``rows`` rows each (one ``split``)."""
    return list(bias.split(rows)) if per_row(bias) else [bias] * len(rows)


def sum_rank_order(parts: list, out) -> None:
    """``out = parts[0] + parts[1] + ...`` in rank order, on every rank alike (at 2 ranks rounded
    once, as the Triton kernels round; beyond, after each add)."""
    if len(parts) == 1:  # one rank (the host-cost benchmark forces the paths there)
        out.copy_(parts[0])
        return
    torch.add(parts[0], parts[1], out=out)
    for part in parts[2:]:
        out.add_(part)
