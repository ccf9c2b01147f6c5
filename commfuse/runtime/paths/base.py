"""The contract every path keeps: what a call is, and what a path says about one.

A *path* is one way to run one op: the unfused NCCL computation, or one of the symmetric-memory
implementations. Each is one object in one module of this package, and says

* ``supports(call, facts)``: why it cannot take a call (a sentence), or None. Only from the
  call's shapes and dtype and the group's agreed facts (``facts.GroupFacts``), never from this
  rank's own state, so every rank answers alike;
* ``workspace_bytes(call)``: the symmetric bytes per parity it needs (0 for NCCL);
* ``config(call, facts, variant)``: its configuration for the call (tilings, chunks), from the
  same inputs; ``variant`` is what a rule of the table asked for, if anything;

and is run by its module of ``runtime/running/`` (``running.run(path, ctx, args)``), given the op's
arguments and the decided configuration. Deciding is size arithmetic (``kernels/sizes/``) and
imports no Triton; running imports the kernels.

The policy (``policy.py``) asks the rules of the group's GPU (``rules.py``) which path a call
takes; the graph pass sizes workspaces through ``workspace_bytes``; ``COMMFUSE_ALGO`` and the
report use the names. Adding a path means adding a module here, its name to ``REGISTRY``, its running
module to ``running/`` and, where it should run by default, a rule to the data.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import torch

from ... import env
from ...kernels.codes import TAG_MASK
from ...kernels.sizes.tiles import FP8_DTYPES
from ..facts import GroupFacts
from ..spec import (MAX_ROW_SLABS, OPS, SPECS, AllGatherMmArgs, Call, MmAllReduceArgs,  # noqa: F401  (the paths' names)
                    MmReduceScatterArgs, OpSpec, row_slabs, rows_dim)

#: The largest symmetric exchange per parity: above it the workspace would be large, and NCCL's
#: ring bandwidth is competitive there.
SYMM_MAX_BYTES = 1 << 30


@dataclasses.dataclass
class Context:
    """What a path's ``run`` gets besides the op's arguments: the decided call, the group's state
    (``groups.Group``) and facts, and the path's configuration for the call."""

    call: Call
    facts: GroupFacts
    group: Any = None
    config: Any = None
    #: The call's pairing tag (``pairing_tag``), 0 with ``COMMFUSE_PAIRING_CHECK`` off.
    tag: int = 0
    #: The path's workspace bytes per parity for the call (``Path.workspace_bytes``), worked out
    #: once per plan (a tile path's sizing walks its tiling); 0 where a tool made the context
    #: without them: the run works them out.
    nbytes: int = 0


def make_context(call: Call, facts: GroupFacts, group, path: "Path", variant: dict | None = None) -> Context:
    """The context a path runs a call with: its configuration (for ``variant``) and, with
    ``COMMFUSE_PAIRING_CHECK``, the call's tag and the configuration the check needs
    (``Path.tagged_config``). The run-time's plans and the tuner's measurements both use it, so a
    tuned path is timed as it will run."""
    if not path.symmetric:
        return Context(call, facts, group)
    config = path.config(call, facts, variant)
    nbytes = path.workspace_bytes(call)
    if not env.current().pairing_check:
        return Context(call, facts, group, config, nbytes=nbytes)
    return Context(call, facts, group, path.tagged_config(config), pairing_tag(call, path.name), nbytes)


def pairing_tag(call: Call, path: str, site: int = 0) -> int:
    """A nonzero ``TAG_BITS``-bit name of what every rank's same call is (``kernels/codes.py``):
    the op, M, K and N, the dtype, the bias, the rows' layout, the path and the call site (the
    graph pass's, ``ops/library.py``; 0 where unknown). The rank-local size of an unevenly
    sharded layer (K of ``mm_all_reduce`` and ``mm_reduce_scatter``, N of ``all_gather_mm``) is
    part of it too: a symmetric path runs only where the shard agreement found every rank's the
    same (``shards.py``; not guarded where an even layer comes before an uneven one, unless with
    ``COMMFUSE_VERIFY``), and it is what tells apart a decode step's all-reduces, which share M
    and N (o_proj, down_proj, the input gradients). Two calls with the same tag are not told apart (1 in 1023 of unlike
    calls)."""
    text = f"{call.op} {call.m} {call.k} {call.n} {call.dtype} {call.bias} {call.rows_dim} {call.slabs} {path}"
    if site:
        text += f" @{site}"
    return 1 + zlib.crc32(text.encode()) % TAG_MASK


class Path:
    """Base of every path. Subclasses set ``op`` and ``name`` and override what differs."""

    op: str = ""
    name: str = ""
    #: Needs the symmetric workspace (every path but NCCL).
    symmetric: bool = True
    #: May run inside a CUDA-graph capture (its epochs live on the device, or it is NCCL).
    capture: bool = False

    @property
    def spec(self) -> OpSpec:
        return SPECS[self.op]

    def tagged_config(self, config):
        """The configuration to run with the pairing check on (what carries no tag changes)."""
        return config

    def supports(self, call: Call, facts: GroupFacts) -> str | None:
        return symmetric_support(call, facts) if self.symmetric else None

    def supports_variant(self, call: Call, facts: GroupFacts, variant: dict | None) -> str | None:
        """``supports`` for the configuration a rule's ``variant`` asks for (most paths have one)."""
        return self.supports(call, facts)

    def workspace_bytes(self, call: Call) -> int:
        return 0

    def config(self, call: Call, facts: GroupFacts, variant: dict | None = None) -> Any:
        return None

    def __repr__(self) -> str:
        return f"<path {self.op}:{self.name}>"


def symmetric_support(call: Call, facts: GroupFacts) -> str | None:
    """What every symmetric path needs of a group and a call."""
    why = facts.unsupported()
    if why:
        return why
    nbytes = call.exchanged_bytes
    if nbytes <= 0:
        return "an empty exchange"
    if nbytes > SYMM_MAX_BYTES:
        return f"{nbytes} bytes to exchange is past the {SYMM_MAX_BYTES >> 20} MiB workspace bound"
    return None


def tile_support(call: Call, facts: GroupFacts) -> str | None:
    """What every Triton tile kernel (TMA GEMM) needs beyond ``symmetric_support``."""
    if not facts.tma:
        return f"{facts.arch} has no TMA (the tile kernels need sm_90 or later)"
    if call.dtype not in (torch.float16, torch.bfloat16, *FP8_DTYPES):
        return f"{call.dtype} (the tile kernels take fp16, bf16 and FP8)"
    if min(call.m, call.k, call.n) < 1:
        return "an empty dimension"
    if (call.k * call.itemsize) % 16 or (call.n * call.itemsize) % 16:
        return "K or N rows are not 16-byte multiples (TMA descriptors)"
    return None


def copy_engine_support(call: Call, facts: GroupFacts) -> str | None:
    """What the copy-engine overlaps of ``all_gather_mm`` and ``mm_reduce_scatter`` need: per-peer
    views, and each rank's rows in one block (or in a few slabs of a batch)."""
    why = symmetric_support(call, facts)
    if why:
        return why
    if not facts.copy_engines:
        return f"the {facts.provider} provider gives no per-peer views for the copy engines"
    if call.rows_dim != 0 and call.slabs < 1:
        return f"more than {MAX_ROW_SLABS} slabs of rows (or an unknown count)"
    return None
