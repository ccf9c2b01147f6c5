"""How ``paths/nccl.py``'s path runs a call: the kernels it launches, imported here, never on
the deciding side."""

from __future__ import annotations

from ..paths.base import Context


def run(path, ctx: Context, args):
    """The op's NCCL equivalent (``OpSpec.nccl``): its matmul, then the functional collective."""
    return path.spec.run_nccl(args)
