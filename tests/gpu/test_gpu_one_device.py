"""Every kernel's cross-rank protocol at 2, 4 and 8 ranks on one GPU, against fp32 references.

Each rank is a workspace on the same GPU (``commfuse.tools.emulated``: its own buffer; one
heap-bases table, so Iris's pointer translation reaches any rank's buffer; one error word), its
kernels launched on its own stream with 1/world of the SMs, so every rank's programs run at once
and really wait on each other's flags. The kernels' launchers and the paths' own work
(``runtime/paths/*.py``: ``overlapped``, a path object's ``run``) are called directly, every knob
an argument. What one GPU cannot show is the link (remote stores here are local) and
several processes; the ranks' tile ownership, flag counts, shares, epochs and parity reuse at 4
and 8 ranks it does, on a machine with a single GPU. Runs in one process (skipped under
torchrun, where rank 0 alone running these would leave the other ranks waiting in their
collective tests):

    pytest -m gpu tests/gpu/test_gpu_one_device.py
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from commfuse.kernels import exchange, fused_all_gather, fused_all_reduce, fused_split_k, launch, tiles
from commfuse.kernels.codes import OP_MM_ALL_REDUCE
from commfuse.runtime import ce_graphs, counters, errors, rules, running
from commfuse.runtime.facts import local_facts
from commfuse.runtime.paths import after_gemm, ar_ce_overlap, ag_fused
from commfuse.runtime.paths.base import Call, Context, MmAllReduceArgs
from commfuse.runtime.running import ag_ce_overlap as ag_ce_overlap_run, ar_ce_overlap as ar_ce_overlap_run, rs_ce_overlap as rs_ce_overlap_run
from commfuse.tools import emulated

# Every emulated rank's spinning kernel needs a hardware queue of its own: with CUDA's default 8
# connections, the 8-rank tests' 16 streams (a main and a side stream per rank) share queues, and a
# rank's barrier can queue behind another rank's spinning one and never start (a false deadlock,
# seen at 8 ranks in the gather and scatter overlaps). tests/conftest.py sets the count before
# anything makes the process's CUDA context; a value set otherwise is what the context has.
CONNECTIONS = int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8"))

pytestmark = [pytest.mark.gpu, pytest.mark.one_gpu,
              pytest.mark.skipif(int(os.environ.get("WORLD_SIZE", "1")) > 1, reason="runs in one process")]

WORLDS = [2, 4, 8]
DT = torch.bfloat16


#: The emulated groups of the running test, by their error word, each as ``runtime.errors.check``
#: reads a group (``_Rank`` of its rank 0).
_made: dict[int, "_Rank"] = {}


@pytest.fixture(autouse=True)
def _bounded():
    """A lost flag becomes an error in seconds, not a hang (``_group``'s bound); after the test, no
    wait of its emulated groups timed out (other than one the test raised already)."""
    _made.clear()
    yield
    torch.cuda.synchronize()
    for group in _made.values():
        errors.check(group)


def _group(world: int, data_bytes: int, timeout_s: float = 20.0) -> list:
    """``world`` emulated ranks' workspaces, whose waits give up after ``timeout_s``."""
    ws = emulated.group(world, data_bytes, timeout_s=timeout_s)
    _made[id(ws[0].err)] = _Rank(ws[0])
    return ws


class _Rank(emulated.GroupState):
    """One emulated rank as the run-time's state of its group (``groups.Group``) shows it to a path
    and to ``runtime.errors.check`` (``emulated.GroupState``): its workspace
    (``paths.common.workspace`` hands it out as long as it is large enough, so nothing is
    allocated, and ``pg()``, which ``paths.common.exchange`` calls only to restart epochs near
    ``EPOCH_LIMIT``, is never called) and side streams of its own."""

    def __init__(self, ws):
        super().__init__(ws)
        self.streams = None

    def side_streams(self, device, count: int = 3) -> tuple:
        if self.streams is None:
            self.streams = tuple(torch.cuda.Stream(device) for _ in range(count))
        return self.streams

    def pg(self):
        raise AssertionError("an emulated rank has no process group")


def _check(ws) -> None:
    """Raise the run-time's error if a wait of this emulated group timed out (``runtime.errors.check``:
    the word its ranks share holds ``[1, op, rank, peer, call]`` and stays set, so later waits of
    the group give up at once; raised once, as for a real group)."""
    errors.check(_made[id(ws[0].err)])


def _operands(world, m, k, n, bias, call=0):
    torch.manual_seed(world * 1000 + m + k + n + 7 * call)
    a = [torch.randn(m, k, device="cuda", dtype=DT) for _ in range(world)]
    b = [(torch.randn(n, k, device="cuda", dtype=DT) / k ** 0.5).t() for _ in range(world)]  # W.t()
    c = [torch.randn(n, device="cuda", dtype=DT) if bias else None for _ in range(world)]
    ref = sum(x.float() @ y.float() for x, y in zip(a, b))
    if bias:
        ref = ref + sum(t.float() for t in c)
    return a, b, c, ref


def _poisoned(world, *shape):
    """A NaN-filled tensor per rank: an element no kernel writes shows."""
    return [torch.full(shape, float("nan"), device="cuda", dtype=DT) for _ in range(world)]


def _halves(ws, parity, shape):
    """This rank's data half of ``parity`` and every rank's, as the copy-engine paths take them."""
    return ws.data(parity, shape, DT), [ws.peer_data(p, parity, shape, DT) for p in range(ws.world)]


def _gather_case(world, rows, k, n, call, streams):
    """Fresh shards, a shared weight (W.t()), the fp32 reference of the gathered product, and
    NaN-poisoned outputs and gathered buffers per rank (the ranks' streams wait for them)."""
    torch.manual_seed(call)
    shards = [torch.randn(rows, k, device="cuda", dtype=DT) for _ in range(world)]
    b = (torch.randn(n, k, device="cuda", dtype=DT) / k ** 0.5).t()
    full = torch.cat(shards)
    outs, gathered = _poisoned(world, world * rows, n), _poisoned(world, world * rows, k)
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    return shards, b, full, full.float() @ b.float(), outs, gathered


def _relerr(got, want):
    assert torch.isfinite(got).all(), "unwritten (NaN-poisoned) or non-finite output"
    return ((got.float() - want).norm() / want.norm()).item()


def _each_rank(ws, streams, fn, tags=None):
    """``fn(rank, epoch, parity)`` for every rank, each on its own stream, in one epoch (its
    pairing tag ``tags[rank]``, else 0)."""
    for r, s in enumerate(streams):
        epoch, parity = ws[r].next_epoch(tag=tags[r] if tags else 0)
        with torch.cuda.stream(s):
            fn(r, epoch, parity)


def _need_queues(streams: int) -> None:
    """Skip a case whose concurrently spinning streams outnumber CUDA's hardware queues."""
    if streams > CONNECTIONS:
        pytest.skip(f"{streams} spinning streams need CUDA_DEVICE_MAX_CONNECTIONS >= {streams} set before "
                    f"CUDA starts (it was {CONNECTIONS})")


def _streams(world):
    _need_queues(world)
    main = torch.cuda.current_stream()
    streams = [torch.cuda.Stream() for _ in range(world)]
    for s in streams:
        s.wait_stream(main)  # the operands were made on the main stream
    return streams


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("scatter", [False, True], ids=["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("reducers", [0, 16])
def test_fused_all_reduce_kernel(world, scatter, reducers):
    """Three calls back to back (both parities, then the first again), outputs poisoned."""
    if scatter and reducers:
        pytest.skip("the reduce-scatter form has no reducers")
    _fused_calls(world, scatter, reducers)


@pytest.mark.parametrize("world", [2, 8])
@pytest.mark.parametrize("scatter", [False, True], ids=["all_reduce", "reduce_scatter"])
def test_fused_all_reduce_kernel_with_a_staggered_start(world, scatter):
    """``Options.stagger_ns``: the programs start their first tiles spread over 20 µs."""
    ws = _fused_calls(world, scatter, 0, fused_all_reduce.Options(stagger_ns=(20_000, 20_000)))
    plans = [v for v in ws[0].launches.values() if isinstance(v, fused_all_reduce._Plan)]
    assert plans and all(p.bound.fixed["STAGGER"] and p.bound.fixed["stagger"] == 20_000 for p in plans)


def _fused_calls(world, scatter, reducers, opts=fused_all_reduce.Options()):
    """Three fused calls on every rank, each against fp32; returns the ranks' workspaces."""
    m, k, n = (1024 if scatter else 1000), 512, 776
    cfg = tiles.TileConfig.parse(f"128x256x64s3w8g8r{reducers}o1")
    ws = _group(world, fused_all_reduce.data_elems(m, n, world, cfg, scatter) * DT.itemsize)
    streams = _streams(world)
    direct, encoded = launch.BOUND_DIRECT, launch.ENCODED_LAUNCHES
    for call in range(3):
        a, b, c, ref = _operands(world, m, k, n, bias=call == 1, call=call)
        share = m // world
        outs = _poisoned(world, share if scatter else m, n)
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
        launches = [fused_all_reduce.prepare(ws[r], a[r], b[r], c[r], outs[r], cfg, scatter, opts)
                    for r in range(world)]
        _each_rank(ws, streams, lambda r, epoch, parity: launches[r](epoch, parity))
        torch.cuda.synchronize()
        _check(ws)
        for r in range(world):
            want = ref[r * share:(r + 1) * share] if scatter else ref
            assert _relerr(outs[r], want) < 1e-2, (call, r)
    assert launch.BOUND_DIRECT >= direct + world  # call 2 reused call 0's plan on every rank, directly
    if _encoded_layout():  # ... with its descriptors encoded once per address
        assert launch.ENCODED_LAUNCHES >= encoded + world
    return ws


def _encoded_layout() -> bool:
    import triton

    return triton.__version__.startswith(launch.ENCODED_LAYOUTS)


@pytest.mark.one_gpu
def test_encoded_launches_follow_their_operands_addresses():
    """The tile GEMM launched again and again through kept descriptor encodings (Triton 3.6's
    launcher): operands at new addresses (fresh tensors each call), at an address seen before (a
    tensor freed and its block handed out again), and of another shape, each output poisoned and
    checked against fp32. A launch that reused a stale encoding would multiply the wrong rows."""
    cfg = tiles.TileConfig.parse("128x256x64s3w8g8r0o1")
    before = launch.ENCODED_LAUNCHES
    w = torch.randn(768, 512, device="cuda", dtype=DT) / 512 ** 0.5
    for call, m in enumerate([1000, 1000, 1000, 640, 1000, 640]):
        a = torch.randn(m, 512, device="cuda", dtype=DT) * (call + 1)
        out = torch.full((m, 768), float("nan"), device="cuda", dtype=DT)
        tiles.matmul(a, w.t(), None, cfg, out=out)
        ref = a.float() @ w.t().float()
        assert _relerr(out, ref) < 1e-2, call
        del a  # its block goes back to the allocator: a later call's operand may take its address
    if _encoded_layout():
        assert launch.ENCODED_LAUNCHES >= before + 3


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("algo", ["one_shot", "two_shot"])
def test_exchange_all_reduce(world, algo):
    m, n = 1000, 776
    ws = _group(world, m * n * DT.itemsize)
    streams = _streams(world)
    for call in range(3):
        torch.manual_seed(call)
        parts = [torch.randn(m, n, device="cuda", dtype=DT) for _ in range(world)]
        ref = sum(p.float() for p in parts)
        outs = _poisoned(world, m, n)
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())

        def run(r, epoch, parity):
            partial = ws[r].data(parity, (m, n), DT)
            partial.copy_(parts[r])
            exchange.all_reduce(ws[r], partial, outs[r], epoch, algo, OP_MM_ALL_REDUCE)

        _each_rank(ws, streams, run)
        torch.cuda.synchronize()
        for r in range(world):
            assert _relerr(outs[r], ref) < 1e-2, (call, r)


@pytest.mark.parametrize("algo", ["one_shot", "two_shot", "gather", "reduce_scatter"])
def test_exchange_with_a_peer_that_never_comes_leaves_nan(algo):
    """Rank 0 of 2 alone calls (rank 1 never launches), its peer's half holding an earlier call's
    bytes: the wait expires, the error names op, group, rank and peer, and where the peer's data
    would go the output is NaN, never a sum with the stale bytes."""
    m, n = 64, 200
    ws = _group(2, 2 * m * n * DT.itemsize, timeout_s=0.5)
    epoch, parity = ws[0].next_epoch()
    for r, value in enumerate((1.0, 100.0)):  # rank 1's half: stale bytes
        ws[r].data(parity, (2 * m * n,), DT).fill_(value)
    mine = ws[0].data(parity, (m, 2, n) if algo == "reduce_scatter" else (m, n), DT)
    if algo in ("one_shot", "two_shot"):
        out = torch.zeros(m, n, device="cuda", dtype=DT)
        exchange.all_reduce(ws[0], mine, out, epoch, algo, OP_MM_ALL_REDUCE)
        peers_part = out
    elif algo == "gather":
        out = torch.zeros(m, 2, n, device="cuda", dtype=DT)
        exchange.gather(ws[0], mine, out, m, n, epoch, OP_MM_ALL_REDUCE)
        assert torch.equal(out[:, 0].float().cpu(), torch.ones(m, n)), "own rows copied"
        peers_part = out[:, 1]
    else:
        out = torch.zeros(m, n, device="cuda", dtype=DT)
        exchange.reduce_scatter(ws[0], mine, out, m, n, epoch, OP_MM_ALL_REDUCE)
        peers_part = out
    torch.cuda.synchronize()
    assert bool(peers_part.isnan().all()), f"{algo}: a late peer's call left values"
    with pytest.raises(RuntimeError, match=r"mm_all_reduce: on group 'one-device-2', rank 0 timed out after 0.5 s "
                       r"waiting for rank 1"):
        _check(ws)


def _run(ws, streams, run, monkeypatch, stubbed: tuple[str, ...] = ()) -> None:
    """One call of a host-orchestrated path on every rank, synchronised. ``stubbed``: exchange
    kernels left out (``barrier``, ``all_reduce``: what the call reads from the peers is then
    garbage, and is not checked), to load the path's other kernels: CUDA loads a kernel at its
    first launch, after the running ones finish, and with every rank's host in this one thread
    rank 0's first add or GEMM would wait for its own spinning kernel, which waits for rank 1's,
    not yet launched. So each spinning kernel is first launched in a call where nothing spins
    before it, and loaded there."""
    with monkeypatch.context() as m:
        for name in stubbed:
            m.setattr(exchange, name, lambda *a, **k: None)
        _each_rank(ws, streams, run)
    torch.cuda.synchronize()


def _side_streams(world: int, distinct: int) -> list[tuple]:
    """Per rank, the side streams of its copy-engine work (the all-reduce's (pulls, adds,
    barriers); the gather's and scatter's overlaps take the first): ``distinct`` streams of its
    own, the last of them standing in for the rest (each may run work beside its rank's stream and
    the process's default stream)."""
    _need_queues(world * (1 + distinct) + 1)
    sides = []
    for _ in range(world):
        own = [torch.cuda.Stream() for _ in range(distinct)]
        sides.append(tuple(own[min(i, distinct - 1)] for i in range(3)))
    return sides


#: Loading calls of the copy-engine all-reduce (``_run``'s ``stubbed``): call 0 the GEMM, copies
#: and adds, call 1 the barrier; the one-shot tail's first launch, in call 2, comes after the
#: GEMMs and before any barrier of rank 0, while nothing spins.
CE_LOADING = [("barrier", "all_reduce"), ("all_reduce",)]


@pytest.mark.parametrize("world", WORLDS)
def test_copy_engine_overlap(world, monkeypatch):
    """The chunked cuBLAS + copy-engine all-reduce (``running.ar_ce_overlap.overlapped``): a barrier per
    chunk, the peers' rows pulled by the copy engines and summed in rank order on the side
    streams, the last chunk by the one-shot kernel. After the loading calls (``CE_LOADING``),
    calls 2-4 (with and without a bias) are checked; every rank returns the same tensor. 8 ranks
    with three side streams each would spin on 33 streams, past CUDA's 32 hardware queues: there
    each rank's side work shares one stream, in the order ``overlapped`` queues it."""
    m, k, n = 4096, 256, 512
    cfg = ar_ce_overlap.CeConfig(ar_ce_overlap.chunk_rows(m))
    assert cfg.rows == (1024,) * 4
    ws = _group(world, m * n * DT.itemsize)
    sides = _side_streams(world, 3 if world <= 4 else 1)
    rank_streams = _streams(world)
    direct = launch.BOUND_DIRECT
    one_shots = []
    real = exchange.all_reduce
    monkeypatch.setattr(exchange, "all_reduce", lambda *args, **kw: (one_shots.append(args[4]), real(*args, **kw)))
    for call in range(5):
        a, b, c, ref = _operands(world, m, k, n, bias=call % 2 == 1, call=call)
        outs, recvs = _poisoned(world, m, n), _poisoned(world, world - 1, m, n)
        for s in rank_streams:
            s.wait_stream(torch.cuda.current_stream())

        def run(r, epoch, parity):
            partial, peers = _halves(ws[r], parity, (m, n))
            ar_ce_overlap_run.overlapped(ws[r], a[r], b[r], c[r], partial, outs[r], recvs[r], peers, epoch, cfg, sides[r])

        _run(ws, rank_streams, run, monkeypatch, CE_LOADING[call] if call < len(CE_LOADING) else ())
        for r in range(world if call >= 2 else 0):
            assert _relerr(outs[r], ref) < 1e-2, (call, r)
            assert torch.equal(outs[r], outs[0]), (call, r)
    assert launch.BOUND_DIRECT > direct  # the chunks' barriers after the first, through the kept launch
    assert one_shots == ["one_shot"] * 3 * world  # the last chunk of calls 2-4


@pytest.mark.parametrize("world", WORLDS)
def test_copy_engine_overlap_replayed_as_a_cuda_graph(world, monkeypatch):
    """The copy-engine all-reduce in its CUDA-graph form (``ce_graphs.py``): the epoch read from
    each rank's epoch cell. Calls 0 and 1 load the kernels (``CE_LOADING``), 2 and 3 run directly;
    from call 4 on through ``ce_graphs.run``: eager, captured, then replayed (a graph per parity),
    each rank's graph on its own stream, the ranks' graphs waiting on each other. Inputs are
    refilled in place and outputs poisoned in place each call (a graph holds their addresses), so
    a replay that read stale inputs or left an element unwritten shows."""
    # Eight emulated ranks' graphs of three branches each (24 concurrent, two of them spinning per
    # rank) can time out (a rank waiting out the bound for another), most likely because the
    # graphs' branches share the device's hardware queues, so one rank's spinning barrier can hold
    # another rank's back, which a process per GPU never does (nothing a rank waits for sits behind
    # its own adds). 8 ranks keep one side stream (two branches); 2 and 4 ranks use three.
    side_count = 3 if world <= 4 else 1
    m, k, n = 4096, 256, 512  # four 1024-row chunks
    cfg = ar_ce_overlap.CeConfig(ar_ce_overlap.chunk_rows(m))
    ws = _group(world, m * n * DT.itemsize)
    sides = _side_streams(world, side_count)
    streams = _streams(world)
    a = [torch.empty(m, k, device="cuda", dtype=DT) for _ in range(world)]
    b = [torch.empty(n, k, device="cuda", dtype=DT).t() for _ in range(world)]
    c = [torch.empty(n, device="cuda", dtype=DT) for _ in range(world)]
    outs, recvs = _poisoned(world, m, n), _poisoned(world, world - 1, m, n)
    counts = dict(counters.CE_GRAPHS)
    hows = []
    for call in range(10):
        fresh_a, fresh_b, fresh_c, ref = _operands(world, m, k, n, bias=True, call=call)
        for r in range(world):
            a[r].copy_(fresh_a[r])
            b[r].copy_(fresh_b[r])
            c[r].copy_(fresh_c[r])
            outs[r].fill_(float("nan"))
            recvs[r].fill_(float("nan"))
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())

        def run(r, epoch, parity):
            partial, peers = _halves(ws[r], parity, (m, n))

            def body(capture_sides):  # in a capture, forked to as many of ce_graphs' streams
                use = sides[r] if capture_sides is None else tuple(
                    capture_sides[min(i, side_count - 1)] for i in range(3))
                ar_ce_overlap_run.overlapped(ws[r], a[r], b[r], c[r], partial, outs[r], recvs[r], peers, None, cfg, use)

            if call < 4:
                ws[r].epoch_cell.fill_(epoch)
                body(None)
            else:
                key = ce_graphs.key(ws[r], parity, (a[r], b[r], c[r], outs[r], recvs[r]), (cfg.rows, side_count))
                hows.append(ce_graphs.run(ws[r], epoch, key, body, torch.cuda.current_device()))

        _run(ws, streams, run, monkeypatch, CE_LOADING[call] if call < len(CE_LOADING) else ())
        for r in range(world if call >= 2 else 0):
            assert _relerr(outs[r], ref) < 1e-2, (call, r)
            assert torch.equal(outs[r], outs[0]), (call, r)
    # a graph per parity (the data half it holds): calls 4 and 5 eager, 6 and 7 captured, 8 and 9 replayed
    assert hows == [how for how in ("eager", "captured", "replayed") for _ in range(2 * world)], hows
    assert counters.CE_GRAPHS["captured"] == counts["captured"] + 2 * world
    assert all(len(w.graphs) == 2 for w in ws)


@pytest.mark.parametrize("world", WORLDS)
def test_gather_overlap(world, monkeypatch):
    """The copy-engine all-gather overlap (``running.ag_ce_overlap.overlapped``): the local rows multiply
    while the copy engines pull the peers' shards behind a barrier, then the peers' rows."""
    rows, k, n = 512, 256, 512  # each rank's rows
    ws = _group(world, rows * k * DT.itemsize)
    sides = _side_streams(world, 1)
    streams = _streams(world)
    for call in range(3):
        shards, b, full, ref, outs, gathered = _gather_case(world, rows, k, n, call, streams)

        def run(r, epoch, parity):
            mine, peers = _halves(ws[r], parity, (rows, k))
            ag_ce_overlap_run.overlapped(ws[r], shards[r], mine, b, None, gathered[r], outs[r], peers, epoch, True,
                                  sides[r][0])

        _run(ws, streams, run, monkeypatch, ("barrier",) if call == 0 else ())
        for r in range(world if call else 0):
            assert torch.equal(gathered[r], full), (call, r)
            assert _relerr(outs[r], ref) < 1e-2, (call, r)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("chunks", [1, 2])
def test_scatter_overlap(world, chunks, monkeypatch):
    """The copy-engine reduce-scatter overlap (``running.rs_ce_overlap.overlapped``): the peers' shares
    multiply first, chunk by chunk, each pulled by its owner behind a barrier; the own share's
    GEMMs add the pulled partials (one chunk: summed after, in rank order)."""
    m, k, n = 512 * world, 256, 512
    share = m // world
    ws = _group(world, m * n * DT.itemsize)
    sides = _side_streams(world, 1)
    streams = _streams(world)
    for call in range(3):
        a, b, c, ref = _operands(world, m, k, n, bias=True, call=call)
        outs, recvs = _poisoned(world, share, n), _poisoned(world, world - 1, share, n)
        owns = [torch.empty(share, n, device="cuda", dtype=DT) if chunks == 1 else None for _ in range(world)]
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())

        def run(r, epoch, parity):
            partial, peers = _halves(ws[r], parity, (m, n))
            rs_ce_overlap_run.overlapped(ws[r], a[r], b[r], c[r], partial, outs[r], recvs[r], owns[r], chunks, peers, epoch,
                                  sides[r][0])

        _run(ws, streams, run, monkeypatch, ("barrier",) if call == 0 else ())
        for r in range(world if call else 0):
            assert _relerr(outs[r], ref[r * share:(r + 1) * share]) < 1e-2, (call, r)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("m, n", [(1, 1024), (16, 1024), (64, 1024), (16, 4096)])
@pytest.mark.parametrize("ll", [False, True])
def test_split_k_kernel(world, m, n, ll):
    """``ll``: the sums pushed as LL words (flags in the words), else values and a flag per tile.
    16 x 4096: the narrow 16-row blocks where they fill an emulated rank's SMs once."""
    k = 2048
    programs = torch.cuda.get_device_properties(0).multi_processor_count // world
    cfg = fused_split_k.config(m, k, n, programs, ll=ll)
    ws = _group(world, fused_split_k.data_bytes(m, n, world, cfg, DT))
    streams = _streams(world)
    for call in range(3):
        a, b, c, ref = _operands(world, m, k, n, bias=call == 1, call=call)
        outs = _poisoned(world, m, n)
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
        launches = [fused_split_k.prepare(ws[r], a[r], b[r], c[r], outs[r], cfg) for r in range(world)]
        _each_rank(ws, streams, lambda r, epoch, parity: launches[r](epoch, parity))
        torch.cuda.synchronize()
        _check(ws)
        for r in range(world):
            assert _relerr(outs[r], ref) < 1e-2, (call, r)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("push", ["sm", "ce"])
def test_fused_all_gather_kernel(world, push):
    """Three calls, outputs and gathered rows poisoned. ``ce``: the copy engines push each rank's
    rows from a side stream of its own (in two chunks), ordered after the rank's stream and
    back; the gathered rows are then copied from the workspace after the kernel."""
    rows, k, n = 256, 512, 776  # each rank's rows
    cfg = ag_fused.tile_config(Call("all_gather_mm", world * rows, k, n, DT, world))
    ws = _group(world, fused_all_gather.data_elems(rows, k, world) * DT.itemsize)
    if push == "ce" and fused_all_gather.copy_engine_flags() is None:
        pytest.skip("no stream writes for the copy engines' flags")
    sides = [s[0] for s in _side_streams(world, 1)] if push == "ce" else [None] * world
    streams = _streams(world)
    for call in range(3):
        shards, b, full, ref, outs, gathered = _gather_case(world, rows, k, n, call, streams)
        launches = [fused_all_gather.prepare(ws[r], shards[r], b, None, gathered[r], outs[r], cfg, side=sides[r],
                                             ce_chunk_count=2) for r in range(world)]
        assert all(go.variants == (("ce_push",) if push == "ce" else ()) for go in launches)

        def run(r, epoch, parity):
            launches[r](epoch, parity)
            # the pushes went out on the side stream: the rank's own is current again
            assert torch.cuda.current_stream() == streams[r] and torch.cuda.current_device() == 0

        _each_rank(ws, streams, run)
        torch.cuda.synchronize()
        _check(ws)
        for r in range(world):
            assert torch.equal(gathered[r], full), (call, r)
            assert _relerr(outs[r], ref) < 1e-2, (call, r)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kernel", ["one_shot", "fused", "split_k"])
def test_another_call_at_the_same_count_is_named_not_summed(world, kernel):
    """The pairing check: rank 1 makes another call (its tag differs) at the count where its peers
    make this one, as after a skipped call. Its peers do not read its data: every rank's output is
    NaN, and the error names the mismatch at once (far within the 20 s bound), not a timeout. The
    next call after ``release`` of the word pairs again (the peers then agree)."""
    m, k, n = (16, 2048, 1024) if kernel == "split_k" else (256, 512, 512)
    programs = torch.cuda.get_device_properties(0).multi_processor_count // world
    if kernel == "split_k":
        cfg = fused_split_k.config(m, k, n, programs, ll=False)  # what the check asks for
        nbytes = fused_split_k.data_bytes(m, n, world, cfg, DT)
    elif kernel == "fused":
        cfg = tiles.TileConfig.parse("128x128x64s3w8g8r0o1")
        nbytes = fused_all_reduce.data_elems(m, n, world, cfg, False) * DT.itemsize
    else:
        nbytes = m * n * DT.itemsize
    ws = _group(world, nbytes)
    streams = _streams(world)
    a, b, c, ref = _operands(world, m, k, n, bias=False)
    tags = [0x155] * world
    tags[1] = 0x2AA
    for mismatch in (True, False):
        outs = _poisoned(world, m, n)
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
        if kernel == "split_k":
            launches = [fused_split_k.prepare(ws[r], a[r], b[r], c[r], outs[r], cfg) for r in range(world)]
        elif kernel == "fused":
            launches = [fused_all_reduce.prepare(ws[r], a[r], b[r], c[r], outs[r], cfg, False)
                        for r in range(world)]
        else:
            def one_shot(r, epoch, parity):
                partial = ws[r].data(parity, (m, n), DT)
                torch.matmul(a[r], b[r], out=partial)
                exchange.all_reduce(ws[r], partial, outs[r], epoch, "one_shot", OP_MM_ALL_REDUCE)
            launches = [lambda epoch, parity, r=r: one_shot(r, epoch, parity) for r in range(world)]
        start = time.monotonic()
        _each_rank(ws, streams, lambda r, epoch, parity: launches[r](epoch, parity),
                   tags if mismatch else [0x155] * world)
        torch.cuda.synchronize()
        elapsed = time.monotonic() - start
        if mismatch:
            assert elapsed < 5, f"a mismatch waited out {elapsed:.1f} s"
            assert all(bool(o.isnan().all()) for o in outs), "another call's data was summed"
            with pytest.raises(RuntimeError, match=r"met a different call.*skipped, added or reordered"):
                _check(ws)
            ws[0].err.zero_()  # (every rank's word) the emulated group starts over
            _made[id(ws[0].err)].broken = None
            for w in ws:
                w.broken = None
        else:
            _check(ws)
            for r in range(world):
                assert _relerr(outs[r], ref) < 1e-2, r


#: About 25 ms of ``torch.cuda._sleep`` at an H200's clock: far longer than the host takes to queue
#: every rank's calls and the device to run the undelayed ones.
SLEEP_CYCLES = 50_000_000


def _poison_next(stream, shape) -> int:
    """NaN into the block the next allocation of ``shape`` on ``stream`` gets (the caching
    allocator hands a freed block back to the next request of its size on its stream); returns
    the block's address."""
    with torch.cuda.stream(stream):
        block = torch.full(shape, float("nan"), device="cuda", dtype=DT)
    ptr = block.data_ptr()
    del block
    return ptr


@pytest.mark.parametrize("order", ["kept", "left_out"])
def test_calls_on_two_streams_per_rank_pair_in_order(order, monkeypatch):
    """Each of two emulated ranks issues two consecutive all-reduces through a path object
    (``running.run(after_gemm.ONE_SHOT, ...)``, as the entry runs it) on two different CUDA streams, the first
    delayed on one rank by a ``torch.cuda._sleep`` queued ahead of it on its stream. Calls pair
    across ranks by their epochs, taken in host order, and ``Workspace.order`` (entered by
    ``paths.common.exchange``) starts a call on the device only after its workspace's previous
    call, as NCCL's one internal stream per group does: every result equals the fp32 reference,
    in two rounds (the delay on rank 0, then on rank 1), each call on another stream than its
    workspace's previous one (after a warm-up round, whose first switch of streams waits for the
    other stream's queue, every switch waits for the event recorded after the previous call).

    ``left_out`` is the control showing the test would fail without it: the delayed rank's
    ``order`` does nothing, so its second call runs at once. Its GEMM fills the other parity's
    half and its one-shot signals call e + 1 into the flag slots the first call uses; a wait passes
    once the flag's count reaches its call's, so the peer's first call (e), waiting on those slots,
    is released and sums the delayed rank's half of parity e % 2, which that rank's first call,
    still behind the sleep, has not written: a stale half (an earlier call's partial), a wrong sum that is finite
    and unflagged. The control asserts exactly that wrong sum (two streams of one rank sharing a
    hardware queue would serialise them and hide it: ``_need_queues``)."""
    world, m, k, n = 2, 1024, 512, 1024
    _need_queues(2 * world + 1)
    ws = _group(world, m * n * DT.itemsize)
    ranks = [_Rank(w) for w in ws]
    streams = [(torch.cuda.Stream(), torch.cuda.Stream()) for _ in range(world)]
    call = Call("mm_all_reduce", m, k, n, DT, world)
    facts = local_facts(world)
    kept = []  # every output stays alive: a freed one would be the next call's block

    def issue(r, stream, a, b, delay: int = 0):
        with torch.cuda.stream(stream):
            if delay:
                torch.cuda._sleep(delay)
            out = running.run(after_gemm.ONE_SHOT, Context(call, facts, ranks[r]),
                              MmAllReduceArgs(a, b, None, ws[r].group_name))
        kept.append(out)
        return out

    def round_of(seed: int, late: int, cycles: int):
        """Both ranks' two calls (rank 0's queued first, as one host thread issues them), the first
        on each rank's first stream, ``late``'s delayed by ``cycles``; returns the outputs by
        (rank, call) and the two references."""
        first, second = (_operands(world, m, k, n, bias=False, call=seed + i) for i in range(2))
        poisoned = {(r, i): _poison_next(streams[r][i], (m, n)) for r in range(world) for i in range(2)}
        for pair in streams:
            for s in pair:
                s.wait_stream(torch.cuda.current_stream())  # operands and poison on the main stream
        outs = {}
        for r in range(world):
            outs[r, 0] = issue(r, streams[r][0], first[0][r], first[1][r], cycles if r == late else 0)
            outs[r, 1] = issue(r, streams[r][1], second[0][r], second[1][r])
        torch.cuda.synchronize()
        _check(ws)
        assert {key: out.data_ptr() for key, out in outs.items()} == poisoned, "an output missed its poisoned block"
        return outs, (first[3], second[3])

    # each stream's cuBLAS workspace, then every kernel (the sleep, cuBLAS's GEMM, the one-shot) made
    # or loaded in a warm-up round, rank 0's first, before anything spins (``_run``)
    a, b, _, _ = _operands(world, m, k, n, bias=False)
    for pair in streams:
        for s in pair:
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                kept.append(a[0] @ b[0])
    torch.cuda.synchronize()
    warm, refs = round_of(0, 0, 1000)
    for r in range(world):
        for i in range(2):
            assert _relerr(warm[r, i], refs[i]) < 1e-2, ("warm-up", r, i)
    if order == "left_out":
        monkeypatch.setattr(ws[0], "order", lambda stream: False)
        outs, refs = round_of(2, 0, SLEEP_CYCLES)
        assert torch.isfinite(outs[1, 0]).all() and _relerr(outs[1, 0], refs[0]) > 0.1, \
            "rank 1's first call summed rank 0's first partial although rank 0's second call ran first"
        return
    for late in range(world):
        outs, refs = round_of(2 + 2 * late, late, SLEEP_CYCLES)
        for r in range(world):
            for i in range(2):
                assert _relerr(outs[r, i], refs[i]) < 1e-2, (late, r, i)


def test_local_facts_of_an_h200():
    """``facts.local_facts``, what the graph pass sizes workspaces with, from an H200 alone: its
    architecture, SM count and TMA, so the sm_90 rules apply and every symmetric path may run."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    if "H200" not in props.name:
        pytest.skip(f"the facts of an H200 (this GPU: {props.name})")
    facts = local_facts(2)
    assert (facts.world, facts.arch, facts.capability, facts.name) == (2, "sm_90", (9, 0), props.name)
    assert facts.sms == props.multi_processor_count > 0
    assert facts.tma and not facts.rocm
    assert facts.unsupported() is None and facts.copy_engines
    assert rules.table(facts.arch, facts.world, facts.name, facts.sms).label().startswith("sm_90")


def test_an_error_word_can_be_made_inside_a_capture():
    """A group's first call may come inside a CUDA-graph capture: its state, the pinned error
    word included, is made there."""
    from commfuse.runtime.workspace import error_word

    x = torch.zeros(4, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.add_(1)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        word = error_word()
        x.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    assert word.is_pinned() and int(word.abs().sum()) == 0 and float(x[0]) == 2.0  # warm-up, one replay


def test_a_one_rank_groups_facts_name_its_gpu_by_uuid():
    """``facts.agree`` names GPUs by UUID (per-rank ``CUDA_VISIBLE_DEVICES`` makes every index 0):
    the same GPU gives the same number, and a group with no same-host peer on another GPU has
    nothing to check."""
    import torch.distributed as dist

    from commfuse.runtime import facts as facts_mod

    props = torch.cuda.get_device_properties(0)
    assert str(props.uuid)  # this torch names the GPU by UUID
    assert facts_mod._gpu_id(0) == facts_mod._gpu_id(torch.cuda.current_device())
    ours = not dist.is_initialized()
    if ours:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29541", rank=0, world_size=1)
    try:
        got = facts_mod.agree(dist.new_group([0], backend="nccl"), torch.device("cuda", 0), "torch", 4 << 20)
    finally:
        if ours:
            dist.destroy_process_group()
    assert got.peer_access and got.peers_visible and got.one_host and got.arch.startswith("sm_")
