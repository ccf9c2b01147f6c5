"""commfuse: fuse the matmul and the collective of tensor-parallel linears under torch.compile.

    model = torch.compile(model, backend="commfuse")            # default settings
    model = torch.compile(model, backend=commfuse.backend(exclude=["layers.0.*"]))
    commfuse.exclude(model.layers[3].attention)                  # opt one instance out
    print(commfuse.report())                                     # what fused, what did not, why
"""

from . import ops  # noqa: F401  (registers torch.ops.commfuse.*)
from .config import PATTERNS, Settings
from .exclusion import exclude, include
from .inductor_plugin import CommfuseBackend, backend
from .report import MatchRecord, Report, clear_report, report
from .runtime.errors import check_errors
from .runtime.groups import release_all

__version__ = "0.1.0"

__all__ = [
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
