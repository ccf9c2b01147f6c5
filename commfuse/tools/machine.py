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

#: What ``--gpu sm_90`` stands for: the GPU the sm_90 rules were measured on.
KNOWN = {"sm_90": ("NVIDIA H200", 132)}


def _settings() -> dict:
    settings = env.current()
    return dict(provider=settings.symm_provider, lane_bytes=round_up(settings.graph_bytes, ALIGN))


def simulated(world: int, arch: str = "sm_90") -> GroupFacts:
    """Facts of ``world`` ranks of one host, each with a GPU of ``arch``, every pair peers."""
    name, sms = KNOWN.get(arch, (f"simulated {arch} GPU", 132))
    return GroupFacts.simulated(world, arch=arch, name=name, sms=sms, **_settings())


def local(world: int) -> GroupFacts | None:
    """Facts of ``world`` ranks on this machine's GPU model (one host, peers: what ``agree`` finds on
    a machine whose GPUs reach each other), or None without a CUDA GPU."""
    if not torch.cuda.is_available():
        return None
    settings = _settings()
    return local_facts(world, provider=settings["provider"], lane_bytes=settings["lane_bytes"])
