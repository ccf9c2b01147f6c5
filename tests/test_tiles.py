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


def test_tile_gemm_and_fused_tile_order_in_the_interpreter():
    pytest.importorskip("triton.tools.tensor_descriptor")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, os.path.join(HERE, "interpreted_tiles.py")], env=env,
                         capture_output=True, text=True, timeout=600, cwd=os.path.dirname(HERE))
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]


def test_split_k_kernel_as_one_rank_of_2_4_and_8_in_the_interpreter():
    """The few-rows kernel's slices, sums, pushes, flags, counters, ticket and (graph lane) device
    epochs, with the other ranks' pushes simulated (``interpreted_split_k.py``)."""
    pytest.importorskip("triton.tools.tensor_descriptor")
    pytest.importorskip("iris")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, os.path.join(HERE, "interpreted_split_k.py")], env=env,
                         capture_output=True, text=True, timeout=600, cwd=os.path.dirname(HERE))
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]


def test_fused_kernels_as_one_rank_of_2_4_and_8_in_the_interpreter():
    """The fused all-reduce (both forms: slabs, slots, pushes, ready/done flags, reducers) and the
    fused all-gather (chunk pushes and flags, the gathered rows), with the other ranks' pushes
    simulated (``interpreted_fused.py``)."""
    pytest.importorskip("triton.tools.tensor_descriptor")
    pytest.importorskip("iris")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, os.path.join(HERE, "interpreted_fused.py")], env=env,
                         capture_output=True, text=True, timeout=600, cwd=os.path.dirname(HERE))
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]


def test_exchange_kernels_as_one_rank_of_2_4_and_8_in_the_interpreter():
    """One-shot, two-shot (both phases, world shares), the pull gather and the reduce-scatter,
    with the other ranks' workspaces and flags simulated (``interpreted_exchange.py``)."""
    pytest.importorskip("iris")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, os.path.join(HERE, "interpreted_exchange.py")], env=env,
                         capture_output=True, text=True, timeout=600, cwd=os.path.dirname(HERE))
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
