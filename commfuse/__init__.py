"""commfuse: fuse the matmul and the collective of tensor-parallel linears under torch.compile.

    model = torch.compile(model, backend="commfuse")            # default settings
    model = torch.compile(model, backend=commfuse.backend(exclude=["layers.0.*"]))
    commfuse.exclude(model.layers[3].attention)                  # opt one instance out
    print(commfuse.report())                                     # what fused, what did not, why
"""

from __future__ import annotations

import importlib

from . import ops  # noqa: F401  (registers torch.ops.commfuse.*)
from .config import DEFAULT_PATTERNS, PATTERNS, Settings
from .exclusion import exclude, include
from .report import MatchRecord, Report, clear_report, report
from .runtime.errors import check_errors
from .runtime.groups import release_all

__version__ = "0.1.0"

#: Loaded on first use: the backend imports Dynamo and Inductor (seconds), which importing
#: commfuse for its ops, its report or ``python -m commfuse --help`` does not need.
_LAZY = {"CommfuseBackend": "inductor_plugin", "backend": "inductor_plugin", "inductor_plugin": None}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f".{_LAZY[name] or name}", __name__)
    return module if _LAZY[name] is None else getattr(module, name)


__all__ = [
    "DEFAULT_PATTERNS",
    "PATTERNS",
    "CommfuseBackend",
    "MatchRecord",
    "Report",
    "Settings",
    "backend",
    "check_errors",
    "clear_report",
    "exclude",
    "include",
    "release_all",
    "report",
]
