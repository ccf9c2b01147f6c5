"""The copy-engine all-reduce replayed as a CUDA graph: two host operations per call instead of ~40.

Inside a model a copy-engine call costs its host more than its GPU time: a GEMM, an event, a
barrier, a peer copy and an add per chunk, ~40 launches that held a slow host 1.3 ms for 0.7 ms
of GPU work, and the model steps whose hosts were slow hid the least communication (``NOTES.md``
§30-33). A model's steps allocate alike, so a call usually finds its operands, output and scratch
at the addresses an earlier call of the same shape had. Such a call replays that call's graph:
the host fills the call's epoch into the workspace's epoch cell (one fill) and launches the graph
(one launch). The barriers and the one-shot tail read the epoch from the cell (``DEVICE_EPOCH``),
so one graph serves every later call at those addresses; one graph per parity, whose data half it
holds.

A call is captured the second time its key is seen, and runs eagerly the first time, with the
same device-epoch kernels, so each is loaded before any capture (a capture must not load modules
or allocate beyond its pool). A replay on one rank and an eager call on another run the same
protocol in the same slots: the ranks need not agree on which calls replay. A capture that fails
turns graphs off for the process (logged) and the call runs eagerly: nothing of it ran yet.
``COMMFUSE_CE_GRAPHS=0`` turns them off.
"""

from __future__ import annotations

import os

import torch

from ..report import log
from .sync import timeout_ns

#: Graphs and once-seen keys a workspace keeps (least recently used dropped first): a model has a
#: few copy-engine call sites, each with a graph per parity; dynamic shapes must not grow it.
GRAPH_LIMIT = 32

#: Calls since import that ran eagerly (first seen), were captured, or replayed (tests check them).
COUNTS = {"eager": 0, "captured": 0, "replayed": 0}

_disabled: list[str] = []  # why graphs were turned off, once a capture failed
_streams: dict[int, tuple] = {}


def enabled() -> bool:
    return not _disabled and os.environ.get("COMMFUSE_CE_GRAPHS", "1") != "0"


def _signature(t: torch.Tensor | None):
    """What a graph bakes in of a tensor: its address and layout."""
    return None if t is None else (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def key(parity: int, tensors: tuple, setting: tuple) -> tuple:
    """A call's key: its parity (the data half), every tensor it reads or writes outside the
    workspace, and the settings its launches bake in (with the wait bound)."""
    return (parity, setting, timeout_ns(), tuple(_signature(t) for t in tensors))


def _capture_streams(device: int) -> tuple:
    """(the stream a capture begins on, the side stream its copies fork to), made once per device."""
    if device not in _streams:
        _streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
    return _streams[device]


def _capture(body, device: int):
    """``body(side)`` captured (not run) into a CUDA graph, in a memory pool of its own (its only
    allocation, cuBLAS's workspace for the capture stream, is made once). A pool shared by every
    graph would be released by PyTorch once the graphs using it were all dropped (a workspace
    released, the least recent dropped), and a later capture into it then fails an internal
    assertion of the caching allocator, leaving the CUDA generator mid-capture (GPU emulation of
    4 ranks after 2, 2xH200)."""
    cap, side = _capture_streams(device)
    graph = torch.cuda.CUDAGraph()
    cap.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(cap):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            body(side)
        finally:
            graph.capture_end()
    return graph


def run(ws, epoch: int, call_key: tuple, body) -> str:
    """Run a copy-engine call whose work is ``body(side)`` (kernels reading the epoch from
    ``ws.epoch_cell``; ``side``: the stream its copies run on, None for the path's own): replay
    its graph, capture and replay it, or run it eagerly. Returns which it did."""
    ws.epoch_cell.fill_(epoch)
    graphs = ws.graphs
    seen = call_key in graphs
    graph = graphs.pop(call_key, None)
    if seen and graph is None:  # the second sighting: capture it
        device = torch.cuda.current_device()
        try:
            graph = _capture(body, device)
        except Exception as exc:  # noqa: BLE001 - nothing of the call ran: run it eagerly
            _disabled.append(f"{type(exc).__name__}: {exc}")
            log.warning("commfuse: capturing a copy-engine all-reduce in a CUDA graph failed (%s); "
                        "such calls run eagerly from now on", _disabled[0])
            graphs.clear()
            COUNTS["eager"] += 1
            body(None)
            return "eager"
        COUNTS["captured"] += 1
        how = "captured"
    else:
        how = "replayed"
    if len(graphs) >= GRAPH_LIMIT:
        del graphs[next(iter(graphs))]  # the least recently used
    graphs[call_key] = graph
    if graph is None:
        COUNTS["eager"] += 1
        body(None)
        return "eager"
    graph.replay()
    COUNTS["replayed"] += how == "replayed"
    return how
