"""The compile-time settings of a backend, compared between the ranks of every group a graph uses.

Which calls fuse is decided when a graph is compiled, by settings a rank may set on its own (the
launch bound, merge sums, the backend's ``min_mnk``, ``patterns`` and ``exclude``). Ranks that
differ there compile one collective into a commfuse op on one rank and leave it to NCCL on its
peer, so nothing of commfuse's would run on both to compare them. The backend compares them when
Dynamo hands it a graph (``CommfuseBackend.__call__``), before Inductor compiles it, for every
group the graph shows: its functional collectives and DTensors, in the graph itself and in the
subgraphs of its higher-order ops (an ``autograd.Function``'s forward and backward, activation
checkpointing). Every rank's backend is handed the same graphs, whatever Inductor's caches hold.

The graph pass compares nothing: it does not run on a rank whose Inductor or AOTAutograd cache
holds the graph, so a comparison there would wait for a peer that never makes it. A group its
fused calls use that the backend did not compare (one reached through a tensor subclass of a
kind the backend's graph does not show) is named in a warning (``warn_unagreed``).
``runtime/alike.py`` does the comparing.
"""

from __future__ import annotations

import logging

import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor

from ..config import Settings
from ..runtime import alike

log = logging.getLogger("commfuse")

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


def _submodule(owner, target: str):
    try:
        for part in str(target).split("."):
            owner = getattr(owner, part)
    except AttributeError:
        return None
    return owner if isinstance(owner, fx.GraphModule) else None


def graph_groups(graph: fx.Graph) -> list[str]:
    """The names of the process groups ``graph`` runs collectives on, as far as it shows them: the
    group names of its functional collectives, and the meshes of its DTensors (Dynamo's graphs
    hold DTensor operations; their collectives appear only once AOT autograd traced them), in
    ``graph`` and in the graphs of the submodules it reads (the bodies of higher-order ops: an
    ``autograd.Function``'s forward and backward, a checkpointed region), in the order the graph
    reaches them, which is the same on every rank."""
    names: dict[str, None] = {}
    _collect(graph, names, set())
    return list(names)


def _collect(graph: fx.Graph, names: dict[str, None], seen: set[int]) -> None:
    owner = graph.owning_module
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module") and owner is not None:
            body = _submodule(owner, node.target)
            if body is not None:
                if id(body) not in seen:
                    seen.add(id(body))
                    _collect(body.graph, names, seen)
                continue
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


def agree(graph: fx.Graph, settings: Settings) -> None:
    """Compare ``settings`` (and the compile-time ``COMMFUSE_*`` settings) with every peer of each
    group ``graph`` uses; one error on every rank naming what differs."""
    mine = settings.alike()
    for name in graph_groups(graph):
        alike.agree_compiled(name, mine)


_warned: set[str] = set()


def warn_unagreed(group_names, settings: Settings, where: str) -> None:
    """Warn, once per group, where the pass fused calls on a group whose ranks did not compare
    ``settings``: never a wait (the peers' passes may not run: their caches may hold the graph)."""
    mine = settings.alike()
    for name in sorted(set(map(str, group_names)) - _warned):
        if not alike.compiled_agreed(name, mine):
            _warned.add(name)
            log.warning("commfuse: %s fused calls on group %r, whose compile-time settings the ranks did not "
                        "compare (the graph Dynamo handed the backend does not show the group): set the launch "
                        "bound, COMMFUSE_MERGE_SUMS, min_mnk, patterns and exclude alike on every rank "
                        "(docs/settings.md)", where, name)
