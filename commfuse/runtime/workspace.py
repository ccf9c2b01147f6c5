"""Symmetric workspaces: one buffer per process group, mapped on every rank, plus a heap-bases table.

Kernels address peers through Iris's RMA primitives, which translate a local pointer to a peer's by
``ptr - heap_bases[me] + heap_bases[peer]``. Two providers give that table:

* ``torch`` (default): ``torch.distributed._symmetric_memory``; its per-peer buffer pointers are the
  heap bases, and its per-peer tensor views let the copy engines read a peer's half;
* ``iris``: the Iris symmetric heap (``allocator_type="vmem_chunked"`` on NVIDIA), chosen with
  ``COMMFUSE_SYMM_PROVIDER=iris`` (the WORLD group only).

Each group also gets a *graph lane* (``GraphLane``), a second, fixed-size buffer that CUDA-graph
replays use: its epochs live on the device, so a replay needs no host step (``kernels/exchange.py``).
Both are ``SymmetricBuffer``s: what the kernels' launchers read of a buffer (heap bases, error
word, wait bound, kept launches) and the device order of its calls are defined there once.

Every device tensor a workspace or lane keeps (flags, heap bases, epoch counters) lives inside its
symmetric buffer, never in PyTorch's caching allocator: the first call of a group may run inside a
CUDA-graph warm-up, whose allocations come from the graph's private pool and are reused by later
captures (a heap-bases table there would be overwritten: illegal addresses).

Layout of a workspace::

    [flags | heap bases: FLAG_BYTES][tile flags | split-K counters | epoch cell | ticket: TILE_FLAG_BYTES]
    [data parity 0][data parity 1]

Flags are int32 epochs (the call count and its pairing tag, ``kernels/codes.py``) that only grow,
so they never need resetting (until epochs restart near ``EPOCH_LIMIT``); the two data halves
alternate between calls, which (with the flag wait at the start of every exchange kernel, and the
per-tile flags of the fused kernels) keeps a fast rank from overwriting data a slow peer is still
reading. Allocation is collective and slow: it happens
on a group's first symmetric call, is reused after, and grows only when a larger call arrives.
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from ..kernels.codes import flag_value

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
#: The heap-bases table (int64 per rank: up to 128 ranks) fills the last bytes of the workspace's
#: flag area (before ``FLAG_BYTES``; the header itself ends with the epoch cell and the ticket) and
#: of the graph lane's header (before ``GRAPH_FLAG_BYTES``).
BASES_BYTES = 1024
#: Call counts restart (collectively, flags and data zeroed) before they reach this: the int32
#: flags (the count above ``TAG_BITS`` tag bits) never overflow, and the split-K kernel's LL
#: words, whose flags hold a count's low 21 bits (``kernels.fused_split_k.LL_EPOCH_BITS``), never
#: meet a stale word of an earlier call with the same bits.
EPOCH_LIMIT = (1 << 21) - 1
MIN_DATA_BYTES = 16 * 1024 * 1024  # per parity; a first allocation serves many later shapes
ALIGN = 256

#: Launches and plans a workspace keeps (``Workspace.kept``); all are dropped when full.
KEPT_LIMIT = 256


def _raw_stream(device: int) -> int:
    """The handle of ``device``'s current stream (``torch.cuda.current_stream(device).cuda_stream``
    without making the stream's object)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream


def round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def error_word() -> torch.Tensor:
    """A pinned host int32[8] the kernels write when a wait times out or meets another call: ``[kind, op, rank, peer, count, tags...]`` (``runtime/errors.py``).
    Pinned so the host reads it without synchronising the GPU."""
    return torch.zeros(8, dtype=torch.int32, pin_memory=torch.cuda.is_available())


@dataclasses.dataclass
class SymmetricBuffer:
    """What a group's symmetric buffers share (the workspace, the graph lane): the buffer mapped
    on every rank and its heap bases, the group's error word and wait bound, the launches kept
    for the buffer's life, and the order of its calls on the device. The kernels' launchers read
    these fields and nothing else of the run-time."""

    group_name: str
    rank: int
    world: int
    buffer: torch.Tensor  # uint8, this rank's part: a header, then two data halves
    heap_bases: torch.Tensor  # int64 [world] device pointers of every rank's buffer (or heap), in ``buffer``
    data_bytes: int  # per parity
    max_programs: int = 132  # the smallest SM count of the group: every rank launches the same grid
    err: torch.Tensor | None = None  # the group's error word (``error_word``)
    timeout_ns: int = 600 * 10**9  # bound on every wait of the kernels launched on it
    _keepalive: object = None  # provider handle (rendezvous handle / Iris context)
    #: kernel launches and call plans kept for the buffer's life (``kernels.launch.Bound``),
    #: keyed by their caller; see ``kept``
    launches: dict = dataclasses.field(default_factory=dict, repr=False)
    #: The stream of the last eager call (``order``), and once calls came from more than one
    #: stream, an event recorded after each call's work
    last_stream: object = dataclasses.field(default=None, repr=False)
    last_event: object = dataclasses.field(default=None, repr=False)
    #: ``last_stream``'s handle (``cuda_stream``), None where it has none
    last_raw: int | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.err is None:
            self.err = error_word()

    def order(self, stream) -> bool:
        """Put a call on ``stream`` after the buffer's previous call: calls are paired across
        ranks by their epochs, taken in host order, so on the device each must also start after the
        one before it (the serialisation NCCL gets from one internal stream per group). A call on
        the stream of the last call is ordered already and costs nothing here; a call on another
        stream waits for the event recorded after the last call (or, the first time, for that
        stream's queue). Returns whether the caller must record ``last_event`` after its work."""
        last = self.last_stream
        if last is not None and last != stream:
            if self.last_event is None:
                stream.wait_stream(last)
                self.last_event = torch.cuda.Event()
            else:
                stream.wait_event(self.last_event)
        self.last_stream = stream
        self.last_raw = getattr(stream, "cuda_stream", None)
        return self.last_event is not None

    def order_current(self):
        """``order`` for the current stream of the buffer's device (a CUDA buffer's): ``(the
        stream, whether to record)``. A call on the last call's stream, told by its handle, is
        ordered already: no stream object is made (each costs the host a device switch)."""
        if self.last_raw is not None and _raw_stream(self.device_index) == self.last_raw:
            return self.last_stream, self.last_event is not None
        stream = torch.cuda.current_stream(self.buffer.device)
        return stream, self.order(stream)

    @functools.cached_property
    def device_index(self) -> int:
        return self.buffer.device.index

    def kept(self, key, make):
        """``launches[key]``, made by ``make()`` if missing; at most ``KEPT_LIMIT`` are kept, the
        least recently used dropped first (a plan per row count: dynamic shapes would otherwise
        grow this without bound, and clearing it all would rebuild every plan at once)."""
        value = self.launches.pop(key, None)
        if value is None:
            value = make()
            while len(self.launches) >= KEPT_LIMIT:
                del self.launches[next(iter(self.launches))]
        self.launches[key] = value  # (dicts keep insertion order: the most recent is last)
        return value

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()


@dataclasses.dataclass
class Workspace(SymmetricBuffer):
    """One group's symmetric workspace on this rank: ``buffer`` is HEADER_BYTES, then two data
    halves of ``data_bytes`` that alternate between calls; it grows (a new one) when a larger call
    arrives."""

    epoch: int = 0
    broken: str | None = None  # set when a call failed after its epoch began (ranks may disagree)
    ticket_base: int = 0  # the ticket's value at the next fused call (claims so far, counted here)
    #: (peer, parity) -> that peer's data half as bytes, made once: the provider's view is slow to
    #: make on the host, and the copy-engine overlaps need one per peer per call
    _peer_halves: dict = dataclasses.field(default_factory=dict, repr=False)
    #: peer -> that peer's tile flags as uint32 (the copy-engine pushes' flag writes), made once
    _peer_flags: dict = dataclasses.field(default_factory=dict, repr=False)
    #: copy-engine calls replayed as CUDA graphs (``ce_graphs.py``): key -> graph, and the keys of
    #: calls seen once; the graphs hold this workspace's addresses and go with it
    graphs: dict = dataclasses.field(default_factory=dict, repr=False)
    graphs_seen: dict = dataclasses.field(default_factory=dict, repr=False)
    #: (parity, shape, dtype, offset) -> the view ``data`` made (bounded by ``KEPT_LIMIT``)
    _views: dict = dataclasses.field(default_factory=dict, repr=False)

    # Views kept for the workspace's life are made outside inference mode: one made inside it would
    # refuse the in-place writes (``restart_epochs``) of a later call outside it.
    @functools.cached_property
    def flags(self) -> torch.Tensor:
        with torch.inference_mode(False):
            return self.buffer[:FLAG_BYTES - BASES_BYTES].view(torch.int32)

    @functools.cached_property
    def tile_flags(self) -> torch.Tensor:
        with torch.inference_mode(False):
            return self.buffer[FLAG_BYTES:FLAG_BYTES + 4 * TILE_FLAG_SLOTS].view(torch.int32)

    @functools.cached_property
    def tile_counters(self) -> torch.Tensor:
        """int32, this rank's only: the split-K kernel's arrivals per tile; zero between calls (the
        last arrival of a tile resets its counter), and zero from the allocation's header."""
        end = HEADER_BYTES - TICKET_BYTES
        with torch.inference_mode(False):
            return self.buffer[end - COUNTER_BYTES:end].view(torch.int32)

    @functools.cached_property
    def ticket(self) -> torch.Tensor:
        """int64 [1], this rank's only: the fused kernel's programs claim tile positions from it;
        it only grows, and ``ticket_base`` is its value when the next call starts."""
        with torch.inference_mode(False):
            return self.buffer[HEADER_BYTES - 8:HEADER_BYTES].view(torch.int64)

    @functools.cached_property
    def epoch_cell(self) -> torch.Tensor:
        """int32 [1], this rank's only, before the ticket: the epoch of the call in flight for
        kernels that read it on the device (``DEVICE_EPOCH``), which a CUDA graph may replay; the
        host fills it before each such call."""
        with torch.inference_mode(False):
            return self.buffer[HEADER_BYTES - 16:HEADER_BYTES - 12].view(torch.int32)

    def graph_bytes(self) -> int:
        """What the copy-engine graphs hold: each one's memory pool (its cuBLAS workspace, its
        intermediates), as measured when it was captured (``ce_graphs.run``)."""
        return sum(getattr(graph, "commfuse_bytes", 0) for graph in self.graphs.values())

    def next_epoch(self, restart=None, tag: int = 0) -> tuple[int, int]:
        """(epoch, parity) of a new call: the flag value it signals and waits for (``self.epoch``,
        the call count from 1, with the call's pairing ``tag``: ``kernels.codes.flag_value``);
        parity picks the data half. Near ``EPOCH_LIMIT`` every rank (at the same call count) calls
        ``restart()`` first."""
        if self.broken:
            raise RuntimeError(self.broken)
        if self.epoch >= EPOCH_LIMIT:
            (restart or self.restart_epochs)()
        self.epoch += 1
        return flag_value(self.epoch, tag), self.epoch % 2

    def restart_epochs(self, group=None) -> None:
        """Collective (every rank reaches the same call count): zero the flags, the tile flags
        (the heap bases between them stay) and the data (no LL word of an old epoch survives),
        count from 0."""
        if group is None:
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
        with torch.inference_mode(False):  # (plans keep it: ``data``)
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
        """``shape`` of ``dtype`` at ``offset_bytes`` into data half ``parity``: a view made once
        per workspace (every call of a shape asks for the same one or two), outside inference
        mode as the workspace's other kept views."""
        key = (parity, tuple(shape), dtype, offset_bytes)
        view = self._views.get(key)
        if view is None:
            start = HEADER_BYTES + parity * self.data_bytes + offset_bytes
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            if offset_bytes + nbytes > self.data_bytes:
                raise RuntimeError(f"commfuse: workspace of {self.data_bytes} bytes is too small for {nbytes}")
            if len(self._views) >= KEPT_LIMIT:
                self._views.clear()
            with torch.inference_mode(False):
                view = self._views[key] = self.buffer[start:start + nbytes].view(dtype).view(shape)
        return view


#: Graph-lane header: int64 flags (epochs never wrap; one slot per program per rank for the staged
#: one-shot, one per tile per rank for the lane's split-K), then this rank's split-K words
#: (``GRAPH_LOCAL_BYTES``), then the per-program epoch counters, then the heap bases.
GRAPH_FLAG_BYTES = 16 * 1024
#: Per-program epoch counters of the graph lane: at least the largest grid (one program per SM).
GRAPH_SLOTS = 256
_LANE_COUNTER_AT = GRAPH_FLAG_BYTES - BASES_BYTES - GRAPH_SLOTS * 8
#: Before the counters, this rank's words of the lane's split-K kernel: its tile ticket, its count
#: of exited programs (both back at zero when a call ends) and its per-tile arrival counters.
GRAPH_LOCAL_BYTES = 2048
_LANE_LOCALS_AT = _LANE_COUNTER_AT - GRAPH_LOCAL_BYTES


def graph_lane_capacity() -> tuple[int, int]:
    """(flag slots, split-K arrival counters) of every graph lane: what a kernel's tiling must fit."""
    return _LANE_LOCALS_AT // 8, (_LANE_COUNTER_AT - _LANE_LOCALS_AT - 16) // 4


@dataclasses.dataclass
class GraphLane(SymmetricBuffer):
    """A fixed-size symmetric buffer ``[int64 flags | split-K words | epoch counters | heap bases]
    [data parity 0][data parity 1]``: ``counter`` holds the lane's epoch per program. Kernels read
    the epoch from ``counter`` and advance it themselves, so the same launch can be captured once
    and replayed any number of times. It is never grown: captured graphs hold its addresses; its
    eager calls are ordered as the workspace's (``order``)."""

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

    def restart(self, group) -> None:
        """Collective: zero every rank's flags, split-K words, epoch counters and data (the heap
        bases stay), so the lane's device epochs start over together. Captured graphs keep working:
        they read the counters at each replay. No kernel of the lane may be in flight on any rank."""
        if self.buffer.is_cuda:
            torch.cuda.synchronize(self.buffer.device)
        dist.barrier(group=group)  # nobody still reads or signals old epochs
        self.buffer[:GRAPH_FLAG_BYTES - BASES_BYTES].zero_()
        self.buffer[GRAPH_FLAG_BYTES:].zero_()
        if self.buffer.is_cuda:
            torch.cuda.synchronize(self.buffer.device)
        dist.barrier(group=group)  # nobody signals before every rank zeroed its flags

    def half_elems(self, dtype: torch.dtype) -> int:
        return self.data_bytes // dtype.itemsize


def header(buf: torch.Tensor, header_bytes: int, ptrs: list[int], bases_end: int) -> torch.Tensor:
    """Zero a buffer's header (flags, counters) and write the heap bases in the BASES_BYTES before
    ``bases_end``; returns them as an int64 view of the buffer (no allocation: module docstring)."""
    if 8 * len(ptrs) > BASES_BYTES:
        raise RuntimeError(f"commfuse: groups of more than {BASES_BYTES // 8} ranks are not supported")
    buf[:header_bytes].zero_()
    bases = buf[bases_end - BASES_BYTES:bases_end - BASES_BYTES + 8 * len(ptrs)].view(torch.int64)
    bases.copy_(torch.tensor(ptrs, dtype=torch.int64))
    return bases


def allocate_torch(group, nbytes: int, device: torch.device):
    """A symmetric buffer from torch symmetric memory (collective): (buffer, heap bases, handle)."""
    import torch.distributed._symmetric_memory as symm_mem  # (only where a GPU path runs)

    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(buf, group.group_name)
    return buf, list(handle.buffer_ptrs), handle


_iris_ctx = None


def allocate_iris(group, nbytes: int, device: torch.device, heap_bytes: int):
    """A buffer on the process's Iris heap (made collectively on first use, ``heap_bytes``)."""
    global _iris_ctx
    if group.size() != dist.get_world_size():
        raise RuntimeError("commfuse: the Iris provider supports only the WORLD group; use the torch provider")
    if _iris_ctx is None:
        import iris  # an optional provider: kept out of ``import commfuse``

        _iris_ctx = iris.iris(heap_bytes, allocator_type="vmem_chunked")
    buf = _iris_ctx.zeros(nbytes, dtype=torch.uint8)
    return buf, [int(x) for x in _iris_ctx.get_heap_bases().tolist()], _iris_ctx


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
