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
import torch.nn.functional as F
from torch._dynamo.utils import counters

import commfuse
from commfuse.runtime.counters import CALLS


def _fresh_cache():
    from torch._inductor import utils

    return getattr(utils, "fresh_cache", None) or utils.fresh_inductor_cache


@pytest.mark.slow
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
        before = CALLS["mm_all_reduce"]
        out = torch.compile(f, backend=commfuse.backend(min_mnk=0))(a, w)
        hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
        assert hits >= 1, dict(counters)
        assert CALLS["mm_all_reduce"] == before + 1  # the pass did not run, yet the cached code calls the op
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
    import os, torch, torch.distributed as dist, torch.distributed._functional_collectives as funcol
    from torch.testing._internal.distributed.fake_pg import FakeStore
    import commfuse

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    SCALE = float(os.environ["SCALE"])  # a constant of the graph: this test's own cache entries

    def f(a, w):
        return funcol.all_reduce(a @ w, "sum", dist.group.WORLD).relu() * SCALE

    a = torch.randn(64, 32, requires_grad=True)
    torch.compile(f, backend=commfuse.backend(min_mnk=0))(a, torch.randn(32, 48)).sum().backward()
    print(commfuse.report())
""")


@pytest.mark.slow
def test_a_second_process_sharing_the_cache_reports_the_first_ones_decisions():
    """Two processes compile the same training step with one Inductor cache directory: the second
    is served from the cache (forward and backward) and its report and ``TORCH_LOGS=commfuse``
    say what the first's did, each line marked. (The suite's cache directory, whose compiled
    kernels the first process reuses; a constant no other run has makes the first one miss.)"""
    import random

    environ = dict(os.environ, SCALE=repr(random.uniform(1.0, 2.0)), TORCH_LOGS="commfuse")

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
        before = CALLS["mm_all_reduce"]
        torch.compile(f, backend=commfuse.backend(min_mnk=10**9))(a, w)  # must not reuse the fused graph
        assert CALLS["mm_all_reduce"] == before
        assert "below the size threshold" in commfuse.report()[-1].reason


class _GradAllReduce(torch.autograd.Function):
    """Identity forward; its backward all-reduces the gradient (a column-parallel layer's input)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return funcol.all_reduce(grad, "sum", dist.group.WORLD)


def _compile_keeping(fn, backend):
    """``torch.compile(fn)`` through ``backend``, and the list of callables the backend returned."""
    returned = []

    def keep(gm, example_inputs, **kwargs):
        returned.append(backend(gm, example_inputs, **kwargs))
        return returned[-1]

    return torch.compile(fn, backend=keep, fullgraph=True), returned


def _caches(aot: bool = False):
    """Inductor's FX graph cache on (fresh); AOTAutograd's on only if ``aot``: without it each graph
    is looked up on its own, the backward when autograd first needs it."""
    import contextlib

    stack = contextlib.ExitStack()
    stack.enter_context(torch._inductor.config.patch(fx_graph_cache=True))
    stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=aot))
    stack.enter_context(_fresh_cache()())
    return stack


def test_a_backward_graph_from_the_cache_is_watched(world2):
    """The backward graph is compiled lazily, at the first backward: one that comes from the FX
    graph cache (the pass did not run: its groups are unknown) is watched for every group, even
    when the forward graph was compiled afresh."""
    from commfuse.runtime import groups

    backend = commfuse.backend(min_mnk=0, launch_bound_bytes=0)
    x, w = torch.randn(8, 32, requires_grad=True), torch.randn(24, 32, requires_grad=True)
    with _caches():
        compiled, _ = _compile_keeping(lambda x, w: F.linear(_GradAllReduce.apply(x), w), backend)
        compiled(x, w).sum().backward()
        assert [r.graph.startswith("backward") for r in commfuse.report().fused] == [True]
        torch._dynamo.reset()
        counters.clear()
        # another forward graph (a miss), the same backward graph (a hit)
        compiled, returned = _compile_keeping(lambda x, w: (F.linear(_GradAllReduce.apply(x), w),
                                                            (x.detach() * 2).sum()), backend)
        out = compiled(x, w)
        assert counters["inductor"]["fxgraph_cache_miss"] == 1 and not counters["inductor"]["fxgraph_cache_hit"]
        out[0].sum().backward()
        assert counters["inductor"]["fxgraph_cache_hit"] == 1
    assert returned[-1].commfuse_watch.every
    group = groups.get(dist.group.WORLD.group_name)
    group.broken = "group refuses calls"
    try:
        with pytest.raises(RuntimeError, match="group refuses calls"):
            compiled(x, w)
    finally:
        commfuse.release_all()


@pytest.mark.parametrize("aot", [False, True], ids=["fx-cache", "aot-cache"])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_a_cached_graph_is_watched_only_if_its_code_calls_commfuse_ops(world2, aot, fused):
    """A graph a cache served (Inductor's FX graph cache, alone or through AOTAutograd's) is looked
    at as it loads: one whose code calls commfuse ops reads every group's error word after its
    runs (the pass did not run: its groups are unknown), one that calls none reads no word, so a
    broken group elsewhere does not make its runs raise."""
    from commfuse.runtime import groups

    backend = commfuse.backend(min_mnk=0, launch_bound_bytes=0)
    x, w = torch.randn(8, 32, requires_grad=True), torch.randn(24, 32, requires_grad=True)

    def f(x, w):
        y = F.linear(x, w)
        return funcol.all_reduce(y, "sum", dist.group.WORLD) if fused else torch.relu(y)

    with _caches(aot):
        for _ in range(2):
            torch._dynamo.reset()
            counters.clear()
            compiled, returned = _compile_keeping(f, backend)
            compiled(x, w).sum().backward()
        assert counters["inductor"]["fxgraph_cache_hit"] == 2  # forward and backward
        assert counters["aot_autograd"]["autograd_cache_hit"] == int(aot)
    watch = returned[-1].commfuse_watch  # (wrapped: a backward graph was to come)
    assert watch.every == fused and not watch.names
    group = groups.get(dist.group.WORLD.group_name)
    group.broken = "group refuses calls"
    try:
        if fused:
            with pytest.raises(RuntimeError, match="group refuses calls"):
                compiled(x, w)
        else:
            compiled(x, w)
    finally:
        commfuse.release_all()
