"""``graph``: ``mm_all_reduce`` through the group's graph lane, whose epochs live on the device, so
a CUDA graph can capture the call once and replay it any number of times (``mode="reduce-overhead"``).

    capture:  [ cuBLAS -> local buffer ][ staged one-shot: copy into the lane, signal, sum ]
    or, for few rows (a rule's ``{"split_k": true}``): the split-K kernel, in the lane's buffers.

Calls inside a capture take it when their output fits the lane (``COMMFUSE_GRAPH_BYTES``, agreed by
every rank); once a process replays graphs on a group, its eager calls that fit take it too (a rank
re-warming its graphs must meet its peer's replays on the same flags). The lane is allocated with
the group's first workspace, never inside a capture (allocation is collective); a call that finds
none runs NCCL.

``scaled_mm_all_reduce`` (FP8, tensor-wise scales) has the same path: the graph's ``_scaled_mm``
(``OpSpec.product``) into a local buffer, then the staged one-shot of its output dtype.
"""

from __future__ import annotations


from ...kernels.sizes import fused_split_k
from ..workspace import GRAPH_SLOTS, graph_lane_capacity
from .base import Call, Path, symmetric_support
from .split_k import support as split_k_support


def _split_k_config(call: Call, facts) -> fused_split_k.SplitConfig:
    return fused_split_k.config(call.m, call.k, call.n, min(facts.sms, GRAPH_SLOTS))


class GraphAllReduce(Path):
    name = "graph"
    capture = True

    def __init__(self, op: str = "mm_all_reduce", split_k: bool = True):
        self.op, self.split_k = op, split_k  # whether a rule's split-K variant may run

    def supports(self, call: Call, facts) -> str | None:
        why = symmetric_support(call, facts)
        if why is None and call.exchanged_bytes > facts.lane_bytes:
            why = f"{call.exchanged_bytes} bytes is past the graph lane's COMMFUSE_GRAPH_BYTES ({facts.lane_bytes})"
        return why

    def supports_variant(self, call: Call, facts, variant: dict | None) -> str | None:
        why = self.supports(call, facts)
        if why is None and variant and variant.get("split_k"):
            if not self.split_k:
                return "the split-K kernel multiplies fp16 and bf16 operands only"
            why = split_k_support(call, facts)
            if why is None:
                slots, counters = graph_lane_capacity()
                why = fused_split_k.misfit_sizes(call.m, call.n, call.world, _split_k_config(call, facts),
                                                 call.dtype, True, slots, counters, facts.lane_bytes)
        return why

    def workspace_bytes(self, call: Call) -> int:
        return call.m * call.n * call.itemsize  # the lane is its own buffer; eager calls size the workspace alike

    def config(self, call: Call, facts, variant=None) -> fused_split_k.SplitConfig | None:
        """The split-K kernel's tiling where the rule asks for it, else None (the staged one-shot)."""
        return _split_k_config(call, facts) if variant and variant.get("split_k") else None


GRAPH = GraphAllReduce()
SCALED_GRAPH = GraphAllReduce("scaled_mm_all_reduce", split_k=False)
