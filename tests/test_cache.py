"""Compiling the same function twice hits the FX graph cache, and the cached code still calls the
commfuse ops (they are registered on import of the backend); the report says the same on a hit as
on the miss, marked as from the cache, in this process and in another sharing the cache."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
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

        miss = list(commfuse.report())

        torch._dynamo.reset()
        commfuse.clear_report()
        before = CALL_COUNTS["mm_all_reduce"]
        out = torch.compile(f, backend=commfuse.backend(min_mnk=0))(a, w)
        hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
        assert hits >= 1, dict(counters)
        assert CALL_COUNTS["mm_all_reduce"] == before + 1  # the pass did not run, yet the cached code calls the op
        torch.testing.assert_close(out, (a @ w).relu())
        rep = commfuse.report()  # the miss's decisions, read back and marked
        assert [r.cached for r in rep] == [True] and [r.cached for r in miss] == [False]
        assert [dataclasses.replace(r, cached=False) for r in rep] == miss
        assert str(rep).splitlines()[0] == miss[0].line() + " [from the FX graph cache]"
        assert "1 fused, 0 skipped (1 of them from the FX graph cache" in rep.summary()


def test_a_cached_graph_without_its_decisions_says_what_its_code_calls(world2):
    """Where the kept decisions are gone (a remote cache, a cleared directory), the report says what
    the cached code calls rather than nothing."""
    import shutil

    from torch._inductor.runtime.cache_dir_utils import cache_dir

    def f(a, w):
        return funcol.all_reduce(a @ w, "sum", dist.group.WORLD)

    a, w = torch.randn(64, 32), torch.randn(32, 48)
    with torch._inductor.config.patch(fx_graph_cache=True), _fresh_cache()():
        torch.compile(f, backend=commfuse.backend(min_mnk=0))(a, w)
        shutil.rmtree(os.path.join(cache_dir(), "commfuse"))
        torch._dynamo.reset()
        commfuse.clear_report()
        torch.compile(f, backend=commfuse.backend(min_mnk=0))(a, w)
    rep = commfuse.report()
    assert not rep and rep.notes == ["a graph from the FX graph cache calls 1 x mm_all_reduce (its decisions were "
                                     "not kept, so skips are not listed) [from the FX graph cache]"]
    assert rep.summary().startswith("commfuse: no decisions kept for the cached graphs")


_TWO_PROCESSES = textwrap.dedent("""
    import torch, torch.distributed as dist, torch.distributed._functional_collectives as funcol
    from torch.testing._internal.distributed.fake_pg import FakeStore
    import commfuse

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)

    def f(a, w):
        return funcol.all_reduce(a @ w, "sum", dist.group.WORLD).relu()

    a = torch.randn(64, 32, requires_grad=True)
    torch.compile(f, backend=commfuse.backend(min_mnk=0))(a, torch.randn(32, 48)).sum().backward()
    print(commfuse.report())
""")


@pytest.mark.slow
def test_a_second_process_sharing_the_cache_reports_the_first_ones_decisions(tmp_path):
    """Two processes compile the same training step with one Inductor cache directory: the second
    is served from the cache (forward and backward) and its report and ``TORCH_LOGS=commfuse``
    say what the first's did, each line marked."""
    environ = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path), TORCH_LOGS="commfuse")

    def run() -> tuple[list[str], list[str]]:
        done = subprocess.run([sys.executable, "-c", _TWO_PROCESSES], env=environ, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        logged = [line.split("] ", 2)[-1] for line in done.stderr.splitlines() if "commfuse/report.py" in line]
        return done.stdout.splitlines(), logged

    first, first_log = run()
    second, second_log = run()
    mark = " [from the FX graph cache]"
    assert first[0].startswith("FUSED   mm_all_reduce     forward#") and first[1].startswith("skipped")
    assert first[2] == "commfuse: 1 fused, 1 skipped"
    assert second[:2] == [line + mark for line in first[:2]]
    assert second[2] == "commfuse: 1 fused, 1 skipped (2 of them from the FX graph cache, decided when the graph " \
                        "was compiled)"
    assert len(first_log) == 2 and second_log == [line + mark for line in first_log]


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
