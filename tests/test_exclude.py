"""Opt-out by instance, class and qualified-name pattern, in forward and backward graphs."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

import commfuse
from helpers import calls


class RowLinear(nn.Linear):
    """A row-parallel linear: local matmul, then all_reduce; column-parallel grads all_reduce too."""

    def forward(self, x):
        return funcol.all_reduce(super().forward(x), "sum", dist.group.WORLD)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = RowLinear(32, 32, bias=False)

    def forward(self, x):
        return torch.relu(self.proj(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def run(net, backend, train=False):
    from torch._inductor.utils import run_and_get_code

    x = torch.randn(4, 16, 32, requires_grad=train)
    compiled = torch.compile(net, backend=backend)

    def step():
        out = compiled(x)
        if train:
            out.sum().backward()
        return out

    _, codes = run_and_get_code(step)
    return "\n".join(codes)


def fused_modules():
    return sorted(r.module for r in commfuse.report() if r.fused)


def skipped(reason_part):
    return sorted(r.module for r in commfuse.report() if not r.fused and reason_part in r.reason)


def test_nothing_excluded(world2):
    code = run(Net(), commfuse.backend(min_mnk=0))
    assert calls(code, "commfuse.mm_all_reduce") == 3
    assert fused_modules() == ["layers.0.proj", "layers.1.proj", "layers.2.proj"]


def test_exclude_instance(world2):
    net = Net()
    assert commfuse.exclude(net.layers[1]) is net.layers[1]
    assert isinstance(net.layers[1], Block) and type(net.layers[1]).__name__ == "Block"
    code = run(net, commfuse.backend(min_mnk=0))
    assert calls(code, "commfuse.mm_all_reduce") == 2
    assert "_c10d_functional.all_reduce" in code
    assert fused_modules() == ["layers.0.proj", "layers.2.proj"]
    assert skipped("commfuse.exclude()") == ["layers.1.proj"]


def test_exclude_instance_survives_copy_and_pickle(world2):
    net = Net()
    commfuse.exclude(net.layers[0])
    for clone in (copy.deepcopy(net), pickle.loads(pickle.dumps(net))):
        assert type(clone.layers[0]) is type(net.layers[0])  # still marked
        assert clone.layers[0].proj.weight is not net.layers[0].proj.weight
        torch.testing.assert_close(clone.layers[0].proj.weight, net.layers[0].proj.weight)
    commfuse.include(net.layers[0])
    assert type(net.layers[0]) is Block


def test_exclude_class(world2):
    code = run(Net(), commfuse.backend(min_mnk=0, exclude=[RowLinear]))
    assert calls(code, "commfuse.mm_all_reduce") == 0
    assert skipped("excluded class") == ["layers.0.proj", "layers.1.proj", "layers.2.proj"]


@pytest.mark.parametrize("pattern, fused", [
    ("layers.2.*", ["layers.0.proj", "layers.1.proj"]),
    ("layers.0", ["layers.1.proj", "layers.2.proj"]),  # a block excludes everything inside it
    ("*.proj", []),
])
def test_exclude_name(world2, pattern, fused):
    run(Net(), commfuse.backend(min_mnk=0, exclude=[pattern]))
    assert fused_modules() == fused


def test_exclude_applies_to_backward(world2):
    """A column-parallel linear's input grad is all-reduced in backward; opt-out must hold there."""

    class ColGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, g):
            return funcol.all_reduce(g, "sum", dist.group.WORLD)

    class Col(nn.Linear):
        def forward(self, x):
            return super().forward(ColGrad.apply(x))

    class TwoCols(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Col(32, 32, bias=False), Col(32, 32, bias=False)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    net = TwoCols()
    code = run(net, commfuse.backend(min_mnk=0, exclude=["a"]), train=True)
    recs = [r for r in commfuse.report() if r.graph.startswith("backward") and r.module]
    assert {r.module: r.fused for r in recs} == {"b": True, "a": False}, commfuse.report()
    assert calls(code, "commfuse.mm_all_reduce") == 1


def test_exclude_rejects_bad_entries():
    with pytest.raises(TypeError, match="exclude entries"):
        commfuse.backend(exclude=[42])
    with pytest.raises(TypeError, match="nn.Module instance"):
        commfuse.exclude(nn.Linear)
    with pytest.raises(ValueError, match="unknown pattern"):
        commfuse.backend(patterns=["mm_reduce_everything"])


def test_qualified_name_normalisation():
    from commfuse.exclusion import qualified_name

    assert qualified_name("L['self'].layers[0].mlp") == "layers.0.mlp"
    assert qualified_name("L['self']._modules['layers']._modules['3'].attn") == "layers.3.attn"
    assert qualified_name("L['mod'].lin") == "lin"
    assert qualified_name("L['self']") == ""
    # a forward wrapped by a decorator taking *args (transformers), a compiled function's global
    assert qualified_name("L['args'][0].layers.1.lin") == "layers.1.lin"
    assert qualified_name("G['model'].layers[1]._modules['lin']") == "layers.1.lin"
    assert qualified_name("G.model.layers.0") == "layers.0"
    assert qualified_name("L['mods'][1].mlp") == "1.mlp"  # a list of modules keeps its index
    assert qualified_name("G['pair'][0]") == "0"
    # a forward replaced by a closure over the bound method (torchtitan), wrapper modules
    assert qualified_name("L['self']._modules['attention'].forward.__closure__[0].cell_contents"
                          ".__self__._modules['wo']") == "attention.wo"
    assert qualified_name("L['fn'].__closure__[0].cell_contents.layers[0]") == "layers.0"
    assert qualified_name("L['self'].layers[0]._checkpoint_wrapped_module.attn") == "layers.0.attn"
    assert qualified_name("L['self']._orig_mod.layers.1") == "layers.1"
    assert qualified_name("L['self'].forward_.lin") == "forward_.lin"  # only a closure drops its function


def _deco(fn):
    import functools

    @functools.wraps(fn)
    def inner(*args, **kwargs):
        return fn(*args, **kwargs)
    return inner


class DecoratedNet(Net):
    """transformers wraps ``forward`` in decorators taking ``*args``: Dynamo's path then starts at
    ``L['args'][0]``, not ``L['self']``."""

    @_deco
    def forward(self, x):
        return super().forward(x)


def test_exclude_name_under_a_decorated_forward(world2):
    run(DecoratedNet(), commfuse.backend(min_mnk=0, exclude=["layers.1.*"]))
    assert fused_modules() == ["layers.0.proj", "layers.2.proj"]
    assert skipped("excluded name pattern") == ["layers.1.proj"]


def _wrap_forwards_in_closures(net: nn.Module) -> nn.Module:
    """As torchtitan's parallelize does: each block's ``forward`` becomes a closure over the bound
    method, so Dynamo reaches the block's children through ``forward.__closure__``."""
    for block in net.layers:
        def wrap(fn):
            def forward_with_redistribution(*args, **kwargs):
                return fn(*args, **kwargs)
            return forward_with_redistribution
        block.forward = wrap(block.forward)
    return net


@pytest.mark.parametrize("pattern", ["layers.1.proj",
                                     "layers.1.forward.__closure__.0.cell_contents.__self__.proj"],
                         ids=["plain", "full_spelling"])
def test_names_through_closures_are_plain(world2, pattern):
    run(_wrap_forwards_in_closures(Net()), commfuse.backend(min_mnk=0, exclude=[pattern]))
    assert fused_modules() == ["layers.0.proj", "layers.2.proj"]
    assert skipped("excluded name pattern") == ["layers.1.proj"]
    assert all("__closure__" not in r.module for r in commfuse.report()), commfuse.report()
    assert not commfuse.report().notes  # both spellings matched a module


def test_exclude_survives_a_later_class_swap(world2):
    """A parametrization (as FSDP2's fully_shard) swaps the instance's class for a subclass of the
    one it had: an instance excluded before stays excluded; include then says what to do."""
    from torch.nn.utils import parametrize

    class Scale(nn.Module):
        def forward(self, w):
            return 2 * w

    net = Net()
    commfuse.exclude(net.layers[1].proj)
    parametrize.register_parametrization(net.layers[1].proj, "weight", Scale())
    assert type(net.layers[1].proj).__name__ == "ParametrizedRowLinear"
    assert commfuse.exclusion.is_excluded_instance(net.layers[1].proj)
    run(net, commfuse.backend(min_mnk=0))
    assert fused_modules() == ["layers.0.proj", "layers.2.proj"]
    with pytest.raises(TypeError, match="include before that change"):
        commfuse.include(net.layers[1].proj)


def test_a_bare_string_is_one_entry(world2):
    run(Net(), commfuse.backend(min_mnk=0, exclude="layers.2.*", patterns="mm_all_reduce"))
    assert fused_modules() == ["layers.0.proj", "layers.1.proj"]


def test_a_module_list_entry_excludes_its_members(world2):
    """A ModuleList is never called, so never on a module stack: excluding it means its members."""
    net = Net()
    run(net, commfuse.backend(min_mnk=0, exclude=net.layers[1:]))
    assert fused_modules() == ["layers.0.proj"]
    for layer in net.layers:
        commfuse.include(layer)


def test_a_name_pattern_that_matches_no_module_is_reported(world2, caplog):
    """``layer.1.*`` (for ``layers.1.*``) excluded nothing, without a word."""
    with caplog.at_level("WARNING", logger="commfuse"):
        run(Net(), commfuse.backend(exclude=["layer.1.*", "layers.2.*"], min_mnk=0))
    rep = commfuse.report()
    assert len(rep.fused) == 2 and len(rep.skipped) == 1  # layers.2 excluded
    label = rep[0].graph
    assert rep.notes == [f"{label}: exclude pattern 'layer.1.*' matched no module of this graph (close module "
                         "names: layers.1, layers.1.proj, layers.2)"]
    assert "'layer.1.*' matched no module" in caplog.text and "'layers.2.*' matched" not in caplog.text
    assert str(rep).splitlines()[-1] == "  note: " + rep.notes[0]
    assert rep.summary().startswith("commfuse: 2 fused, 1 skipped")
