"""The CPU simulation of a group's ranks that the run-time's tests share: every rank's workspace
in one process, the exchange kernels replaced by sums over those workspaces, stand-in streams, and
the three ops' calls into the entry as ``ops/library.py`` makes them."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from commfuse import env
from commfuse.kernels import exchange
from commfuse.runtime import entry, groups, reference
from commfuse.runtime import facts as facts_mod
from commfuse.runtime import workspace as wsmod
from commfuse.runtime.facts import GroupFacts
from commfuse.runtime.counters import PATHS
from commfuse.runtime.spec import ALL_GATHER_MM, MM_ALL_REDUCE, MM_REDUCE_SCATTER
from helpers import init_fake_pg

AR, AG, RS = "mm_all_reduce", "all_gather_mm", "mm_reduce_scatter"


class _Buffers:
    """Every rank's workspace; ``mine`` is the one the call under test runs on."""

    def __init__(self, rank: int, world: int, data_bytes: int = 1 << 16):
        self.world = world
        self.bufs = list(torch.zeros(world, wsmod.HEADER_BYTES + 2 * data_bytes, dtype=torch.uint8))
        self.mine = wsmod.Workspace("0", rank, world, self.bufs[rank], torch.zeros(world, dtype=torch.int64),
                                    data_bytes, _keepalive=self)

    def peer_data(self, peer: int, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``peer``'s data half of the next call's parity (where its GEMM or copy writes)."""
        parity = (self.mine.epoch + 1) % 2
        return self.get_buffer(peer, shape, dtype,
                               (wsmod.HEADER_BYTES + parity * self.mine.data_bytes) // dtype.itemsize)

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


def _mm_all_reduce(a, b, bias, group_name, site=0):
    """The op's CUDA call into the run-time, as ``ops/library.py`` makes it."""
    return entry.run(MM_ALL_REDUCE, MM_ALL_REDUCE.Args(a, b, bias, group_name), site)


def _all_gather_mm(shard, b, bias, gather_dim, world_size, group_name, return_gathered=True, site=0):
    args = ALL_GATHER_MM.Args(shard, b, bias, gather_dim, world_size, group_name, return_gathered)
    return entry.run(ALL_GATHER_MM, args, site)


def _mm_reduce_scatter(a, b, bias, shape, scatter_dim, world_size, group_name, site=0):
    shape = reference.resolve_shape(shape, a.shape[0] * b.shape[1])
    args = MM_REDUCE_SCATTER.Args(a, b, bias, shape, scatter_dim, world_size, group_name)
    return entry.run(MM_REDUCE_SCATTER, args, site)


def _inputs(world, m, k, n, bias_kind):
    torch.manual_seed(3)
    a = [torch.randn(m, k) for _ in range(world)]
    b = [torch.randn(k, n) for _ in range(world)]
    bias = [None if bias_kind is None else torch.randn(*((n,) if bias_kind == "1d" else (m, n)))
            for _ in range(world)]
    return a, b, bias


def _partial(a, b, bias):
    return a @ b if bias is None else torch.addmm(bias, a, b)


def _ran(op):
    """The counts of ``PATHS`` for ``op`` now, to compare with after a call."""
    return {k.split(":")[1]: v for k, v in PATHS.items() if k.startswith(op + ":")}


def _changed(op, before):
    after = _ran(op)
    return [k for k in after if after[k] != before.get(k, 0)]


class _FakeEvent:
    """A timing event whose time is the number of events recorded before it (in ms)."""
    clock = 0

    def record(self, stream=None):
        _FakeEvent.clock += 1
        self.at = _FakeEvent.clock

    def elapsed_time(self, end):
        return end.at - self.at
