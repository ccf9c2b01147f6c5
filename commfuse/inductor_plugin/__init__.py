"""torch.compile integration: the backend and the post-grad graph pass."""

from .backend import CommfuseBackend, backend, commfuse_backend
from .graph_pass import CommfusePass, rewrite

__all__ = ["CommfuseBackend", "CommfusePass", "backend", "commfuse_backend", "rewrite"]
