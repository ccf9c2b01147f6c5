"""Kernels, symmetric-memory providers and dispatch behind the ``torch.ops.commfuse`` ops."""

from . import ops  # noqa: F401  (registers torch.ops.commfuse.*)
