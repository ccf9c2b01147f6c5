"""The FP8 ops' symmetric paths (the graph's ``_scaled_mm`` before or after the exchange kernels),
simulated on the CPU for 2, 4 and 8 ranks as ``tests/test_running.py`` simulates the bf16 ones:
every rank's workspace in one process, the exchange kernels replaced by sums over them.

What is checked: each path's output against an fp32 sum of the ranks' unfused products (the
graph's own ``_scaled_mm``, each rank's scales its own), the gathered FP8 bits, that each exchange
names the FP8 op (its error code), and how the policy and the tuner see the paths."""

from __future__ import annotations

import pytest
import torch

from commfuse import env
from commfuse.kernels import codes, exchange
from commfuse.runtime import entry, policy, reference
from commfuse.runtime.facts import GroupFacts
from commfuse.runtime.paths import REGISTRY, by_op
from commfuse.runtime.spec import (ALL_GATHER_ROWWISE_SCALED_MM, ALL_GATHER_SCALED_MM, ROWWISE_SCALED_MM_ALL_REDUCE,
                                   ROWWISE_SCALED_MM_REDUCE_SCATTER, SCALED_MM_ALL_REDUCE,
                                   SPECS, Call)

from sim import _changed, _one_thread, _ran, sim  # noqa: F401  (fixtures: pytest finds them by name in this module)

E4M3, BF16 = torch.float8_e4m3fn, torch.bfloat16
K, N = 32, 16


def _fp8(*shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 2).to(E4M3)


def _weight(seed: int) -> torch.Tensor:
    """A ``[K, N]`` FP8 weight laid out column-major, as ``_scaled_mm`` takes its right operand."""
    return _fp8(N, K, seed=seed).t()


def _scale(seed: int, *shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g) + 0.5


def _codes(monkeypatch, sim):
    """Wrap the stand-in exchanges to record the op code each is launched with."""
    seen = []
    for name in ("all_reduce", "gather", "reduce_scatter"):
        def wrapped(*a, _fn=getattr(exchange, name), **k):  # the runs pass the op code last, by position
            seen.append(a[-1])
            return _fn(*a, **k)

        monkeypatch.setattr(exchange, name, wrapped)
    return seen


def _close(got: torch.Tensor, want32: torch.Tensor) -> None:
    """``got`` (the product's dtype) against the fp32 sum, rounded once to that dtype."""
    torch.testing.assert_close(got.float(), want32.to(got.dtype).float(), rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("algo", ["one_shot", "two_shot"])
@pytest.mark.parametrize("out_dtype, with_bias", [(BF16, False), (BF16, True), (torch.float32, False)])
def test_scaled_mm_all_reduce_paths(sim, monkeypatch, algo, out_dtype, with_bias):
    """Each rank's own scales on its own partial, before the exchange."""
    seen = _codes(monkeypatch, sim)
    world, r, m = sim.world, sim.mine.rank, 3 * sim.world
    a = [_fp8(m, K, seed=10 + p) for p in range(world)]
    b = [_weight(20 + p) for p in range(world)]
    sa = [_scale(30 + p) for p in range(world)]
    sb = [_scale(40 + p) for p in range(world)]
    bias = [_scale(50 + p, N).to(BF16) if with_bias else None for p in range(world)]
    parts = [reference.scaled_matmul(a[p], b[p], sa[p], sb[p], bias[p], out_dtype, False) for p in range(world)]
    for p in sim.peers():
        sim.peer_data(p, (m, N), out_dtype).copy_(parts[p])  # what the peer's _scaled_mm wrote
    before = _ran(SCALED_MM_ALL_REDUCE.name)
    args = SCALED_MM_ALL_REDUCE.Args(a[r], b[r], sa[r], sb[r], bias[r], out_dtype, False, "0")
    with env.override(algo=algo):
        out = entry.run(SCALED_MM_ALL_REDUCE, args)
    assert _changed(SCALED_MM_ALL_REDUCE.name, before) == [algo]
    assert out.dtype == out_dtype and out.shape == (m, N)
    _close(out, sum(part.float() for part in parts))
    assert seen == [codes.OP_SCALED_AR]


@pytest.mark.parametrize("spec_name, scatter", [("scaled_mm_all_reduce", False), ("scaled_mm_reduce_scatter", True),
                                                ("rowwise_scaled_mm_all_reduce", False),
                                                ("rowwise_scaled_mm_reduce_scatter", True)])
@pytest.mark.parametrize("fast", [True, False])
def test_the_tile_kernel_takes_fp8_operands_with_their_scales(sim, monkeypatch, spec_name, scatter, fast):
    """The ``fused`` paths of the FP8 ops hand the tile kernel the FP8 operands, this rank's scales
    (row-wise: ``[M, 1]`` and ``[1, N]``; the backward's form, with unit scales and post-scales:
    their products) and its accumulation, with K blocks of 128 bytes, and an output (the partials'
    dtype) of ``out_dtype``; the kernel's stand-in sums every rank's ``_scaled_mm`` (what the
    interpreter checks the kernel against, ``tests/interpreted_fused.py``)."""
    from commfuse.kernels import fused_all_reduce

    world, r, m = sim.world, sim.mine.rank, 4 * sim.world
    rowwise, post = spec_name.startswith("rowwise"), not fast  # (the backward's form: precise accumulation)
    a = [_fp8(m, K, seed=120 + p) for p in range(world)]
    b = [_weight(130 + p) for p in range(world)]
    shape_a, shape_b = ((m, 1), (1, N)) if rowwise else ((), ())
    sa, sb = [_scale(140 + p, *shape_a) for p in range(world)], [_scale(150 + p, *shape_b) for p in range(world)]
    pa = [_scale(160 + p, m, 1) if rowwise and post else None for p in range(world)]
    pb = [_scale(170 + p, 1, N) if rowwise and post else None for p in range(world)]
    parts = [reference.rowwise_scaled_matmul(a[p], b[p], sa[p], sb[p], None, BF16, fast, pa[p], pb[p])
             for p in range(world)]
    total = sum(part.float() for part in parts)
    seen = []

    def prepare(ws, a_, b_, bias, out, cfg, scatter_, opts, trace=None, scales=None, use_fast_accum=True):
        seen.append((a_.dtype, out.dtype, cfg.bk, scatter_, use_fast_accum))
        if not rowwise:
            assert scales[0] is sa[r] and scales[1] is sb[r]
        else:  # a row's and a column's scales, with every factor folded in
            assert scales[0].shape == (m,) and scales[1].shape == (N,)
            torch.testing.assert_close(_as_kernel(a_, b_, scales, bias), parts[r].float(), rtol=1.6e-2, atol=1e-2)

        def launch(epoch, parity):
            out.copy_(total.chunk(world)[r] if scatter_ else total)
        launch.variants = ()
        return launch

    monkeypatch.setattr(fused_all_reduce, "prepare", prepare)
    spec = SPECS[spec_name]
    rest = ([m, N], 0, world, "0") if scatter else ("0",)
    args = spec.Args(a[r], b[r], sa[r], sb[r], None, BF16, fast, *((pa[r], pb[r]) if rowwise else ()), *rest)
    before = _ran(spec.name)
    with env.override(algo="fused"):
        out = entry.run(spec, args)
    assert _changed(spec.name, before) == ["fused"]
    assert seen == [(E4M3, BF16, 128, scatter, fast)]
    _close(out, total.chunk(world)[r] if scatter else total)


def _as_kernel(a, b, scales, bias):
    """What the tile kernels compute of this rank's product from the scales and bias they are
    handed: the fp32 product times a row's and a column's scale (or one each), plus the bias."""
    sa, sb = scales
    product = (a.float() @ b.float()) * (sa.reshape(-1, 1) if sa.numel() > 1 else sa) * sb.reshape(1, -1)
    return product + (0 if bias is None else bias.float())


@pytest.mark.parametrize("order", ["row-column", "column-row", "both-rows"])
@pytest.mark.parametrize("bias", [False, True])
def test_the_tile_kernels_fold_the_backwards_post_scales_in_any_order(sim, monkeypatch, order, bias):
    """The row-wise backward's post-scales (and its bias, which the graph scales with them) reach
    the tile kernels as a row's and a column's factor whichever order the graph multiplied them
    in: the fused all-reduce and split-K compute what the unfused product does."""
    from commfuse.kernels import fused_all_reduce, fused_split_k

    m = 8
    a, b = _fp8(m, K, seed=300), _weight(301)
    ones_a, ones_b = torch.ones(m, 1), torch.ones(1, N)
    first, second = {"row-column": (_scale(302, m, 1), _scale(303, 1, N)),
                     "column-row": (_scale(303, 1, N), _scale(302, m, 1)),
                     "both-rows": (_scale(302, m, 1), _scale(304, m, 1))}[order]
    c = _scale(305, N).to(BF16) if bias else None
    want = reference.rowwise_scaled_matmul(a, b, ones_a, ones_b, c, BF16, False, first, second).float()
    handed = []

    def record(*args, scales=None, **kw):
        handed.append(_as_kernel(a, b, scales, args[3]))

        def launch(*_):
            pass
        launch.variants = ()
        return launch

    monkeypatch.setattr(fused_all_reduce, "prepare", lambda ws, a_, b_, bias_, out, cfg, scatter, opts, scales=None,
                        use_fast_accum=True, **kw: record(ws, a_, b_, bias_, scales=scales))
    monkeypatch.setattr(fused_split_k, "prepare", lambda ws, a_, b_, bias_, out, cfg, lane=False, scales=None,
                        use_fast_accum=True: record(ws, a_, b_, bias_, scales=scales))
    spec = ROWWISE_SCALED_MM_ALL_REDUCE
    args = spec.Args(a, b, ones_a, ones_b, c, BF16, False, first, second, "0")
    for algo in ("fused", "split_k"):
        with env.override(algo=algo):
            entry.run(spec, args)
    assert len(handed) == 2
    for got in handed:
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)


def test_a_scale_of_neither_a_rows_nor_a_columns_shape_runs_unfused(sim, monkeypatch):
    """A post-scale of the product's full shape cannot be folded into a row's and a column's
    factor: the call runs the unfused computation (alike on every rank: the shapes are the
    graph's) with the reason logged, not a kernel that would read the scale wrongly."""
    from commfuse.kernels import fused_all_reduce

    monkeypatch.setattr(fused_all_reduce, "prepare", lambda *a, **k: pytest.fail("the kernel was launched"))
    m = 8
    a, b = _fp8(m, K, seed=310), _weight(311)
    spec = ROWWISE_SCALED_MM_ALL_REDUCE
    args = spec.Args(a, b, torch.ones(m, 1), torch.ones(1, N), None, BF16, False, _scale(312, m, N), torch.ones(1, N),
                     "0")
    before = _ran(spec.name)
    with env.override(algo="fused"):
        out = entry.run(spec, args)
    assert _changed(spec.name, before) == ["nccl"]
    want = reference.rowwise_scaled_matmul(a, b, torch.ones(m, 1), torch.ones(1, N), None, BF16, False,
                                           args.post_scale_a, args.post_scale_b)
    torch.testing.assert_close(out, want)  # (the fake group's all-reduce: this rank's own)


@pytest.mark.parametrize("out_dtype", [BF16, torch.float32])
def test_scaled_mm_all_reduce_through_the_graph_lane(sim, monkeypatch, out_dtype):
    """``scaled_mm_all_reduce``'s ``graph`` path: the graph's ``_scaled_mm`` (this rank's scales)
    into a local buffer of the output dtype, then the lane's staged one-shot, whose error code
    names the FP8 op; a product past the lane runs NCCL. Its split-K variant is refused."""
    from commfuse.runtime import running
    from commfuse.runtime import workspace as wsmod
    from commfuse.runtime.paths.ar_graph import SCALED_GRAPH
    from commfuse.runtime.paths.base import Context

    world, r, m = sim.world, sim.mine.rank, 4
    a = [_fp8(m, K, seed=180 + p) for p in range(world)]
    b = [_weight(190 + p) for p in range(world)]
    sa, sb = [_scale(200 + p) for p in range(world)], [_scale(210 + p) for p in range(world)]
    parts = [reference.scaled_matmul(a[p], b[p], sa[p], sb[p], None, out_dtype, True) for p in range(world)]
    staged = []

    def stand_in(lane, src, out, op, tag=0):
        staged.append((src.dtype, op))
        torch.testing.assert_close(src, parts[r])  # this rank's own product, scaled
        out.copy_(sum(part.float() for part in parts))

    monkeypatch.setattr(exchange, "staged_all_reduce", stand_in)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # (eager; the path asks CUDA)
    lane = wsmod.GraphLane("0", r, world, torch.zeros(wsmod.GRAPH_FLAG_BYTES + 2 * 4096, dtype=torch.uint8),
                           torch.zeros(world, dtype=torch.int64), 4096, 132)
    sim.group.lane, sim.group.capture = lane, type("State", (), {"failure": None})()
    args = SCALED_MM_ALL_REDUCE.Args(a[r], b[r], sa[r], sb[r], None, out_dtype, True, "0")
    call = SCALED_MM_ALL_REDUCE.call(args, world)
    assert SCALED_GRAPH.supports(call, sim.facts) is None
    assert "split-K" in SCALED_GRAPH.supports_variant(call, sim.facts, {"split_k": True})
    out = running.run(SCALED_GRAPH, Context(call, sim.facts, sim.group), args)
    assert staged == [(out_dtype, codes.OP_SCALED_GRAPH)] and out.dtype == out_dtype
    _close(out, sum(part.float() for part in parts))
    big = [_fp8(80, K, seed=7)] * 2  # 80 x 16 of the output dtype: past the lane's 4096 bytes
    args = SCALED_MM_ALL_REDUCE.Args(big[0], b[r], sa[r], sb[r], None, torch.float32, True, "0")
    running.run(SCALED_GRAPH, Context(SCALED_MM_ALL_REDUCE.call(args, world), sim.facts, sim.group), args)
    assert len(staged) == 1


@pytest.mark.parametrize("spec_name", ["scaled_mm_all_reduce", "rowwise_scaled_mm_all_reduce"])
def test_the_split_k_kernel_takes_fp8_operands_with_their_scales(sim, monkeypatch, spec_name):
    """The FP8 all-reduces' ``split_k`` (decode: few rows) hands the split-K kernel the FP8
    operands, this rank's scales and its accumulation, and an output of ``out_dtype``."""
    from commfuse.kernels import fused_split_k

    world, r, m = sim.world, sim.mine.rank, 8
    rowwise = spec_name.startswith("rowwise")
    a = [_fp8(m, K, seed=230 + p) for p in range(world)]
    b = [_weight(240 + p) for p in range(world)]
    sa = [_scale(250 + p, *((m, 1) if rowwise else ())) for p in range(world)]
    sb = [_scale(260 + p, *((1, N) if rowwise else ())) for p in range(world)]
    total = sum(reference.rowwise_scaled_matmul(a[p], b[p], sa[p], sb[p], None, BF16, True).float()
                for p in range(world))
    seen = []

    mine = reference.rowwise_scaled_matmul(a[r], b[r], sa[r], sb[r], None, BF16, True).float()

    def prepare(ws, a_, b_, bias, out, cfg, lane=False, scales=None, use_fast_accum=True):
        # tensor-wise: the scales as they are; row-wise: a row's and a column's, as the kernel reads them
        handed = scales[0] is sa[r] and scales[1] is sb[r] if not rowwise else scales[0].shape == (m,)
        torch.testing.assert_close(_as_kernel(a_, b_, scales, bias), mine, rtol=1.6e-2, atol=1e-2)
        seen.append((a_.dtype, out.dtype, handed, use_fast_accum))

        def launch(epoch=0, parity=0):
            out.copy_(total)
        return launch

    monkeypatch.setattr(fused_split_k, "prepare", prepare)
    spec = SPECS[spec_name]
    args = spec.Args(a[r], b[r], sa[r], sb[r], None, BF16, True, *((None, None) if rowwise else ()), "0")
    before = _ran(spec.name)
    with env.override(algo="split_k"):
        out = entry.run(spec, args)
    assert _changed(spec.name, before) == ["split_k"]
    assert seen == [(E4M3, BF16, True, True)]
    _close(out, total)


def test_the_gather_tile_kernel_takes_fp8_shards_with_their_scales(sim, monkeypatch):
    """``all_gather_scaled_mm``'s ``fused`` path hands the gather kernel the FP8 shard, the
    scales, K blocks of 128 bytes, an output of ``out_dtype`` and a gathered tensor of FP8."""
    from commfuse.kernels import fused_all_gather

    world, r, rows = sim.world, sim.mine.rank, 32
    shards = [_fp8(rows, K, seed=160 + p) for p in range(world)]
    b, sa, sb = _weight(170), _scale(171), _scale(172)
    full = torch.cat([x.view(torch.uint8) for x in shards]).view(E4M3)
    want = reference.scaled_matmul(full, b, sa, sb, None, BF16, True)
    seen = []

    def prepare(ws, shard, b_, bias, gathered, out, cfg, side=None, pushers=0, ce_chunk_count=1, scales=None,
                use_fast_accum=True):
        seen.append((shard.dtype, gathered.dtype, out.dtype, cfg.bk, scales[0] is sa and scales[1] is sb))

        def launch(epoch, parity):
            out.copy_(want)
            gathered.copy_(full)
        launch.variants = ()
        return launch

    monkeypatch.setattr(fused_all_gather, "prepare", prepare)
    args = ALL_GATHER_SCALED_MM.Args(shards[r], b, sa, sb, None, BF16, True, 0, world, "0", True)
    with env.override(algo="fused"):
        out, gathered = entry.run(ALL_GATHER_SCALED_MM, args)
    assert seen == [(E4M3, E4M3, BF16, 128, True)]
    assert torch.equal(out, want) and torch.equal(gathered.view(torch.uint8), full.view(torch.uint8))


@pytest.mark.parametrize("algo", ["one_shot", "two_shot"])
@pytest.mark.parametrize("post", [False, True], ids=["forward", "backward-form"])
def test_rowwise_scaled_mm_all_reduce_paths(sim, monkeypatch, algo, post):
    """Row-wise scales as they are; the backward's form (unit scales in ``_scaled_mm``, the row and
    column scales multiplied in after it) scales each rank's partial before the exchange."""
    seen = _codes(monkeypatch, sim)
    world, r, m = sim.world, sim.mine.rank, 2 * sim.world
    a = [_fp8(m, K, seed=60 + p) for p in range(world)]
    b = [_weight(70 + p) for p in range(world)]
    ones_a, ones_b = torch.ones(m, 1), torch.ones(1, N)
    sa = [ones_a if post else _scale(80 + p, m, 1) for p in range(world)]
    sb = [ones_b if post else _scale(90 + p, 1, N) for p in range(world)]
    pa = [_scale(100 + p, m, 1) if post else None for p in range(world)]
    pb = [_scale(110 + p, 1, N) if post else None for p in range(world)]
    parts = [reference.rowwise_scaled_matmul(a[p], b[p], sa[p], sb[p], None, BF16, True, pa[p], pb[p])
             for p in range(world)]
    for p in sim.peers():
        sim.peer_data(p, (m, N), BF16).copy_(parts[p])
    spec = ROWWISE_SCALED_MM_ALL_REDUCE
    args = spec.Args(a[r], b[r], sa[r], sb[r], None, BF16, True, pa[r], pb[r], "0")
    before = _ran(spec.name)
    with env.override(algo=algo):
        out = entry.run(spec, args)
    assert _changed(spec.name, before) == [algo]
    _close(out, sum(part.float() for part in parts))
    assert seen == [codes.OP_ROWWISE_AR]


@pytest.mark.parametrize("spec_name", ["scaled_mm_reduce_scatter", "rowwise_scaled_mm_reduce_scatter"])
@pytest.mark.parametrize("shape_of, scatter_dim", [(lambda w: [2 * w, N], 0), (lambda w: [2, w, N], 1)])
def test_scaled_mm_reduce_scatter_paths(sim, monkeypatch, spec_name, shape_of, scatter_dim):
    seen = _codes(monkeypatch, sim)
    spec = SPECS[spec_name]
    world, r, m = sim.world, sim.mine.rank, 2 * sim.world
    shape = shape_of(world)
    a = [_fp8(m, K, seed=120 + p) for p in range(world)]
    b = [_weight(130 + p) for p in range(world)]
    rowwise = spec is ROWWISE_SCALED_MM_REDUCE_SCATTER
    sa = [_scale(140 + p, *((m, 1) if rowwise else ())) for p in range(world)]
    sb = [_scale(150 + p, *((1, N) if rowwise else ())) for p in range(world)]
    bias = [_scale(160 + p, N).to(BF16) for p in range(world)]
    if rowwise:
        parts = [reference.rowwise_scaled_matmul(a[p], b[p], sa[p], sb[p], bias[p], BF16, True) for p in range(world)]
        args = [spec.Args(a[p], b[p], sa[p], sb[p], bias[p], BF16, True, None, None, shape, scatter_dim, world, "0")
                for p in range(world)]
    else:
        parts = [reference.scaled_matmul(a[p], b[p], sa[p], sb[p], bias[p], BF16, True) for p in range(world)]
        args = [spec.Args(a[p], b[p], sa[p], sb[p], bias[p], BF16, True, shape, scatter_dim, world, "0")
                for p in range(world)]
    for p in sim.peers():
        sim.peer_data(p, (m, N), BF16).copy_(parts[p])
    before = _ran(spec.name)
    with env.override(algo="pull"):
        out = entry.run(spec, args[r])
    assert _changed(spec.name, before) == ["pull"]
    total = sum(part.float() for part in parts).view(shape)
    _close(out, total.chunk(world, dim=scatter_dim)[r])
    assert seen == [codes.OP_ROWWISE_RS if rowwise else codes.OP_SCALED_RS]


@pytest.mark.parametrize("gather_dim, shape", [(0, (3, K)), (1, (2, 3, K))])
@pytest.mark.parametrize("float8", [E4M3, torch.float8_e5m2])
def test_all_gather_scaled_mm_pull_moves_fp8(sim, monkeypatch, gather_dim, shape, float8):
    """The gathered operand is the shards' FP8 bits, in rank order along ``gather_dim``; the
    product is the graph's ``_scaled_mm`` of them."""
    seen = _codes(monkeypatch, sim)
    world, r = sim.world, sim.mine.rank
    shards = [_fp8(*shape, seed=170 + p).to(torch.float32).to(float8) for p in range(world)]
    b = _weight(180)
    sa, sb = _scale(181), _scale(182)
    bias = _scale(183, N).to(BF16)
    for p in sim.peers():
        sim.peer_data(p, shape, float8).copy_(shards[p])  # the peer's shard in its workspace
    spec = ALL_GATHER_SCALED_MM
    before = _ran(spec.name)
    with env.override(algo="pull"):
        out, gathered = entry.run(spec, spec.Args(shards[r], b, sa, sb, bias, BF16, True, gather_dim, world, "0",
                                                   True))
    assert _changed(spec.name, before) == ["pull"]
    want = torch.cat([s.view(torch.uint8) for s in shards], dim=gather_dim)
    assert gathered.dtype == float8 and torch.equal(gathered.view(torch.uint8), want)
    expected = reference.scaled_matmul(want.view(float8).reshape(-1, K), b, sa, sb, bias, BF16, True)
    assert out.dtype == BF16 and torch.equal(out, expected)  # the same product of the same bits
    assert seen == [codes.OP_SCALED_AG]


@pytest.mark.parametrize("gathered", [False, True], ids=["fp8-rows", "read-after"])
@pytest.mark.parametrize("pow2, hp", [(False, BF16), (True, BF16), (False, torch.float32)], ids=["bf16", "bf16-pow2", "fp32"])
@pytest.mark.parametrize("rows", [3, 1])
def test_all_gather_rowwise_scaled_mm_pull_quantises_before_the_gather(sim, monkeypatch, gathered, pow2, hp, rows):
    """Each rank's rows quantised before the gather, its FP8 rows and float32 multipliers gathered
    as one block of bytes and unpacked into dense rows (cuBLAS's FP8 GEMM takes no other stride:
    with one row per rank the unpacking is not a copy by itself): the same bits and the same
    product as the unfused op's (quantise after an NCCL gather). Where the graph reads the bf16
    gathered tensor, that is gathered and quantised after, as the unfused op does."""
    from commfuse.runtime.running import ag_pull as ag_pull_run

    real = ag_pull_run.reference.rows_times

    def dense_rows(q, *rest):
        assert q.is_contiguous(), q.stride()
        return real(q, *rest)

    monkeypatch.setattr(ag_pull_run.reference, "rows_times", dense_rows)
    seen = _codes(monkeypatch, sim)
    world, r = sim.world, sim.mine.rank
    spec = ALL_GATHER_ROWWISE_SCALED_MM
    g = torch.Generator().manual_seed(200)
    shards = [(torch.randn(rows, K, generator=g) * (p + 1)).to(hp) for p in range(world)]
    b, sb, bias = _weight(201), _scale(202, 1, N), _scale(203, N).to(BF16)
    for p in sim.peers():  # what each peer left in its workspace
        if gathered:
            sim.peer_data(p, (rows, K), hp).copy_(shards[p])
        else:
            q, mult = reference.quantise_rows(shards[p], E4M3, 1e-12, pow2)
            packed = sim.peer_data(p, (rows * K + 4 * rows,), torch.uint8)
            packed[:rows * K].copy_(q.view(torch.uint8).reshape(-1))
            packed[rows * K:].copy_(mult.reshape(-1).view(torch.uint8))
    args = spec.Args(shards[r], b, sb, bias, BF16, True, E4M3, 1e-12, pow2, 0, world, "0", gathered)
    before = _ran(spec.name)
    with env.override(algo="pull"):
        out, got_gathered = entry.run(spec, args)
    assert _changed(spec.name, before) == ["pull"]
    want, want_gathered = _unfused_rowwise(shards, b, sb, bias, pow2, gathered)
    assert torch.equal(out, want)
    if gathered:
        assert torch.equal(got_gathered, want_gathered)
    assert seen == [codes.OP_ROWWISE_AG]


@pytest.mark.parametrize("gathered", [False, True], ids=["fp8-rows", "bf16-read-after"])
def test_the_rowwise_gather_tile_kernel_takes_quantised_rows_and_their_scales(sim, monkeypatch, gathered):
    """``all_gather_rowwise_scaled_mm``'s ``fused`` path quantises this rank's rows as the graph
    does and hands the kernel the FP8 rows with their multipliers' reciprocals (the row scales it
    gathers with the rows) and the weight's column scales, pushed by programs; where the graph
    reads the bf16 gathered tensor it runs the pull path's form (gathered, then quantised)."""
    from commfuse.kernels import fused_all_gather

    world, r, rows = sim.world, sim.mine.rank, 3
    spec = ALL_GATHER_ROWWISE_SCALED_MM
    g = torch.Generator().manual_seed(220)
    shards = [(torch.randn(rows, K, generator=g) * (p + 1)).to(BF16) for p in range(world)]
    b, sb = _weight(221), _scale(222, 1, N)
    want, want_gathered = _unfused_rowwise(shards, b, sb, None, True, gathered)
    seen = []

    def prepare(ws, shard, b_, bias, got, out, cfg, side=None, pushers=0, ce_chunk_count=1, scales=None,
                use_fast_accum=True, rowwise=False):
        q, mult = reference.quantise_rows(shards[r], E4M3, 1e-12, True)
        assert torch.equal(shard.view(torch.uint8), q.view(torch.uint8)) and got is None and pushers > 0
        assert torch.equal(scales[0], mult.reshape(-1).reciprocal()) and scales[1] is sb
        seen.append((rowwise, cfg.bk))

        def launch(epoch, parity):
            out.copy_(want)
        launch.variants = ()
        return launch

    monkeypatch.setattr(fused_all_gather, "prepare", prepare)
    for p in sim.peers():  # the bf16 form's pull reads each peer's shard from its workspace
        sim.peer_data(p, (rows, K), BF16).copy_(shards[p])
    args = spec.Args(shards[r], b, sb, None, BF16, True, E4M3, 1e-12, True, 0, world, "0", gathered)
    with env.override(algo="fused"):
        out, got_gathered = entry.run(spec, args)
    assert seen == ([] if gathered else [(True, 128)])
    assert torch.equal(out, want)
    if gathered:
        assert torch.equal(got_gathered, want_gathered)


def _unfused_rowwise(shards, b, sb, bias, pow2, gathered):
    """The unfused op's product: the gathered rows quantised after the gather (the same bits as
    each shard's rows quantised before it, which the unfused op's FP8 form gathers)."""
    full = torch.cat(shards)
    q, mult = reference.quantise_rows(full, E4M3, 1e-12, pow2)
    out = reference.scaled_matmul(q, b, mult.reciprocal(), sb, bias, BF16, True)
    return out, full if gathered else None


def _fp8_call(op: str, m: int = 4096, dtype=BF16, world: int = 2) -> Call:
    return Call(op, m, 4096, 4096, dtype if "gather" not in op else E4M3, world)


FP8_OPS = [name for name, spec in SPECS.items() if "scaled" in name]


def test_every_fp8_op_has_its_paths():
    assert sorted(FP8_OPS) == ["all_gather_rowwise_scaled_mm", "all_gather_scaled_mm", "rowwise_scaled_mm_all_reduce",
                               "rowwise_scaled_mm_reduce_scatter", "scaled_mm_all_reduce",
                               "scaled_mm_reduce_scatter"]
    for op in FP8_OPS:
        names = sorted(p.name for p in by_op(op))
        want = ["nccl", "one_shot", "two_shot"] if op.endswith("all_reduce") else ["nccl", "pull"]
        if not op.endswith("all_reduce"):  # the tile kernel too
            want = sorted([*want, "fused"])
        if op.endswith("all_reduce"):  # and split-K; the tensor-wise one the graph lane too
            want = sorted([*want, "fused", "split_k", *(["graph"] if op == "scaled_mm_all_reduce" else [])])
        assert names == want, op


@pytest.mark.parametrize("op", FP8_OPS)
@pytest.mark.parametrize("arch", ["sm_90", "sm_100", "sm_89"])
@pytest.mark.parametrize("world", [2, 8])
def test_fp8_ops_stay_unfused_by_rule_until_measured(op, arch, world):
    """Every shipped table keeps the FP8 ops on NCCL by a rule that says why; forcing or the tuner
    may pick the symmetric paths, which are candidates wherever the group runs symmetric paths."""
    facts = GroupFacts.simulated(world, arch=arch)
    call = _fp8_call(op, world=world)
    decision = policy.choose(call, facts, quiet=True)
    assert (decision.name, decision.source) == ("nccl", "rules")
    assert "FP8 paths not yet measured on real links" in decision.reason
    names = [p.name for p in policy.candidates(call, facts)]
    # the tile kernel needs TMA (sm_90 and later): not a candidate on sm_89; the graph lane is a
    # capture's, not an eager call's; split-K takes at most 256 rows (this call has 4096)
    tiles = ["fused"] if arch == "sm_89" else []
    assert names[0] == "nccl" and names == [p.name for p in by_op(op) if p.name not in (*tiles, "graph", "split_k")], names
    if op.endswith("all_reduce"):
        few = _fp8_call(op, m=16, world=world)
        assert ("split_k" in [p.name for p in policy.candidates(few, facts)]) == (arch != "sm_89")
    forced = "pull" if "gather" in op or "scatter" in op else "two_shot"
    assert policy.choose(call, facts, forced=forced, quiet=True).name == forced
    assert policy.choose(call, facts, tuned=lambda: forced, quiet=True).source == "tuned"
    # the graph pass plans the forced path's workspace: the product's bytes, or the FP8 shard's
    planned = policy.workspace_bytes(call, facts, forced=forced)
    assert planned == REGISTRY[(op, forced)].workspace_bytes(call) > 0
    if "gather" in op:
        # one byte an element; the row-wise gather's: the bf16 shard it gathers where the graph reads it
        assert planned == call.m // world * call.k * (2 if "rowwise" in op else 1)
    # inside a capture: no graph lane for these ops, NCCL
    assert policy.choose(call, facts, capturing=True, quiet=True).name == "nccl"


def test_groups_that_cannot_run_symmetric_paths_keep_fp8_on_nccl():
    call = _fp8_call("scaled_mm_all_reduce")
    for facts in (GroupFacts.simulated(1), GroupFacts.simulated(2, arch="gfx942", rocm=True)):
        assert policy.choose(call, facts, forced="one_shot", quiet=True).source == "unsupported"
        assert [p.name for p in policy.candidates(call, facts)] == ["nccl"]


def test_every_op_with_a_symmetric_path_has_an_error_code_of_its_own():
    """A timed-out wait names the op the user's graph called, not the bf16 op whose kernel ran (the
    path tests above check each run passes its op's code): an op given a symmetric path without a
    code of its own would fail at its first call."""
    assert {p.op for p in REGISTRY.values() if p.symmetric} <= set(codes.EXCHANGE_CODE)
