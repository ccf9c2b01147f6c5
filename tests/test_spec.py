"""``runtime/spec.py``: one spec per op, and everything that reads an op reads it there."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

from commfuse import patterns
from commfuse.runtime import spec as spec_mod
from commfuse.runtime.paths import REGISTRY, by_op
from commfuse.runtime.spec import SPECS, Arg, Call, OpSpec

ROOT = pathlib.Path(__file__).resolve().parent.parent / "commfuse"
F16 = torch.float16

CALLS = [
    Call("mm_all_reduce", 96, 64, 32, F16, 2, True),
    Call("mm_all_reduce", 5, 16, 8, torch.float32, 4),
    Call("all_gather_mm", 96, 64, 32, F16, 2, True),
    Call("all_gather_mm", 96, 64, 32, F16, 4, False, 1, 3),  # a batch of 3 sequences gathered along dim 1
    Call("mm_reduce_scatter", 96, 64, 32, F16, 2, True),
    Call("mm_reduce_scatter", 96, 64, 32, F16, 4, False, 1, 2),
    Call("scaled_mm_all_reduce", 96, 64, 32, torch.bfloat16, 2, True),  # FP8: the dtype is the output's
    Call("all_gather_scaled_mm", 96, 64, 32, torch.float8_e4m3fn, 4, False, 1, 3),  # the gathered shard's
    Call("scaled_mm_reduce_scatter", 96, 64, 32, torch.float32, 2, False, 1, 2),
    Call("rowwise_scaled_mm_all_reduce", 96, 64, 32, torch.bfloat16, 2, True),
    Call("all_gather_rowwise_scaled_mm", 96, 64, 32, torch.float8_e4m3fn, 4, False, 1, 3),  # FP8 rows gathered
    Call("rowwise_scaled_mm_reduce_scatter", 96, 64, 32, torch.bfloat16, 2, False, 1, 2),
    Call("mm_all_reduce_add_rms_norm", 96, 64, 32, torch.bfloat16, 2, True),
    Call("mm_all_reduce_add_rms_norm", 5, 16, 999, torch.float32, 4),
    Call("mm_reduce_scatter_add_rms_norm", 96, 64, 32, torch.bfloat16, 2, True),
    Call("mm_reduce_scatter_add_rms_norm", 96, 16, 999, torch.float32, 4, False, 1, 2),
]


def test_each_registered_schema_is_its_specs():
    for spec in SPECS.values():
        schema = getattr(torch.ops.commfuse, spec.name).default._schema
        assert str(schema) == f"commfuse::{spec.schema}"
        assert [a.name for a in schema.arguments] == [*spec.Args._fields, "site"]
        assert len(schema.returns) == len(spec.outputs)


@pytest.mark.parametrize("call", CALLS, ids=Call.short)
def test_the_tuners_inputs_make_the_call_they_were_made_for(call):
    """``inputs`` and ``call`` are inverse: what the tuner times is the call it tunes."""
    spec = call.spec

    def rand(*shape):
        return torch.randn(*shape).to(call.dtype)

    args = spec.inputs(call, "g", rand)
    assert isinstance(args, spec.Args)
    assert spec.call(args, call.world) == call
    assert spec.key(args) == spec.key(spec.inputs(call, "other", rand))  # the group is not part of it
    assert call.exchanged_bytes == spec.exchanged(call) * call.itemsize > 0


@pytest.mark.parametrize("call", CALLS, ids=Call.short)
def test_the_tuners_inputs_are_all_on_the_device_rand_makes(call):
    """The tuner makes its inputs on the GPU through ``rand``: a tensor made elsewhere (a CPU
    scale) would fail the candidates' and the reference's first run."""
    args = call.spec.inputs(call, "g", lambda *shape: torch.empty(*shape, device="meta").to(call.dtype))
    devices = {name: t.device.type for name, t in args._asdict().items() if isinstance(t, torch.Tensor)}
    assert set(devices.values()) == {"meta"}, devices


def test_specs_name_their_patterns_and_paths():
    # each pattern makes its op, and its FP8 form's (a _scaled_mm in the matmul's place); the
    # add_rms_norm pattern (no FP8 form) makes the ops of the matmul, all-reduce (or sequence
    # parallelism's reduce-scatter), add and norm
    assert set(s.pattern for s in SPECS.values()) == {p.NAME for p in patterns.ALL}
    products = [p for p in patterns.ALL if hasattr(p, "FP8_NAME")]
    assert [s.name for s in SPECS.values() if s.name not in {p.NAME for p in patterns.ALL}] == [
        *(p.FP8_NAME for p in products), *(p.ROWWISE_NAME for p in products), "mm_all_reduce_add_rms_norm",
        "mm_reduce_scatter_add_rms_norm"]
    assert SPECS["mm_all_reduce_add_rms_norm"].pattern == SPECS["mm_reduce_scatter_add_rms_norm"].pattern == (
        "add_rms_norm")
    for spec in SPECS.values():
        assert REGISTRY[(spec.name, "nccl")] is by_op(spec.name)[0]
        assert all(p.spec is spec for p in by_op(spec.name))
    assert [s.name for s in SPECS.values() if s.graph_lane] == ["mm_all_reduce", "scaled_mm_all_reduce",
                                                                 "mm_all_reduce_add_rms_norm"]
    assert all((s.lane_bytes is not None) == s.graph_lane for s in SPECS.values())


def test_a_spec_for_an_op_to_come_states_its_schema_from_its_layout():
    """An op with two outputs and extra operands (a residual, a norm weight, a float, a flag) and
    FP8 operands (scales, an output dtype, fast accumulation) is a spec like the others."""
    layout = (Arg("a", "Tensor"), Arg("b", "Tensor"), Arg("scale_a", "Tensor"), Arg("scale_b", "Tensor"),
              Arg("residual", "Tensor"), Arg("norm_weight", "Tensor"), Arg("eps", "float"),
              Arg("out_dtype", "ScalarType?"), Arg("group_name", "str"), Arg("use_fast_accum", "bool", "False"))
    base = spec_mod.MM_ALL_REDUCE
    norm = OpSpec(name="mm_all_reduce_rms_norm", args=layout, outputs=("out", "residual_out"),
                  reference=base.reference, pattern="mm_all_reduce", call=base.call, key=base.key,
                  own_size=base.own_size, shared=base.shared, exchanged=base.exchanged, inputs=base.inputs,
                  rows_unit=base.rows_unit)
    assert norm.schema == (
        "mm_all_reduce_rms_norm(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor residual, "
        "Tensor norm_weight, float eps, ScalarType? out_dtype, str group_name, bool use_fast_accum=False, "
        "int site=0) -> (Tensor, Tensor)")
    assert norm.Args._fields == tuple(a.name for a in layout)
    torch._C.parse_schema(f"commfuse::{norm.schema}")  # a schema torch accepts


def test_no_op_is_named_in_a_branch_of_the_run_time():
    """What differs between ops is in their specs: the run-time compares no op to a name."""
    branch = re.compile(r"""\bop\s*(==|!=|\bin\b)\s*[("'\[]|==\s*["'](mm_all_reduce|all_gather_mm|mm_reduce_scatter)""")
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
             for p in sorted((ROOT / "runtime").rglob("*.py")) if p.name != "spec.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if branch.search(line)]
    assert not found, "\n".join(found)
