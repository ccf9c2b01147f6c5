"""How each path runs (``runtime/running/*.py``), simulated on the CPU for 2, 4 and 8 ranks.

The Triton exchange kernels and the CUDA streams are replaced by stand-ins that read the peer's
workspace directly (the peer's data is put there beforehand, as its GEMM or copy would have), so the
index arithmetic of every path's run (chunking, shares, rank order, per-row bias slicing, gather
layouts, peer views and kept launches of the workspace) is checked against the unfused computation
without a GPU. Synchronisation itself is covered by the GPU suite (tests/gpu).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from commfuse import env
from commfuse.kernels import exchange
from commfuse.kernels.codes import flag_value
from commfuse.runtime import ce_graphs, running
from commfuse.runtime import workspace as wsmod
from commfuse.runtime.paths import REGISTRY, ar_ce_overlap, rs_ce_overlap
from commfuse.runtime.paths.base import (AllGatherMmArgs, Call, Context, MmAllReduceArgs, MmReduceScatterArgs,
                                         row_slabs, rows_dim)
from commfuse.runtime.running import ag_ce_overlap as ag_ce_overlap_run, ar_ce_overlap as ar_ce_overlap_run, rs_ce_overlap as rs_ce_overlap_run

from sim import (  # noqa: F401  (fixtures: pytest finds them by name in this module)
    AR, AG, RS, _Buffers, _Group, _Stream, _all_gather_mm, _mm_all_reduce, _mm_reduce_scatter, _one_thread, sim,
    _changed, _inputs, _partial, _ran)


def _args(op, *args, **kw):
    if op == AR:
        return MmAllReduceArgs(*args)
    if op == AG:
        kw.setdefault("return_gathered", True)
        return AllGatherMmArgs(*args, **kw)
    return MmReduceScatterArgs(*args)


def _call_of(op, args, world) -> Call:
    """The ``Call`` the entry makes of these arguments."""
    if op == AR:
        return Call(op, args.a.shape[0], args.a.shape[1], args.b.shape[1], args.a.dtype, world, args.bias is not None)
    if op == AG:
        shard, k = args.shard, args.shard.shape[-1]
        dim = rows_dim(shard.shape, args.gather_dim)
        return Call(op, shard.numel() // k * world, k, args.b.shape[1], shard.dtype, world, args.bias is not None,
                    dim, row_slabs(shard.shape, dim))
    dim = rows_dim(args.shape, args.scatter_dim)
    return Call(op, args.a.shape[0], args.a.shape[1], args.b.shape[1], args.a.dtype, world, args.bias is not None,
                dim, row_slabs(args.shape, dim))


def run_path(sim, op, name, *args, config=None, **kw):
    """Path ``name`` of ``op`` run as a tool runs it: with a ``Context`` holding ``config`` (the
    path's own for the call where None) and the group stand-in."""
    args = _args(op, *args, **kw)
    call = _call_of(op, args, sim.world)
    path = REGISTRY[(op, name)]
    config = config if config is not None else path.config(call, sim.facts)
    return running.run(path, Context(call, sim.facts, sim.group, config), args)


@pytest.mark.parametrize("algo", ["one_shot", "two_shot", "ce_overlap"])
@pytest.mark.parametrize("bias_kind", [None, "1d", "2d"])
def test_mm_all_reduce_paths(sim, algo, bias_kind):
    """Every forced path's result; the copy-engine overlap's last chunk is the one-shot's."""
    a, b, bias = _inputs(sim.world, 10, 6, 7, bias_kind)
    r = sim.mine.rank
    for p in sim.peers():
        sim.peer_data(p, (10, 7)).copy_(_partial(a[p], b[p], bias[p]))  # what the peer's GEMM wrote
    before = _ran(AR)
    with env.override(algo=algo):
        out = _mm_all_reduce(a[r], b[r], bias[r], "0")
    want = sum(_partial(a[p], b[p], bias[p]) for p in range(sim.world))
    torch.testing.assert_close(out, want)
    assert _changed(AR, before) == [algo]
    # the stand-in sums alike: the forced exchange must be the one asked (the overlap's tail: one-shot)
    assert sim.algos == ["one_shot" if algo == "ce_overlap" else algo], sim.algos


@pytest.mark.parametrize("bias_kind", [None, "2d"])
@pytest.mark.parametrize("rows, last, tail_rows", [(10, 0, 2), (200, 8, 8)])
def test_copy_engine_overlap_with_a_one_shot_tail(sim, monkeypatch, bias_kind, rows, last, tail_rows):
    """The last chunk's rows go to the one-shot exchange, in flag slots after the chunks' barriers;
    the others are pulled and summed. 3 chunks: of 4, 4 and 2 rows; with the last chunk asked to
    be 8 of 200 rows, of 128, 64 and 8."""
    calls = []
    real = exchange.all_reduce
    monkeypatch.setattr(exchange, "all_reduce", lambda ws_, partial, out, epoch, algo, op_code, **kw: (
        calls.append((partial.shape, algo, kw.get("slot_base"))), real(ws_, partial, out, epoch, algo, op_code)))
    a, b, bias = _inputs(sim.world, rows, 6, 7, bias_kind)
    r = sim.mine.rank
    for p in sim.peers():
        sim.peer_data(p, (rows, 7)).copy_(_partial(a[p], b[p], bias[p]))
    config = ar_ce_overlap.CeConfig(ar_ce_overlap.chunk_rows(rows, 3, last), graphs=False)
    assert len(config.rows) == 3 and config.rows[-1] == tail_rows
    out = run_path(sim, AR, "ce_overlap", a[r], b[r], bias[r], "0", config=config)
    torch.testing.assert_close(out, sum(_partial(a[p], b[p], bias[p]) for p in range(sim.world)))
    assert calls == [(torch.Size([tail_rows, 7]), "one_shot", 3)]
    assert sim.mine.broken is None and sim.mine.epoch == 1


def test_copy_engine_side_work_spreads_over_its_three_streams(sim, monkeypatch):
    """Each chunk's barrier on the barriers' stream behind its GEMM's event; its pulls on the
    pulls' stream behind the event recorded after its own barrier (so that stream holds event waits
    and pulls only); its add on the adds' stream behind the event recorded after its pulls. Events
    are told apart (stream, count), so a pull or an add that waited on another chunk's event
    fails; the caller's stream waits for every stream, the pulls' last. The last chunk is the
    one-shot's, on the caller's stream, and takes none of this."""
    log, current = [], ["main"]

    class Recorded:
        def __init__(self, name):
            self.name, self.events = name, 0

        def wait_stream(self, other):
            log.append((self.name, "wait_stream", other.name))

        def record_event(self):
            event = (self.name, self.events)
            self.events += 1
            log.append((self.name, "record", event))
            return event

        def wait_event(self, event):
            log.append((self.name, "wait_event", event))

    names = ("main", "pulls", "adds", "barriers")
    rec = {name: Recorded(name) for name in names}

    @contextlib.contextmanager
    def on(stream):
        before, current[0] = current[0], stream.name
        try:
            yield
        finally:
            current[0] = before

    m, n, rows = 10, 7, 4  # 3 chunks of 4, 4 and 2 rows
    real_copy = torch.Tensor.copy_

    def copy_(self, src, non_blocking=False):
        if non_blocking:  # a pull: which chunk of which peer's received rows
            log.append((current[0], "pull", (self.storage_offset() % (m * n)) // (rows * n)))
        return real_copy(self, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    sim.sides = (rec["pulls"], rec["adds"], rec["barriers"])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: rec[current[0]])
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(exchange, "barrier", lambda ws_, epoch, op_code, slot=0: log.append((current[0], "barrier", slot)))
    real_sum, real_all_reduce = ar_ce_overlap_run.sum_rank_order, exchange.all_reduce
    monkeypatch.setattr(ar_ce_overlap_run, "sum_rank_order", lambda parts, out: (
        log.append((current[0], "add", out.storage_offset() // (rows * n))), real_sum(parts, out)))
    monkeypatch.setattr(exchange, "all_reduce", lambda *args, **kw: (
        log.append((current[0], "one_shot", kw.get("slot_base"))), real_all_reduce(*args, **kw)))
    a, b, bias = _inputs(sim.world, m, 6, n, "2d")
    r = sim.mine.rank
    for p in sim.peers():
        sim.peer_data(p, (m, n)).copy_(_partial(a[p], b[p], bias[p]))
    log.clear()
    config = ar_ce_overlap.CeConfig(ar_ce_overlap.chunk_rows(m, 3), graphs=False)
    out = run_path(sim, AR, "ce_overlap", a[r], b[r], bias[r], "0", config=config)
    torch.testing.assert_close(out, sum(_partial(a[p], b[p], bias[p]) for p in range(sim.world)))
    on_ = {name: [e[1:] for e in log if e[0] == name] for name in names}
    chunks, peers = 2, sim.world - 1  # the one-shot takes the last chunk on the caller's stream
    assert on_["main"][:3] == [("record", ("main", i)) for i in range(3)]  # every chunk's GEMM event, first
    rest = on_["main"][3:]
    assert rest[0] == ("one_shot", 3)  # after the chunks' barrier slots
    rest = rest[1:]
    assert on_["barriers"] == [x for i in range(chunks) for x in [
        ("wait_event", ("main", i)), ("barrier", i), ("record", ("barriers", i))]]
    assert on_["pulls"] == [("wait_stream", "main")] + [
        x for i in range(chunks) for x in [("wait_event", ("barriers", i)), *[("pull", i)] * peers,
                                           ("record", ("pulls", i))]]
    assert on_["adds"] == [x for i in range(chunks) for x in [("wait_event", ("pulls", i)), ("add", i)]]
    assert sorted(rest[:2]) == [("wait_stream", "adds"), ("wait_stream", "barriers")]
    assert rest[2:] == [("wait_stream", "pulls")]


def test_a_workspace_keeps_a_bounded_number_of_launches(sim, monkeypatch):
    """A plan per row count (dynamic shapes): once full, ``kept`` drops the least recently used."""
    monkeypatch.setattr(wsmod, "KEPT_LIMIT", 3)
    ws = sim.mine
    made = [ws.kept(("plan", m), lambda m=m: object()) for m in range(3)]
    assert ws.kept(("plan", 0), lambda: None) is made[0] and len(ws.launches) == 3  # 0 is now the most recent
    ws.kept(("plan", 3), object)
    assert list(ws.launches) == [("plan", 2), ("plan", 0), ("plan", 3)]  # 1, the least recent, went
    assert ws.kept(("plan", 2), lambda: None) is made[2]


def test_peer_views_are_made_once_per_peer_and_parity(sim, monkeypatch):
    """The copy-engine paths read the peers' halves through views the workspace keeps: the
    provider makes each (peer, parity) view once, and later calls, of other shapes too, slice
    it."""
    made = []
    real = sim.get_buffer
    monkeypatch.setattr(sim, "get_buffer", lambda *a: made.append(a[0]) or real(*a))
    r = sim.mine.rank
    with env.override(algo="ce_overlap"):
        for call, (m, n) in enumerate([(10, 7), (6, 5), (10, 7)]):
            a, b, bias = _inputs(sim.world, m, 6, n, "1d")
            for p in sim.peers():
                sim.peer_data(p, (m, n)).copy_(_partial(a[p], b[p], bias[p]))
            made_before = len(made)
            out = _mm_all_reduce(a[r], b[r], bias[r], "0")
            assert len(made) - made_before == (sim.world if call < 2 else 0)  # every rank's view, per parity
            torch.testing.assert_close(out, sum(_partial(a[p], b[p], bias[p]) for p in range(sim.world)))


@pytest.mark.parametrize("algo, gather_dim, shape", [
    ("pull", 0, (4, 6)), ("pull", 1, (2, 3, 6)), ("ce_overlap", 0, (4, 6)), ("ce_overlap", 0, (2, 2, 6)),
    ("ce_overlap", 1, (1, 4, 6)), ("ce_overlap", 2, (1, 1, 3, 6)),  # leading 1s: blocks of rows, like dim 0
    ("ce_overlap", 1, (2, 3, 6)), ("ce_overlap", 1, (3, 2, 2, 6))])  # a batch: a block in each slab
@pytest.mark.parametrize("bias_kind", [None, "1d"])
def test_all_gather_mm_paths(sim, monkeypatch, algo, gather_dim, shape, bias_kind):
    overlapped = []
    real = ag_ce_overlap_run.overlapped
    monkeypatch.setattr(ag_ce_overlap_run, "overlapped", lambda *a, **k: overlapped.append(1) or real(*a, **k))
    torch.manual_seed(4)
    shards_ = [torch.randn(*shape) for _ in range(sim.world)]
    b, bias = torch.randn(6, 5), (None if bias_kind is None else torch.randn(5))
    r = sim.mine.rank
    for p in sim.peers():
        sim.peer_data(p, shape).copy_(shards_[p])  # the peer's shard, copied into its workspace
    mine = sim.peer_data(r, shape)  # where this call must leave its shard for the peers
    before = _ran(AG)
    with env.override(algo=algo):
        out, gathered = _all_gather_mm(shards_[r], b, bias, gather_dim, sim.world, "0")
    assert _changed(AG, before) == [algo]
    want_gathered = torch.cat(shards_, dim=gather_dim)
    torch.testing.assert_close(mine, shards_[r])
    torch.testing.assert_close(gathered, want_gathered)
    torch.testing.assert_close(out, _partial(want_gathered.reshape(-1, 6), b, bias))
    # a graph that does not use the gathered tensor: the same product, no gathered tensor promised
    for p in sim.peers():
        sim.peer_data(p, shape).copy_(shards_[p])  # the next call's parity
    mine = sim.peer_data(r, shape)
    with env.override(algo=algo):
        out2, gathered2 = _all_gather_mm(shards_[r], b, bias, gather_dim, sim.world, "0",
                                              return_gathered=False)
    torch.testing.assert_close(mine, shards_[r])
    torch.testing.assert_close(out2, out)
    assert len(overlapped) == (2 if algo == "ce_overlap" else 0)  # any leading dims (as slabs) take it
    if gathered2 is not None:  # what the entry returns is the gathered tensor or nothing
        torch.testing.assert_close(gathered2, want_gathered)


@pytest.mark.parametrize("algo, rows_per_rank, shape_of, scatter_dim", [
    ("pull", 4, lambda w: [4 * w, 7], 0), ("pull", 4, lambda w: [2, 2 * w, 7], 1),
    ("ce_overlap", 4, lambda w: [4 * w, 7], 0), ("ce_overlap", 4, lambda w: [2 * w, 2, 7], 0),
    ("ce_overlap", 5, lambda w: [5 * w, 7], 0), ("ce_overlap", 4, lambda w: [1, 4 * w, 7], 1),
    ("ce_overlap", 4, lambda w: [2, 2 * w, 7], 1), ("ce_overlap", 6, lambda w: [3, w, 2, 7], 1)])
@pytest.mark.parametrize("bias_kind", [None, "1d", "2d"])
@pytest.mark.parametrize("chunks", [None, 1, 3])
def test_mm_reduce_scatter_paths(sim, monkeypatch, algo, rows_per_rank, shape_of, scatter_dim, bias_kind, chunks):
    """Through the entry (the path's own chunks), or with 1 or 3 row chunks per share asked of the
    copy-engine overlap (3 of 5 rows: 2, 2, 1)."""
    slots, overlapped = [], []
    monkeypatch.setattr(exchange, "barrier", lambda ws_, epoch, op, slot=0: slots.append(slot))
    real = rs_ce_overlap_run.overlapped
    monkeypatch.setattr(rs_ce_overlap_run, "overlapped", lambda *a, **k: overlapped.append(1) or real(*a, **k))
    m = rows_per_rank * sim.world
    shape = shape_of(sim.world)
    a, b, bias = _inputs(sim.world, m, 6, 7, bias_kind)
    r = sim.mine.rank
    for p in sim.peers():
        sim.peer_data(p, (m, 7)).copy_(_partial(a[p], b[p], bias[p]))
    if chunks is None:
        before = _ran(RS)
        with env.override(algo=algo):
            out = _mm_reduce_scatter(a[r], b[r], bias[r], shape, scatter_dim, sim.world, "0")
        assert _changed(RS, before) == [algo]
    else:
        slabs = max(row_slabs(shape, rows_dim(shape, scatter_dim)), 1)
        config = (rs_ce_overlap.RsOverlapConfig(rs_ce_overlap.chunks(m // sim.world // slabs, sim.world, slabs, chunks))
                  if algo == "ce_overlap" else None)
        out = run_path(sim, RS, algo, a[r], b[r], bias[r], shape, scatter_dim, sim.world, "0", config=config)
    total = sum(_partial(a[p], b[p], bias[p]) for p in range(sim.world)).view(shape)
    torch.testing.assert_close(out, total.chunk(sim.world, dim=scatter_dim)[r])
    assert len(slots) == len(set(slots)), "every barrier of a call has its own flag slot"
    # the copy-engine overlap takes scatters along any leading dim (a batch before it: as slabs)
    assert len(overlapped) == (algo == "ce_overlap")


def test_kept_views_made_in_inference_mode_take_writes_outside_it(sim):
    """A workspace first used under ``torch.inference_mode`` (a prefill) keeps its flag and peer
    views for later calls outside it (training), which write the flags in place."""
    fresh = wsmod.Workspace("0", sim.mine.rank, sim.world, sim.bufs[sim.mine.rank].clone(),
                            torch.zeros(sim.world, dtype=torch.int64), 1 << 16, _keepalive=sim)
    with torch.inference_mode():
        fresh.flags, fresh.tile_flags, fresh.peer_data(0, 0, (4, 4), torch.float32)
    fresh.flags.zero_()
    fresh.tile_flags.add_(1)
    fresh.peer_data(0, 0, (4, 4), torch.float32).add_(1)


def test_one_shot_promises_vector_loads_only_on_aligned_partials(monkeypatch):
    """A chunk of a larger partial (the copy-engine tail) may start off a 16-byte boundary: the
    one-shot kernel's loads must then not be vectorised (a misaligned load faults)."""
    seen = []

    class Launch:  # the kept launch: what it was made with
        def __init__(self, kernel, grid, changing, **fixed):
            seen.append(fixed["VEC"])

        def __call__(self, **changes):
            pass

    monkeypatch.setattr(exchange, "Bound", Launch)
    monkeypatch.setattr(exchange, "_common", lambda ws, epoch: {"epoch": epoch})
    ws = _Buffers(0, 2).mine
    data = ws.data(0, (64,), torch.bfloat16)
    out = torch.empty(64, dtype=torch.bfloat16)
    exchange.all_reduce(ws, data[:32], out[:32], 1, "one_shot", 0)
    exchange.all_reduce(ws, data[3:35], out[:32], 1, "one_shot", 0)  # 6 bytes in
    assert seen == [1, 0]


@pytest.mark.parametrize("graphs", [True, False])
def test_the_copy_engine_path_reads_its_epoch_on_the_device_when_graphed(sim, monkeypatch, graphs):
    """``CeConfig.graphs`` (``ce_graphs.py``): with graphs the chunks' barriers and the one-shot
    tail get no epoch (they read the workspace's epoch cell, which holds the call's), without them
    the call's epoch; the result is the sum either way, and only graphed calls are remembered."""
    monkeypatch.setattr(ce_graphs, "_disabled", [])
    ws, seen = sim.mine, []
    real = exchange.all_reduce
    monkeypatch.setattr(exchange, "all_reduce", lambda ws_, partial, out, epoch, algo, op_code, **kw: (
        seen.append(("one_shot", epoch, int(ws.epoch_cell))), real(ws_, partial, out, epoch, algo, op_code, **kw)))
    monkeypatch.setattr(exchange, "barrier", lambda ws_, epoch, op_code, slot=0: seen.append(
        ("barrier", epoch, int(ws.epoch_cell))))
    a, b, bias = _inputs(sim.world, 10, 6, 7, "1d")
    r = ws.rank
    for p in sim.peers():
        sim.peer_data(p, (10, 7)).copy_(_partial(a[p], b[p], bias[p]))
    config = ar_ce_overlap.CeConfig(ar_ce_overlap.chunk_rows(10, 3), graphs=graphs)
    with env.override(ce_graphs=True):
        out = run_path(sim, AR, "ce_overlap", a[r], b[r], bias[r], "0", config=config)
    torch.testing.assert_close(out, sum(_partial(a[p], b[p], bias[p]) for p in range(sim.world)))
    want = None if graphs else flag_value(ws.epoch)
    # the host queues the tail's one-shot after the last GEMM, then the side stream's barriers
    assert [s[:2] for s in seen] == [("one_shot", want)] + [("barrier", want)] * 2
    if graphs:
        assert all(s[2] == flag_value(ws.epoch) for s in seen) and len(ws.graphs_seen) == 1 and not ws.graphs
    else:
        assert not ws.graphs and not ws.graphs_seen


@pytest.mark.parametrize("weight_last", [True, False], ids=["llama", "rms_norm"])
@pytest.mark.parametrize("bias_kind", [None, "1d"])
def test_add_rms_norm_one_shot_runs_the_chain_on_every_rank(sim, monkeypatch, weight_last, bias_kind):
    """``mm_all_reduce_add_rms_norm``'s one-shot: the partial goes into this call's half of the
    workspace (the kernel's stand-in reads every rank's at that offset), the 3-D residual is read as
    rows of the product, and ``h`` and ``n`` come back shaped as the residual; against fp32 of the
    unfused chain with the peers' partials."""
    from commfuse.kernels import norm_epilogue
    from commfuse.runtime import reference
    from commfuse.runtime.paths import ar_norm
    from commfuse.runtime.spec import MM_ALL_REDUCE_ADD_RMS_NORM

    world, r, hidden = sim.world, sim.mine.rank, 7
    seen = []

    def stand_in(ws, partial, x, weight, h, n, eps, epoch, op_code, weight_last=True, **_):
        seen.append((partial.shape, x.shape, x.is_contiguous()))
        total = sum(sim.at(p, partial).float() for p in range(world))
        h.copy_(x.float() + total)  # one rounding, as the kernel's
        n.copy_(reference.rms_norm(h, weight, eps, weight_last))

    monkeypatch.setattr(norm_epilogue, "all_reduce_add_rms_norm", stand_in)
    a, b, bias = _inputs(world, 10, 6, hidden, bias_kind)
    for p in sim.peers():
        sim.peer_data(p, (10, hidden)).copy_(_partial(a[p], b[p], bias[p]))
    residual, weight = torch.randn(2, 5, hidden), torch.randn(hidden)
    args = MM_ALL_REDUCE_ADD_RMS_NORM.Args(a[r], b[r], bias[r], residual, weight, 1e-6, weight_last, "0")
    call = Call(MM_ALL_REDUCE_ADD_RMS_NORM.name, 10, 6, hidden, torch.float32, world, bias_kind is not None)
    path = REGISTRY[(MM_ALL_REDUCE_ADD_RMS_NORM.name, "one_shot")]
    assert path is ar_norm.ONE_SHOT
    h, n = running.run(path, Context(call, sim.facts, sim.group, path.config(call, sim.facts)), args)
    assert seen == [(torch.Size([10, hidden]), torch.Size([10, hidden]), True)]
    assert h.shape == n.shape == residual.shape and h.is_contiguous() and n.is_contiguous()
    want_h = residual + sum(_partial(a[p], b[p], bias[p]) for p in range(world)).view(residual.shape)
    want_n = want_h * torch.rsqrt(want_h.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    torch.testing.assert_close(h, want_h)
    torch.testing.assert_close(n, want_n)


@pytest.mark.parametrize("form", ["rows", "sequence"])
def test_sequence_parallel_norm_pull_reads_this_ranks_share_of_every_partial(sim, monkeypatch, form):
    """``mm_reduce_scatter_add_rms_norm``'s pull: the partial goes into this call's half of the
    workspace whole, and the kernel is told how the share's rows lie in it (``chunk`` rows of each
    slab of ``world * chunk``: the share along dim 0, or along the sequence of a batch of 3); the
    stand-in reads the peers' partials by that rule, and ``h`` and ``n`` come back shaped as the
    share against fp32 of the unfused chain."""
    from commfuse.kernels import norm_epilogue
    from commfuse.runtime import reference
    from commfuse.runtime.paths import rs_norm
    from commfuse.runtime.spec import MM_REDUCE_SCATTER_ADD_RMS_NORM

    world, r, hidden, k = sim.world, sim.mine.rank, 7, 6
    slabs, per = (1, 2) if form == "rows" else (3, 2)  # per: the share's rows of each slab
    m = slabs * world * per
    seen = []

    def stand_in(ws, partial, x, weight, h, n, chunk, eps, epoch, op_code, weight_last=True, **_):
        seen.append((tuple(partial.shape), tuple(x.shape), chunk))
        total = sum(sim.at(p, partial).float() for p in range(world))
        rows = [(i // chunk) * chunk * world + r * chunk + i % chunk for i in range(x.shape[0])]
        h.copy_(x.float() + total[rows])
        n.copy_(reference.rms_norm(h, weight, eps, weight_last))

    monkeypatch.setattr(norm_epilogue, "reduce_scatter_add_rms_norm", stand_in)
    a, b, bias = _inputs(world, m, k, hidden, "1d")
    for p in sim.peers():
        sim.peer_data(p, (m, hidden)).copy_(_partial(a[p], b[p], bias[p]))
    shape, dim = ([m, hidden], 0) if form == "rows" else ([slabs, world * per, hidden], 1)
    share = list(shape)
    share[dim] //= world
    residual, weight = torch.randn(share), torch.randn(hidden)
    args = MM_REDUCE_SCATTER_ADD_RMS_NORM.Args(a[r], b[r], bias[r], residual, weight, 1e-6, True, shape, dim, world,
                                               "0")
    call = MM_REDUCE_SCATTER_ADD_RMS_NORM.call(args, world)
    path = REGISTRY[(MM_REDUCE_SCATTER_ADD_RMS_NORM.name, "pull")]
    assert path is rs_norm.PULL
    h, n = running.run(path, Context(call, sim.facts, sim.group, path.config(call, sim.facts)), args)
    assert seen == [((m, hidden), (slabs * per, hidden), per)]
    assert h.shape == n.shape == residual.shape and h.is_contiguous() and n.is_contiguous()
    total = sum(_partial(a[p], b[p], bias[p]) for p in range(world)).view(shape)
    want_h = residual + total.chunk(world, dim)[r]
    want_n = reference.rms_norm(want_h, weight, 1e-6, True)
    torch.testing.assert_close(h, want_h)
    torch.testing.assert_close(n, want_n)
