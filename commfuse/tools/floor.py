"""The compute-only floor: a backend that compiles a model like Inductor but with every functional
collective replaced by a local stand-in of the same shape, so the model does its computation and
no communication. Its time is the floor that overlap can approach. Results are wrong by design:
use it only to time.

    all_reduce(x)                -> x
    all_gather_into_tensor(x, W) -> cat([x] * W)
    reduce_scatter_tensor(x, W)  -> x[: x.shape[0] // W]
    wait_tensor(x)               -> x
"""

from __future__ import annotations

import hashlib
import pathlib

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..patterns.common import arg, c10d, val

aten = torch.ops.aten


def _stand_in(graph: fx.Graph, node: fx.Node) -> fx.Node | None:
    x = node.args[0]
    if node.target in (c10d.all_reduce.default, c10d.all_reduce_.default, c10d.wait_tensor.default):
        return x
    with graph.inserting_before(node):
        if node.target is c10d.all_gather_into_tensor.default:
            new = graph.call_function(aten.cat.default, ([x] * arg(node, 1, "group_size"),))
        elif node.target is c10d.reduce_scatter_tensor.default:
            rows = val(x).shape[0] // arg(node, 2, "group_size")
            new = graph.call_function(aten.slice.Tensor, (x, 0, 0, rows))
        else:
            return None
    new.meta["val"] = node.meta["val"]
    return new


def remove_collectives(graph: fx.Graph) -> int:
    """Replace every functional collective of ``graph`` by its stand-in; returns how many."""
    replaced = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        new = _stand_in(graph, node)
        if new is None:
            continue
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        replaced += node.target is not c10d.wait_tensor.default
    graph.lint()
    return replaced


class FloorPass(CustomGraphPass):
    def __call__(self, graph: fx.Graph) -> None:
        remove_collectives(graph)

    def uuid(self) -> str:
        return hashlib.sha256(pathlib.Path(__file__).read_bytes()).hexdigest()


def make_floor_backend(**inductor_config):
    """A floor backend with extra Inductor settings (e.g. ``{"triton.cudagraphs": True}``)."""

    def floor(gm: torch.fx.GraphModule, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        patches = dict(inductor_config, post_grad_custom_post_pass=FloorPass())
        return compile_fx(gm, example_inputs, config_patches=patches)

    return floor


#: ``torch.compile(model, backend=floor_backend)``: Inductor without communication.
floor_backend = make_floor_backend()
