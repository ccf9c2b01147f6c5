"""A dynamic token dimension on the 2 GPUs: one compiled graph serves M from 1 to 16384 (the
dispatch picks one-shot or a fused kernel per call, the workspace grows collectively when a
larger call comes), and every result equals the fp32 reference of the unfused computation."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._dynamo.utils import counters

import commfuse
from commfuse import check_errors
from commfuse.runtime import plans
from commfuse.runtime.counters import PATHS
from gpu_util import gather_all, relerr, start_over, workspaces

pytestmark = pytest.mark.gpu


def test_one_graph_for_m_from_1_to_16384(nccl, monkeypatch):
    g = nccl
    torch.manual_seed(0)  # the gathered product's weight: the same on every rank
    w1 = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16) / 32
    # the reduced products' weights differ per rank (row-parallel shards), so the sums' terms do:
    # a path that ignored its peer's partial would not match
    torch.manual_seed(1 + dist.get_rank())
    w2 = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16) / 32
    w3 = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16) / 32
    w2_all, w3_all = [w.float() for w in gather_all(w2)], [w.float() for w in gather_all(w3)]

    def f(x):
        h = funcol.all_gather_tensor(x, 0, g) @ w1
        return (funcol.all_reduce(torch.relu(h) @ w2, "sum", g),
                funcol.reduce_scatter_tensor(h @ w3, "sum", 0, g))

    start_over()  # start from the first allocation: the test shows the growth
    monkeypatch.setattr(plans, "_planned", {})  # (no size planned by earlier tests' graphs)
    torch._dynamo.reset()
    commfuse.clear_report()
    compiled = torch.compile(f, backend=commfuse.backend())
    counters.clear()
    before = PATHS.copy()
    torch.manual_seed(10 + dist.get_rank())
    size = {}
    for m in (1, 3, 64, 1000, 4096, 16384, 2, 8192):
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        torch._dynamo.decorators.mark_unbacked(x, 0)
        with torch.no_grad():
            ar, rs = compiled(x)
        check_errors()
        h = (torch.cat(gather_all(x)).float() @ w1.float()).bfloat16().float()  # the same on every rank
        want_ar = sum(torch.relu(h) @ w for w in w2_all)
        want_rs = sum(h @ w for w in w3_all)[dist.get_rank() * m:(dist.get_rank() + 1) * m]
        assert ar.shape == (2 * m, 1024) and rs.shape == (m, 1024)
        assert relerr(ar, want_ar) < 2e-2, f"M={m}: all_reduce"
        assert relerr(rs, want_rs) < 2e-2, f"M={m}: reduce_scatter"
        size[m] = max(ws.data_bytes for ws in workspaces())
    assert counters["stats"]["unique_graphs"] == 1
    assert len(commfuse.report().fused) == 3
    used = PATHS - before
    assert used["mm_all_reduce:fused"] > 0, used  # the large calls took the fused kernel
    assert len({k for k in used if k.startswith("mm_all_reduce:")}) >= 2, used  # and others not
    assert size[16384] > size[64]  # grew when the large calls came (the first allocation is 16 MiB)
    assert size[8192] == size[16384]  # and serves the smaller ones after
