"""The ``torch.ops.commfuse`` ops: schemas, fake implementations and argument checks
(``library.py``). Importing this package registers them."""

from . import library  # noqa: F401  (registers torch.ops.commfuse.*)
from .library import CALL_COUNTS

__all__ = ["CALL_COUNTS", "library"]
