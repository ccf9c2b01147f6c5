"""``one_shot``: ``mm_all_reduce_add_rms_norm`` as cuBLAS into the symmetric workspace, then one
kernel that sums the ranks' partials, adds the residual and normalises each row
(``kernels/norm_epilogue.py``).

    unfused:   mm(a, b) -> all_reduce(partial) -> out -> [ Inductor: h = residual + out, n = rmsnorm(h) * w ]
    this path: mm(a, b) into the workspace's half of this call -> exchange + add + norm kernel -> h, n

What it saves is the reduced sum's trip through memory (written, then read back by the add + norm
kernel) and a kernel launch. A program of the kernel owns whole rows, so the hidden size is at most
``MAX_HIDDEN``; beyond it, and on a group that runs no symmetric path, the call runs the unfused
chain (NCCL). Measured on sm_90 only: other architectures run NCCL too.

``graph``: the same through the group's graph lane (``paths/ar_graph.py``: epochs on the device),
so a CUDA graph captures the call once and replays it (decode under ``mode="reduce-overhead"``,
where a launch saved weighs most):

    capture:  [ cuBLAS -> local buffer ][ staged exchange + add + norm: copy into the lane, signal,
                                          sum, add the residual, normalise ]

A call past the lane (``COMMFUSE_GRAPH_BYTES``) or that finds no lane runs the unfused chain.
"""

from __future__ import annotations

from ...kernels.sizes.norm_epilogue import MAX_HIDDEN
from .base import Call, Path, symmetric_support

#: The architecture the kernel was measured on (``docs/decisions.md`` §17).
ARCH = "sm_90"


class OneShotNorm(Path):
    op = "mm_all_reduce_add_rms_norm"
    name = "one_shot"

    def supports(self, call: Call, facts) -> str | None:
        why = symmetric_support(call, facts)
        if why:
            return why
        if facts.arch != ARCH:
            return f"the norm epilogue is measured on {ARCH} only, not {facts.arch}"
        if call.n > MAX_HIDDEN:
            return f"rows of {call.n} elements are past the norm epilogue's {MAX_HIDDEN}"
        if min(call.m, call.n) < 1:
            return "an empty dimension"
        return None

    def workspace_bytes(self, call: Call) -> int:
        return call.m * call.n * call.itemsize


ONE_SHOT = OneShotNorm()


class GraphNorm(OneShotNorm):
    name = "graph"
    capture = True

    def supports(self, call: Call, facts) -> str | None:
        why = super().supports(call, facts)
        if why is None and call.exchanged_bytes > facts.lane_bytes:
            why = f"{call.exchanged_bytes} bytes is past the graph lane's COMMFUSE_GRAPH_BYTES ({facts.lane_bytes})"
        return why


GRAPH = GraphNorm()
