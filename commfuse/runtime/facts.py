"""What the paths may assume about the GPUs of a group, agreed by every rank before any is chosen.

A path that a rank chose from its own GPU alone could differ from its peers' (a mixed node, a rank
whose GPU cannot reach a peer's), and ranks on different paths run different collectives: a hang
or a wrong sum. So each group's facts are agreed once, with one small collective on the group's
first CUDA call, and every choice after reads only them and the call's shapes:

* the GPU architecture and name (every rank's alike, else ``mixed``: then no path but NCCL runs),
* the smallest SM count (every rank launches the same grids),
* peer access between every pair of ranks, and whether every rank is on one host,
* ROCm (where these kernels do not run), and the symmetric-memory provider.

``GroupFacts.unsupported()`` gives the one reason why a group runs the unfused ops only, or None.
Tests build facts directly (``GroupFacts.simulated``) to decide as a given GPU would.
"""

from __future__ import annotations

import dataclasses
import hashlib
import socket

import torch
import torch.distributed as dist

#: What the tile kernels' TMA descriptors need (Hopper and later).
TMA_MIN_CAPABILITY = (9, 0)


@dataclasses.dataclass(frozen=True)
class GroupFacts:
    """The facts of one group that paths may read (all agreed, the same on every rank)."""

    world: int
    arch: str  # "sm_90", "sm_100", "gfx942", "cpu", or "mixed"
    name: str  # the GPU's name where every rank's is alike, else "mixed"
    sms: int  # the smallest SM count of the group
    peer_access: bool = True  # every rank can map every peer's memory
    peers_visible: bool = True  # every rank sees its same-host peers' GPUs (to check peer access)
    one_host: bool = True
    rocm: bool = False
    provider: str = "torch"  # symmetric memory: "torch" or "iris"
    tensor_descriptors: bool = True  # this Triton has host tensor descriptors (TMA)
    lane_bytes: int = 4 << 20  # per-parity bytes of the group's graph lane (COMMFUSE_GRAPH_BYTES)

    @property
    def capability(self) -> tuple[int, int] | None:
        if not self.arch.startswith("sm_"):
            return None
        digits = self.arch[3:]
        return int(digits[:-1]), int(digits[-1])

    @property
    def tma(self) -> bool:
        """The TMA unit and Triton's descriptors for it: the tile kernels' GEMMs."""
        cap = self.capability
        return self.tensor_descriptors and cap is not None and cap >= TMA_MIN_CAPABILITY

    @property
    def copy_engines(self) -> bool:
        """Peer copies through per-peer tensor views of the workspace (the torch provider's)."""
        return self.provider == "torch" and not self.rocm

    def unsupported(self) -> str | None:
        """Why no symmetric-memory path may run on this group (the calls run NCCL), or None."""
        if self.world < 2:
            return "one rank: nothing to exchange"
        if self.rocm:
            return "ROCm: the kernels are written for NVIDIA GPUs"
        if self.arch == "mixed":
            return "the ranks' GPUs differ in architecture"
        if not self.arch.startswith("sm_"):
            return f"no CUDA GPU ({self.arch})"
        if not self.one_host:
            return "the group's ranks span more than one host"
        if not self.peers_visible:
            return ("a peer's GPU is not visible to a rank (per-rank CUDA_VISIBLE_DEVICES), so peer access "
                    "cannot be checked: make the host's GPUs visible to every rank and pick one by LOCAL_RANK")
        if not self.peer_access:
            return "a rank's GPU cannot access a peer's memory"
        return None

    def key(self) -> tuple:
        """What of the facts a choice may depend on (the tuner's cache key uses it)."""
        return dataclasses.astuple(self)

    @classmethod
    def simulated(cls, world: int, arch: str = "sm_90", name: str = "NVIDIA H200", sms: int = 132,
                  **facts) -> "GroupFacts":
        """Facts of a group of ``world`` ranks on a given GPU (tests, and sizing at compile time)."""
        return cls(world=world, arch=arch, name=name, sms=sms, **facts)


def _tensor_descriptors() -> bool:
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401  (kept out of import commfuse)
    except Exception:  # noqa: BLE001 - an older or broken Triton: the tile kernels are not offered
        return False
    return True


def local_arch(device: torch.device) -> tuple[str, str, int, bool]:
    """(architecture, name, SM count, ROCm) of this rank's GPU."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "cpu", "cpu", 0, False
    props = torch.cuda.get_device_properties(device)
    rocm = torch.version.hip is not None
    if rocm:
        arch = getattr(props, "gcnArchName", "rocm").split(":")[0]
    else:
        arch = f"sm_{props.major}{props.minor}"
    return arch, props.name, props.multi_processor_count, rocm


def local_facts(world: int, device: torch.device | None = None, provider: str = "torch",
                lane_bytes: int = 4 << 20) -> GroupFacts:
    """Facts from this rank's GPU alone: what the graph pass sizes workspaces with (the allocation
    agrees on sizes itself), never what a call chooses with."""
    device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                        else torch.device("cpu"))
    arch, name, sms, rocm = local_arch(device)
    return GroupFacts(world, arch, name, sms, rocm=rocm, provider=provider,
                      tensor_descriptors=_tensor_descriptors(), lane_bytes=lane_bytes)


def _host_id() -> int:
    """A 62-bit number naming this host, alike on every rank of it."""
    digest = hashlib.sha256(socket.gethostname().encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


def _arch_code(arch: str) -> int:
    """An integer per architecture name, for the agreement's reduction."""
    return int.from_bytes(hashlib.sha256(arch.encode()).digest()[:6], "little")


def _gpu_id(index: int) -> int:
    """A 56-bit number naming a GPU alike in every process that sees it, whatever its index there
    (``CUDA_VISIBLE_DEVICES`` may differ by rank): its UUID, else its PCI location."""
    props = torch.cuda.get_device_properties(index)
    ident = str(getattr(props, "uuid", "") or "")
    if not ident:
        ident = f"{getattr(props, 'pci_domain_id', 0)}:{getattr(props, 'pci_bus_id', 0)}:" \
                f"{getattr(props, 'pci_device_id', index)}"
    return int.from_bytes(hashlib.sha256(ident.encode()).digest()[:7], "little")


def agree(group, device: torch.device, provider: str, lane_bytes: int) -> GroupFacts:
    """Collective over ``group``: every rank's facts, reduced to what every rank can rely on.

    Two rounds of small collectives: the ranks' (host, GPU, architecture, SMs, graph-lane size),
    then whether each rank sees, and can reach, its same-host peers' GPUs. GPUs are named by
    UUID, not index: with per-rank ``CUDA_VISIBLE_DEVICES`` every rank's GPU is index 0. The graph
    lane's size (``COMMFUSE_GRAPH_BYTES``) must be alike: its parity halves must start at the same
    offset on every rank, or a staged peer read lands in the wrong bytes."""
    world = group.size()
    arch, name, sms, rocm = local_arch(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    gpu = _gpu_id(index)
    mine = torch.tensor([_host_id(), gpu, _arch_code(arch), _arch_code(name), sms, int(rocm), lane_bytes,
                         int(_tensor_descriptors())], dtype=torch.int64, device=device)
    every = torch.empty((world, mine.numel()), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(every, mine, group=group)
    rows = every.tolist()
    lanes = sorted({r[6] for r in rows})
    if len(lanes) > 1:
        raise ValueError(
            f"commfuse: COMMFUSE_GRAPH_BYTES differs between the ranks of group {group.group_name!r} "
            f"({lanes[0]} to {lanes[-1]} bytes after rounding; this rank: {lane_bytes}); set it alike on every rank")
    hosts = {r[0] for r in rows}
    peers = {r[1] for r in rows if r[0] == rows[group.rank()][0] and r[1] != gpu}  # ranks sharing a GPU: none
    visible = {_gpu_id(i): i for i in range(torch.cuda.device_count())} if peers else {}
    seen = all(p in visible for p in peers)
    reach = seen and all(torch.cuda.can_device_access_peer(index, visible[p]) for p in peers)
    ok = torch.tensor([int(reach), int(seen)], dtype=torch.int64, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    alike_arch = len({r[2] for r in rows}) == 1
    alike_name = len({r[3] for r in rows}) == 1
    return GroupFacts(
        world=world,
        arch=arch if alike_arch else "mixed",
        name=name if alike_name else "mixed",
        sms=min(r[4] for r in rows),
        peer_access=bool(ok[0].item()),
        peers_visible=bool(ok[1].item()),
        one_host=len(hosts) == 1,
        rocm=any(r[5] for r in rows),
        provider=provider,
        tensor_descriptors=all(r[7] for r in rows),  # every rank's Triton can build the tile kernels
        lane_bytes=lane_bytes,
    )
