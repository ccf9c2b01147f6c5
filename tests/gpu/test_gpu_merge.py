"""Merged input-gradient sums (``merge_sums``) in a real training step: the compiled backward of
the DTensor and sequence-parallel transformer gives the gradients of an fp32 eager reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import commfuse
from commfuse.demo import transformer as demo
from gpu_util import poison, relerr

pytestmark = pytest.mark.gpu


def _grads(model, x, run=None):
    """Input and parameter gradients of one step; ``run``: what computes it (a compiled model)."""
    x = x.detach().clone().requires_grad_(True)
    (model if run is None else run)(x).float().pow(2).mean().backward()
    grads = {"x": x.grad}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = g.to_local() if hasattr(g, "to_local") else g
    return grads


def _model(kind, dtype):
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)  # the same weights on every rank before sharding
    cfg = demo.Config(dim=1024, n_layers=1, n_heads=8, n_kv_heads=4, ffn_dim=2048)
    model = demo.Transformer(cfg).to(device="cuda", dtype=dtype)
    return demo.parallelize_dtensor(model, init_device_mesh("cuda", (dist.get_world_size(),)),
                                    sequence_parallel=kind == "sp"), cfg


@pytest.mark.parametrize("kind", ["dtensor", "sp"])
def test_merged_backward_matches_fp32(nccl, kind):
    world, rank = dist.get_world_size(), dist.get_rank()
    seq = 1024 // world if kind == "sp" else 1024
    model, cfg = _model(kind, torch.bfloat16)
    reference = _model(kind, torch.float32)[0]
    torch.manual_seed(1 + (rank if kind == "sp" else 0))  # after the models: sequence parallel, each
    x = torch.randn(2, seq, cfg.dim, device="cuda", dtype=torch.bfloat16)  # rank its own shard
    want = _grads(reference, x.float())
    eager = _grads(model, x)
    for p in model.parameters():
        p.grad = None
    commfuse.clear_report()
    torch._dynamo.reset()
    poison()
    got = _grads(model, x, torch.compile(model, backend="commfuse"))
    merged = commfuse.report().merged
    # backward: q/k/v and w1/w3 input gradients, each set one matmul reduced once, and fused
    # (sequence parallel: the wo/w2 input gradients' all-gathers besides)
    assert sorted(len(r.matmul.split("+")) for r in merged) == [2, 3], commfuse.report()
    fused = [r.pattern for r in commfuse.report().fused if r.graph.startswith("backward")]
    assert len(fused) == (4 if kind == "sp" else 2), commfuse.report()
    for name, ref in want.items():
        err, base = relerr(got[name], ref), relerr(eager[name], ref)
        assert err < max(2 * base, 1e-2), f"{name}: commfuse {err:.2e}, bf16 eager {base:.2e}"
