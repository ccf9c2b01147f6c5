"""Symmetric workspaces: one buffer per process group, mapped on every rank, plus a heap-bases table.

Kernels address peers through Iris's RMA primitives, which translate a local pointer to a peer's by
``ptr - heap_bases[me] + heap_bases[peer]``. Two providers give that table:

* ``torch`` (default): ``torch.distributed._symmetric_memory``; its per-peer buffer pointers are the
  heap bases.
* ``iris``: the Iris symmetric heap (``allocator_type="vmem_chunked"`` on NVIDIA), chosen with
  ``COMMFUSE_SYMM_PROVIDER=iris``.

Each group also gets a *graph lane* (``GraphLane``), a second, fixed-size buffer that CUDA-graph
replays use: its epochs live on the device, so a replay needs no host step (see ``exchange.py``).

Every device tensor a workspace or lane keeps (flags, heap bases, epoch counters) lives inside its
symmetric buffer, never in PyTorch's caching allocator: the first call of a group may run inside a
CUDA-graph warm-up, whose allocations come from the graph's private pool and are reused by later
captures (a heap-bases table there was overwritten: illegal addresses).

Layout of a workspace: ``[flags | heap bases: FLAG_BYTES][tile flags | split-K counters | ticket:
TILE_FLAG_BYTES][data parity 0][data parity 1]``. Flags are int32 epoch counters that only grow, so they never need
resetting (until epochs restart near EPOCH_LIMIT); the two data halves alternate between calls,
which (with the flag wait at the start of every exchange kernel, and the per-tile flags of the
fused kernel) keeps a fast rank from overwriting data a slow peer is still reading. Allocation is
collective and slow: it happens lazily on the first call for a group, is reused after, and grows
only when a larger call arrives (the same on every rank, since sizes come from shapes alone).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading

import torch
import torch.distributed as dist

from .. import env
from ..report import log

FLAG_BYTES = 64 * 1024
#: Per-tile flags of the fused GEMM kernels (``ready`` per tile and rank, ``done`` per tile), then
#: the split-K kernel's per-tile arrival counters (each back at 0 when a call ends), and at the end
#: the epoch cell of kernels that read their epoch on the device (``Workspace.epoch_cell``) and the
#: fused kernels' tile ticket (an int64 that only grows).
TILE_FLAG_BYTES = 1024 * 1024
TICKET_BYTES = 64
COUNTER_BYTES = 32 * 1024
#: Epoch flag slots (int32) the fused kernels may use.
TILE_FLAG_SLOTS = (TILE_FLAG_BYTES - COUNTER_BYTES - TICKET_BYTES) // 4
HEADER_BYTES = FLAG_BYTES + TILE_FLAG_BYTES
#: The last bytes of each header hold the heap-bases table (int64 per rank): up to 128 ranks.
BASES_BYTES = 1024
#: Epochs restart (collectively, flags and data zeroed) before they reach this: the int32 flags
#: never overflow, and the split-K kernel's LL words, whose flags hold an epoch's low 21 bits
#: (``fused_split_k.LL_EPOCH_BITS``), never meet a stale word of an earlier epoch with the same bits.
EPOCH_LIMIT = (1 << 21) - 1
MIN_DATA_BYTES = 16 * 1024 * 1024  # per parity; a first allocation serves many later shapes
_ALIGN = 256


def provider_name() -> str:
    name = os.environ.get("COMMFUSE_SYMM_PROVIDER", "torch").strip().lower()
    if name not in ("torch", "iris"):
        raise ValueError(f"COMMFUSE_SYMM_PROVIDER must be 'torch' or 'iris', got {name!r}")
    return name


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


#: Launches and plans a workspace keeps (``Workspace.kept``); all are dropped when full.
KEPT_LIMIT = 256


@dataclasses.dataclass
class Workspace:
    group_name: str
    rank: int
    world: int
    buffer: torch.Tensor  # uint8, HEADER_BYTES + 2 * data_bytes, on this rank
    heap_bases: torch.Tensor  # int64 [world] device pointers of every rank's buffer (or heap), in ``buffer``
    data_bytes: int
    max_programs: int = 132  # the smallest SM count of the group: every rank launches the same grid
    epoch: int = 0
    broken: str | None = None  # set when a call failed after its epoch began (ranks may disagree)
    ticket_base: int = 0  # the ticket's value at the next fused call (claims so far, counted here)
    _keepalive: object = None  # provider handle (rendezvous handle / Iris context)
    #: (peer, parity) -> that peer's data half as bytes, made once: the provider's view costs tens
    #: of µs of host, and the copy-engine overlaps need one per peer per call
    _peer_halves: dict = dataclasses.field(default_factory=dict, repr=False)
    #: peer -> that peer's tile flags as uint32 (the copy-engine pushes' flag writes), made once
    _peer_flags: dict = dataclasses.field(default_factory=dict, repr=False)
    #: kernel launches and call plans kept for this workspace's life (``launch.Bound``), keyed by
    #: their caller; see ``kept``
    launches: dict = dataclasses.field(default_factory=dict, repr=False)
    #: copy-engine calls replayed as CUDA graphs (``ce_graphs.py``): key -> graph, and the keys of
    #: calls seen once; the graphs hold this workspace's addresses and go with it
    graphs: dict = dataclasses.field(default_factory=dict, repr=False)
    graphs_seen: dict = dataclasses.field(default_factory=dict, repr=False)

    # Views kept for the workspace's life are made outside inference mode: one made inside it would
    # refuse the in-place writes (``_restart_epochs``) of a later call outside it.
    @functools.cached_property
    def flags(self) -> torch.Tensor:
        with torch.inference_mode(False):
            return self.buffer[:FLAG_BYTES - BASES_BYTES].view(torch.int32)

    @functools.cached_property
    def tile_flags(self) -> torch.Tensor:
        with torch.inference_mode(False):
            return self.buffer[FLAG_BYTES:FLAG_BYTES + 4 * TILE_FLAG_SLOTS].view(torch.int32)

    @property
    def tile_counters(self) -> torch.Tensor:
        """int32, this rank's only: the split-K kernel's arrivals per tile; zero between calls (the
        last arrival of a tile resets its counter), and zero from the allocation's header."""
        end = HEADER_BYTES - TICKET_BYTES
        return self.buffer[end - COUNTER_BYTES:end].view(torch.int32)

    @property
    def ticket(self) -> torch.Tensor:
        """int64 [1], this rank's only: the fused kernel's programs claim tile positions from it;
        it only grows, and ``ticket_base`` is its value when the next call starts."""
        return self.buffer[HEADER_BYTES - 8:HEADER_BYTES].view(torch.int64)

    @functools.cached_property
    def epoch_cell(self) -> torch.Tensor:
        """int32 [1], this rank's only, before the ticket: the epoch of the call in flight for
        kernels that read it on the device (``DEVICE_EPOCH``), which a CUDA graph may replay; the
        host fills it before each such call."""
        with torch.inference_mode(False):
            return self.buffer[HEADER_BYTES - 16:HEADER_BYTES - 12].view(torch.int32)

    def kept(self, key, make):
        """``launches[key]``, made by ``make()`` if missing; at most ``KEPT_LIMIT`` are kept (a
        plan per row count: dynamic shapes would otherwise grow this without bound)."""
        value = self.launches.get(key)
        if value is None:
            value = make()
            if len(self.launches) >= KEPT_LIMIT:
                self.launches.clear()
            self.launches[key] = value
        return value

    def next_epoch(self) -> tuple[int, int]:
        """(epoch, parity) of a new call: epoch counts calls from 1; parity picks the data half."""
        if self.broken:
            raise RuntimeError(self.broken)
        if self.epoch >= EPOCH_LIMIT:
            self._restart_epochs()
        self.epoch += 1
        return self.epoch, self.epoch % 2

    def _restart_epochs(self) -> None:
        """Collective (every rank reaches the same call count): zero the flags, the tile flags
        (the heap bases between them stay) and the data (no LL word of an old epoch survives),
        count from 0."""
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(self.group_name)
        if self.buffer.is_cuda:
            torch.cuda.synchronize(self.buffer.device)
        dist.barrier(group=group)  # nobody still reads or signals old epochs
        self.flags.zero_()
        self.tile_flags.zero_()  # else old epochs near the limit satisfy every new wait at once
        self.tile_counters.zero_()
        self.buffer[HEADER_BYTES:].zero_()
        if self.buffer.is_cuda:
            torch.cuda.synchronize(self.buffer.device)
        dist.barrier(group=group)  # nobody signals before every rank zeroed its flags
        self.epoch = 0

    def peer_data(self, peer: int, parity: int, shape, dtype: torch.dtype) -> torch.Tensor | None:
        """A tensor aliasing ``peer``'s data half (copy-engine reads), or None if the provider has no
        such view (Iris)."""
        half = self._peer_halves.get((peer, parity))
        if half is None:
            get_buffer = getattr(self._keepalive, "get_buffer", None)
            if get_buffer is None:
                return None
            with torch.inference_mode(False):
                half = get_buffer(peer, [self.data_bytes], torch.uint8, HEADER_BYTES + parity * self.data_bytes)
            self._peer_halves[(peer, parity)] = half
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if nbytes > self.data_bytes:
            raise RuntimeError(f"commfuse: workspace of {self.data_bytes} bytes is too small for {nbytes}")
        return half[:nbytes].view(dtype).view(shape)

    def peer_tile_flags(self, peer: int) -> torch.Tensor | None:
        """``peer``'s tile flags as a flat uint32 tensor (stream writes from this rank: torch's
        ``stream_write_value32_`` takes uint32), or None without such views (Iris)."""
        flags = self._peer_flags.get(peer)
        if flags is None:
            get_buffer = getattr(self._keepalive, "get_buffer", None)
            if get_buffer is None:
                return None
            with torch.inference_mode(False):
                flags = get_buffer(peer, [4 * TILE_FLAG_SLOTS], torch.uint8, FLAG_BYTES).view(torch.uint32)
            self._peer_flags[peer] = flags
        return flags

    def data(self, parity: int, shape, dtype: torch.dtype, offset_bytes: int = 0) -> torch.Tensor:
        start = HEADER_BYTES + parity * self.data_bytes + offset_bytes
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if offset_bytes + nbytes > self.data_bytes:
            raise RuntimeError(f"commfuse: workspace of {self.data_bytes} bytes is too small for {nbytes}")
        return self.buffer[start:start + nbytes].view(dtype).view(shape)


#: Graph-lane header: int64 flags (epochs never wrap; one slot per program per rank), then the
#: per-program epoch counters, then the heap bases.
GRAPH_FLAG_BYTES = 16 * 1024
#: Per-program epoch counters of the graph lane: at least the largest grid (one program per SM).
GRAPH_SLOTS = 256
_LANE_COUNTER_AT = GRAPH_FLAG_BYTES - BASES_BYTES - GRAPH_SLOTS * 8
#: Before the counters, this rank's words of the lane's split-K kernel: its tile ticket, its count
#: of exited programs (both back at zero when a call ends) and its per-tile arrival counters.
GRAPH_LOCAL_BYTES = 2048
_LANE_LOCALS_AT = _LANE_COUNTER_AT - GRAPH_LOCAL_BYTES


def graph_data_bytes() -> int:
    """Per-parity bytes of the graph lane: calls captured in CUDA graphs up to this size use it
    (``COMMFUSE_GRAPH_BYTES``, default 4 MiB: bf16 decode batches of 128 at hidden size 16384)."""
    return _round_up(env.integer("COMMFUSE_GRAPH_BYTES", 4 << 20, minimum=1), _ALIGN)


@dataclasses.dataclass
class GraphLane:
    """A fixed-size symmetric buffer ``[int64 flags | split-K words | epoch counters | heap bases]
    [data parity 0][data parity 1]``: ``counter`` holds the lane's epoch per program. Kernels read the epoch from ``counter`` and advance
    it themselves, so the same launch can be captured once and replayed any number of times. It is
    never grown or freed while the process runs: captured graphs hold its addresses."""

    group_name: str
    rank: int
    world: int
    buffer: torch.Tensor
    heap_bases: torch.Tensor
    data_bytes: int
    max_programs: int
    _keepalive: object = None

    @property
    def flags(self) -> torch.Tensor:
        return self.buffer[:_LANE_LOCALS_AT].view(torch.int64)

    @property
    def ticket(self) -> torch.Tensor:
        """int64 [2]: the split-K kernel's ticket and its exited programs; its last program to
        exit zeroes both."""
        return self.buffer[_LANE_LOCALS_AT:_LANE_LOCALS_AT + 16].view(torch.int64)

    @property
    def tile_counters(self) -> torch.Tensor:
        """int32: the split-K kernel's arrivals per tile (each back at zero when a call ends)."""
        return self.buffer[_LANE_LOCALS_AT + 16:_LANE_COUNTER_AT].view(torch.int32)

    @property
    def counter(self) -> torch.Tensor:
        """int64 [GRAPH_SLOTS]: this rank's epoch per program (only this rank reads or writes it)."""
        return self.buffer[_LANE_COUNTER_AT:GRAPH_FLAG_BYTES - BASES_BYTES].view(torch.int64)

    def data(self, dtype: torch.dtype) -> torch.Tensor:
        """Both parities, as one flat tensor of ``dtype`` (parity p starts at p * half_elems)."""
        return self.buffer[GRAPH_FLAG_BYTES:].view(dtype)

    def half_elems(self, dtype: torch.dtype) -> int:
        return self.data_bytes // dtype.itemsize


_workspaces: dict[tuple[str, str], Workspace] = {}
_lanes: dict[tuple[str, str], GraphLane] = {}
_planned: dict[str, int] = {}  # group name -> largest per-parity bytes a compiled graph needs
_lock = threading.Lock()


def plan(group_name: str, data_bytes: int) -> None:
    """Record that a compiled graph will need ``data_bytes`` per parity on ``group_name``, so the
    first allocation serves every fused op of the graph (the graph pass calls this)."""
    with _lock:
        _planned[group_name] = max(_planned.get(group_name, 0), int(data_bytes))


def _allocate_torch(group_name: str, nbytes: int, device: torch.device):
    import torch.distributed._symmetric_memory as symm_mem

    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(buf, group_name)
    return buf, list(handle.buffer_ptrs), handle


_iris_ctx = None


def iris_context():
    """The process's Iris heap (collective on first use): ``COMMFUSE_IRIS_HEAP_BYTES``, default 4 GiB."""
    global _iris_ctx
    if _iris_ctx is None:
        import iris

        heap = env.integer("COMMFUSE_IRIS_HEAP_BYTES", 4 << 30, minimum=1)
        _iris_ctx = iris.iris(heap, allocator_type="vmem_chunked")
    return _iris_ctx


def _allocate_iris(group_name: str, nbytes: int, device: torch.device):
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    if group.size() != dist.get_world_size():
        raise RuntimeError("commfuse: the Iris provider supports only the WORLD group; use the torch provider")
    ctx = iris_context()
    buf = ctx.zeros(nbytes, dtype=torch.uint8)
    return buf, [int(x) for x in ctx.get_heap_bases().tolist()], ctx


def _header(buf: torch.Tensor, header_bytes: int, ptrs: list[int], bases_end: int) -> torch.Tensor:
    """Zero a buffer's header (flags, counters) and write the heap bases in the BASES_BYTES before
    ``bases_end``; returns them as an int64 view of the buffer (no allocation: see the module
    docstring)."""
    if 8 * len(ptrs) > BASES_BYTES:
        raise RuntimeError(f"commfuse: groups of more than {BASES_BYTES // 8} ranks are not supported")
    buf[:header_bytes].zero_()
    bases = buf[bases_end - BASES_BYTES:bases_end - BASES_BYTES + 8 * len(ptrs)].view(torch.int64)
    bases.copy_(torch.tensor(ptrs, dtype=torch.int64))
    return bases


def workspace(group_name: str, data_bytes: int, device: torch.device) -> Workspace:
    """The group's workspace with at least ``data_bytes`` per parity. Collective when it allocates."""
    key = (group_name, provider_name())
    with _lock:
        ws = _workspaces.get(key)
        if ws is not None and ws.data_bytes >= data_bytes:
            return ws
        broken = _broken or (ws.broken if ws is not None else None)
        if broken:  # no collective allocation (nor a fresh workspace) from a rank that may be out of step
            raise RuntimeError(broken)
        outside_graph_pools(device, _allocate, key, data_bytes, device, ws)
        return _workspaces[key]


def outside_graph_pools(device: torch.device, fn, *args) -> None:
    """Run ``fn`` on a helper thread. A CUDA-graph warm-up (Inductor's ``reduce-overhead``) sends
    every allocation of *its* thread to the graph's private pool, which later captures reuse: the
    allocation's temporaries (and anything a provider allocates) must not land there. An exception
    of ``fn`` is raised again on the caller's thread."""
    failure: list[BaseException] = []

    def target():
        try:
            if device.type == "cuda" and device.index is not None:
                torch.cuda.set_device(device)
            fn(*args)
        except BaseException as exc:  # re-raised on the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=target, name="commfuse-symm-alloc")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]


def _allocate(key: tuple[str, str], data_bytes: int, device: torch.device, ws: Workspace | None) -> None:
    """Collective: a (larger) workspace for ``key``, and the group's graph lane on first use."""
    group_name = key[0]
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    size = max(data_bytes, MIN_DATA_BYTES, _planned.get(group_name, 0),
               0 if ws is None else 2 * ws.data_bytes)
    # Ranks may disagree (a plan from a graph one rank loaded from cache): agree on the largest
    # size, and on the smallest SM count so every rank launches the same grids.
    # The graph lane's size too (``COMMFUSE_GRAPH_BYTES``, read per rank): its parity halves must
    # start at the same offset on every rank, or a staged peer read lands in the wrong bytes.
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    lane_bytes = _lanes[key].data_bytes if key in _lanes else graph_data_bytes()
    agreed = torch.tensor([size, -sms, lane_bytes, -lane_bytes], dtype=torch.int64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    size, sms = _round_up(int(agreed[0]), _ALIGN), -int(agreed[1])
    if int(agreed[2]) != -int(agreed[3]):
        raise ValueError(
            f"commfuse: COMMFUSE_GRAPH_BYTES differs between the ranks of group {group_name!r} "
            f"({-int(agreed[3])} to {int(agreed[2])} bytes after rounding; this rank: {lane_bytes}); "
            "set it alike on every rank")
    if ws is not None:  # every rank must be done with the old buffer before anyone frees it
        torch.cuda.synchronize(device)
        dist.barrier(group=group)
    alloc = _allocate_iris if key[1] == "iris" else _allocate_torch
    log.info("allocating a %d MiB symmetric workspace for group %s (%s provider)",
             (HEADER_BYTES + 2 * size) >> 20, group_name, key[1])
    buf, ptrs, handle = alloc(group_name, HEADER_BYTES + 2 * size, device)
    bases = _header(buf, HEADER_BYTES, ptrs, FLAG_BYTES)
    buf[HEADER_BYTES:].zero_()  # no stale bytes can pass for a split-K LL word (fused_split_k.py)
    if key not in _lanes:  # with the first workspace, so it exists before any capture
        lbuf, lptrs, lhandle = alloc(group_name, GRAPH_FLAG_BYTES + 2 * lane_bytes, device)
        _lanes[key] = GraphLane(group_name, group.rank(), group.size(), lbuf,
                                _header(lbuf, GRAPH_FLAG_BYTES, lptrs, GRAPH_FLAG_BYTES), lane_bytes,
                                min(sms, GRAPH_SLOTS), _keepalive=lhandle)
    torch.cuda.synchronize(device)
    dist.barrier(group=group)  # no peer may signal before every rank zeroed its flags
    ws = Workspace(group_name, group.rank(), group.size(), buf, bases, size, max_programs=sms,
                   _keepalive=handle)
    _workspaces[key] = ws


def graph_lane(group_name: str) -> GraphLane | None:
    """The group's graph lane, or None before the group's first symmetric call allocated it.
    Raises once a graph-lane call timed out (``fail_lanes``)."""
    if _lane_failure:
        raise RuntimeError(
            f"commfuse: the graph lanes are out of step after an earlier failure ({_lane_failure}). "
            "Call commfuse.kernels.symm.release_all() on every rank and capture the graphs again.")
    return _lanes.get((group_name, provider_name()))


_replayed: set[tuple[str, str]] = set()
_lane_failure: str | None = None


def mark_replayed(group_name: str) -> None:
    """A CUDA-graph capture launched the group's lane: its replays will keep using it."""
    _replayed.add((group_name, provider_name()))


def replayed_lane_bytes(group_name: str) -> int:
    """The lane's per-parity bytes once captured graphs use it, else 0. Eager calls that fit then
    take the lane too: a rank whose graph tree re-warms (eager) must meet a peer that replays."""
    key = (group_name, provider_name())
    lane = _lanes.get(key)
    return lane.data_bytes if lane is not None and key in _replayed else 0


def mark_all_broken(reason: str) -> None:
    """A wait timed out: every workspace of this process refuses further calls with ``reason``,
    and so does any made later (a regrown one, another group's first) until ``release_all``."""
    global _broken
    with _lock:
        _broken = reason
        for ws in _workspaces.values():
            ws.broken = reason


_broken: str | None = None


#: Calls (op, group, shapes) that a CUDA-graph capture of this process sent to NCCL.
_captured_nccl: set[tuple] = set()


def captured_to_nccl(op: str, group_name: str, key: tuple, capturing: bool) -> bool:
    """Inside a capture, calls the graph lane cannot take run NCCL. A rank whose graph tree
    re-warms (eager) while its peer replays must meet those NCCL collectives, so once this process
    captured a call to NCCL, eager calls of the same op, group and shapes (``key``) run NCCL too,
    with nothing before them (no size agreement: the replay has none). Ranks capture alike, so
    every rank decides alike."""
    return not capturing and (op, group_name, key) in _captured_nccl


def record_capture(op: str, group_name: str, key: tuple, algo: str, capturing: bool) -> None:
    """A call inside a capture that runs NCCL (``algo``): its eager twins will too."""
    if capturing and algo == "nccl":
        _captured_nccl.add((op, group_name, key))


def fail_lanes(reason: str) -> None:
    """A graph-lane wait timed out: the ranks' device-side epochs now differ, for good."""
    global _lane_failure
    _lane_failure = reason


def release_all() -> None:
    """Drop every workspace and graph lane (tests, teardown). Not collective; call on every rank
    together, and never replay a CUDA graph captured before (it holds the lanes' addresses)."""
    global _lane_failure, _broken
    with _lock:
        _workspaces.clear()
        _lanes.clear()
        _replayed.clear()
        _captured_nccl.clear()
        _lane_failure = None
        _broken = None
