"""A group of ranks on one GPU, for tests and one-GPU benchmarks of the cross-rank kernels.

Each rank is a workspace over a buffer of its own on the same device; all share one heap-bases
table, so Iris's pointer translation reaches any rank's buffer, and each rank gets 1/world of the
SMs as its grid. Launch every rank's kernel on a stream of its own so all their programs run at
once and really wait on each other's flags. What this cannot show is the link: a remote store is
a local one here, so every byte a kernel exchanges costs HBM bandwidth on the one device.

One host thread launches every rank, so the process must load its kernels when CUDA starts
(``CUDA_MODULE_LOADING=EAGER`` in the environment before anything initialises CUDA: importing
commfuse asks whether CUDA is available, which is already too late, so a script sets it before
its first ``import torch``, as the one-GPU benchmarks and the tests do). Loaded lazily, the first
launch of a kernel (a cuBLAS GEMM after a gather, say) may wait for the device's running kernels,
among them a rank's kernel that spins until a rank this thread has not launched yet signals: it
then waits out the bound and reports the peer as late. ``group`` and ``lanes`` ask the driver
which mode it runs in and warn once where it loads lazily. Separate processes (real ranks) do not
wait on each other that way.
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

from ..runtime import capture
from ..runtime import workspace as symm


class _Views:
    """The torch provider's peer views (``get_buffer``) over the emulated ranks' buffers."""

    def __init__(self, bufs):
        self.bufs = bufs

    def get_buffer(self, peer, sizes, dtype, storage_offset):
        nbytes = torch.Size(sizes).numel() * dtype.itemsize
        start = storage_offset * dtype.itemsize
        return self.bufs[peer][start:start + nbytes].view(dtype).view(sizes)


class GroupState:
    """An emulated group as ``runtime.errors.check`` reads a group (``groups.Group``): the
    workspace of its rank 0, its name and error word (which its ranks share), no graph lane, and
    ``broken`` once an error was raised. Group ranks are global ranks."""

    def __init__(self, ws: symm.Workspace):
        self.workspace, self.name, self.err = ws, ws.group_name, ws.err
        self.err_host = ws.err.numpy()
        self.lane = self.broken = None
        self.capture = capture.State()

    def global_rank(self, group_rank: int) -> int:
        return group_rank


log = logging.getLogger("commfuse")
_warned: list[str] = []
#: ``CUmoduleLoadingMode``'s values
_EAGER, _LAZY = 1, 2


def loading_mode() -> str | None:
    """How the CUDA driver loads this process's kernels, ``"EAGER"`` or ``"LAZY"``, as the
    driver says (``cuModuleGetLoadingMode``: what it read when CUDA started, whatever the
    environment says now); None where it cannot say (no driver, an old one)."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        get = driver.cuModuleGetLoadingMode
    except (OSError, AttributeError):
        return None
    if driver.cuInit(0) != 0:
        return None
    mode = ctypes.c_int(0)
    if get(ctypes.byref(mode)) != 0:
        return None
    return {_EAGER: "EAGER", _LAZY: "LAZY"}.get(mode.value)


def _check_loading() -> None:
    """Say once where the driver loads kernels lazily (the module docstring): a wait in a test or
    benchmark may then time out though nothing is wrong with the kernels."""
    if torch.version.hip:  # HIP has no such mode to ask for
        return
    mode = loading_mode() or os.environ.get("CUDA_MODULE_LOADING", "LAZY").upper()
    if mode != "EAGER" and not _warned:
        _warned.append(mode)
        log.warning("commfuse: an emulated group while CUDA loads kernels %s: a kernel loaded at its first "
                    "launch may hold up the other ranks' launches until the wait bound (set "
                    "CUDA_MODULE_LOADING=EAGER before the script's first import of torch)", mode.lower())


def _buffers(world: int, nbytes: int, device: torch.device):
    """``world`` zeroed buffers on one device, their heap-bases table, the torch provider's views
    over them, and each rank's share of the SMs."""
    _check_loading()
    programs = torch.cuda.get_device_properties(device).multi_processor_count // world
    bufs = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(world)]
    bases = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=device)
    return bufs, bases, _Views(bufs), programs


def group(world: int, data_bytes: int, device: torch.device | str = "cuda",
          timeout_s: float = 600.0) -> list[symm.Workspace]:
    """``world`` workspaces of ``data_bytes`` per parity on one device, zeroed, one per rank (one
    error word for all of them: the group's). ``data_bytes`` is rounded up as the run-time's
    allocation rounds it (``workspace.ALIGN``), so the second parity starts aligned as there."""
    data_bytes = symm.round_up(data_bytes, symm.ALIGN)
    bufs, bases, views, programs = _buffers(world, symm.HEADER_BYTES + 2 * data_bytes, torch.device(device))
    err = symm.error_word()
    return [symm.Workspace(f"one-device-{world}", r, world, bufs[r], bases, data_bytes, max_programs=programs,
                           err=err, timeout_ns=int(timeout_s * 1e9), _keepalive=views) for r in range(world)]


def lanes(world: int, data_bytes: int, device: torch.device | str = "cuda",
          timeout_s: float = 600.0) -> list[symm.GraphLane]:
    """``world`` graph lanes of ``data_bytes`` per parity on one device, as ``group`` makes
    workspaces: their kernels keep their epochs on the device, so each rank's launches may be
    captured in a CUDA graph of its own and the ranks' graphs replayed together."""
    bufs, bases, views, programs = _buffers(world, symm.GRAPH_FLAG_BYTES + 2 * data_bytes, torch.device(device))
    err = symm.error_word()
    return [symm.GraphLane(f"one-device-lane-{world}", r, world, bufs[r], bases, data_bytes,
                           min(programs, symm.GRAPH_SLOTS), err=err, timeout_ns=int(timeout_s * 1e9),
                           _keepalive=views) for r in range(world)]
