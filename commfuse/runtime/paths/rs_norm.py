"""``pull``: ``mm_reduce_scatter_add_rms_norm`` (sequence parallelism's row-parallel linear, its
reduce-scatter, the residual add and the next RMSNorm) as cuBLAS into the symmetric workspace,
then one kernel that pulls this rank's share of every rank's partial, sums it, adds the residual
and normalises each row (``kernels/norm_epilogue.py``'s one-shot over the share's rows).

    unfused:   mm(a, b) -> reduce_scatter(partial) -> share -> [ Inductor: h = residual + share,
                                                                n = rmsnorm(h) * w ]
    this path: mm(a, b) into the workspace's half of this call -> pull + add + norm kernel -> h, n

As ``ar_norm.py``'s one-shot, it saves the share's trip through memory and a launch; a program
owns whole rows, so the hidden size is at most ``MAX_HIDDEN``; other GPUs than the one measured
and groups without symmetric paths run the unfused chain (NCCL). No graph-lane form: inside a
capture the call runs NCCL (the pattern leaves such chains to Inductor).
"""

from __future__ import annotations

from .ar_norm import OneShotNorm


class ReduceScatterNorm(OneShotNorm):
    op = "mm_reduce_scatter_add_rms_norm"
    name = "pull"


PULL = ReduceScatterNorm()
