"""When a copy-engine all-reduce runs eagerly, is captured or replays (``runtime/ce_graphs.py``),
on the CPU: CUDA graphs are stood in for by a recording of the call's work that a replay runs
again on the tensors it was captured with (what a graph's baked addresses amount to). The real
capture and replay run in the GPU suites (``test_gpu_ops.py``, ``test_gpu_one_device.py``); the
path's device-epoch kernels through ``runtime/paths/ar_ce_overlap.py`` in ``test_running.py``."""

from __future__ import annotations

import pytest
import torch

from commfuse import env
from commfuse.runtime import ce_graphs
from commfuse.runtime.workspace import HEADER_BYTES, Workspace


class _FakeGraph:
    """A 'graph' of ``body``: a replay runs it again, as a capture would have baked it."""

    def __init__(self, body):
        self.body, self.replays = body, 0

    def replay(self):
        self.replays += 1
        self.body(None)


@pytest.fixture
def fake_capture(monkeypatch):
    made = []

    def capture(body, device):
        made.append(_FakeGraph(body))
        return made[-1]

    monkeypatch.setattr(ce_graphs, "_capture", capture)
    monkeypatch.setattr(ce_graphs, "_disabled", [])
    with env.override(ce_graphs=None):  # the default: on
        yield made


def _workspace(timeout_ns: int = 600 * 10**9):
    return Workspace("0", 0, 2, torch.zeros(HEADER_BYTES + 2 * 4096, dtype=torch.uint8),
                     torch.zeros(2, dtype=torch.int64), 4096, timeout_ns=timeout_ns)


def test_a_call_runs_eagerly_then_is_captured_then_replays(fake_capture):
    ws = _workspace()
    a = torch.randn(4, 3)
    ran, epochs = [], []

    def body(side):
        ran.append(side)
        epochs.append(int(ws.epoch_cell))

    key = ce_graphs.key(ws, 1, (a, None), (4, 4, 2))
    assert [ce_graphs.run(ws, e, key, body, 0) for e in (5, 7, 9, 11)] == ["eager", "captured", "replayed", "replayed"]
    # the first call ran its work itself, each later one through the graph captured at the second
    assert len(fake_capture) == 1 and fake_capture[0].replays == 3
    assert epochs == [5, 7, 9, 11]  # the epoch cell held each call's own epoch when its work ran
    assert ran == [None] * 4  # the eager call on the path's own streams; replays as captured


def test_the_key_holds_addresses_layouts_parity_settings_and_the_wait_bound():
    """The wait bound baked into the captured kernels is the workspace's (``Workspace.timeout_ns``,
    set from ``COMMFUSE_TIMEOUT_S`` at allocation), not a setting read per call."""
    a = torch.randn(4, 6)
    ws = _workspace()
    base = ce_graphs.key(ws, 0, (a, None), (4, 4))
    assert ce_graphs.key(ws, 0, (a, None), (4, 4)) == base
    others = [ce_graphs.key(ws, 1, (a, None), (4, 4)),  # the other data half
              ce_graphs.key(ws, 0, (a.clone(), None), (4, 4)),  # another address
              ce_graphs.key(ws, 0, (a.view(6, 4), None), (4, 4)),  # the same memory, another shape
              ce_graphs.key(ws, 0, (a[:, :3], None), (4, 4)),  # another layout
              ce_graphs.key(ws, 0, (a, a), (4, 4)),  # a bias where there was none
              ce_graphs.key(ws, 0, (a, None), (2, 2, 2, 2)),  # other chunks
              ce_graphs.key(_workspace(timeout_ns=5 * 10**9), 0, (a, None), (4, 4))]  # another bound
    assert all(k != base for k in others) and len(set(others)) == len(others)


def test_graphs_and_once_seen_keys_are_kept_least_recently_used_first_out(fake_capture, monkeypatch):
    """Keys seen once have a table of their own: new keys (a prefill length per call) never push a
    graph out; each table drops its least recently used entry when full."""
    monkeypatch.setattr(ce_graphs, "GRAPH_LIMIT", 2)
    monkeypatch.setattr(ce_graphs, "SEEN_LIMIT", 2)
    ws = _workspace()

    def run(key):
        return ce_graphs.run(ws, 1, key, lambda side: None, 0)

    assert [run(k) for k in ("k1", "k1", "k2", "k2")] == ["eager", "captured", "eager", "captured"]
    assert [run(k) for k in ("n1", "n2", "n3")] == ["eager"] * 3  # new keys only
    assert list(ws.graphs) == ["k1", "k2"] and list(ws.graphs_seen) == ["n2", "n3"]
    assert run("k1") == "replayed"  # k1 now the most recent graph
    assert run("n3") == "captured"  # a third graph drops k2, the least recently used
    assert list(ws.graphs) == ["k1", "n3"] and list(ws.graphs_seen) == ["n2"]
    assert run("n1") == "eager"  # forgotten: seen anew
    assert len(fake_capture) == 3


def test_a_failed_capture_runs_the_call_eagerly_and_turns_graphs_off(monkeypatch, caplog):
    monkeypatch.setattr(ce_graphs, "_disabled", [])

    def capture(body, device):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(ce_graphs, "_capture", capture)
    monkeypatch.setattr(ce_graphs, "_still_capturing", lambda device: False)
    ws = _workspace()
    ran = []
    with env.override(ce_graphs=True):
        assert ce_graphs.run(ws, 1, "k", ran.append, 0) == "eager"
        with caplog.at_level("WARNING"):
            assert ce_graphs.run(ws, 2, "k", ran.append, 0) == "eager"
        assert ran == [None, None]  # both calls' work ran, once each
        assert "capturing a copy-engine all-reduce" in caplog.text and "not permitted" in caplog.text
        assert not ce_graphs.enabled() and not ws.graphs and not ws.graphs_seen
        assert ce_graphs.run(ws, 3, "k", ran.append, 0) == "eager"  # graphs stay off: the work runs


def test_a_capture_that_leaves_a_stream_capturing_raises(monkeypatch):
    """Nothing of the call ran, but a stream left capturing makes every later CUDA call fail:
    the call raises (its exchange then marks the workspace broken) instead of running eagerly."""
    monkeypatch.setattr(ce_graphs, "_disabled", [])
    monkeypatch.setattr(ce_graphs, "_still_capturing", lambda device: True)

    def capture(body, device):
        raise RuntimeError("operation failed due to a previous error during capture")

    monkeypatch.setattr(ce_graphs, "_capture", capture)
    ws = _workspace()
    ran = []
    ce_graphs.run(ws, 1, "k", ran.append, 0)
    with pytest.raises(RuntimeError, match="left a stream capturing.*previous error during capture"):
        ce_graphs.run(ws, 2, "k", ran.append, 0)
    assert ran == [None]


def test_graphs_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(ce_graphs, "_disabled", [])
    with env.override(ce_graphs="0"):
        assert not ce_graphs.enabled()
    with env.override(ce_graphs="1"):
        assert ce_graphs.enabled()
    monkeypatch.setenv("COMMFUSE_CE_GRAPHS", "0")  # the environment, read again
    try:
        assert not env.reload().ce_graphs and not ce_graphs.enabled()
    finally:
        monkeypatch.delenv("COMMFUSE_CE_GRAPHS")
        env.reload()
    assert ce_graphs.enabled()


def test_each_graph_counts_the_bytes_its_capture_reserved(fake_capture, monkeypatch):
    """A copy-engine graph's pool (its cuBLAS workspace, its intermediates) is measured at its
    capture, so ``groups.memory()`` reports bytes, not only a count; a graph pushed out of the
    workspace's graphs takes its bytes with it."""
    reserved = iter(range(0, 10 * (3 << 20), 3 << 20))  # each capture reserves 3 MiB
    monkeypatch.setattr(ce_graphs, "_reserved", lambda device: next(reserved))
    monkeypatch.setattr(ce_graphs, "GRAPH_LIMIT", 2)
    ws = _workspace()
    tensors = [torch.randn(4, 3) for _ in range(3)]
    for a in tensors:
        key = ce_graphs.key(ws, 0, (a, None), (4,))
        for epoch in (1, 2):  # seen, then captured
            ce_graphs.run(ws, epoch, key, lambda side: None, 0)
    assert len(fake_capture) == 3 and len(ws.graphs) == 2
    assert ws.graph_bytes() == 2 * (3 << 20)
