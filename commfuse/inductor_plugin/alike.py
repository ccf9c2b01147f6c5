"""The compile-time settings of a backend, compared between the ranks of every group a graph uses.

Which calls fuse is decided when a graph is compiled, by settings a rank may set on its own (the
launch bound, merge sums, the backend's ``min_mnk``, ``patterns`` and ``exclude``). Ranks that
differ there compile one collective into a commfuse op on one rank and leave it to NCCL on its
peer, so nothing of commfuse's would run on both to compare them. The backend compares them when
it is handed a graph (``CommfuseBackend.__call__``), before Inductor compiles it, and so also when
Inductor's cache would skip the pass on one rank; the pass compares them for the groups its
post-grad graph names (a group reached only through a tensor subclass the backend's graph did not
show). ``runtime/alike.py`` does the comparing.
"""

from __future__ import annotations

import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor

from ..config import Settings
from ..runtime import alike

#: Namespaces of the collectives a traced graph may hold.
_COLLECTIVES = ("_c10d_functional", "_c10d_functional_autograd", "c10d")


def _namespace(target) -> str | None:
    """An op's namespace, of an overload (post-grad graphs) or of a packet (Dynamo's graphs)."""
    name = getattr(target, "namespace", None) or getattr(target, "_qualified_op_name", "")
    return name.split("::")[0] or None


def _mesh_groups(mesh) -> list[str]:
    try:
        return [pg.group_name for pg in mesh.get_all_groups()]
    except Exception:  # noqa: BLE001 - a mesh without process groups of this rank
        return []


def graph_groups(graph: fx.Graph) -> list[str]:
    """The names of the process groups ``graph`` runs collectives on, as far as it shows them: the
    group names of its functional collectives, and the meshes of its DTensors (Dynamo's graphs
    hold DTensor operations; their collectives appear only once AOT autograd traced them)."""
    names: dict[str, None] = {}
    for node in graph.nodes:
        if node.op == "call_function" and _namespace(node.target) in _COLLECTIVES:
            for arg in (*node.args, *node.kwargs.values()):
                if isinstance(arg, str) and arg not in names:
                    try:
                        _resolve_process_group(arg)
                    except Exception:  # noqa: BLE001 - a reduce op's name, not a group's
                        continue
                    names[arg] = None
        value = node.meta.get("example_value", node.meta.get("val"))
        mesh = value.device_mesh if isinstance(value, DTensor) else value if isinstance(value, DeviceMesh) else None
        if mesh is not None:
            names.update(dict.fromkeys(_mesh_groups(mesh)))
    return list(names)


def agree(graph: fx.Graph, settings: Settings) -> None:
    """Compare ``settings`` (and the compile-time ``COMMFUSE_*`` settings) with every peer of each
    group ``graph`` uses; one error on every rank naming what differs."""
    mine = settings.alike()
    for name in graph_groups(graph):
        alike.agree_compiled(name, mine)
