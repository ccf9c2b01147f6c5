"""The group facts the command-line tools decide with: this machine's GPUs, or a simulated GPU.

The run-time agrees a group's facts collectively on its first call (``runtime/facts.py``); a tool
that runs without the ranks (``explain`` on the CPU, ``tune --show``) builds the facts such a group
would agree on, with the settings that enter them (the provider, the graph lane's size) as the
run-time reads them, so a tuning cache's machine key computed here is the one the run-time uses.
"""

from __future__ import annotations

import torch

from commfuse import env
from commfuse.runtime.facts import GroupFacts, local_facts
from commfuse.runtime.workspace import ALIGN, round_up

#: The GPUs a tool may simulate: name -> (architecture, SM count of that model).
GPUS = {
    "A100": ("sm_80", 108),
    "A10": ("sm_86", 72),
    "L40S": ("sm_89", 142),
    "H100 PCIe": ("sm_90", 114),
    "H100": ("sm_90", 132),  # SXM
    "H200": ("sm_90", 132),
    "B200": ("sm_100", 148),
}
#: What ``--gpu ARCH`` stands for, per known architecture: one GPU of it (for sm_90 the one its
#: rules were measured on).
ARCHS = {"sm_80": "A100", "sm_86": "A10", "sm_89": "L40S", "sm_90": "H200", "sm_100": "B200"}


def resolve(gpu: str) -> tuple[str, str, int]:
    """(architecture, name, SM count) of ``gpu``: a known architecture (``sm_90``) or GPU name
    (``H100``, ``NVIDIA H200``, any case); ``ValueError`` saying which are known otherwise."""
    text = " ".join(str(gpu).split())
    if text.lower() in ARCHS:
        name = ARCHS[text.lower()]
        return text.lower(), f"NVIDIA {name}", GPUS[name][1]
    bare = text[len("nvidia "):] if text.lower().startswith("nvidia ") else text
    for name, (arch, sms) in GPUS.items():
        if bare.lower() == name.lower():
            return arch, f"NVIDIA {name}", sms
    raise ValueError(f"{gpu!r} is not a known architecture ({', '.join(ARCHS)}) or GPU ({', '.join(GPUS)})")


def _settings() -> dict:
    settings = env.current()
    return dict(provider=settings.symm_provider, lane_bytes=round_up(settings.graph_bytes, ALIGN))


def simulated(world: int, gpu: str = "sm_90") -> GroupFacts:
    """Facts of ``world`` ranks of one host, each with a GPU ``gpu`` (``resolve``), every pair peers."""
    arch, name, sms = resolve(gpu)
    return GroupFacts.simulated(world, arch=arch, name=name, sms=sms, **_settings())


def local(world: int) -> GroupFacts | None:
    """Facts of ``world`` ranks on this machine's GPU model (one host, peers: what ``agree`` finds on
    a machine whose GPUs reach each other), or None without a CUDA GPU."""
    if not torch.cuda.is_available():
        return None
    settings = _settings()
    return local_facts(world, provider=settings["provider"], lane_bytes=settings["lane_bytes"])
