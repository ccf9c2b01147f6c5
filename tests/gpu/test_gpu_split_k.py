"""The split-K kernel of mm_all_reduce for few rows (``fused_split_k.py``) against an fp32
reference of the unfused computation, on fresh random data with poisoned outputs, 2 ranks: both
weight layouts, a transposed activation, 1-D and per-row bias, fp16 and bf16, ragged M, N and K,
slice counts that do not divide K, both providers; the default dispatch for decode-sized
calls; calls mixed with the other kernels on one workspace; a peer that never comes; the sums
pushed as LL words and as values with a flag per tile. Slice counts and the LL form are the
path's configuration (``fused_split_k.config(..., split=, ll=)``), passed in its ``Context``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from commfuse import check_errors, env
from commfuse.kernels import fused_split_k
from commfuse.runtime import groups, policy
from commfuse.runtime.paths.base import Call
from commfuse.runtime.counters import PATHS
from gpu_util import group_state, relerr, run_forced, start_over, timed_out, workspaces
from test_gpu_fused import _fused_call, _operands, _reference

pytestmark = pytest.mark.gpu


def _split_k(**changes):
    """The split-K path's configuration for a call (``fused_split_k.config`` for the group's SM
    count, as the path makes it), with ``changes`` (``split``, ``ll``)."""
    return lambda call, facts: fused_split_k.config(call.m, call.k, call.n, facts.sms, **changes)


def _split_k_call(a, b, c, group_name, **changes):
    return _fused_call(a, b, c, group_name, path="split_k", config=_split_k(**changes))


@pytest.fixture(params=["torch", "iris"])
def provider(request, settings):
    settings(symm_provider=request.param)
    return request.param


@pytest.mark.parametrize("m", [1, 7, 32, 200])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", ["plain", "bias", "row_bias", "weight_t", "a_transposed"])
@pytest.mark.parametrize("ll", [False, True], ids=["values", "ll"])
def test_split_k_matches_the_fp32_reference(nccl, provider, m, dtype, form, ll):
    """``ll``: the sums pushed with their flags in LL words (``SplitConfig.ll``), or as values
    followed by one flag per tile."""
    k, n = 1000, 776  # K is not a multiple of the 128-deep step, N not of the 128-wide tile
    torch.manual_seed(1000 * dist.get_rank() + m)
    _split_k_call(*_operands(m, k, n, dtype, form), nccl.group_name, ll=ll)


@pytest.mark.parametrize("split", [1, 3, 5, 8])
def test_split_k_forced_slice_counts(nccl, split):
    """8 K steps in 3 slices leave a short last slice (3, 3, 2), in 5 an empty one (2 each, then
    none), in 8 one step each."""
    torch.manual_seed(5 + dist.get_rank())
    a, b, c = _operands(16, 1000, 776, torch.bfloat16, "bias")
    _split_k_call(a, b, c, nccl.group_name, split=split)


@pytest.mark.parametrize("m", [1, 4, 32])
def test_default_dispatch_takes_split_k_for_decode_sized_calls(nccl, settings, m):
    settings(algo=None)
    _, facts = group_state(nccl.group_name)
    assert policy.choose(Call("mm_all_reduce", m, 7168, 4096, torch.bfloat16, 2), facts).name == "split_k"
    torch.manual_seed(9 + dist.get_rank())
    _fused_call(*_operands(m, 7168, 4096, torch.bfloat16, "weight_t"), nccl.group_name, path="split_k", forced=False)


def test_split_k_mixed_with_the_other_kernels(nccl):
    """Back-to-back split-K, fused tile, one-shot and fused reduce-scatter calls share one
    workspace (parities, epochs, tile flags, the ticket): each result is checked; afterwards the
    ticket is where the host counted and every arrival counter is back at zero. A forced split-K
    call of more rows than the kernel takes runs the rules' choice instead."""
    gen = torch.Generator().manual_seed(6)  # the same sequence on every rank
    torch.manual_seed(51 + dist.get_rank())
    before = PATHS.copy()
    expected = {"split_k": 0, "fused": 0}
    for i in range(80):
        algo = ("split_k", "fused", "one_shot", "split_k")[i % 4]
        m = (1, 16, 100, 1024)[int(torch.randint(4, (1,), generator=gen))]
        if i % 8 != 6 and algo in expected and (algo == "fused" or m <= fused_split_k.MAX_ROWS):
            expected[algo] += 1
        a, b, _ = _operands(m, 2048, 1024, torch.bfloat16, "weight_t")
        if i % 8 == 6:
            with env.override(algo="fused"):
                out = torch.ops.commfuse.mm_reduce_scatter(a, b, None, [m, 1024], 0, 2, nccl.group_name) \
                    if m % 2 == 0 else torch.ops.commfuse.mm_all_reduce(a, b, None, nccl.group_name)
            want = _reference(a, b, None)
            want = want.chunk(2)[dist.get_rank()] if m % 2 == 0 else want
        else:
            with env.override(algo=algo):
                out = torch.ops.commfuse.mm_all_reduce(a, b, None, nccl.group_name)
            want = _reference(a, b, None)
        check_errors()
        assert relerr(out, want) < 1e-2, f"call {i}: {algo} M={m}"
    used = PATHS - before
    assert used["mm_all_reduce:split_k"] == expected["split_k"] >= 20
    assert used["mm_all_reduce:fused"] >= expected["fused"] >= 10  # plus the odd-row calls at i % 8 == 6
    torch.cuda.synchronize()
    for ws in workspaces():
        assert int(ws.ticket.item()) == ws.ticket_base
        assert ws.tile_counters.eq(0).all()


@pytest.mark.parametrize("ll", [False, True], ids=["values", "ll"])
def test_split_k_skipped_call_poisons_and_names_the_peer(nccl, settings, ll):
    """Rank 1 skips a call: rank 0 gets NaN, not its partial (nor, LL, the sums of the call
    before in the same parity), and an error naming the group and both ranks."""
    settings(timeout_s=1)
    start_over()  # a workspace allocated now waits at most 1 s
    a, b, _ = _operands(16, 1024, 1024, torch.bfloat16, "weight_t")

    def call():
        return run_forced("mm_all_reduce", "split_k", a, b, None, nccl.group_name, config=_split_k(ll=ll))[0]

    for _ in range(2):  # both ranks: the workspace exists, both parities hold a call's sums
        call()
    check_errors()
    dist.barrier()
    if dist.get_rank() == 0:
        out = call()
        with pytest.raises(RuntimeError, match=timed_out("mm_all_reduce (fused split-K kernel)", nccl.group_name)):
            check_errors()
        assert torch.isnan(out).all()
        assert groups.get(nccl.group_name).workspace.tile_counters.eq(0).all()
    start_over()  # epochs now differ between ranks: fresh workspaces (with the default bound)
