"""Turning a kernel's timed-out wait into a Python error, and keeping a group out of step from
pairing calls again.

A wait that passes its bound writes ``[1, op, rank, peer]`` into its group's error word (a pinned
host int32[8], ``workspace.error_word``) and lets the kernel finish; the host reads the word, with
no synchronisation, at the group's next call (``check``) or whenever ``check_errors()`` is called.
The error names the group, the op, the global ranks of the waiter and of the late peer.

After a timeout the group refuses further calls until ``commfuse.release_all()``: a peer slower
than the bound may since have paired its waits with this rank's later calls.
"""

from __future__ import annotations

import torch

from ..kernels.codes import GRAPH_LANE_OP, OPS
from . import groups as groups_mod


def _message(group, op: int, rank: int, peer: int, during: str | None, timeout_s: float) -> str:
    now = f" (noticed when {during} was called)" if during else ""
    return (
        f"commfuse.{OPS.get(op, op)}: on group {group.name!r}, rank {group.global_rank(rank)} timed out after "
        f"{timeout_s:g} s waiting for rank {group.global_rank(peer)} (group ranks {rank} and {peer}){now}. "
        "The peer did not reach the same collective call: a rank that raised, skipped the call or diverged. "
        "Results of that call are invalid. COMMFUSE_TIMEOUT_S sets the bound.")


def check(group, during: str | None = None) -> None:
    """Raise if a kernel of ``group`` timed out (each failure is raised once; the group then
    refuses calls until ``release_all``)."""
    if group.err_host[0] == 0:
        return
    word = group.err
    op, rank, peer = (int(x) for x in word[1:4])
    word.zero_()
    ws = group.workspace
    timeout_s = (ws.timeout_ns if ws is not None else 0) / 1e9
    msg = _message(group, op, rank, peer, during, timeout_s)
    if op == GRAPH_LANE_OP:  # its epochs are on the device: this group's ranks stay out of step
        group.lane_failure = msg
    group.broken = (f"{msg} Group {group.name!r} refuses further calls: call commfuse.release_all() on every "
                    "rank to start over.")
    if ws is not None:
        ws.broken = group.broken
    groups_mod.bump()
    raise RuntimeError(msg)


def check_errors() -> None:
    """Synchronise the current device and raise if a commfuse wait of any group timed out."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    for group in groups_mod.all_groups():
        check(group)
