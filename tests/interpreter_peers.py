"""Shared set-up of the interpreter scripts (``interpreted_*.py``, run under TRITON_INTERPRET=1):
what the interpreter cannot run is replaced, and a group of ranks lives in one process.

The interpreter has no inline assembly, so the GPU timer becomes a clock that never advances (no
wait times out; the scripts' subprocess timeout bounds a wait that never ends) and the fused
all-gather's proxy fence and the fused all-reduce's wait for its TMA pushes no-ops (one memory,
stores done when issued). The fused all-reduce's ablation bits are
constexpr globals for the compiler and plain integers for the interpreter. The group's error word
(``Workspace.err``) is a plain int32[8] here: pinned memory needs CUDA.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

import commfuse
from commfuse.kernels import fused_all_gather, fused_all_reduce, fused_split_k, sync
from commfuse.runtime import workspace as symm

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
assert os.path.dirname(os.path.dirname(os.path.abspath(commfuse.__file__))) == _ROOT, (
    f"commfuse imported from {commfuse.__file__}, not from this checkout ({_ROOT}): put it first on PYTHONPATH")


@triton.jit
def _now():
    return tl.full((), 0, tl.int64)


@triton.jit
def _no_fence():
    pass


sync.now = _now
fused_all_reduce.now = _now
fused_all_gather.now = _now
fused_split_k.now = _now
fused_all_gather._proxy_fence = _no_fence
fused_all_reduce._bulk_stores_done = _no_fence
fused_all_reduce.NO_REMOTE, fused_all_reduce.NO_WAIT, fused_all_reduce.NO_COPY = 1, 2, 4

DT = torch.float16  # the interpreter mishandles bf16


def group(world: int, data_bytes: int, programs: int, lane: bool = False, timeout_ns: int = 600 * 10**9) -> list:
    """One workspace (``lane``: graph lane) per rank of ``world`` over CPU memory, all sharing one
    heap-bases table, so iris translates a pointer of one into any other, and one error word (the
    group's, as on GPUs). ``timeout_ns``: every wait's bound (below zero: a wait is late at once,
    the interpreter's clock standing still)."""
    header = symm.GRAPH_FLAG_BYTES if lane else symm.HEADER_BYTES
    bufs = [torch.zeros(header + 2 * data_bytes, dtype=torch.uint8) for _ in range(world)]
    bases = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    err = torch.zeros(8, dtype=torch.int32)
    if lane:
        return [symm.GraphLane("0", r, world, bufs[r], bases, data_bytes, programs, err=err, timeout_ns=timeout_ns)
                for r in range(world)]
    return [symm.Workspace("0", r, world, bufs[r], bases, data_bytes, max_programs=programs, err=err,
                           timeout_ns=timeout_ns) for r in range(world)]
