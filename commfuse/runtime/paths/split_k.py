"""``split_k``: ``mm_all_reduce`` for few rows (decode, small batches) in one kernel
(``kernels/fused_split_k.py``): a split-K GEMM whose last K slice of each tile sums the slices,
pushes the sum to every peer and raises one flag per peer.

    unfused:   [ GEMM (few rows: streams the weight) ][ all_reduce: latency ]
    this path: [ GEMM slices over every SM; each tile's sum pushed as it completes ][ last sums ]

With few rows the exchange costs latency, not bandwidth: what is left after the GEMM is one push
and one flag (or, for few values, the push alone: LL words that carry their flag).

The FP8 all-reduces (``scaled_mm_all_reduce``, ``rowwise_scaled_mm_all_reduce``: FP8 decode) take
the same kernel on FP8 operands: each rank's scales on its tiles' sums of slices before the push,
so what is pushed is the output dtype's, as the unfused graph's partial.
"""

from __future__ import annotations

import dataclasses


from ...kernels.sizes import fused_split_k
from ..workspace import COUNTER_BYTES, TILE_FLAG_SLOTS
from .base import Call, Path
from .ar_fused import fused_support

#: The workspace is sized for this many programs, more than any GPU has SMs: a group's agreed
#: count (its smallest GPU's) never needs more slices, hence never more bytes, and the request is
#: the same on every rank whatever its GPU (allocation is collective).
PLAN_PROGRAMS = 1024


def support(call: Call, facts, fp8: bool = False) -> str | None:
    """Why the split-K kernel (on ``fp8`` operands) cannot take ``call`` (what every tile kernel
    needs, then its own)."""
    return fused_support(call, facts, False, fp8) or fused_split_k.unsupported(
        call.m, call.k, call.n, call.dtype, call.world, COUNTER_BYTES // 4, TILE_FLAG_SLOTS)


def config(call: Call, programs: int) -> fused_split_k.SplitConfig:
    """The tiling and K slices for a group whose smallest GPU has ``programs`` SMs."""
    return fused_split_k.config(call.m, call.k, call.n, programs)


def plan_bytes(call: Call) -> int:
    """Per-parity bytes for this shape on any group: those of its wide blocks with their most
    slices (``PLAN_PROGRAMS``), which no tiling of fewer SMs exceeds."""
    wide = fused_split_k.config(call.m, call.k, call.n, PLAN_PROGRAMS, tile=fused_split_k.wide_tile(call.m, call.k, call.n))
    return fused_split_k.data_bytes(call.m, call.n, call.world, wide, call.dtype)


class SplitK(Path):
    name = "split_k"

    def __init__(self, op: str = "mm_all_reduce", fp8: bool = False):
        self.op, self.fp8 = op, fp8

    def supports(self, call: Call, facts) -> str | None:
        return support(call, facts, self.fp8)

    def workspace_bytes(self, call: Call) -> int:
        return plan_bytes(call)

    def config(self, call: Call, facts, variant=None) -> fused_split_k.SplitConfig:
        return config(call, facts.sms)

    def tagged_config(self, cfg: fused_split_k.SplitConfig) -> fused_split_k.SplitConfig:
        """LL words carry the call count alone (no room for a tag): flags, which carry it."""
        return dataclasses.replace(cfg, ll=False)


SPLIT_K = SplitK()
SCALED_SPLIT_K = SplitK("scaled_mm_all_reduce", fp8=True)
ROWWISE_SPLIT_K = SplitK("rowwise_scaled_mm_all_reduce", fp8=True)
