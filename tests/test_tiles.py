"""The tile kernels' GEMM, the fused all-reduce kernel's tile order, and every fused kernel (all-
reduce, reduce-scatter, all-gather, split-K) and the exchange kernels as one rank with its peers
simulated, in Triton's CPU interpreter (fp16: the interpreter mishandles bf16).
The cross-GPU parts run in tests/gpu."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


#: script -> what it checks: each runs in a fresh interpreter process with TRITON_INTERPRET=1
INTERPRETED = {
    "interpreted_tiles.py": "the tile GEMM (bf16, and FP8 with _scaled_mm's scales) and the fused all-reduce's tile order",
    "interpreted_split_k.py": "the split-K kernel's slices, sums, pushes, flags, counters, ticket "
                              "and (graph lane) device epochs",
    "interpreted_fused.py": "the fused all-reduce (both forms: slabs, slots, pushes, ready/done "
                            "flags, reducers, inline copies waiting for late peers, TMA pushes) and the fused "
                            "all-gather (chunk pushes and flags)",
    "interpreted_inline_order.py": "the fused all-reduce's inline-copy order (the kernel's own "
                                   "function) and an exhaustive model of its waits: never stuck, "
                                   "stuck without a copy's release before its wait",
    "interpreted_exchange.py": "one-shot, two-shot (both phases), the pull gather, the "
                               "reduce-scatter, the graph lane's staged one-shot, the one-shot "
                               "and barrier reading their epoch on the device, and NaN (not stale "
                               "bytes) where a late peer's data would go",
    "interpreted_norm_epilogue.py": "the all-reduce + add + RMSNorm kernels (one-shot, the graph lane's "
                                    "staged form): h and n against fp32 and the unfused chain's "
                                    "rounding (both forms), odd hidden sizes, NaN for a late peer",
}


#: Scripts that take more than ~20 s of CPU (the fused kernels' cases run every program of every
#: position one after another): marked slow
SLOW = {"interpreted_fused.py", "interpreted_norm_epilogue.py", "interpreted_inline_order.py", "interpreted_exchange.py",
        "interpreted_split_k.py"}


@pytest.mark.parametrize("script", [pytest.param(s, marks=pytest.mark.slow) if s in SLOW else s
                                    for s in sorted(INTERPRETED)])
def test_kernels_in_the_interpreter(script):
    """Each script checks its kernels on the CPU; all but the first as one rank of 2, 4 and 8
    with the other ranks' pushes and flags simulated (see each script's docstring)."""
    pytest.importorskip("triton.tools.tensor_descriptor")
    if script != "interpreted_tiles.py":
        pytest.importorskip("iris")
    root = os.path.dirname(HERE)
    # the script's own directory leads its sys.path, not the working directory: without the
    # checkout's root first, ``import commfuse`` finds whatever copy is installed
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    run = subprocess.run([sys.executable, os.path.join(HERE, script)], env=env,
                         capture_output=True, text=True, timeout=600, cwd=root)
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]


@pytest.mark.parametrize("form", ["single_row_transposed", "odd_offset_view", "transposed", "expanded", "dense"])
def test_descriptors_accept_every_activation_layout(form):
    """TMA wants 16-byte aligned rows and base: a one-row transposed view (torch gives its row
    stride as 1), a view at an odd offset or an expanded row (stride 0) must be copied densely,
    never described as is."""
    pytest.importorskip("triton.tools.tensor_descriptor")
    import torch

    from commfuse.kernels import tiles

    k, n = 64, 32
    a = {"single_row_transposed": torch.randn(k, 1, dtype=torch.float16).t(),
         "odd_offset_view": torch.randn(5 * k + 3, dtype=torch.float16)[3:].view(5, k),
         "transposed": torch.randn(k, 7, dtype=torch.float16).t(),
         "expanded": torch.randn(1, k, dtype=torch.float16).expand(4, k),  # row stride 0
         "dense": torch.randn(6, k, dtype=torch.float16)}[form]
    w = torch.randn(n, k, dtype=torch.float16)
    cfg = tiles.TileConfig(bm=16, bn=16, bk=16)
    for b, transposed in ((w.t(), True), (w.t().contiguous(), False)):
        a_desc, b_desc, b_t = tiles.descriptor_operands(a, b, cfg)
        assert b_t is transposed
        assert a_desc.strides == [k, 1] and a_desc.base.data_ptr() % 16 == 0
        assert torch.equal(a_desc.base, a)  # the same values, wherever they now live
        assert b_desc.strides == ([k, 1] if transposed else [n, 1])
