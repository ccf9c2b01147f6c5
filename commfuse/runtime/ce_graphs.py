"""The copy-engine all-reduce replayed as a CUDA graph: two host operations per call instead of ~40.

Inside a model a copy-engine call can cost its host more than its GPU time: a GEMM, an event, a
barrier, a peer copy and an add per chunk, about 40 launches, and model steps whose hosts fall
behind hide the least communication. A model's steps allocate alike, so a call usually finds its
operands, output and scratch at the addresses an earlier call of the same shape had. Such a call replays that call's graph:
the host fills the call's epoch into the workspace's epoch cell (one fill) and launches the graph
(one launch). The barriers and the one-shot tail read the epoch from the cell (``DEVICE_EPOCH``),
so one graph serves every later call at those addresses; one graph per parity, whose data half it
holds.

A call is captured the second time its key is seen, and runs eagerly the first time, with the
same device-epoch kernels, so each is loaded before any capture (a capture must not load modules
or allocate beyond its pool). A replay on one rank and an eager call on another run the same
protocol in the same slots: the ranks need not agree on which calls replay. Captures run on a
helper thread (a CUDA-graph warm-up of Inductor's sends its own thread's allocations to its pool)
into a memory pool of their own, each with a cuBLAS workspace of its own. A capture that fails
turns graphs off for the process (logged, with the cause) and the call runs eagerly: nothing of
it ran yet; if it left a stream capturing, the call raises instead. ``COMMFUSE_CE_GRAPHS=0``
turns them off.
"""

from __future__ import annotations


import torch

import logging

from .. import env
from . import groups
from .counters import CE_GRAPHS
from .workspace import outside_graph_pools

log = logging.getLogger("commfuse")

#: Graphs a workspace keeps, and keys it remembers seeing once (each least recently used dropped
#: first): a model has a few copy-engine call sites, each with a graph per parity, and dynamic
#: shapes (a prefill length per call) must neither grow them nor push the graphs out. Each graph's
#: pool holds its own cuBLAS workspace (32 MiB on Hopper by default) besides the graph itself.
GRAPH_LIMIT = 16
SEEN_LIMIT = 64

_disabled: list[str] = []  # why graphs were turned off, once a capture failed
_streams: dict[int, tuple] = {}


def enabled() -> bool:
    return not _disabled and env.current().ce_graphs


def _signature(t: torch.Tensor | None):
    """What a graph bakes in of a tensor: its address and layout."""
    return None if t is None else (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def gemm_settings() -> tuple:
    """The process's settings that choose cuBLAS's kernels for the captured GEMMs."""
    matmul = torch.backends.cuda.matmul
    return (matmul.allow_tf32, matmul.allow_bf16_reduced_precision_reduction,
            matmul.allow_fp16_reduced_precision_reduction, str(torch.backends.cuda.preferred_blas_library()))


def key(ws, parity: int, tensors: tuple, setting: tuple) -> tuple:
    """A call's key: its parity (the data half), every tensor it reads or writes outside the
    workspace, the settings its launches bake in (with the wait bound) and cuBLAS's."""
    return (parity, setting, ws.timeout_ns, gemm_settings(), tuple(_signature(t) for t in tensors))


def _capture_streams(device: int) -> tuple:
    """(the stream a capture begins on, the side streams its pulls, adds and barriers fork to),
    made once per device."""
    if device not in _streams:
        _streams[device] = tuple(torch.cuda.Stream(device) for _ in range(4))
    return _streams[device]


def _clear_cublas_workspaces() -> None:
    """Drop cuBLAS's workspaces, so the capture's GEMMs get one inside the graph's own pool: one
    kept from an earlier graph's pool (or the caching allocator's) could be freed while this graph
    still uses it (Inductor's CUDA graphs clear them around their captures too)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def _capture(body, device: int):
    """``body(sides)`` captured (not run) into a CUDA graph, on a helper thread, in a memory pool of
    its own: a pool shared by every graph is released by PyTorch once the graphs using it are all
    dropped, and a later capture into it fails an internal assertion of the caching allocator and
    leaves the CUDA generator mid-capture (ranks emulated on one GPU, 4 after 2). The cause of a
    failure is what raises, not the capture's end that fails after it."""
    cap, *sides = _capture_streams(device)
    graph = torch.cuda.CUDAGraph()
    cap.wait_stream(torch.cuda.current_stream(device))

    def capture():
        torch.cuda.current_blas_handle()  # this thread's cuBLAS handle, made before the capture
        failure = None
        with torch.cuda.stream(cap):
            _clear_cublas_workspaces()
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                body(tuple(sides))
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after the capture ends
                failure = exc
            try:
                graph.capture_end()
            except BaseException as exc:  # noqa: BLE001
                if failure is None:
                    failure = exc
                else:
                    log.debug("commfuse: ending a failed capture also failed: %s", exc)
        if failure is not None:
            raise failure

    outside_graph_pools(torch.device("cuda", device), capture)
    return graph


def _still_capturing(device: int) -> bool:
    for stream in _capture_streams(device):
        with torch.cuda.stream(stream):
            if torch.cuda.is_current_stream_capturing():
                return True
    return False


def _give_up(exc: BaseException, device: int, ws) -> None:
    """Graphs off for the process after a failed capture, every workspace's dropped."""
    _disabled.append(f"{type(exc).__name__}: {exc}")
    for each in [ws, *(g.workspace for g in groups.all_groups() if g.workspace is not None)]:
        groups.let_go(*each.graphs.values())
        each.graphs.clear()
        each.graphs_seen.clear()
    if _still_capturing(device):
        raise RuntimeError(f"commfuse: capturing a copy-engine all-reduce in a CUDA graph failed and left "
                           f"a stream capturing ({_disabled[0]}); this process's CUDA state is not usable") from exc
    log.warning("commfuse: capturing a copy-engine all-reduce in a CUDA graph failed (%s); such calls run "
                "eagerly from now on", _disabled[0])


def keys(ws) -> tuple[frozenset, frozenset]:
    """The keys of ``ws``'s graphs and first sightings now (``drop_since``)."""
    return frozenset(ws.graphs), frozenset(ws.graphs_seen)


def drop_since(ws, before: tuple[frozenset, frozenset]) -> None:
    """Forget the graphs and sightings ``ws`` gained since ``keys(ws)`` gave ``before``: the tuner's
    synthetic calls, whose addresses no real call repeats, must not hold graph slots and pools."""
    for key in set(ws.graphs) - before[0]:
        groups.let_go(ws.graphs.pop(key))
    for key in set(ws.graphs_seen) - before[1]:
        del ws.graphs_seen[key]


def _remember(table: dict, key, value, limit: int) -> None:
    table.pop(key, None)
    if len(table) >= limit:
        groups.let_go(table.pop(next(iter(table))))  # the least recently used
    table[key] = value


def _reserved(device: int) -> int:
    """The bytes PyTorch's caching allocator holds on ``device`` (private graph pools included)."""
    return torch.cuda.memory_reserved(device) if torch.cuda.is_available() else 0


def run(ws, epoch: int, call_key: tuple, body, device: int) -> str:
    """Run a copy-engine call on GPU ``device`` whose work is ``body(sides)`` (kernels reading the
    epoch from ``ws.epoch_cell``; ``sides``: the streams its pulls, adds and barriers run on, None for the
    path's own): replay its graph, capture and replay it, or run it eagerly. Returns which it did."""
    ws.epoch_cell.fill_(epoch)
    graph = ws.graphs.get(call_key)
    how = "replayed"
    if graph is None:
        if call_key not in ws.graphs_seen:  # the first sighting: eager, and remembered
            _remember(ws.graphs_seen, call_key, None, SEEN_LIMIT)
            CE_GRAPHS["eager"] += 1
            body(None)
            return "eager"
        try:  # the second: captured
            before = _reserved(device)
            graph = _capture(body, device)
            # its pool is its own: what the allocator reserved meanwhile is this graph's
            # (``Workspace.graph_bytes``)
            graph.commfuse_bytes = max(0, _reserved(device) - before)
        except Exception as exc:  # noqa: BLE001 - nothing of the call ran: run it eagerly
            _give_up(exc, device, ws)
            CE_GRAPHS["eager"] += 1
            body(None)
            return "eager"
        ws.graphs_seen.pop(call_key, None)
        CE_GRAPHS["captured"] += 1
        how = "captured"
    _remember(ws.graphs, call_key, graph, GRAPH_LIMIT)
    graph.replay()
    CE_GRAPHS["replayed"] += how == "replayed"
    return how
