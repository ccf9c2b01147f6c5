"""``ce_overlap``: ``mm_all_reduce`` as cuBLAS in row chunks, each chunk's exchange done by the copy
engines (no SMs) while the next chunk multiplies.

    unfused:   mm(a, b) ----------------------> all_reduce -> out
    this path: mm(chunk 0) mm(chunk 1) ... mm(chunk c-1) [one-shot of chunk c-1 on the SMs]
                        barrier 0, pull 0, add 0  barrier 1, pull 1, add 1 ...   (side streams)

Every chunk's GEMM is queued first, then the side streams' work, each chunk's behind its GEMM's
event: the same order on the GPU, and the host switches streams once per side stream, not per
chunk. A barrier kernel learns that every rank's rows of a chunk are ready, the copy engines pull
the peers' rows of it and one local add sums them in rank order; barriers, pulls and adds each run
on a side stream of their own, so the pulls go back to back while later barriers wait. The last
chunk, after the last GEMM, is pulled and summed by the one-shot kernel on the SMs the GEMMs have
left (where its flag slots fit after the chunks' barriers; else the copy engines take it too).
A call whose operands, output and scratch sit where an earlier call of its shape had them is
replayed as a CUDA graph (``ce_graphs.py``): one fill of the epoch cell and one graph launch
instead of a launch per chunk's GEMM, barrier, pulls and add.

What keeps a peer from writing a partial this rank still pulls: consecutive calls on a group come
from one stream (or streams ordered after each other: ``Workspace.order`` in
``runtime/workspace.py``, through ``paths/common.exchange``), a call's barriers follow its first
GEMM on the caller's stream, which follows the previous call's pulls.
"""

from __future__ import annotations

import dataclasses


from ... import env
from .base import Call, Path

#: Rows per chunk the default aims for, and the chunk count's bounds: each chunk costs a GEMM, a
#: barrier, a pull per peer and an add; fewer rows per chunk leave a shorter exposed tail.
CHUNK_ROWS, MIN_CHUNKS, MAX_CHUNKS = 1024, 2, 8
#: One flag slot per chunk: at most this many chunks.
CHUNK_LIMIT = 256


@dataclasses.dataclass(frozen=True)
class CeConfig:
    rows: tuple[int, ...]  # each chunk's rows, in order
    graphs: bool = True  # replay the call as a CUDA graph where its addresses repeat


def chunk_rows(m: int, chunks: int | None = None, last: int = 0) -> tuple[int, ...]:
    """Each chunk's rows: ``chunks`` equal chunks (default 1024-row ones, 2 to 8; the last shorter
    by the remainder); ``last`` > 0 sets the last chunk's rows instead, the others sharing the rest
    in multiples of 64 rows (a value that leaves them no rows keeps the even chunks)."""
    chunks = max(1, min(chunks or min(MAX_CHUNKS, max(MIN_CHUNKS, m // CHUNK_ROWS)), m, CHUNK_LIMIT))
    if chunks < 2 or not 0 < last < m - (chunks - 2):
        rows = max(1, -(-m // chunks))
        return tuple(min(rows, m - lo) for lo in range(0, m, rows))
    rest = m - last
    rows = -(-rest // ((chunks - 1) * 64)) * 64
    return tuple(min(rows, rest - lo) for lo in range(0, rest, rows)) + (last,)


class CeOverlapAllReduce(Path):
    op = "mm_all_reduce"
    name = "ce_overlap"

    def supports(self, call: Call, facts) -> str | None:
        why = super().supports(call, facts)
        if why is None and not facts.copy_engines:
            why = f"the {facts.provider} provider gives no per-peer views for the copy engines"
        return why

    def workspace_bytes(self, call: Call) -> int:
        return call.m * call.n * call.itemsize

    def config(self, call: Call, facts, variant=None) -> CeConfig:
        return CeConfig(chunk_rows(call.m), graphs=env.current().ce_graphs)


CE_OVERLAP = CeOverlapAllReduce()
