"""The ``torch.ops.commfuse`` ops: schemas, fake implementations and argument checks
(``library.py``). Importing this package registers them."""

from . import library  # noqa: F401  (registers torch.ops.commfuse.*)

__all__ = ["library"]
