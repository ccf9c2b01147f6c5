"""Errors out of CUDA-graph replays, no free inside a capture, and what kept lanes and copy-engine
graphs cost: on one GPU, ranks emulated as in ``test_gpu_sticky.py`` (graph lanes sharing one
heap-bases table and one error word; rank 1 never launching), the group state registered as the
run-time keeps it (``runtime/groups.py``) under a name no process group has.

    pytest -m one_gpu tests/gpu/test_gpu_replays_and_memory.py
"""

from __future__ import annotations

import gc
import os
import time
import weakref

import pytest
import torch

from commfuse import env
from commfuse.kernels import exchange
from commfuse.kernels.codes import GRAPH_LANE_OP
from commfuse.runtime import capture, ce_graphs, errors, groups
from commfuse.runtime import workspace as ws_mod
from commfuse.tools import emulated

pytestmark = [pytest.mark.gpu, pytest.mark.one_gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(int(os.environ.get("WORLD_SIZE", "1")) > 1, reason="runs in one process")]

BOUND_S = 1.0


def _lanes(name: str, world: int, data_bytes: int, timeout_s: float) -> list:
    """``world`` graph lanes on one device sharing one heap-bases table and one error word."""
    device = torch.device("cuda")
    bufs = [torch.zeros(ws_mod.GRAPH_FLAG_BYTES + 2 * data_bytes, dtype=torch.uint8, device=device)
            for _ in range(world)]
    err = ws_mod.error_word()
    programs = torch.cuda.get_device_properties(device).multi_processor_count // world
    lanes = []
    for r in range(world):
        bases = ws_mod.header(bufs[r], ws_mod.GRAPH_FLAG_BYTES, [b.data_ptr() for b in bufs], ws_mod.GRAPH_FLAG_BYTES)
        lanes.append(ws_mod.GraphLane(name, r, world, bufs[r], bases, data_bytes, programs, err=err,
                                      timeout_ns=int(timeout_s * 1e9)))
    return lanes


class _Anchor:
    """Stands for the process-group object a group's state is tied to (only weakly referenced)."""


def _register(monkeypatch, name: str, err: torch.Tensor, lane=None, workspace=None):
    """The run-time's state of an emulated group's rank 0, as ``groups.get`` would keep it."""
    anchor = _Anchor()
    group = groups.Group(name, weakref.ref(anchor), (0, 1), 0, 2, "torch", err)
    group.lane, group.workspace = lane, workspace
    monkeypatch.setitem(groups._groups, (name, "torch"), group)
    return group, anchor


def test_a_timeout_in_a_replay_raises_at_the_first_run_after_it(monkeypatch):
    """What the backend returns under ``mode="reduce-overhead"`` replays graphs; a wait of a replay
    that times out only writes the group's word. ``errors.watch_runs`` (what wraps Inductor's
    callable) reads the word after each run, without synchronising: the run that launched the
    failing replay returns at once, the first run after the replay completed raises naming the
    group, the op, the ranks and the call, and later runs refuse."""
    name = "one-device-replay"
    lane = _lanes(name, 2, 1 << 20, BOUND_S)[0]  # rank 1 never launches
    group, _anchor = _register(monkeypatch, name, lane.err, lane=lane)
    n = 4096
    src = torch.ones(n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        exchange.staged_all_reduce(lane, src, out, GRAPH_LANE_OP)  # compiled and loaded before capture
        stream.synchronize()
        lane.err.zero_()
        lane.counter.zero_()
        graph.capture_begin()
        exchange.staged_all_reduce(lane, src, out, GRAPH_LANE_OP)
        graph.capture_end()
    torch.cuda.synchronize()

    def step():
        with torch.cuda.stream(stream):
            graph.replay()
        return out

    watch = errors.Watch()
    watch.names.add(name)
    run = errors.watch_runs(step, watch)
    began = time.perf_counter()
    assert run() is out  # the replay waits for its peer on the device; the host goes on
    assert time.perf_counter() - began < BOUND_S / 2
    stream.synchronize()  # the replay's wait timed out and it completed
    assert int(lane.err[0]) == 1
    # (the call is named where the lane's device count is past 0: "in call N of the group's graph lane")
    with pytest.raises(RuntimeError, match=rf"mm_all_reduce \(graph lane\): on group '{name}', rank 0 timed out "
                                           rf"after 1 s waiting for rank 1 \(group ranks 0 and 1\).*"
                                           rf"noticed when a compiled graph of commfuse ops"):
        run()
    with pytest.raises(RuntimeError, match=rf"Group '{name}' refuses further calls"):
        run()
    stream.synchronize()  # (the later replays end at once: the word is sticky)
    assert torch.isnan(out.float()).any() and group.broken


class _SyncOnFree:
    """Frees as a symmetric buffer does, synchronising the device (illegal inside a capture, which
    it would invalidate: here it records whether a capture was on instead)."""

    def __init__(self, log: list):
        self.log = log

    def __del__(self):
        capturing = torch.cuda.is_current_stream_capturing()
        self.log.append(capturing)
        if not capturing:
            torch.cuda.synchronize()


def test_groups_dropped_inside_a_capture_are_freed_after_it(monkeypatch):
    """A sweep of destroyed groups (at a group's creation, every ``SWEEP_EVERY`` calls) and a
    ``release`` inside a CUDA-graph capture drop the groups' state, but their buffers are freed
    only at the first call outside the capture; the capture completes and replays."""
    freed = []
    swept, released = emulated.group(2, 1 << 20)[0], emulated.group(2, 1 << 20)[0]
    for ws in (swept, released):
        ws._keepalive = _SyncOnFree(freed)
    a, _ = _register(monkeypatch, "one-device-swept", swept.err, workspace=swept)
    b, _ = _register(monkeypatch, "one-device-released", released.err, workspace=released)
    del swept, released, ws
    x = torch.zeros(1024, device="cuda")
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
        x.add_(1)
        with groups._lock:  # what a group's creation runs: no process group has this name
            groups._sweep()
        groups.release("one-device-released")
        dropped = a.workspace is None and b.workspace is None
        x.add_(1)
    assert dropped and freed == []  # dropped inside the capture, not freed
    graph.replay()
    torch.cuda.synchronize()
    assert int(x[0]) == 2
    groups.free_deferred()  # what the first call after the capture runs
    gc.collect()
    assert freed == [False, False]


@torch.library.custom_op("commfuse_test::lane_call", mutates_args=())
def _lane_call(x: torch.Tensor, name: str) -> torch.Tensor:
    """Stands for a captured lane call: marks the group's lane replayed inside a capture."""
    if torch.cuda.is_current_stream_capturing():
        capture.mark_replayed(groups._groups[(name, "torch")])
    return x.clone()


@_lane_call.register_fake
def _(x, name):
    return torch.empty_like(x)


def test_a_kept_lane_is_freed_once_inductors_graphs_are_gone(monkeypatch):
    """A lane Inductor's CUDA graphs (``mode="reduce-overhead"``) captured is kept past
    ``release`` while those graphs may replay, and freed once their graph tree is gone."""
    monkeypatch.setattr(groups, "_held", [])
    name = "one-device-kept"
    lanes = _lanes(name, 2, 1 << 20, BOUND_S)
    group, _anchor = _register(monkeypatch, name, lanes[0].err, lane=lanes[0])
    kept = weakref.ref(lanes[0])
    del lanes
    torch._dynamo.reset()
    f = torch.compile(lambda x: _lane_call(x * 2, name) + 1, mode="reduce-overhead", backend="inductor")
    x = torch.ones(1024, device="cuda")
    for _ in range(3):  # warm-up, recording, replay
        y = f(x)
    torch.cuda.synchronize()
    assert float(y[0]) == 3.0
    assert group.capture.replayed and len(group.capture.owners) == 1 and not group.capture.unowned
    groups.release(name)  # no process group has the name: no restart, the lane is kept
    assert groups.held() == [group] and kept() is not None
    groups.release(name)
    assert groups.held() == [group] and kept() is not None  # the graphs are alive
    del f, y
    torch._dynamo.reset()  # Inductor's graph trees go with it
    groups.release(name)
    gc.collect()
    assert groups.held() == [] and kept() is None


def test_memory_reports_the_bytes_of_copy_engine_graphs(monkeypatch):
    """A copy-engine call's CUDA graph has a memory pool of its own, with a cuBLAS workspace:
    ``memory()`` reports what its capture reserved, not only the graph count."""
    monkeypatch.setattr(ce_graphs, "_disabled", [])
    ws = emulated.group(2, 1 << 20)[0]
    _register(monkeypatch, "one-device-ce", ws.err, workspace=ws)
    a = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(512, 1024, device="cuda", dtype=torch.bfloat16)

    def body(sides):
        torch.matmul(a, b, out=out)

    with env.override(ce_graphs=None):  # the default: on
        key = ce_graphs.key(ws, 0, (a, b, out), (512,))
        assert [ce_graphs.run(ws, e, key, body, torch.cuda.current_device()) for e in (1, 2, 3)] == \
            ["eager", "captured", "replayed"]
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), (a.float() @ b.float()), rtol=2e-2, atol=2e-1)
    row = [r for r in groups.memory() if r["group"] == "one-device-ce"][0]
    assert row["ce_graphs"] == 1 and row["ce_graph_bytes"] == ws.graph_bytes() > 0
