"""The doors of ``runtime/paths/common.py``: a group's calls from two streams reach the device in
the order the host counted them, for the workspace and for the graph lane.
"""

from __future__ import annotations

import types

import pytest
import torch

from commfuse.kernels.codes import flag_value
from commfuse.runtime import workspace as wsmod
from commfuse.runtime.facts import GroupFacts
from commfuse.runtime.paths import common
from commfuse.runtime.paths.base import (Call, Context)

from sim import (  # noqa: F401  (fixtures: pytest finds them by name in this module)
    AR, AG, RS, _Buffers, _Group, _Stream, _one_thread, sim)


class _Event:
    def __init__(self, log):
        self.log = log

    def record(self, stream):
        self.log.append((stream.name, "record"))


class _NamedStream:
    def __init__(self, name, log, handle=None):
        self.name, self.log = name, log
        if handle is not None:  # a CUDA stream's handle (``cuda_stream``)
            self.cuda_stream = handle

    def wait_stream(self, other):
        self.log.append((self.name, "wait_stream", other.name))

    def wait_event(self, event):
        self.log.append((self.name, "wait_event"))


@pytest.mark.parametrize("handles", [False, True], ids=["objects", "handles"])
def test_calls_of_a_group_from_two_streams_are_ordered_on_the_device(monkeypatch, handles):
    """Calls pair across ranks by their epochs, taken in host order, so on the device each call of
    a group must start after the one before (``Workspace.order``, in ``paths.common.exchange``). A
    call on the stream of the group's last call is ordered already: it waits on nothing and records
    nothing. A call on another stream waits for the last one (for that stream's queue the first
    time, then for the event recorded after the previous call), and from then on every call records
    that event after its work. With ``handles`` (CUDA's streams), a call tells the last call's
    stream by its handle, and makes a stream object only when the stream changed."""
    log = []
    s1, s2 = _NamedStream("s1", log, 11 if handles else None), _NamedStream("s2", log, 22 if handles else None)
    current = [s1]
    made = []

    def current_stream(device=None):
        made.append(current[0].name)
        return current[0]

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(wsmod, "_raw_stream", lambda device: current[0].cuda_stream)
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
    # the stream objects made: at every call, or only where the stream changed
    assert made == (["s1", "s2", "s1", "s2", "s1"] if handles else ["s1", "s1", "s2", "s2", "s1", "s2", "s1"])


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
