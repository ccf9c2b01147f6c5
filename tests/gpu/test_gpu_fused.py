"""The fused tile kernel of mm_all_reduce (``fused_all_reduce.py``) against an fp32 reference of
the unfused computation, on fresh random data with poisoned outputs, 2 ranks. Every form the
kernel meets in compiled graphs: both weight layouts, a transposed activation, 1-D and per-row
bias, fp16 and bf16, tile-ragged M and N, both symmetric-memory providers; plus repeated calls
mixed with the other paths, and a peer that never comes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from commfuse.kernels import cuda_paths, fused_all_reduce, symm
from commfuse.kernels.sync import check_errors
from gpu_util import gather_all, poison, relerr

pytestmark = pytest.mark.gpu


def _operands(m, k, n, dtype, form):
    a = torch.randn(k, m, device="cuda", dtype=dtype).t() if form == "a_transposed" else \
        torch.randn(m, k, device="cuda", dtype=dtype)
    b = (torch.randn(n, k, device="cuda", dtype=dtype).t() if form == "weight_t" else
         torch.randn(k, n, device="cuda", dtype=dtype)) / k ** 0.5
    c = {"bias": torch.randn(n, device="cuda", dtype=dtype),
         "row_bias": torch.randn(m, 1, device="cuda", dtype=dtype)}.get(form)
    return a, b, c


def _reference(a, b, c):
    ref = sum(x.float() @ y.float() for x, y in zip(gather_all(a), gather_all(b)))
    if c is not None:
        ref = ref + sum(t.float() for t in gather_all(c))
    return ref


def _fused_call(a, b, c, group_name, path="fused"):
    """One call on poisoned memory: it must take ``path`` and equal the fp32 reference, and every
    rank must return the same reduced tensor, not its own partial."""
    poison()
    before = cuda_paths.PATHS[f"mm_all_reduce:{path}"]
    out = torch.ops.commfuse.mm_all_reduce(a, b, c, group_name)
    ref = _reference(a, b, c)
    check_errors()
    assert cuda_paths.PATHS[f"mm_all_reduce:{path}"] == before + 1
    assert relerr(out, ref) < 1e-2
    outs = gather_all(out)
    assert torch.equal(outs[0], outs[1])
    return out


@pytest.fixture(params=["torch", "iris"])
def provider(request, monkeypatch):
    monkeypatch.setenv("COMMFUSE_SYMM_PROVIDER", request.param)
    return request.param


#: How the peers' pushed sums reach the output: ``COMMFUSE_TILE_CONFIG`` and
#: ``COMMFUSE_AR_COPY_LAG`` per form (``inline_lag0``: each copy right behind its own tile, so
#: copies usually wait for the peer's flag, releasing their pending tile first).
#: ``inline_tma``: the pushes are TMA stores (``COMMFUSE_FUSED_TMA_PUSH=1``, an experiment).
COPIES = {"reducers": ("128x256x64s3w8g8r16o1", None), "inline": ("128x256x64s3w8g8r0o1", None),
          "inline_lag0": ("128x256x64s3w8g8r0o1", "0"), "inline_tma": ("128x256x64s3w8g8r0o1", None)}


def _copies(monkeypatch, copies):
    cfg, lag = COPIES[copies]
    monkeypatch.setenv("COMMFUSE_FUSED_TMA_PUSH", "1" if copies == "inline_tma" else "0")
    monkeypatch.setenv("COMMFUSE_TILE_CONFIG", cfg)
    if lag is None:
        monkeypatch.delenv("COMMFUSE_AR_COPY_LAG", raising=False)
    else:
        monkeypatch.setenv("COMMFUSE_AR_COPY_LAG", lag)
    return fused_all_reduce.INLINE_CALLS


@pytest.mark.parametrize("copies", sorted(COPIES))
@pytest.mark.parametrize("m", [1, 7, 129, 1000, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", ["plain", "bias", "row_bias", "weight_t", "a_transposed"])
def test_fused_matches_the_fp32_reference(nccl, provider, m, dtype, form, copies, monkeypatch):
    if copies in ("inline_lag0", "inline_tma") and dtype == torch.float16:
        pytest.skip("the copies' order does not depend on the dtype: bf16 covers it")
    monkeypatch.setenv("COMMFUSE_ALGO", "fused")
    inline_before = _copies(monkeypatch, copies)
    tma_before = fused_all_reduce.TMA_CALLS
    k, n = 1024, 776  # N is not a multiple of the 256-wide tile; rows are 16-byte multiples
    torch.manual_seed(1000 * dist.get_rank() + m)
    _fused_call(*_operands(m, k, n, dtype, form), nccl.group_name)
    assert fused_all_reduce.INLINE_CALLS == inline_before + (copies != "reducers")
    assert fused_all_reduce.TMA_CALLS == tma_before + (copies == "inline_tma")


@pytest.mark.parametrize("m, k, n, path", [(1536, 2048, 4096, "fused"), (1024, 512, 8192, "fused"),
                                          (2048, 4096, 4104, "fused"), (1024, 512, 4096, "one_shot")])
def test_default_dispatch_of_1024_to_4096_rows(nccl, monkeypatch, m, k, n, path):
    """Without ``COMMFUSE_ALGO`` a call of 1024-4096 rows, K <= 4096 and more than one wave of
    128x256 tiles takes the fused kernel (one wave: cuBLAS + one-shot), with the default tiling,
    and equals the fp32 reference."""
    for name in ("COMMFUSE_ALGO", "COMMFUSE_TILE_CONFIG", "COMMFUSE_AR_COPY_LAG", "COMMFUSE_FUSED_TMA_PUSH"):
        monkeypatch.delenv(name, raising=False)
    torch.manual_seed(23 + dist.get_rank() + m + n)
    _fused_call(*_operands(m, k, n, torch.bfloat16, "weight_t"), nccl.group_name, path=path)


@pytest.mark.parametrize("copies", sorted(COPIES))
def test_prefill_sized_call_back_to_back_without_synchronising(nccl, monkeypatch, copies):
    """20 calls of an o_proj-sized all-reduce queued without a host synchronisation between
    them (the parities alternate while a peer may still be in the previous call), each result
    kept and checked against fp32 afterwards."""
    monkeypatch.setenv("COMMFUSE_ALGO", "fused")
    inline_before = _copies(monkeypatch, copies)
    torch.manual_seed(17 + dist.get_rank())
    calls = [_operands(4096, 1024, 2048, torch.bfloat16, "weight_t") for _ in range(20)]
    outs = [torch.ops.commfuse.mm_all_reduce(a, b, None, nccl.group_name) for a, b, _ in calls]
    check_errors()
    for i, ((a, b, _), out) in enumerate(zip(calls, outs)):
        assert relerr(out, _reference(a, b, None)) < 1e-2, f"call {i}"
    assert fused_all_reduce.INLINE_CALLS - inline_before == (0 if copies == "reducers" else 20)


@pytest.mark.parametrize("tickets", ["0", "1"])
def test_default_dispatch_fuses_a_prefill_sized_call(nccl, monkeypatch, tickets):
    monkeypatch.delenv("COMMFUSE_ALGO", raising=False)
    monkeypatch.setenv("COMMFUSE_FUSED_TICKETS", tickets)
    torch.manual_seed(7 + dist.get_rank())
    a, b, _ = _operands(8192, 2048, 4096, torch.bfloat16, "weight_t")  # an o_proj of 4x2048 tokens
    _fused_call(a, b, None, nccl.group_name)


@pytest.mark.parametrize("tickets", ["0", "1"])
def test_fused_calls_mixed_with_other_paths_stay_correct(nccl, monkeypatch, tickets):
    """Back-to-back calls alternate the fused all-reduce, its reduce-scatter form and one-shot
    calls on the same workspace (parities, epochs and tile flags shared): each result is checked. With tickets, the device's
    ticket must end where the host's count says (each position claimed once, one failed claim
    per program)."""
    monkeypatch.setenv("COMMFUSE_FUSED_TICKETS", tickets)
    gen = torch.Generator().manual_seed(3)  # the same sequence on every rank
    torch.manual_seed(21 + dist.get_rank())
    shapes = [(4096, 1024, 1024), (300, 2048, 776), (2, 1024, 1024), (2048, 512, 4096)]
    for i in range(90):
        m, k, n = shapes[int(torch.randint(len(shapes), (1,), generator=gen))]
        monkeypatch.setenv("COMMFUSE_ALGO", "fused" if i % 3 else "one_shot")
        a, b, _ = _operands(m, k, n, torch.bfloat16, "weight_t")
        if i % 3 == 2:  # the reduce-scatter form, on the same workspace and tile flags
            out = torch.ops.commfuse.mm_reduce_scatter(a, b, None, [m, n], 0, 2, nccl.group_name)
            want = _reference(a, b, None).chunk(2)[dist.get_rank()]
        else:
            out = torch.ops.commfuse.mm_all_reduce(a, b, None, nccl.group_name)
            want = _reference(a, b, None)
        check_errors()
        assert relerr(out, want) < 1e-2, f"call {i}: {m}x{k}x{n}"
    for ws in symm._workspaces.values():
        assert int(ws.ticket.item()) == ws.ticket_base


@pytest.mark.parametrize("op", ["mm_all_reduce", "mm_all_reduce_inline", "mm_all_reduce_inline_tma",
                                "mm_reduce_scatter", "all_gather_mm", "all_gather_mm_ce",
                                "mm_reduce_scatter_pull"])
def test_fused_skipped_call_poisons_and_names_the_peer(nccl, monkeypatch, op):
    """Rank 1 skips a fused call: rank 0 gets NaN, not its partial, and an error naming both
    (``all_gather_mm_ce``: the all-gather whose shard the copy engines push;
    ``mm_reduce_scatter_pull``: the reduce-scatter whose owners pull the partials)."""
    if op == "all_gather_mm_ce":
        monkeypatch.setenv("COMMFUSE_AG_PUSH", "ce")
        op = "all_gather_mm"
    if op.startswith("mm_all_reduce"):  # the copies by reducers, or inline
        _copies(monkeypatch, op[len("mm_all_reduce_"):] or "reducers")
        op = "mm_all_reduce"
    if op == "mm_reduce_scatter_pull":
        monkeypatch.setenv("COMMFUSE_RS_PULL", "1")
        op = "mm_reduce_scatter"
    monkeypatch.setenv("COMMFUSE_TIMEOUT_S", "1")
    monkeypatch.setenv("COMMFUSE_ALGO", "fused")
    a, b, _ = _operands(512, 1024, 1024, torch.bfloat16, "weight_t")

    def call():
        if op == "mm_all_reduce":
            return torch.ops.commfuse.mm_all_reduce(a, b, None, nccl.group_name)
        if op == "all_gather_mm":  # this rank's rows are fine; the peer's are NaN
            return torch.ops.commfuse.all_gather_mm(a, b, None, 0, 2, nccl.group_name, False)[0][512:]
        return torch.ops.commfuse.mm_reduce_scatter(a, b, None, [512, 1024], 0, 2, nccl.group_name)

    call()  # both ranks: the workspace exists
    check_errors()
    dist.barrier()
    if dist.get_rank() == 0:
        out = call()
        with pytest.raises(RuntimeError, match=rf"{op} \(fused tile kernel\): rank 0 timed out after 1 s "
                           "waiting for rank 1"):
            check_errors()
        assert torch.isnan(out).all()
    dist.barrier()
    symm.release_all()  # epochs now differ between ranks: start over with fresh workspaces


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("pull", [False, True])
@pytest.mark.parametrize("m", [2, 14, 258, 2000, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", ["plain", "bias", "row_bias", "weight_t", "three_d"])
def test_fused_reduce_scatter_matches_the_fp32_reference(nccl, provider, m, dtype, form, pull, tma, monkeypatch):
    """The kernel's reduce-scatter form (forced here; dispatch.py has its defaults): rank r gets
    share r of the summed rows; a share whose rows are not a multiple of the tile height
    included; the peers' partials pushed to their owners or pulled by them (``pull``), pushed
    through the TMA unit (``tma``, an experiment; the pull ignores it)."""
    from commfuse.kernels import fused_all_reduce

    if tma and (pull or dtype == torch.float16):
        pytest.skip("the TMA push is an option of the pushed form; bf16 covers it")
    monkeypatch.setenv("COMMFUSE_FUSED_TMA_PUSH", "1" if tma else "0")
    monkeypatch.setenv("COMMFUSE_ALGO", "fused")
    monkeypatch.setenv("COMMFUSE_RS_PULL", "1" if pull else "0")
    tma_before = fused_all_reduce.TMA_CALLS
    pulls_before = fused_all_reduce.PULL_CALLS
    k, n = 1024, 776
    torch.manual_seed(2000 * dist.get_rank() + m)
    a, b, c = _operands(m, k, n, dtype, "plain" if form == "three_d" else form)
    shape = [2, m // 2, n] if form == "three_d" else [m, n]
    poison()
    before = cuda_paths.PATHS["mm_reduce_scatter:fused"]
    out = torch.ops.commfuse.mm_reduce_scatter(a, b, c, shape, 0, 2, nccl.group_name)
    ref = _reference(a, b, c).view(shape).chunk(2, dim=0)[dist.get_rank()]
    check_errors()
    assert cuda_paths.PATHS["mm_reduce_scatter:fused"] == before + 1
    assert fused_all_reduce.PULL_CALLS == pulls_before + pull
    assert fused_all_reduce.TMA_CALLS == tma_before + tma
    assert out.shape == ref.shape
    assert relerr(out, ref) < 1e-2


def _ce_pushes_expected(provider, push):
    """Whether the copy engines push (``COMMFUSE_AG_PUSH=ce``): only with the torch provider,
    whose peer views they need; with Iris the kernel's programs push."""
    from commfuse.kernels import fused_all_gather

    return push == "ce" and provider == "torch" and fused_all_gather.copy_engine_flags() is not None


@pytest.mark.parametrize("push", ["sm", "ce"])
@pytest.mark.parametrize("rows", [1, 7, 100, 1024, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", ["plain", "bias", "weight_t", "three_d", "no_gathered"])
def test_fused_all_gather_matches_the_fp32_reference(nccl, provider, rows, dtype, form, push, monkeypatch):
    """The fused all-gather kernel (``fused_all_gather.py``): ``out`` equals the fp32 product of
    the gathered rows and ``gathered`` equals every rank's shard in rank order; shards whose rows
    are not a multiple of the tile height or of the pushed chunk included; the shard pushed by
    the kernel's programs or by the copy engines (``push``)."""
    from commfuse.kernels import fused_all_gather

    monkeypatch.setenv("COMMFUSE_ALGO", "fused")
    monkeypatch.setenv("COMMFUSE_AG_PUSH", push)
    ce_before = fused_all_gather.CE_CALLS
    k, n = 1024, 776
    torch.manual_seed(5)  # the same weight and bias on every rank
    _, b, _ = _operands(1, k, n, dtype, "weight_t" if form == "weight_t" else "plain")
    c = torch.randn(n, device="cuda", dtype=dtype) if form == "bias" else None
    torch.manual_seed(3000 * dist.get_rank() + rows)
    shard = torch.randn(rows, k, device="cuda", dtype=dtype)
    if form == "three_d":  # [batch, seq, hidden], gathered along the batch
        shard = shard.view(1, rows, k)
    poison()
    before = cuda_paths.PATHS["all_gather_mm:fused"]
    out, gathered = torch.ops.commfuse.all_gather_mm(shard, b, c, 0, 2, nccl.group_name,
                                                     form != "no_gathered")
    full = torch.cat(gather_all(shard.contiguous()))
    bs = gather_all(b.contiguous())
    ref = full.reshape(-1, k).float() @ bs[0].float() + (c.float() if c is not None else 0)
    check_errors()
    assert cuda_paths.PATHS["all_gather_mm:fused"] == before + 1
    assert fused_all_gather.CE_CALLS == ce_before + _ce_pushes_expected(provider, push)
    assert torch.equal(bs[0], bs[1]), "the test needs the same weight on every rank"
    assert relerr(out, ref) < 1e-2
    if form != "no_gathered":
        assert torch.equal(gathered, full)


@pytest.mark.parametrize("pull", [False, True])
def test_fused_reduce_scatter_back_to_back_without_synchronising(nccl, pull, monkeypatch):
    """40 fused reduce-scatters queued with no synchronisation, shapes alternating (1024 and 2048
    rows, both tilings), fresh data each: checked only at the end, so a partial overwritten
    before its owner read it (pushed or pulled) would show."""
    from commfuse.kernels import fused_all_reduce

    monkeypatch.setenv("COMMFUSE_ALGO", "fused")
    monkeypatch.setenv("COMMFUSE_RS_PULL", "1" if pull else "0")
    pulls_before = fused_all_reduce.PULL_CALLS
    torch.manual_seed(87 + dist.get_rank())
    calls = []
    for i in range(40):
        m = 1024 * (1 + i % 2)
        a = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16) / 32
        calls.append((a, w, torch.ops.commfuse.mm_reduce_scatter(a, w, None, [m, 1024], 0, 2, nccl.group_name)))
    check_errors()
    assert fused_all_reduce.PULL_CALLS - pulls_before == (40 if pull else 0)
    for i, (a, w, out) in enumerate(calls):
        assert relerr(out, _reference(a, w, None).chunk(2)[dist.get_rank()]) < 1e-2, f"call {i}"


@pytest.mark.parametrize("push", ["sm", "ce"])
def test_fused_all_gather_back_to_back_without_synchronising(nccl, push, monkeypatch):
    """40 fused all-gathers queued with no synchronisation between them, shapes alternating
    (1024 and 2048 gathered rows, so parities and chunk flags of both sizes interleave), each on
    fresh data: every result is checked only at the end, so a push that overwrote rows a peer
    still read, or a flag that let a tile read stale rows, would show."""
    from commfuse.kernels import fused_all_gather

    monkeypatch.setenv("COMMFUSE_ALGO", "fused")
    monkeypatch.setenv("COMMFUSE_AG_PUSH", push)
    torch.manual_seed(77)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16) / 32
    torch.manual_seed(78 + dist.get_rank())
    shards = [torch.randn(512 * (1 + i % 2), 1024, device="cuda", dtype=torch.bfloat16) for i in range(40)]
    ce_before = fused_all_gather.CE_CALLS
    outs = [torch.ops.commfuse.all_gather_mm(x, w, None, 0, 2, nccl.group_name, i % 3 == 0) for i, x in enumerate(shards)]
    check_errors()
    assert fused_all_gather.CE_CALLS - ce_before == (40 if _ce_pushes_expected(symm.provider_name(), push) else 0)
    for i, (x, (out, gathered)) in enumerate(zip(shards, outs)):
        full = torch.cat(gather_all(x))
        assert relerr(out, full.float() @ w.float()) < 1e-2, f"call {i}"
        if i % 3 == 0:
            assert torch.equal(gathered, full), f"call {i}"


@pytest.mark.parametrize("push", ["sm", "ce"])
def test_fused_all_gather_mixed_with_the_other_fused_kernels(nccl, push, monkeypatch):
    """Back-to-back fused all-gathers, all-reduces and reduce-scatters share one workspace
    (parities, epochs, tile flags, the ticket): each result is checked."""
    monkeypatch.setenv("COMMFUSE_ALGO", "fused")
    monkeypatch.setenv("COMMFUSE_AG_PUSH", push)
    before = cuda_paths.PATHS.copy()
    gen = torch.Generator().manual_seed(4)  # the same sequence on every rank
    torch.manual_seed(31 + dist.get_rank())
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16) / 32
    dist.broadcast(w, 0)
    for i in range(60):
        m = (64, 1000, 4096)[int(torch.randint(3, (1,), generator=gen))]
        a = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        op = i % 3
        if op == 0:
            out, gathered = torch.ops.commfuse.all_gather_mm(a, w, None, 0, 2, nccl.group_name, True)
            full = torch.cat(gather_all(a))
            want = full.float() @ w.float()
            assert torch.equal(gathered, full), f"call {i}"
        elif op == 1:
            out = torch.ops.commfuse.mm_all_reduce(a, w, None, nccl.group_name)
            want = _reference(a, w, None)
        else:
            out = torch.ops.commfuse.mm_reduce_scatter(a, w, None, [m, 1024], 0, 2, nccl.group_name)
            want = _reference(a, w, None).chunk(2)[dist.get_rank()]
        check_errors()
        assert relerr(out, want) < 1e-2, f"call {i}: op {op}, M={m}"
    used = cuda_paths.PATHS - before
    assert used == {"all_gather_mm:fused": 20, "mm_all_reduce:fused": 20, "mm_reduce_scatter:fused": 20}
    for ws in symm._workspaces.values():
        assert int(ws.ticket.item()) == ws.ticket_base
