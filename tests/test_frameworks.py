"""Graphs that tensor-parallel frameworks produce with their own code fuse, on two gloo ranks.

torchtitan's Llama 3 debugmodel (one block) split by its own TP plan with and without sequence
parallelism, and transformers' Llama and Qwen3 split by their own TP plans at load time
(``from_pretrained(..., distributed_config=DistributedConfig(tp_size=2))``). Each block is
compiled with ``backend="commfuse"`` as README's recipes say; per block, how many collectives fuse
forward and backward is asserted, and the outputs and every gradient must equal eager's.

Needs the ``test`` extra's torchtitan and transformers (skipped without them).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from helpers import spawn

WORLD = 2


def _init(rank: int, init_file: str) -> None:
    import datetime

    os.environ["COMMFUSE_LAUNCH_BOUND_BYTES"] = "0"  # the tiny shapes would all be launch-bound
    torch._inductor.config.fx_graph_cache = False  # every compile runs the pass, so the report is whole
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _same(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> None:
    got, want = _local(got).double(), _local(want).double()
    err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    assert err < rtol, f"{name}: relative error {err:.2e} against eager (rank {dist.get_rank()})"


def _eager_then_compiled(model, blocks, run) -> None:
    """``run()`` (a forward and backward of ``model``) eagerly, then with each of ``blocks``
    compiled by commfuse; outputs and every parameter's gradient must agree."""
    import commfuse

    def step():
        out = run()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return out.detach(), grads

    want, want_grads = step()
    commfuse.clear_report()
    torch._dynamo.reset()
    for block in blocks:
        block.compile(backend="commfuse", fullgraph=True)
    got, got_grads = step()
    _same("output", got, want)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        _same(f"gradient of {name}", got_grads[name], want_grads[name])


def _counts() -> dict:
    """{"forward"|"backward": (fused collectives per pattern, merged sums)} of the one block's graphs."""
    import commfuse

    rep = commfuse.report()
    out = {}
    for side in ("forward", "backward"):
        fused = sorted(r.pattern for r in rep.fused if r.graph.startswith(side))
        merged = sum(1 for r in rep.merged if r.graph.startswith(side))
        skipped = [f"{r.collective}: {r.reason}" for r in rep.skipped if r.graph.startswith(side)]
        out[side] = (fused, merged, skipped)
    return out


# ---- torchtitan ------------------------------------------------------------------------------------

#: Per backend and sequence parallelism: (forward, backward) fused collectives of one block and the
#: merged sums of its backward. With sequence parallelism every block runs 4 collectives each way:
#: the all-gather before wqkv and before w1/w3, the reduce-scatter after wo and w2 (forward), and
#: their mirror images (backward), where the w1/w3 input gradients are summed, merged, then fused.
#: (Without it the plan is the plain Colwise/Rowwise split, whose all-reduces transformers' plans
#: below and test_dtensor.py cover.)
TORCHTITAN_EXPECTED = {
    ("spmd_types", True): ((["all_gather_mm"] * 2 + ["mm_reduce_scatter"] * 2,
                            ["all_gather_mm"] * 2 + ["mm_reduce_scatter"] * 2), 1),
    ("full_dtensor", True): ((["all_gather_mm"] * 2 + ["mm_reduce_scatter"] * 2,
                              ["all_gather_mm"] * 2 + ["mm_reduce_scatter"] * 2), 1),
}


def _sdpa_instead_of_flex(q, k, v, *, block_mask=None, scale=None, enable_gqa=False, **_):
    """FlexAttention has no backward on the CPU; the debugmodel's masks (positions 0..S-1, one
    document) are causal, so plain causal attention computes the same. The collectives, what this
    test is about, are in the linears around it."""
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa), None


def _torchtitan_worker(rank: int, init_file: str) -> None:
    _init(rank, init_file)
    import torchtitan.distributed.parallel_dims as titan_dims
    from torchtitan.distributed import ParallelDims, full_dtensor
    from torchtitan.distributed import utils as titan_utils
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    FlexAttention._compiled_flex_attn = staticmethod(_sdpa_instead_of_flex)
    titan_dims.device_type = "cpu"  # without an accelerator it would build CUDA meshes for DTensor
    for (backend, sp), ((fwd, bwd), merged) in TORCHTITAN_EXPECTED.items():
        titan_utils.set_spmd_backend(backend)
        config = model_registry("debugmodel").model
        config.layers = config.layers[:1]
        set_llama3_sharding_config(config, enable_sp=sp)
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=WORLD, pp=1, ep=1, world_size=WORLD,
                            spmd_backend=backend)
        dims.build_mesh()
        torch.manual_seed(0)  # the same weights on every rank before they are split
        model = config.build()
        model.init_weights(buffer_device=None)
        model.parallelize(dims)
        ids = torch.randint(0, config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
        positions = torch.arange(64).expand(2, 64)
        masks = model.get_attention_masks(positions=positions)
        if backend == "spmd_types":
            ids, _, _ = annotate_input_spmd_types(dims, ids, ids.clone(), {"positions": positions})
        elif backend == "full_dtensor":
            ids, _, extra = full_dtensor.parallelize_inputs(dims, ids, ids.clone(), {"positions": positions})
            positions = extra["positions"]
        context = titan_utils.get_spmd_context(parallel_dims=dims)

        def run():
            with context():
                out = model(ids, positions=positions, attention_masks=masks)
                out.float().pow(2).mean().backward()
            return out

        _eager_then_compiled(model, list(model.layers.values()), run)
        counts = _counts()
        where = f"torchtitan {backend} sp={sp}"
        assert counts["forward"] == (fwd, 0, []), (where, counts)
        assert counts["backward"] == (bwd, merged, []), (where, counts)
        import commfuse

        assert all("__closure__" not in r.module for r in commfuse.report()), commfuse.report()
        assert {r.module for r in commfuse.report().fused if r.graph.startswith("forward")} >= {
            "attention.wo", "feed_forward.w2"}, commfuse.report()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="needs torchtitan")
def test_torchtitan_llama3_debugmodel_tp_fuses_every_collective_of_a_block():
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_torchtitan_worker, args=(os.path.join(tmp, "rendezvous"),), nprocs=WORLD)


# ---- transformers ----------------------------------------------------------------------------------

#: Per model: forward, backward fused collectives of one decoder layer, merged backward sums. Forward:
#: the all-reduces after o_proj and down_proj. Backward: q/k/v and gate/up input gradients, each
#: set's all-reduced partials merged into one matmul, then fused.
TRANSFORMERS_EXPECTED = {
    "LlamaConfig": (["mm_all_reduce"] * 2, ["mm_all_reduce"] * 2, 2),
    # q_norm/k_norm: replicated weights, their gradients all-reduced outside the graph
    "Qwen3Config": (["mm_all_reduce"] * 2, ["mm_all_reduce"] * 2, 2),
}


def _transformers_worker(rank: int, init_file: str, folder: str) -> None:
    _init(rank, init_file)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    for name, (fwd, bwd, merged) in TRANSFORMERS_EXPECTED.items():
        config = getattr(transformers, name)(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                             num_key_value_heads=2, head_dim=16, num_hidden_layers=1,
                                             vocab_size=256)
        path = os.path.join(folder, name)
        if rank == 0:  # a checkpoint of random weights: the library's TP applies at load time
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(config).save_pretrained(path)
        dist.barrier()
        model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=WORLD),
                                                     dtype=torch.float32)
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))

        def run():
            out = model(ids).logits
            out.float().pow(2).mean().backward()
            return out

        _eager_then_compiled(model, list(model.model.layers), run)
        counts = _counts()
        assert counts["forward"] == (fwd, 0, []), (name, counts)
        assert counts["backward"] == (bwd, merged, []), (name, counts)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("transformers", "accelerate")),
                    reason="needs transformers and accelerate")
def test_transformers_own_tp_plans_fuse_every_collective_of_a_layer():
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_transformers_worker, args=(os.path.join(tmp, "rendezvous"), tmp), nprocs=WORLD)
