"""DTensor tensor parallelism on a fake device mesh: Colwise/Rowwise MLP, and the sequence-parallel
variant, through a full training step (forward and backward graphs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import commfuse
from helpers import calls


class MLP(nn.Module):
    def __init__(self, dim=64, hidden=256, bias=True):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x):
        return self.down(torch.relu(self.up(self.norm(x))))


def _train_step(model, x):
    from torch._inductor.utils import run_and_get_code

    compiled = torch.compile(model, backend=commfuse.backend(min_mnk=0))
    _, codes = run_and_get_code(lambda: compiled(x).sum().backward())
    return "\n".join(codes)


def _by_graph():
    out = {}
    for r in commfuse.report():
        out.setdefault((r.pattern, r.graph.split("#")[0], r.fused), []).append(r.module)
    return out


@pytest.mark.parametrize("world", [2, 4, 8], indirect=True, ids=["world2", "world4", "world8"])
@pytest.mark.parametrize("bias", [True, False])
def test_colwise_rowwise_mlp(world, bias):
    mesh = init_device_mesh("cpu", (world,))
    model = parallelize_module(MLP(bias=bias), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    code = _train_step(model, torch.randn(4, 16, 64, requires_grad=True))
    assert calls(code, "commfuse.mm_all_reduce") == 2
    assert "_c10d_functional.all_reduce" not in code
    assert _by_graph() == {
        ("mm_all_reduce", "forward", True): ["down"],  # row-parallel output
        ("mm_all_reduce", "backward", True): ["up"],  # column-parallel input gradient
    }


@pytest.mark.parametrize("world", [2, 4, 8], indirect=True, ids=["world2", "world4", "world8"])
def test_sequence_parallel_mlp(world):
    mesh = init_device_mesh("cpu", (world,))
    plan = {
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
    }
    model = parallelize_module(MLP(), mesh, plan)
    code = _train_step(model, torch.randn(4, 32 // world, 64, requires_grad=True))
    assert calls(code, "commfuse.all_gather_mm") == 2
    assert calls(code, "commfuse.mm_reduce_scatter") == 2
    assert "_c10d_functional.all_gather_into_tensor" not in code
    assert "_c10d_functional.reduce_scatter_tensor" not in code
    assert _by_graph() == {
        ("all_gather_mm", "forward", True): ["up"],
        ("mm_reduce_scatter", "forward", True): ["down"],  # row-parallel output, sequence-sharded
        ("all_gather_mm", "backward", True): ["down"],  # gathered grad -> down's input grad
        ("mm_reduce_scatter", "backward", True): ["up"],  # column-parallel input grad
    }


def test_transformer_stack_exclusion(world2):
    """The bundled Llama-style stack: one excluded block stays unfused, the other fuses fully."""
    from commfuse.demo import transformer as demo

    mesh = init_device_mesh("cpu", (2,))
    model = demo.parallelize_dtensor(demo.Transformer(demo.Config(dim=64, ffn_dim=128, n_layers=2)), mesh)
    commfuse.exclude(model.layers[0])
    _train_step(model, torch.randn(2, 8, 64, requires_grad=True))
    fused = {r.module for r in commfuse.report() if r.fused}
    skipped = {r.module for r in commfuse.report() if not r.fused}
    assert fused and all(m.startswith("layers.1.") for m in fused)
    assert skipped and all(m.startswith("layers.0.") for m in skipped)
