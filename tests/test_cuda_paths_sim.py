"""The CUDA paths' data movement, simulated on the CPU for 2, 4 and 8 ranks.

The Triton exchange kernels and the CUDA streams are replaced by stand-ins that read the peer's
workspace directly (the peer's data is put there beforehand, as its GEMM or copy would have), so
the index arithmetic of every path (chunking, shares, rank order, per-row bias slicing, gather
layouts) is checked against the unfused computation without a GPU. Synchronisation itself is
covered by the GPU suite (tests/gpu).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from commfuse.kernels import ce_graphs, cuda_paths, exchange, shards, symm
from helpers import init_fake_pg


class _Buffers:
    """Every rank's workspace; ``mine`` is the one the call under test runs on."""

    def __init__(self, rank: int, world: int, data_bytes: int = 1 << 16):
        self.world = world
        self.bufs = [torch.zeros(symm.HEADER_BYTES + 2 * data_bytes, dtype=torch.uint8) for _ in range(world)]
        self.mine = symm.Workspace("0", rank, world, self.bufs[rank], torch.zeros(world, dtype=torch.int64),
                                   data_bytes, _keepalive=self)

    def peer_data(self, peer: int, shape) -> torch.Tensor:
        """``peer``'s data half of the next call's parity (where its GEMM or copy writes)."""
        parity = (self.mine.epoch + 1) % 2
        return self.get_buffer(peer, shape, torch.float32,
                               (symm.HEADER_BYTES + parity * self.mine.data_bytes) // 4)

    def peers(self):
        return [p for p in range(self.world) if p != self.mine.rank]

    def get_buffer(self, peer, shape, dtype, offset):  # the torch provider's peer views
        start = offset * dtype.itemsize
        return self.bufs[peer][start:start + torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)

    def at(self, peer: int, like: torch.Tensor) -> torch.Tensor:
        """``peer``'s tensor at the same workspace offset as ``like`` (what iris.load translates to)."""
        off = like.data_ptr() - self.mine.buffer.data_ptr()
        raw = self.bufs[peer][off:off + like.numel() * like.element_size()]
        return raw.view(like.dtype).view(like.shape)


@pytest.fixture(params=[(2, 0), (2, 1), (4, 2), (8, 5)], ids=lambda p: f"world{p[0]}-rank{p[1]}")
def sim(request, monkeypatch):
    world, rank = request.param
    init_fake_pg(world)
    bufs = _Buffers(rank, world)
    ws = bufs.mine
    WORLD = world

    bufs.algos = []  # the exchange each all-reduce asked for (the stand-in sums alike for all)

    def all_reduce(ws_, partial, out, epoch, algo, op_code, **_):
        bufs.algos.append(algo)
        out.copy_(sum(bufs.at(p, partial).float() for p in range(WORLD)))

    def gather(ws_, mine, out, outer, inner, epoch, op_code, **_):
        view = out.view(outer, WORLD, inner)
        for p in range(WORLD):
            view[:, p] = bufs.at(p, mine).reshape(outer, inner)

    def reduce_scatter(ws_, partial, out, outer, inner, epoch, op_code, **_):
        total = sum(bufs.at(p, partial).float() for p in range(WORLD)).view(outer, WORLD, inner)
        out.copy_(total[:, ws.rank].reshape(out.shape))

    class _Stream:
        def wait_stream(self, other):
            pass

        def record_event(self):
            return None

        def wait_event(self, event):
            pass

    monkeypatch.setattr(exchange, "all_reduce", all_reduce)
    monkeypatch.setattr(exchange, "gather", gather)
    monkeypatch.setattr(exchange, "reduce_scatter", reduce_scatter)
    monkeypatch.setattr(exchange, "barrier", lambda *a, **k: None)
    monkeypatch.setattr(symm, "workspace", lambda *a, **k: ws)
    monkeypatch.setattr(cuda_paths, "_side_stream", lambda device: _Stream())
    monkeypatch.setattr(cuda_paths, "_ce_streams", lambda device: (_Stream(), _Stream(), _Stream()))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    return bufs


def _inputs(world, m, k, n, bias_kind):
    torch.manual_seed(3)
    a = [torch.randn(m, k) for _ in range(world)]
    b = [torch.randn(k, n) for _ in range(world)]
    bias = [None if bias_kind is None else torch.randn(*((n,) if bias_kind == "1d" else (m, n)))
            for _ in range(world)]
    return a, b, bias


def _partial(a, b, bias):
    return a @ b if bias is None else torch.addmm(bias, a, b)


@pytest.mark.parametrize("algo", ["one_shot", "two_shot", "ce_overlap", "ce_overlap:copy", "overlap"])
@pytest.mark.parametrize("bias_kind", [None, "1d", "2d"])
def test_mm_all_reduce_paths(sim, monkeypatch, algo, bias_kind):
    """Every path, the copy-engine overlap with its default tail and with every chunk copied."""
    algo, _, tail = algo.partition(":")
    monkeypatch.setenv("COMMFUSE_ALGO", algo)
    if tail:
        monkeypatch.setenv("COMMFUSE_CE_TAIL", tail)
    monkeypatch.setenv("COMMFUSE_CE_CHUNKS", "3")  # uneven chunks
    a, b, bias = _inputs(sim.world, 10, 6, 7, bias_kind)
    r = sim.mine.rank
    for p in sim.peers():
        sim.peer_data(p, (10, 7)).copy_(_partial(a[p], b[p], bias[p]))  # what the peer's GEMM wrote
    out = cuda_paths.mm_all_reduce(a[r], b[r], bias[r], "0")
    want = sum(_partial(a[p], b[p], bias[p]) for p in range(sim.world))
    torch.testing.assert_close(out, want)
    if algo in ("one_shot", "two_shot"):  # the stand-in sums alike: the forced exchange must be the one asked
        assert sim.algos == [algo], sim.algos


@pytest.mark.parametrize("bias_kind", [None, "2d"])
@pytest.mark.parametrize("rows, last, tail_rows", [(10, None, 2), (200, "8", 8)])
def test_copy_engine_overlap_with_a_one_shot_tail(sim, monkeypatch, bias_kind, rows, last, tail_rows):
    """``COMMFUSE_CE_TAIL=one_shot``: the last chunk's rows go to the one-shot exchange, in flag
    slots after the chunks' barriers; the others are pulled and summed as before. 3 chunks: of 4,
    4 and 2 rows; with ``COMMFUSE_CE_LAST_ROWS=8`` of 200 rows, of 128, 64 and 8."""
    monkeypatch.setenv("COMMFUSE_ALGO", "ce_overlap")
    monkeypatch.setenv("COMMFUSE_CE_CHUNKS", "3")
    monkeypatch.setenv("COMMFUSE_CE_TAIL", "one_shot")
    if last:
        monkeypatch.setenv("COMMFUSE_CE_LAST_ROWS", last)
    calls = []
    real = exchange.all_reduce
    monkeypatch.setattr(exchange, "all_reduce", lambda ws_, partial, out, epoch, algo, op_code, **kw: (
        calls.append((partial.shape, algo, kw.get("slot_base"))), real(ws_, partial, out, epoch, algo, op_code)))
    a, b, bias = _inputs(sim.world, rows, 6, 7, bias_kind)
    r = sim.mine.rank
    for p in sim.peers():
        sim.peer_data(p, (rows, 7)).copy_(_partial(a[p], b[p], bias[p]))
    out = cuda_paths.mm_all_reduce(a[r], b[r], bias[r], "0")
    torch.testing.assert_close(out, sum(_partial(a[p], b[p], bias[p]) for p in range(sim.world)))
    assert calls == [(torch.Size([tail_rows, 7]), "one_shot", 3)]
    monkeypatch.setenv("COMMFUSE_CE_TAIL", "last")
    with pytest.raises(ValueError, match="COMMFUSE_CE_TAIL"):
        cuda_paths.mm_all_reduce(a[r], b[r], bias[r], "0")
    assert sim.mine.broken is None  # refused before the call's epoch began


@pytest.mark.parametrize("tail", ["copy", "one_shot"])
@pytest.mark.parametrize("streams", ["1", "2", "3"])
def test_copy_engine_side_work_spreads_over_the_streams_asked_for(sim, monkeypatch, streams, tail):
    """``COMMFUSE_CE_STREAMS``: 1, each chunk's barrier, pulls and add in turn on one side stream;
    2, each add on a second stream behind the event the pulls' stream recorded after that chunk's
    pulls; 3, the barriers on a third too, each chunk's pulls behind the event recorded after its
    own barrier, so the pulls' stream holds event waits and pulls only. Events are told apart
    (stream, count), so a pull or an add that waited on another chunk's event fails; the caller's
    stream waits for every stream used, the pulls' last. With the one-shot tail the last chunk
    takes none of this."""
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
    monkeypatch.setattr(cuda_paths, "_ce_streams", lambda device: (rec["pulls"], rec["adds"], rec["barriers"]))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: rec[current[0]])
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(exchange, "barrier", lambda ws_, epoch, op_code, slot=0: log.append((current[0], "barrier", slot)))
    real_sum, real_all_reduce = cuda_paths._sum_rank_order, exchange.all_reduce
    monkeypatch.setattr(cuda_paths, "_sum_rank_order", lambda parts, out: (
        log.append((current[0], "add", out.storage_offset() // (rows * n))), real_sum(parts, out)))
    monkeypatch.setattr(exchange, "all_reduce", lambda *args, **kw: (
        log.append((current[0], "one_shot", kw.get("slot_base"))), real_all_reduce(*args, **kw)))
    for name, value in (("ALGO", "ce_overlap"), ("CE_CHUNKS", "3"), ("CE_TAIL", tail), ("CE_STREAMS", streams),
                        ("CE_GRAPHS", "0")):
        monkeypatch.setenv(f"COMMFUSE_{name}", value)
    a, b, bias = _inputs(sim.world, m, 6, n, "2d")
    r = sim.mine.rank
    for p in sim.peers():
        sim.peer_data(p, (m, n)).copy_(_partial(a[p], b[p], bias[p]))
    log.clear()
    out = cuda_paths.mm_all_reduce(a[r], b[r], bias[r], "0")
    torch.testing.assert_close(out, sum(_partial(a[p], b[p], bias[p]) for p in range(sim.world)))
    on = {name: [e[1:] for e in log if e[0] == name] for name in names}
    chunks = 3 if tail == "copy" else 2  # the one-shot takes the last chunk on the caller's stream
    peers = sim.world - 1
    gemms = [("record", ("main", i)) for i in range(3)]
    assert on["main"][:3] == gemms  # every chunk's GEMM event, first
    rest = on["main"][3:]
    if tail == "one_shot":
        assert rest[0] == ("one_shot", 3)  # after the chunks' barrier slots
        rest = rest[1:]

    def pulls(i):
        return [("pull", i)] * peers

    if streams == "1":
        assert on["pulls"] == [("wait_stream", "main")] + [
            x for i in range(chunks) for x in [("wait_event", ("main", i)), ("barrier", i), *pulls(i), ("add", i)]]
        assert on["adds"] == on["barriers"] == [] and rest == [("wait_stream", "pulls")]
    elif streams == "2":
        assert on["pulls"] == [("wait_stream", "main")] + [
            x for i in range(chunks)
            for x in [("wait_event", ("main", i)), ("barrier", i), *pulls(i), ("record", ("pulls", i))]]
        assert on["adds"] == [x for i in range(chunks) for x in [("wait_event", ("pulls", i)), ("add", i)]]
        assert on["barriers"] == [] and rest == [("wait_stream", "adds"), ("wait_stream", "pulls")]
    else:
        assert on["barriers"] == [x for i in range(chunks) for x in [
            ("wait_event", ("main", i)), ("barrier", i), ("record", ("barriers", i))]]
        assert on["pulls"] == [("wait_stream", "main")] + [
            x for i in range(chunks) for x in [("wait_event", ("barriers", i)), *pulls(i), ("record", ("pulls", i))]]
        assert on["adds"] == [x for i in range(chunks) for x in [("wait_event", ("pulls", i)), ("add", i)]]
        assert sorted(rest[:2]) == [("wait_stream", "adds"), ("wait_stream", "barriers")]
        assert rest[2:] == [("wait_stream", "pulls")]


def test_a_workspace_keeps_a_bounded_number_of_launches(sim, monkeypatch):
    """A plan per row count (dynamic shapes): ``kept`` drops them all once full."""
    monkeypatch.setattr(symm, "KEPT_LIMIT", 3)
    ws = sim.mine
    made = [ws.kept(("plan", m), lambda m=m: object()) for m in range(3)]
    assert ws.kept(("plan", 1), lambda: None) is made[1] and len(ws.launches) == 3
    ws.kept(("plan", 3), object)
    assert list(ws.launches) == [("plan", 3)]


def test_peer_views_are_made_once_per_peer_and_parity(sim, monkeypatch):
    """The copy-engine paths read the peers' halves through views the workspace keeps: the
    provider makes each (peer, parity) view once, and later calls, of other shapes too, slice
    it."""
    monkeypatch.setenv("COMMFUSE_ALGO", "ce_overlap")
    made = []
    real = sim.get_buffer
    monkeypatch.setattr(sim, "get_buffer", lambda *a: made.append(a[0]) or real(*a))
    r = sim.mine.rank
    for call, (m, n) in enumerate([(10, 7), (6, 5), (10, 7)]):
        a, b, bias = _inputs(sim.world, m, 6, n, "1d")
        for p in sim.peers():
            sim.peer_data(p, (m, n)).copy_(_partial(a[p], b[p], bias[p]))
        made_before = len(made)
        out = cuda_paths.mm_all_reduce(a[r], b[r], bias[r], "0")
        assert len(made) - made_before == (sim.world if call < 2 else 0)  # every rank's view, per parity
        torch.testing.assert_close(out, sum(_partial(a[p], b[p], bias[p]) for p in range(sim.world)))


@pytest.mark.parametrize("algo, gather_dim, shape", [
    ("symm", 0, (4, 6)), ("symm", 1, (2, 3, 6)), ("overlap", 0, (4, 6)), ("overlap", 0, (2, 2, 6)),
    ("overlap", 1, (1, 4, 6)), ("overlap", 2, (1, 1, 3, 6)),  # leading 1s: blocks of rows, like dim 0
    ("overlap", 1, (2, 3, 6)), ("overlap", 1, (3, 2, 2, 6))])  # a batch: a block in each slab
@pytest.mark.parametrize("bias_kind", [None, "1d"])
@pytest.mark.parametrize("local", ["workspace", "copy"])
def test_all_gather_mm_paths(sim, monkeypatch, algo, gather_dim, shape, bias_kind, local):
    monkeypatch.setenv("COMMFUSE_ALGO", algo)
    monkeypatch.setenv("COMMFUSE_AG_LOCAL", local)  # what the overlap's local GEMM reads
    overlapped = []
    real = cuda_paths._gather_overlapped
    monkeypatch.setattr(cuda_paths, "_gather_overlapped", lambda *a, **k: overlapped.append(1) or real(*a, **k))
    torch.manual_seed(4)
    shards = [torch.randn(*shape) for _ in range(sim.world)]
    b, bias = torch.randn(6, 5), (None if bias_kind is None else torch.randn(5))
    r = sim.mine.rank
    for p in sim.peers():
        sim.peer_data(p, shape).copy_(shards[p])  # the peer's shard, copied into its workspace
    mine = sim.peer_data(r, shape)  # where this call must leave its shard for the peers
    out, gathered = cuda_paths.all_gather_mm(shards[r], b, bias, gather_dim, sim.world, "0")
    want_gathered = torch.cat(shards, dim=gather_dim)
    torch.testing.assert_close(mine, shards[r])
    torch.testing.assert_close(gathered, want_gathered)
    torch.testing.assert_close(out, _partial(want_gathered.reshape(-1, 6), b, bias))
    # a graph that does not use the gathered tensor: the same product, no gathered tensor promised
    for p in sim.peers():
        sim.peer_data(p, shape).copy_(shards[p])  # the next call's parity
    mine = sim.peer_data(r, shape)
    out2, gathered2 = cuda_paths.all_gather_mm(shards[r], b, bias, gather_dim, sim.world, "0",
                                               return_gathered=False)
    torch.testing.assert_close(mine, shards[r])
    torch.testing.assert_close(out2, out)
    assert len(overlapped) == (2 if algo == "overlap" else 0)  # any leading dims (as slabs) take it
    if gathered2 is not None:
        torch.testing.assert_close(gathered2, want_gathered)


def test_paths_count_the_path_that_ran(sim, monkeypatch):
    """A forced overlap that cannot take the call (more row slabs than it handles) runs the
    symmetric pull, and PATHS (what tests read to know which path ran) says so."""
    from commfuse.kernels import dispatch

    slabs = dispatch.MAX_ROW_SLABS + 1
    monkeypatch.setenv("COMMFUSE_ALGO", "overlap")
    before = dict(cuda_paths.PATHS)
    shards = [torch.randn(slabs, 2, 6) for _ in range(sim.world)]
    for p in sim.peers():
        sim.peer_data(p, (slabs, 2, 6)).copy_(shards[p])
    out, gathered = cuda_paths.all_gather_mm(shards[sim.mine.rank], torch.randn(6, 5), None, 1, sim.world, "0")
    torch.testing.assert_close(gathered, torch.cat(shards, dim=1))
    assert cuda_paths.PATHS["all_gather_mm:symm"] == before.get("all_gather_mm:symm", 0) + 1
    assert cuda_paths.PATHS["all_gather_mm:overlap"] == before.get("all_gather_mm:overlap", 0)
    monkeypatch.setenv("COMMFUSE_ALGO", "ce_overlap")
    m, shape = 2 * sim.world * slabs, [slabs, 2 * sim.world, 7]
    a, b, _ = _inputs(sim.world, m, 6, 7, None)
    for p in sim.peers():
        sim.peer_data(p, (m, 7)).copy_(a[p] @ b[p])
    out = cuda_paths.mm_reduce_scatter(a[sim.mine.rank], b[sim.mine.rank], None, shape, 1, sim.world, "0")
    want = sum(a[p] @ b[p] for p in range(sim.world)).view(shape).chunk(sim.world, dim=1)[sim.mine.rank]
    torch.testing.assert_close(out, want)
    assert cuda_paths.PATHS["mm_reduce_scatter:symm"] == before.get("mm_reduce_scatter:symm", 0) + 1


def test_a_bad_all_gather_setting_fails_before_the_exchange(sim, monkeypatch):
    """A setting the overlap cannot read raises before the call's epoch: the workspace stays
    usable (an error after the epoch began would mark it broken on this rank only)."""
    monkeypatch.setenv("COMMFUSE_ALGO", "overlap")
    monkeypatch.setenv("COMMFUSE_AG_LOCAL", "1")
    epoch = sim.mine.epoch
    with pytest.raises(ValueError, match="COMMFUSE_AG_LOCAL"):
        cuda_paths.all_gather_mm(torch.randn(4, 6), torch.randn(6, 5), None, 0, sim.world, "0")
    assert sim.mine.broken is None and sim.mine.epoch == epoch


@pytest.mark.parametrize("algo, rows_per_rank, shape_of, scatter_dim", [
    ("symm", 4, lambda w: [4 * w, 7], 0), ("symm", 4, lambda w: [2, 2 * w, 7], 1),
    ("ce_overlap", 4, lambda w: [4 * w, 7], 0), ("ce_overlap", 4, lambda w: [2 * w, 2, 7], 0),
    ("ce_overlap", 5, lambda w: [5 * w, 7], 0), ("ce_overlap", 4, lambda w: [1, 4 * w, 7], 1),
    ("ce_overlap", 4, lambda w: [2, 2 * w, 7], 1), ("ce_overlap", 6, lambda w: [3, w, 2, 7], 1)])
@pytest.mark.parametrize("bias_kind", [None, "1d", "2d"])
@pytest.mark.parametrize("chunks", ["1", "3"])
def test_mm_reduce_scatter_paths(sim, monkeypatch, algo, rows_per_rank, shape_of, scatter_dim, bias_kind, chunks):
    monkeypatch.setenv("COMMFUSE_ALGO", algo)
    monkeypatch.setenv("COMMFUSE_RS_CHUNKS", chunks)  # the overlap's row chunks per share (3 of 5 rows: 2, 2, 1)
    slots, overlapped = [], []
    monkeypatch.setattr(exchange, "barrier", lambda ws_, epoch, op, slot=0: slots.append(slot))
    real = cuda_paths._scatter_overlapped
    monkeypatch.setattr(cuda_paths, "_scatter_overlapped", lambda *a, **k: overlapped.append(1) or real(*a, **k))
    m = rows_per_rank * sim.world
    shape = shape_of(sim.world)
    a, b, bias = _inputs(sim.world, m, 6, 7, bias_kind)
    r = sim.mine.rank
    for p in sim.peers():
        sim.peer_data(p, (m, 7)).copy_(_partial(a[p], b[p], bias[p]))
    out = cuda_paths.mm_reduce_scatter(a[r], b[r], bias[r], shape, scatter_dim, sim.world, "0")
    total = sum(_partial(a[p], b[p], bias[p]) for p in range(sim.world)).view(shape)
    torch.testing.assert_close(out, total.chunk(sim.world, dim=scatter_dim)[r])
    assert len(slots) == len(set(slots)), "every barrier of a call has its own flag slot"
    # the copy-engine overlap takes scatters along any leading dim (a batch before it: as slabs)
    assert len(overlapped) == (algo == "ce_overlap")


def test_forced_copy_engine_paths_with_no_rows_fall_back(sim, monkeypatch):
    """Zero rows: nothing to chunk, so a forced copy-engine path takes the plain symmetric one
    (counted as such) instead of failing inside the exchange, which would break the workspace."""
    monkeypatch.setenv("COMMFUSE_ALGO", "ce_overlap")
    r = sim.mine.rank
    a, b, bias = _inputs(sim.world, 0, 6, 7, "1d")
    before = dict(cuda_paths.PATHS)
    out = cuda_paths.mm_all_reduce(a[r], b[r], bias[r], "0")
    assert out.shape == (0, 7) and sim.mine.broken is None
    assert cuda_paths.PATHS["mm_all_reduce:one_shot"] == before.get("mm_all_reduce:one_shot", 0) + 1
    out = cuda_paths.mm_reduce_scatter(a[r], b[r], bias[r], [0, 7], 0, sim.world, "0")
    assert out.shape == (0, 7) and sim.mine.broken is None
    assert cuda_paths.PATHS["mm_reduce_scatter:symm"] == before.get("mm_reduce_scatter:symm", 0) + 1


def test_kept_views_made_in_inference_mode_take_writes_outside_it(sim):
    """A workspace first used under ``torch.inference_mode`` (a prefill) keeps its flag and peer
    views for later calls outside it (training), which write the flags in place."""
    fresh = symm.Workspace("0", sim.mine.rank, sim.world, sim.bufs[sim.mine.rank].clone(),
                           torch.zeros(sim.world, dtype=torch.int64), 1 << 16, _keepalive=sim)
    with torch.inference_mode():
        fresh.flags, fresh.tile_flags, fresh.peer_data(0, 0, (4, 4), torch.float32)
    fresh.flags.zero_()
    fresh.tile_flags.add_(1)
    fresh.peer_data(0, 0, (4, 4), torch.float32).add_(1)


class _FakeEvent:
    """A timing event whose time is the number of events recorded before it (in ms)."""
    clock = 0

    def record(self, stream=None):
        _FakeEvent.clock += 1
        self.at = _FakeEvent.clock

    def elapsed_time(self, end):
        return end.at - self.at


def test_call_times_key_each_call_by_shapes_and_the_path_taken(sim, monkeypatch):
    """``call_times.record(True)``: each call of an op's entry is timed on the caller's stream,
    keyed by the op, its operands' shapes and layout and the path it took (a forced path that fell back
    counts as the path that ran); nothing is kept while recording is off; ``collect`` empties."""
    from commfuse.kernels import call_times

    monkeypatch.setattr(call_times, "_event", _FakeEvent)
    monkeypatch.setattr(call_times, "_timeable", lambda a: True)
    idle = iter([True, False, False, True, False])  # the stream's state at each recorded call
    monkeypatch.setattr(call_times, "_idle", lambda a: next(idle))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    r = sim.mine.rank

    def call(algo, m):
        monkeypatch.setenv("COMMFUSE_ALGO", algo)
        a, b, bias = _inputs(sim.world, m, 6, 7, None)
        for p in sim.peers():
            sim.peer_data(p, (m, 7)).copy_(_partial(a[p], b[p], bias[p]))
        cuda_paths.mm_all_reduce(a[r], b[r], bias[r], "0")

    def calls():
        call_times.record(True)
        try:
            call("one_shot", 10)
            call("two_shot", 10)
            call("one_shot", 10)
            call("ce_overlap", 0)  # no rows to chunk: runs one-shot instead
            monkeypatch.setenv("COMMFUSE_ALGO", "symm")  # an entry with a keyword argument
            shards = [torch.randn(4, 6) for _ in range(sim.world)]
            for p in sim.peers():
                sim.peer_data(p, (4, 6)).copy_(shards[p])
            b = torch.randn(6, 5)
            out, _ = cuda_paths.all_gather_mm(shards[r], b, None, 0, sim.world, "0", return_gathered=False)
            torch.testing.assert_close(out, torch.cat(shards) @ b)
        finally:
            call_times.record(False)
        call("one_shot", 10)

    call("one_shot", 10)  # not recording
    calls()
    detail = call_times.collect(detail=True)
    assert {k: [(c.gpu_us, c.idle) for c in v] for k, v in detail.items()} == {
        ("mm_all_reduce", (10, 6), (6, 7), False, "one_shot"): [(1e3, True), (1e3, False)],
        ("mm_all_reduce", (10, 6), (6, 7), False, "two_shot"): [(1e3, False)],
        ("mm_all_reduce", (0, 6), (6, 7), False, "one_shot"): [(1e3, True)],
        ("all_gather_mm", (4, 6), (6, 5), False, "symm"): [(1e3, False)]}
    assert all(c.host_us > 0 and 0 <= c.cpu_us <= c.host_us + 1e3 for v in detail.values() for c in v)
    assert next(idle, None) is None  # asked once per recorded call, never while not recording
    monkeypatch.setattr(call_times, "_idle", lambda a: False)
    calls()
    times = call_times.collect()
    assert times == {("mm_all_reduce", (10, 6), (6, 7), False, "one_shot"): [1e3, 1e3],
                     ("mm_all_reduce", (10, 6), (6, 7), False, "two_shot"): [1e3],
                     ("mm_all_reduce", (0, 6), (6, 7), False, "one_shot"): [1e3],
                     ("all_gather_mm", (4, 6), (6, 5), False, "symm"): [1e3]}
    assert call_times.collect() == {}


def test_one_shot_promises_vector_loads_only_on_aligned_partials(monkeypatch):
    """A chunk of a larger partial (the copy-engine tail, the SM overlap) may start off a 16-byte
    boundary: the one-shot kernel's loads must then not be vectorised (a misaligned load faults)."""
    seen = []
    monkeypatch.setattr(exchange, "run_kernel", lambda kernel, grid, *a, **kw: seen.append(kw["VEC"]))
    monkeypatch.setattr(exchange, "_common", lambda ws, epoch: {})
    ws = _Buffers(0, 2).mine
    data = ws.data(0, (64,), torch.bfloat16)
    out = torch.empty(64, dtype=torch.bfloat16)
    exchange.all_reduce(ws, data[:32], out[:32], 1, "one_shot", 0)
    exchange.all_reduce(ws, data[3:35], out[:32], 1, "one_shot", 0)  # 6 bytes in
    assert seen == [1, 0]


@pytest.mark.parametrize("graphs", ["1", "0"])
def test_the_copy_engine_path_reads_its_epoch_on_the_device_when_graphed(sim, monkeypatch, graphs):
    """``COMMFUSE_CE_GRAPHS`` (``ce_graphs.py``): with graphs the chunks' barriers and the one-shot
    tail get no epoch (they read the workspace's epoch cell, which holds the call's), without them
    the call's epoch; the result is the sum either way, and only graphed calls are remembered."""
    monkeypatch.setenv("COMMFUSE_CE_GRAPHS", graphs)
    monkeypatch.setenv("COMMFUSE_ALGO", "ce_overlap")
    monkeypatch.setenv("COMMFUSE_CE_CHUNKS", "3")
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
    out = cuda_paths.mm_all_reduce(a[r], b[r], bias[r], "0")
    torch.testing.assert_close(out, sum(_partial(a[p], b[p], bias[p]) for p in range(sim.world)))
    want = None if graphs == "1" else ws.epoch
    # the host queues the tail's one-shot after the last GEMM, then the side stream's barriers
    assert [s[:2] for s in seen] == [("one_shot", want)] + [("barrier", want)] * 2
    if graphs == "1":
        assert all(s[2] == ws.epoch for s in seen) and len(ws.graphs_seen) == 1 and not ws.graphs
    else:
        assert not ws.graphs and not ws.graphs_seen


def test_eager_twins_of_calls_captured_to_nccl_run_nccl(sim, monkeypatch):
    """A CUDA-graph capture sends these calls to NCCL. A rank whose graph tree re-warms runs the
    same calls eagerly while its peer replays the NCCL collectives, so once a capture took NCCL for
    an op, group and shapes, eager calls with those run NCCL too; other shapes keep their path."""
    from commfuse.kernels import dispatch

    monkeypatch.setattr(symm, "_captured_nccl", set())
    world, rank = sim.world, sim.mine.rank
    shard, b = torch.randn(4, 6), torch.randn(6, 5)
    a, w = torch.randn(2 * world, 6), torch.randn(6, 7)

    def paths(op):
        return {k.split(":")[1]: v for k, v in cuda_paths.PATHS.items() if k.startswith(op + ":")}

    def run(capturing, rows=4):
        monkeypatch.setattr(dispatch, "capturing", lambda: capturing)
        before = (paths("all_gather_mm"), paths("mm_reduce_scatter"))
        cuda_paths.all_gather_mm(shard[:rows], b, None, 0, world, "0")
        cuda_paths.mm_reduce_scatter(a[:rows * world // 2], w, None, [rows * world // 2, 7], 0, world, "0")
        after = (paths("all_gather_mm"), paths("mm_reduce_scatter"))
        return [next(k for k in aft if aft[k] != bef.get(k, 0)) for bef, aft in zip(before, after)]

    assert run(False) == ["symm", "symm"]  # before any capture
    assert run(True) == ["nccl", "nccl"]  # inside the capture
    assert run(False) == ["nccl", "nccl"]  # the re-warming rank meets its peer's replays
    # ... with nothing before them, not even the size agreement of an op whose sizes once differed
    monkeypatch.setattr(shards, "_uneven", {("0", "all_gather_mm"), ("0", "mm_reduce_scatter")})
    learned = shards.LEARNED
    assert run(False) == ["nccl", "nccl"] and shards.LEARNED == learned
    monkeypatch.setattr(shards, "_uneven", set())
    assert run(False, rows=2) == ["symm", "symm"]  # shapes no capture took keep their path
    symm.release_all()
    assert run(False) == ["symm", "symm"]


def test_a_captured_all_reduce_past_the_lane_makes_its_eager_twins_run_nccl(sim, monkeypatch):
    """A capture whose all-reduce the graph lane cannot take (no lane yet) runs NCCL inside the
    lane path; its eager twin must run NCCL too, not a symmetric path."""
    from commfuse.kernels import dispatch

    monkeypatch.setattr(symm, "_captured_nccl", set())
    monkeypatch.setattr(symm, "graph_lane", lambda name: None)
    a, b = torch.randn(8, 6), torch.randn(6, 5)

    def path(capturing):
        monkeypatch.setattr(dispatch, "capturing", lambda: capturing)
        before = dict(cuda_paths.PATHS)
        cuda_paths.mm_all_reduce(a, b, None, "0")
        return next(k for k, v in cuda_paths.PATHS.items() if v != before.get(k, 0))

    assert path(True) == "mm_all_reduce:graph"  # the lane path, which found no lane: NCCL
    assert path(False) == "mm_all_reduce:nccl"
    symm.release_all()
