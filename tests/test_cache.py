"""Compiling the same function twice hits the FX graph cache, and the cached code still calls the
commfuse ops (they are registered on import of the backend)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._dynamo.utils import counters

import commfuse
from commfuse.ops import CALL_COUNTS


def _fresh_cache():
    from torch._inductor import utils

    return getattr(utils, "fresh_cache", None) or utils.fresh_inductor_cache


def test_fx_graph_cache_hit_still_fuses(world2):
    def f(a, w):
        return funcol.all_reduce(a @ w, "sum", dist.group.WORLD).relu()

    a, w = torch.randn(64, 32), torch.randn(32, 48)
    with torch._inductor.config.patch(fx_graph_cache=True), _fresh_cache()():
        counters.clear()
        torch.compile(f, backend=commfuse.backend(min_mnk=0))(a, w)
        assert counters["inductor"]["fxgraph_cache_miss"] == 1
        assert len(commfuse.report().fused) == 1

        torch._dynamo.reset()
        commfuse.clear_report()
        before = CALL_COUNTS["mm_all_reduce"]
        out = torch.compile(f, backend=commfuse.backend(min_mnk=0))(a, w)
        hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
        assert hits >= 1, dict(counters)
        assert not commfuse.report()  # the pass did not run again...
        assert CALL_COUNTS["mm_all_reduce"] == before + 1  # ...yet the cached code calls the op
        torch.testing.assert_close(out, (a @ w).relu())


def test_different_settings_do_not_share_cache_entries(world2):
    def f(a, w):
        return funcol.all_reduce(a @ w, "sum", dist.group.WORLD)

    a, w = torch.randn(64, 32), torch.randn(32, 48)
    with torch._inductor.config.patch(fx_graph_cache=True), _fresh_cache()():
        torch.compile(f, backend=commfuse.backend(min_mnk=0))(a, w)
        torch._dynamo.reset()
        before = CALL_COUNTS["mm_all_reduce"]
        torch.compile(f, backend=commfuse.backend(min_mnk=10**9))(a, w)  # must not reuse the fused graph
        assert CALL_COUNTS["mm_all_reduce"] == before
        assert "below the size threshold" in commfuse.report()[-1].reason
