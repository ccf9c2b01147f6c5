"""The fused tile kernel of mm_all_reduce (``fused_all_reduce.py``) against an fp32 reference of
the unfused computation, on fresh random data with poisoned outputs, 2 ranks. Every form the
kernel meets in compiled graphs: both weight layouts, a transposed activation, 1-D and per-row
bias, fp16 and bf16, tile-ragged M and N, both symmetric-memory providers; plus repeated calls
mixed with the other paths, and a peer that never comes.

A path's own configuration for a call runs through the op and the run-time's entry with
``COMMFUSE_ALGO`` (``gpu_util.run_forced``); any other (a tiling, the copies' lag, the static tile
order, the TMA push, the reduce-scatter's pull, who pushes the all-gather's shard) is passed to the
path in its ``Context``, as the sweep tools pass it."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
import torch.distributed as dist

from commfuse import check_errors, env
from commfuse.kernels import fused_all_gather
from commfuse.kernels.tiles import TileConfig
from commfuse.runtime import counters, policy
from commfuse.runtime.paths import ag_fused, ar_fused, rs_fused
from commfuse.runtime.paths.base import Call
from commfuse.runtime.counters import PATHS
from gpu_util import gather_all, group_state, poison, relerr, run_forced, start_over, timed_out, workspaces

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


def _fused_call(a, b, c, group_name, path="fused", config=None, forced=True):
    """One call on poisoned memory: it must take ``path`` (``forced``: with ``config``, as
    ``run_forced`` takes it, None for the path's own; else the entry's own choice, under the
    settings in force) and equal the fp32 reference, and every rank must return the same reduced
    tensor, not its own partial."""
    poison()
    if forced:
        out, _ = run_forced("mm_all_reduce", path, a, b, c, group_name, config=config)
    else:
        before = PATHS[f"mm_all_reduce:{path}"]
        out = torch.ops.commfuse.mm_all_reduce(a, b, c, group_name)
    ref = _reference(a, b, c)
    check_errors()
    if not forced:
        assert PATHS[f"mm_all_reduce:{path}"] == before + 1
    assert relerr(out, ref) < 1e-2
    outs = gather_all(out)
    assert torch.equal(outs[0], outs[1])
    return out


@pytest.fixture(params=["torch", "iris"])
def provider(request, settings):
    settings(symm_provider=request.param)
    return request.param


def _fused(tile: str | None = None, scatter: bool = False, **options):
    """The fused path's configuration for a call (a function of the call and the group's facts, as
    ``run_forced`` takes it): the path's own (``scatter``: the reduce-scatter's), with ``tile``
    (``TileConfig.parse``) and ``options`` (``fused_all_reduce.Options`` fields) in place of its own."""
    path = rs_fused.FUSED if scatter else ar_fused.FUSED

    def config(call, facts):
        own = path.config(call, facts)
        return ar_fused.FusedConfig(TileConfig.parse(tile) if tile else own.tile,
                                           own.options._replace(**options))

    return config


#: How the peers' pushed sums reach the output: the tiling and ``Options`` per form. ``inline``
#: is the path's own (128 x 256 tiles, no reducer programs: the multiplying programs copy the sums
#: inline, four waves behind their own tiles); ``reducers``: 16 programs copy them;
#: ``inline_lag0``: each copy right behind its own tile, so copies usually wait for the peer's flag,
#: releasing their pending tile first; ``inline_tma``: the pushes are TMA stores (an experiment).
COPIES = {"reducers": ("128x256x64s3w8g8r16o1", {}), "inline": ("128x256x64s3w8g8r0o1", {}),
          "inline_lag0": ("128x256x64s3w8g8r0o1", {"copy_lag_waves": 0.0}),
          "inline_tma": ("128x256x64s3w8g8r0o1", {"tma_push": True})}


def _copies(copies):
    tile, options = COPIES[copies]
    return _fused(tile, **options)


@pytest.mark.parametrize("copies", sorted(COPIES))
@pytest.mark.parametrize("m", [1, 7, 129, 1000, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", ["plain", "bias", "row_bias", "weight_t", "a_transposed"])
def test_fused_matches_the_fp32_reference(nccl, provider, m, dtype, form, copies):
    if copies in ("inline_lag0", "inline_tma") and dtype == torch.float16:
        pytest.skip("the copies' order does not depend on the dtype: bf16 covers it")
    inline_before, tma_before = counters.KERNELS["fused_all_reduce:inline"], counters.KERNELS["fused_all_reduce:tma"]
    k, n = 1024, 776  # N is not a multiple of the 256-wide tile; rows are 16-byte multiples
    torch.manual_seed(1000 * dist.get_rank() + m)
    _fused_call(*_operands(m, k, n, dtype, form), nccl.group_name, config=_copies(copies))
    assert counters.KERNELS["fused_all_reduce:inline"] == inline_before + (copies != "reducers")
    assert counters.KERNELS["fused_all_reduce:tma"] == tma_before + (copies == "inline_tma")


@pytest.mark.parametrize("m, k, n, path", [(1536, 2048, 4096, "fused"), (1024, 512, 8192, "fused"),
                                          (2048, 4096, 4104, "fused"), (1024, 512, 4096, "one_shot")])
def test_default_dispatch_of_1024_to_4096_rows(nccl, settings, m, k, n, path):
    """Without ``COMMFUSE_ALGO`` a call of 1024-4096 rows, K <= 4096 and more than one wave of
    128x256 tiles takes the fused kernel (one wave: cuBLAS + one-shot), with the path's own
    configuration, and equals the fp32 reference."""
    settings(algo=None)
    torch.manual_seed(23 + dist.get_rank() + m + n)
    _fused_call(*_operands(m, k, n, torch.bfloat16, "weight_t"), nccl.group_name, path=path, forced=False)


@pytest.mark.parametrize("copies", sorted(COPIES))
def test_prefill_sized_call_back_to_back_without_synchronising(nccl, copies):
    """20 calls of an o_proj-sized all-reduce queued without a host synchronisation between
    them (the parities alternate while a peer may still be in the previous call), each result
    kept and checked against fp32 afterwards."""
    inline_before = counters.KERNELS["fused_all_reduce:inline"]
    torch.manual_seed(17 + dist.get_rank())
    calls = [_operands(4096, 1024, 2048, torch.bfloat16, "weight_t") for _ in range(20)]
    outs = [run_forced("mm_all_reduce", "fused", a, b, None, nccl.group_name, config=_copies(copies))[0]
            for a, b, _ in calls]
    check_errors()
    for i, ((a, b, _), out) in enumerate(zip(calls, outs)):
        assert relerr(out, _reference(a, b, None)) < 1e-2, f"call {i}"
    assert counters.KERNELS["fused_all_reduce:inline"] - inline_before == (0 if copies == "reducers" else 20)


@pytest.mark.parametrize("tickets", [False, True], ids=["static_order", "tickets"])
def test_default_dispatch_fuses_a_prefill_sized_call(nccl, settings, tickets):
    """The rules fuse an o_proj of 4x2048 tokens; the kernel gives the reference with its
    programs claiming tiles from the ticket (the path's own configuration, through the entry's
    default dispatch) and in the static tile order (``Options(tickets=False)``, passed in)."""
    settings(algo=None)
    torch.manual_seed(7 + dist.get_rank())
    a, b, _ = _operands(8192, 2048, 4096, torch.bfloat16, "weight_t")
    if tickets:
        _fused_call(a, b, None, nccl.group_name, forced=False)
    else:
        _, facts = group_state(nccl.group_name)
        assert policy.choose(Call("mm_all_reduce", 8192, 2048, 4096, torch.bfloat16, 2), facts).name == "fused"
        _fused_call(a, b, None, nccl.group_name, config=_fused(tickets=False))


@pytest.mark.parametrize("tickets", [False, True], ids=["static_order", "tickets"])
def test_fused_calls_mixed_with_other_paths_stay_correct(nccl, tickets):
    """Back-to-back calls alternate the fused all-reduce, its reduce-scatter form and one-shot
    calls on the same workspace (parities, epochs and tile flags shared): each result is checked. With tickets, the device's
    ticket must end where the host's count says (each position claimed once, one failed claim
    per program)."""
    gen = torch.Generator().manual_seed(3)  # the same sequence on every rank
    torch.manual_seed(21 + dist.get_rank())
    shapes = [(4096, 1024, 1024), (300, 2048, 776), (2, 1024, 1024), (2048, 512, 4096)]
    for i in range(90):
        m, k, n = shapes[int(torch.randint(len(shapes), (1,), generator=gen))]
        a, b, _ = _operands(m, k, n, torch.bfloat16, "weight_t")
        if i % 3 == 2:  # the reduce-scatter form, on the same workspace and tile flags
            out, _ = run_forced("mm_reduce_scatter", "fused", a, b, None, [m, n], 0, 2, nccl.group_name,
                                config=_fused(scatter=True, tickets=tickets))
            want = _reference(a, b, None).chunk(2)[dist.get_rank()]
        elif i % 3:
            out, _ = run_forced("mm_all_reduce", "fused", a, b, None, nccl.group_name, config=_fused(tickets=tickets))
            want = _reference(a, b, None)
        else:
            out, _ = run_forced("mm_all_reduce", "one_shot", a, b, None, nccl.group_name)
            want = _reference(a, b, None)
        check_errors()
        assert relerr(out, want) < 1e-2, f"call {i}: {m}x{k}x{n}"
    for ws in workspaces():
        assert int(ws.ticket.item()) == ws.ticket_base


def _fused_ag(push: str):
    """The fused all-gather's own configuration for a call, with the shard pushed by ``push``:
    ``sm`` (programs of the kernel) or ``ce`` (the copy engines)."""
    return lambda call, facts: dataclasses.replace(ag_fused.FUSED.config(call, facts), push=push)


#: op -> (the op, its configuration, the fused kernel as the error word names it).
_SKIPPED = {
    "mm_all_reduce": ("mm_all_reduce", _copies("reducers"), "mm_all_reduce"),
    "mm_all_reduce_inline": ("mm_all_reduce", _copies("inline"), "mm_all_reduce"),
    "mm_all_reduce_inline_tma": ("mm_all_reduce", _copies("inline_tma"), "mm_all_reduce"),
    "mm_reduce_scatter": ("mm_reduce_scatter", _fused(scatter=True), "mm_reduce_scatter"),
    "all_gather_mm": ("all_gather_mm", _fused_ag("sm"), "all_gather_mm"),
    "all_gather_mm_ce": ("all_gather_mm", _fused_ag("ce"), "all_gather_mm"),
    "mm_reduce_scatter_pull": ("mm_reduce_scatter", _fused(scatter=True, pull=True), "mm_reduce_scatter"),
}


@pytest.mark.parametrize("case", sorted(_SKIPPED))
def test_fused_skipped_call_poisons_and_names_the_peer(nccl, settings, case):
    """Rank 1 skips a fused call: rank 0 gets NaN, not its partial, and an error naming the group
    and both ranks (``all_gather_mm_ce``: the all-gather whose shard the copy engines push;
    ``mm_reduce_scatter_pull``: the reduce-scatter whose owners pull the partials)."""
    op, config, name = _SKIPPED[case]
    settings(timeout_s=1)
    start_over()  # a workspace allocated now waits at most 1 s
    a, b, _ = _operands(512, 1024, 1024, torch.bfloat16, "weight_t")

    def call():
        if op == "mm_all_reduce":
            return run_forced(op, "fused", a, b, None, nccl.group_name, config=config)[0]
        if op == "all_gather_mm":  # this rank's rows are fine; the peer's are NaN
            return run_forced(op, "fused", a, b, None, 0, 2, nccl.group_name, False, config=config)[0][0][512:]
        return run_forced(op, "fused", a, b, None, [512, 1024], 0, 2, nccl.group_name, config=config)[0]

    call()  # both ranks: the workspace exists
    check_errors()
    dist.barrier()
    if dist.get_rank() == 0:
        out = call()
        with pytest.raises(RuntimeError, match=timed_out(f"{name} (fused tile kernel)", nccl.group_name)):
            check_errors()
        assert torch.isnan(out).all()
    start_over()  # epochs now differ between ranks: fresh workspaces (with the default bound)


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("pull", [False, True])
@pytest.mark.parametrize("m", [2, 14, 258, 2000, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", ["plain", "bias", "row_bias", "weight_t", "three_d"])
def test_fused_reduce_scatter_matches_the_fp32_reference(nccl, provider, m, dtype, form, pull, tma):
    """The kernel's reduce-scatter form (forced here; the rules have its defaults): rank r gets
    share r of the summed rows; a share whose rows are not a multiple of the tile height
    included; the peers' partials pushed to their owners or pulled by them (``pull``), pushed
    through the TMA unit (``tma``, an experiment; the pull ignores it)."""
    if tma and (pull or dtype == torch.float16):
        pytest.skip("the TMA push is an option of the pushed form; bf16 covers it")
    tma_before = counters.KERNELS["fused_all_reduce:tma"]
    pulls_before = counters.KERNELS["fused_all_reduce:pull"]
    k, n = 1024, 776
    torch.manual_seed(2000 * dist.get_rank() + m)
    a, b, c = _operands(m, k, n, dtype, "plain" if form == "three_d" else form)
    shape = [2, m // 2, n] if form == "three_d" else [m, n]
    poison()
    out, _ = run_forced("mm_reduce_scatter", "fused", a, b, c, shape, 0, 2, nccl.group_name,
                        config=_fused(scatter=True, pull=pull, tma_push=tma))
    ref = _reference(a, b, c).view(shape).chunk(2, dim=0)[dist.get_rank()]
    check_errors()
    assert counters.KERNELS["fused_all_reduce:pull"] == pulls_before + pull
    assert counters.KERNELS["fused_all_reduce:tma"] == tma_before + tma
    assert out.shape == ref.shape
    assert relerr(out, ref) < 1e-2


def _ce_pushes_expected(provider, push):
    """Whether the copy engines push (``push`` ``ce``): only with the torch provider, whose peer
    views they need; with Iris the kernel's programs push."""
    return push == "ce" and provider == "torch" and fused_all_gather.copy_engine_flags() is not None


@pytest.mark.parametrize("push", ["sm", "ce"])
@pytest.mark.parametrize("rows", [1, 7, 100, 1024, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", ["plain", "bias", "weight_t", "three_d", "no_gathered"])
def test_fused_all_gather_matches_the_fp32_reference(nccl, provider, rows, dtype, form, push):
    """The fused all-gather kernel (``fused_all_gather.py``): ``out`` equals the fp32 product of
    the gathered rows and ``gathered`` equals every rank's shard in rank order; shards whose rows
    are not a multiple of the tile height or of the pushed chunk included; the shard pushed by
    the kernel's programs or by the copy engines (``push``; the path's own choice from 2 MiB
    shards up, passed in below)."""
    ce_before = counters.KERNELS["fused_all_gather:ce_push"]
    k, n = 1024, 776
    torch.manual_seed(5)  # the same weight and bias on every rank
    _, b, _ = _operands(1, k, n, dtype, "weight_t" if form == "weight_t" else "plain")
    c = torch.randn(n, device="cuda", dtype=dtype) if form == "bias" else None
    torch.manual_seed(3000 * dist.get_rank() + rows)
    shard = torch.randn(rows, k, device="cuda", dtype=dtype)
    if form == "three_d":  # [batch, seq, hidden], gathered along the batch
        shard = shard.view(1, rows, k)
    poison()
    (out, gathered), _ = run_forced("all_gather_mm", "fused", shard, b, c, 0, 2, nccl.group_name,
                                    form != "no_gathered", config=_fused_ag(push))
    full = torch.cat(gather_all(shard.contiguous()))
    bs = gather_all(b.contiguous())
    ref = full.reshape(-1, k).float() @ bs[0].float() + (c.float() if c is not None else 0)
    check_errors()
    assert counters.KERNELS["fused_all_gather:ce_push"] == ce_before + _ce_pushes_expected(provider, push)
    assert torch.equal(bs[0], bs[1]), "the test needs the same weight on every rank"
    assert relerr(out, ref) < 1e-2
    if form != "no_gathered":
        assert torch.equal(gathered, full)
    else:
        assert gathered is None


@pytest.mark.parametrize("pull", [False, True])
def test_fused_reduce_scatter_back_to_back_without_synchronising(nccl, pull):
    """40 fused reduce-scatters queued with no synchronisation, shapes alternating (1024 and 2048
    rows, both tilings), fresh data each: checked only at the end, so a partial overwritten
    before its owner read it (pushed or pulled) would show."""
    pulls_before = counters.KERNELS["fused_all_reduce:pull"]
    torch.manual_seed(87 + dist.get_rank())
    calls = []
    for i in range(40):
        m = 1024 * (1 + i % 2)
        a = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16) / 32
        out, _ = run_forced("mm_reduce_scatter", "fused", a, w, None, [m, 1024], 0, 2, nccl.group_name,
                            config=_fused(scatter=True, pull=pull))
        calls.append((a, w, out))
    check_errors()
    assert counters.KERNELS["fused_all_reduce:pull"] - pulls_before == (40 if pull else 0)
    for i, (a, w, out) in enumerate(calls):
        assert relerr(out, _reference(a, w, None).chunk(2)[dist.get_rank()]) < 1e-2, f"call {i}"


@pytest.mark.parametrize("push", ["sm", "ce"])
def test_fused_all_gather_back_to_back_without_synchronising(nccl, push):
    """40 fused all-gathers queued with no synchronisation between them, shapes alternating
    (1024 and 2048 gathered rows, so parities and chunk flags of both sizes interleave), each on
    fresh data: every result is checked only at the end, so a push that overwrote rows a peer
    still read, or a flag that let a tile read stale rows, would show."""
    torch.manual_seed(77)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16) / 32
    torch.manual_seed(78 + dist.get_rank())
    shards = [torch.randn(512 * (1 + i % 2), 1024, device="cuda", dtype=torch.bfloat16) for i in range(40)]
    ce_before = counters.KERNELS["fused_all_gather:ce_push"]
    outs = [run_forced("all_gather_mm", "fused", x, w, None, 0, 2, nccl.group_name, i % 3 == 0,
                       config=_fused_ag(push))[0] for i, x in enumerate(shards)]
    check_errors()
    ce = _ce_pushes_expected(env.current().symm_provider, push)
    assert counters.KERNELS["fused_all_gather:ce_push"] - ce_before == (40 if ce else 0)
    for i, (x, (out, gathered)) in enumerate(zip(shards, outs)):
        full = torch.cat(gather_all(x))
        assert relerr(out, full.float() @ w.float()) < 1e-2, f"call {i}"
        if i % 3 == 0:
            assert torch.equal(gathered, full), f"call {i}"


@pytest.mark.parametrize("push", ["sm", "ce"])
def test_fused_all_gather_mixed_with_the_other_fused_kernels(nccl, push):
    """Back-to-back fused all-gathers, all-reduces and reduce-scatters share one workspace
    (parities, epochs, tile flags, the ticket): each result is checked; every call that went
    through the entry (the path's own configuration) was counted on its fused path."""
    before = PATHS.copy()
    through_entry = collections.Counter()
    gen = torch.Generator().manual_seed(4)  # the same sequence on every rank
    torch.manual_seed(31 + dist.get_rank())
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16) / 32
    dist.broadcast(w, 0)
    for i in range(60):
        m = (64, 1000, 4096)[int(torch.randint(3, (1,), generator=gen))]
        a = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        op = ("all_gather_mm", "mm_all_reduce", "mm_reduce_scatter")[i % 3]
        if op == "all_gather_mm":
            (out, gathered), entry = run_forced(op, "fused", a, w, None, 0, 2, nccl.group_name, True,
                                                config=_fused_ag(push))
            full = torch.cat(gather_all(a))
            want = full.float() @ w.float()
            assert torch.equal(gathered, full), f"call {i}"
        elif op == "mm_all_reduce":
            out, entry = run_forced(op, "fused", a, w, None, nccl.group_name)
            want = _reference(a, w, None)
        else:
            out, entry = run_forced(op, "fused", a, w, None, [m, 1024], 0, 2, nccl.group_name)
            want = _reference(a, w, None).chunk(2)[dist.get_rank()]
        through_entry[f"{op}:fused"] += entry
        check_errors()
        assert relerr(out, want) < 1e-2, f"call {i}: {op}, M={m}"
    assert through_entry["mm_all_reduce:fused"] == through_entry["mm_reduce_scatter:fused"] == 20
    assert PATHS - before == +through_entry
    for ws in workspaces():
        assert int(ws.ticket.item()) == ws.ticket_base
