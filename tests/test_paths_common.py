"""The doors of ``runtime/paths/common.py``: a group's calls from two streams reach the device in
the order the host counted them, for the workspace and for the graph lane.
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
import torch.distributed as dist

from commfuse import env
from commfuse.kernels import exchange
from commfuse.kernels.codes import flag_value
from commfuse.runtime import groups
from commfuse.runtime import facts as facts_mod
from commfuse.runtime import workspace as wsmod
from commfuse.runtime.facts import GroupFacts
from commfuse.runtime.paths import common
from commfuse.runtime.paths.base import (Call, Context)
from helpers import init_fake_pg

AR, AG, RS = "mm_all_reduce", "all_gather_mm", "mm_reduce_scatter"


class _Buffers:
    """Every rank's workspace; ``mine`` is the one the call under test runs on."""

    def __init__(self, rank: int, world: int, data_bytes: int = 1 << 16):
        self.world = world
        self.bufs = list(torch.zeros(world, wsmod.HEADER_BYTES + 2 * data_bytes, dtype=torch.uint8))
        self.mine = wsmod.Workspace("0", rank, world, self.bufs[rank], torch.zeros(world, dtype=torch.int64),
                                    data_bytes, _keepalive=self)

    def peer_data(self, peer: int, shape) -> torch.Tensor:
        """``peer``'s data half of the next call's parity (where its GEMM or copy writes)."""
        parity = (self.mine.epoch + 1) % 2
        return self.get_buffer(peer, shape, torch.float32,
                               (wsmod.HEADER_BYTES + parity * self.mine.data_bytes) // 4)

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


class _Stream:
    def wait_stream(self, other):
        pass

    def record_event(self):
        return None

    def wait_event(self, event):
        pass


class _Group:
    """What a path reads of its group (``groups.Group``) when a test runs it with a ``Context``:
    the group's side streams (stand-ins) and its process group."""

    def __init__(self, sim):
        self.sim, self.name = sim, "0"

    def side_streams(self, device, count: int = 3) -> tuple:
        return self.sim.sides

    def pg(self):
        return dist.group.WORLD


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The products here are tiny: a second intra-op thread only adds its hand-off (ms per
    matmul on a busy machine), so they run on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=[(2, 0), (2, 1), (4, 2), (8, 5)], ids=lambda p: f"world{p[0]}-rank{p[1]}")
def sim(request, monkeypatch):
    world, rank = request.param
    init_fake_pg(world)
    groups.release_all()
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

    bufs.all_reduce = all_reduce
    monkeypatch.setattr(exchange, "all_reduce", all_reduce)
    monkeypatch.setattr(exchange, "gather", gather)
    monkeypatch.setattr(exchange, "reduce_scatter", reduce_scatter)
    monkeypatch.setattr(exchange, "barrier", lambda *a, **k: None)
    monkeypatch.setattr(groups, "workspace", lambda group, nbytes, device: ws)
    # the facts every rank of an H200 group agrees on its first call (the agreement is collective)
    monkeypatch.setattr(facts_mod, "agree", lambda pg, device, provider, lane_bytes: GroupFacts.simulated(
        WORLD, provider=provider, lane_bytes=lane_bytes))
    bufs.sides = (_Stream(), _Stream(), _Stream())  # (pulls, adds, barriers)
    monkeypatch.setattr(groups.Group, "side_streams", lambda self, device, count=3: bufs.sides)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    bufs.facts = GroupFacts.simulated(world)
    bufs.group = _Group(bufs)
    with env.override(algo=None, ce_graphs=False, verify=False):  # graphs: test_ce_graphs.py, and below
        yield bufs
    groups.release_all()


class _FakeEvent:
    """A timing event whose time is the number of events recorded before it (in ms)."""
    clock = 0

    def record(self, stream=None):
        _FakeEvent.clock += 1
        self.at = _FakeEvent.clock

    def elapsed_time(self, end):
        return end.at - self.at


class _Event:
    def __init__(self, log):
        self.log = log

    def record(self, stream):
        self.log.append((stream.name, "record"))


class _NamedStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append((self.name, "wait_stream", other.name))

    def wait_event(self, event):
        self.log.append((self.name, "wait_event"))


def test_calls_of_a_group_from_two_streams_are_ordered_on_the_device(monkeypatch):
    """Calls pair across ranks by their epochs, taken in host order, so on the device each call of
    a group must start after the one before (``Workspace.order``, in ``paths.common.exchange``). A
    call on the stream of the group's last call is ordered already: it waits on nothing and records
    nothing. A call on another stream waits for the last one (for that stream's queue the first
    time, then for the event recorded after the previous call), and from then on every call records
    that event after its work."""
    log = []
    s1, s2 = _NamedStream("s1", log), _NamedStream("s2", log)
    current = [s1]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: _Event(log))
    on_gpu = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))  # the buffer, as CUDA sees it
    ws = wsmod.Workspace("0", 0, 2, on_gpu, None, 1024, err=torch.zeros(8, dtype=torch.int32))
    ctx = Context(Call(AR, 8, 8, 8, torch.bfloat16, 2), GroupFacts.simulated(2))

    def call(stream, n):
        current[0] = stream
        log.append(("call", n, "begins"))
        with common.exchange(ctx, ws, AR) as (epoch, _):
            assert epoch == flag_value(n)
            log.append((stream.name, "work", n))
        return log[log.index(("call", n, "begins")) + 1:]

    assert call(s1, 1) == [("s1", "work", 1)]
    assert call(s1, 2) == [("s1", "work", 2)]  # the same stream: nothing to wait for, nothing recorded
    assert call(s2, 3) == [("s2", "wait_stream", "s1"), ("s2", "work", 3), ("s2", "record")]
    assert call(s2, 4) == [("s2", "work", 4), ("s2", "record")]
    assert call(s1, 5) == [("s1", "wait_event"), ("s1", "work", 5), ("s1", "record")]
    assert call(s2, 6) == [("s2", "wait_event"), ("s2", "work", 6), ("s2", "record")]
    # a call that fails records nothing: the workspace refuses the next one (its epochs may differ)
    current[0] = s1
    with pytest.raises(ValueError):
        with common.exchange(ctx, ws, AR):
            log.append(("failed",))
            raise ValueError("a launch failed")
    assert log[-2:] == [("s1", "wait_event"), ("failed",)] and ws.broken


def test_graph_lane_calls_from_two_streams_are_ordered_through_its_door(monkeypatch):
    """The graph lane's eager calls go through ``common.lane_exchange``, which orders them as
    ``exchange`` orders the workspace's (``GraphLane.order`` is ``Workspace.order``); inside a
    capture it orders nothing (the replays' stream does)."""
    log = []
    s1, s2 = _NamedStream("s1", log), _NamedStream("s2", log)
    current = [s1]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: _Event(log))
    on_gpu = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    lane = wsmod.GraphLane("0", 0, 2, on_gpu, None, 1024, 132, err=torch.zeros(8, dtype=torch.int32))

    def call(stream, n, capturing=False):
        current[0] = stream
        start = len(log)
        with common.lane_exchange(lane, capturing):
            log.append((stream.name, "work", n))
        return log[start:]

    assert call(s1, 1) == [("s1", "work", 1)]
    assert call(s2, 2) == [("s2", "wait_stream", "s1"), ("s2", "work", 2), ("s2", "record")]
    assert call(s1, 3) == [("s1", "wait_event"), ("s1", "work", 3), ("s1", "record")]
    assert call(s2, 4, capturing=True) == [("s2", "work", 4)] and lane.last_stream is s1
