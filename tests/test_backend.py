"""The backend: entry-point discovery, chaining a user's post-grad pass, the pass's cache id."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._inductor.custom_graph_pass import CustomGraphPass

import commfuse
from commfuse.config import Settings
from commfuse.inductor_plugin import CommfusePass
from helpers import calls, compile_code


@pytest.mark.slow
def test_backend_by_name_without_import():
    """``backend="commfuse"`` resolves through the torch_dynamo_backends entry point."""
    script = textwrap.dedent("""
        import sys, torch, torch.distributed as dist
        import torch.distributed._functional_collectives as funcol
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        assert "commfuse" not in sys.modules
        f = lambda a, w: funcol.all_reduce(a @ w, "sum", dist.group.WORLD)
        a, w = torch.randn(64, 128), torch.randn(128, 64)
        torch._inductor.config.fx_graph_cache = False
        out = torch.compile(f, backend="commfuse")(a, w)
        torch.testing.assert_close(out, a @ w)
        import commfuse
        print("fused", len(commfuse.report().fused), "calls", commfuse.runtime.counters.CALLS["mm_all_reduce"])
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd="/", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fused 1 calls 1" in proc.stdout


class RecordingPass(CustomGraphPass):
    def __init__(self):
        self.graphs = 0

    def __call__(self, graph):
        self.graphs += 1
        # Proof that it ran before commfuse: the all_reduce is still in the graph.
        assert any(n.target is torch.ops._c10d_functional.all_reduce.default for n in graph.nodes)

    def uuid(self):
        return "recording-pass-v1"


def test_user_post_grad_pass_is_chained(world2):
    user = RecordingPass()
    a, w = torch.randn(64, 32), torch.randn(32, 48)
    with torch._inductor.config.patch(post_grad_custom_post_pass=user):
        _, code = compile_code(lambda a, w: funcol.all_reduce(a @ w, "sum", dist.group.WORLD), a, w)
    assert user.graphs == 1
    assert calls(code, "commfuse.mm_all_reduce") == 1


def test_uuid_tracks_settings_and_chain():
    base = CommfusePass(Settings())
    assert base.uuid() == CommfusePass(Settings()).uuid() is not None
    assert base.uuid() != CommfusePass(Settings(min_mnk=1)).uuid()
    assert base.uuid() != CommfusePass(Settings(patterns=("mm_all_reduce",))).uuid()
    assert base.uuid() != CommfusePass(Settings(), chained=RecordingPass()).uuid()
    assert CommfusePass(Settings(), chained=lambda g: None).uuid() is None  # plain callable: no cache
    assert CommfusePass(Settings(exclude_names=("layers.0",))).uuid() is None


def test_inductor_config_cannot_replace_the_pass():
    with pytest.raises(ValueError, match="post_grad_custom_post_pass"):
        commfuse.backend(inductor_config={"post_grad_custom_post_pass": None})


def test_settings_validation():
    with pytest.raises(ValueError, match="min_mnk"):
        Settings(min_mnk=-1)
    assert Settings.build(exclude=["a.*", torch.nn.Linear]).exclude_names == ("a.*",)


@pytest.mark.parametrize("kwargs", [dict(min_mnk="big"), dict(min_mnk=-1), dict(launch_bound_bytes=-5),
                                    dict(launch_bound_bytes=1.5), dict(min_mnk=True)])
def test_backend_sizes_must_be_whole_numbers(kwargs):
    """A negative launch bound fused every size, a string minimum failed inside ``int()``."""
    with pytest.raises(ValueError, match=f"commfuse.backend: {next(iter(kwargs))} must be a whole number"):
        commfuse.backend(**kwargs)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(tune=True), TypeError, "commfuse.backend: tune must be a str, one of 'off', 'cache', 'first-use'; got True"),
    (dict(tune=1), TypeError, "commfuse.backend: tune must be a str, one of 'off', 'cache', 'first-use'; got 1"),
    (dict(tune=["cache"]), TypeError, "commfuse.backend: tune must be a str"),
    (dict(tune="always"), ValueError, "commfuse.backend: tune='always' is not one of 'off', 'cache', 'first-use'"),
    (dict(patterns=5), TypeError, "commfuse.backend: patterns must be a list of pattern names"),
    (dict(patterns=[Settings]), TypeError, "commfuse.backend: patterns must name patterns as str"),
    (dict(patterns=["mm_allreduce"]), ValueError,
     "commfuse.backend: patterns has an unknown pattern 'mm_allreduce'; did you mean 'mm_all_reduce'?"),
    (dict(mode=1), TypeError, "commfuse.backend: mode must be a str"),
])
def test_backend_arguments_are_checked_by_type_and_value(kwargs, error, message):
    """``tune=True``, ``1`` and ``['cache']`` acted as ``"cache"``; ``tune='always'`` was refused
    naming ``COMMFUSE_TUNE``, which the caller never set."""
    from commfuse import env

    before = env.current().tune
    with pytest.raises(error) as info:
        commfuse.backend(**kwargs)
    assert str(info.value).startswith(message), str(info.value)
    assert "COMMFUSE_" not in str(info.value)
    assert env.current().tune == before  # a refused tune= set nothing


def test_a_backend_with_no_patterns_warns_at_the_callers_line():
    with pytest.warns(UserWarning, match=r"patterns=\[\] enables no rewrite: this backend fuses nothing") as got:
        built = commfuse.backend(patterns=[])
    assert built.settings.patterns == ()
    assert [w.filename for w in got] == [__file__]


class ConfigProbe(CustomGraphPass):
    """Records the Inductor settings in force while the post-grad passes run."""

    def __init__(self):
        self.seen = []

    def __call__(self, graph):
        cfg = torch._inductor.config
        self.seen.append((cfg.triton.cudagraphs, cfg.epilogue_fusion))

    def uuid(self):
        return "config-probe-v1"


def _all_reduced_mm(a, w):
    return funcol.all_reduce(a @ w, "sum", dist.group.WORLD)


@pytest.mark.parametrize("compile_kwargs, want", [
    (dict(), (False, True)),
    (dict(mode="reduce-overhead"), (True, True)),
    (dict(options={"triton.cudagraphs": True, "epilogue-fusion": False}), (True, False)),
])
def test_torch_compile_mode_and_options_reach_inductor(world2, monkeypatch, compile_kwargs, want):
    """``torch.compile`` passes ``mode`` and ``options`` to a custom backend as keywords: they
    failed with a TypeError at the first call. The launch-bound 128 KiB output fuses only where
    the CUDA-graph setting reached the pass."""
    monkeypatch.setenv("COMMFUSE_LAUNCH_BOUND_BYTES", str(1 << 20))
    probe = ConfigProbe()
    a, w = torch.randn(256, 64), torch.randn(64, 128)
    with torch._inductor.config.patch(post_grad_custom_post_pass=probe):
        out = torch.compile(_all_reduced_mm, backend="commfuse", fullgraph=True, **compile_kwargs)(a, w)
    torch.testing.assert_close(out, a @ w)
    assert probe.seen == [want]
    cudagraphs = want[0]
    assert len(commfuse.report().fused) == (1 if cudagraphs else 0)
    assert cudagraphs or "launch-bound" in commfuse.report()[0].reason


def test_torch_compile_options_win_over_the_backends_mode(world2):
    probe = ConfigProbe()
    backend = commfuse.backend(min_mnk=0, mode="reduce-overhead")
    with torch._inductor.config.patch(post_grad_custom_post_pass=probe):
        torch.compile(_all_reduced_mm, backend=backend, options={"triton.cudagraphs": False})(
            torch.randn(64, 32), torch.randn(32, 48))
    assert probe.seen == [(False, True)]
    assert len(commfuse.report().fused) == 1


@pytest.mark.parametrize("compile_kwargs, message", [
    (dict(options={"no_such_key": 1}), "unknown Inductor option 'no_such_key' in torch.compile(options=...)"),
    (dict(options={"triton.cudagraph": True}),
     "unknown Inductor option 'triton.cudagraph' in torch.compile(options=...); did you mean 'triton.cudagraphs'"),
    (dict(mode="reduce-overheads"), "unknown mode 'reduce-overheads' in torch.compile(mode=...); Inductor's modes:"),
])
def test_torch_compile_unknown_option_or_mode_is_named_before_compiling(world2, monkeypatch, compile_kwargs,
                                                                         message):
    from torch._inductor import compile_fx

    def not_reached(*args, **kwargs):
        raise AssertionError("compile_fx ran")

    monkeypatch.setattr(compile_fx, "compile_fx", not_reached)
    with pytest.raises(Exception, match=re.escape(message)) as info:
        torch.compile(_all_reduced_mm, backend="commfuse", **compile_kwargs)(torch.randn(64, 32), torch.randn(32, 48))
    inner = getattr(info.value, "inner_exception", info.value)  # Dynamo wraps backend errors
    assert isinstance(inner, ValueError) and "\n" not in str(inner)


def test_backend_names_an_unknown_inductor_config_key_when_built():
    with pytest.raises(ValueError, match=r"^commfuse: unknown Inductor option 'no_such_key' in "
                                         r"commfuse.backend\(inductor_config=...\)$"):
        commfuse.backend(inductor_config={"no_such_key": 1})
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        commfuse.backend(mode="fast")
    assert commfuse.backend(mode="max-autotune", inductor_config={"max-autotune": False}).inductor_config == {
        "max_autotune": False, "triton.cudagraphs": True, "coordinate_descent_tuning": True}
