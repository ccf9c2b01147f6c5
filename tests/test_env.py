"""The environment settings' parsers (``commfuse/env.py``): a value they do not understand raises
naming the variable, instead of being read as the default."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch.fx as fx

from commfuse import config, env
from commfuse.kernels import dispatch, fused_all_reduce, sync, verify

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("value, want", [("1", True), ("true", True), (" On ", True), ("YES", True),
                                         ("0", False), ("false", False), ("off", False), ("no", False)])
def test_switch_words(monkeypatch, value, want):
    monkeypatch.setenv("COMMFUSE_VERIFY", value)
    assert env.flag("COMMFUSE_VERIFY", not want) is want
    assert verify.enabled() is want


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_setting_is_the_default(monkeypatch, value):
    monkeypatch.setenv("COMMFUSE_MERGE_SUMS", value)
    monkeypatch.setenv("COMMFUSE_AR_COPY_LAG", value)
    monkeypatch.setenv("COMMFUSE_FUSED_STAGGER_US", value)
    assert config.merge_sums_allowed()
    assert fused_all_reduce.copy_lag(10) == 40
    assert fused_all_reduce.stagger_ns(False, 2, 1) == fused_all_reduce.STAGGER_US * 1000


def test_switches_that_were_read_as_the_default(monkeypatch):
    """``false`` turned merging off only as ``0`` did, ``true`` left the check off: no more."""
    monkeypatch.setenv("COMMFUSE_MERGE_SUMS", "false")
    assert not config.merge_sums_allowed()
    monkeypatch.setenv("COMMFUSE_VERIFY", "true")
    assert verify.enabled()
    monkeypatch.setenv("COMMFUSE_RS_PULL", "2")  # any word turned the pull on
    with pytest.raises(ValueError, match="COMMFUSE_RS_PULL='2' is not a switch"):
        dispatch.scatter_pull()


@pytest.mark.parametrize("name, value, message", [
    ("COMMFUSE_LAUNCH_BOUND_BYTES", "1MiB", "is not a whole number"),
    ("COMMFUSE_LAUNCH_BOUND_BYTES", "-1", "must be at least 0"),
    ("COMMFUSE_CE_CHUNKS", "0", "must be at least 1"),
    ("COMMFUSE_TIMEOUT_S", "0", "must be above 0"),
    ("COMMFUSE_TIMEOUT_S", "inf", "must be a finite number"),
    ("COMMFUSE_TIMEOUT_S", "10m", "is not a number"),
    ("COMMFUSE_AR_COPY_LAG", "-1", "must be at least 0"),
    ("COMMFUSE_FAST_LAUNCH", "off-ish", "is not a switch"),
])
def test_bad_values_raise_naming_the_variable(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(name) + ".*" + re.escape(message)):
        env.validate()


def test_readers_check_their_own_values(monkeypatch):
    monkeypatch.setenv("COMMFUSE_TIMEOUT_S", "-5")
    with pytest.raises(ValueError, match="COMMFUSE_TIMEOUT_S"):
        sync.timeout_ns()
    monkeypatch.setenv("COMMFUSE_TIMEOUT_S", "2.5")
    assert sync.timeout_ns() == 2_500_000_000
    monkeypatch.setenv("COMMFUSE_LAUNCH_BOUND_BYTES", "4096")
    assert config.default_launch_bound_bytes() == 4096
    monkeypatch.setenv("COMMFUSE_OVERLAP", "4x0")
    with pytest.raises(ValueError, match="COMMFUSE_OVERLAP='4x0' is not CxP"):
        dispatch.overlap_config(1024)
    monkeypatch.setenv("COMMFUSE_OVERLAP", "2X16")
    assert dispatch.overlap_config(1024) == (2, 16)


def test_the_graph_pass_names_a_bad_setting_before_any_rewrite(monkeypatch):
    """A malformed size failed inside the sum merging, whose message blamed the merging."""
    from commfuse.inductor_plugin import graph_pass

    monkeypatch.setenv("COMMFUSE_LAUNCH_BOUND_BYTES", "1MiB")
    graph = fx.Graph()
    graph.output(graph.placeholder("x"))
    with pytest.raises(ValueError, match="COMMFUSE_LAUNCH_BOUND_BYTES='1MiB' is not a whole number"):
        graph_pass.rewrite(graph, config.Settings())


def test_every_setting_read_through_the_parsers_is_validated_and_documented():
    """The names the code passes to ``env.flag`` / ``integer`` / ``number`` are the ones
    ``validate`` checks, and README.md names each."""
    read = set()
    for path in (ROOT / "commfuse").rglob("*.py"):
        read |= set(re.findall(r'env\.(?:flag|integer|number)\(\s*"(COMMFUSE_\w+)"', path.read_text()))
    checked = set(env.SWITCHES) | set(env.INTEGERS) | set(env.NUMBERS)
    assert read == checked, (sorted(read - checked), sorted(checked - read))
    readme = (ROOT / "README.md").read_text()
    assert not [name for name in checked if name not in readme]


@pytest.mark.parametrize("name, value", [
    ("COMMFUSE_LOG", "verbose"), ("COMMFUSE_SYMM_PROVIDER", "nvshmem"), ("COMMFUSE_TILE_CONFIG", "128by256"),
    ("COMMFUSE_SPLIT_K_LL", "maybe"), ("COMMFUSE_AG_PUSH", "gpu"), ("COMMFUSE_AG_LOCAL", "cpy"),
    ("COMMFUSE_CE_STREAMS", "4"), ("COMMFUSE_CE_TAIL", "nccl"), ("COMMFUSE_OVERLAP", "4by32"),
    ("COMMFUSE_ALGO", "fastest"),
])
def test_named_choices_are_validated_at_compile_time(monkeypatch, name, value):
    """Settings that name a value fail in ``validate`` (the graph pass), naming the variable,
    not first inside a call on GPUs (``COMMFUSE_OVERLAP`` was read inside the call's exchange,
    where an error marks the workspace broken) or never on the CPU."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        env.validate()


def test_the_split_k_ll_setting_is_a_switch(monkeypatch):
    monkeypatch.setenv("COMMFUSE_SPLIT_K_LL", "true")
    assert dispatch.split_k_ll() is True
    monkeypatch.setenv("COMMFUSE_SPLIT_K_LL", "0")
    assert dispatch.split_k_ll() is False
    monkeypatch.delenv("COMMFUSE_SPLIT_K_LL")
    assert dispatch.split_k_ll() is None
    env.validate()


def test_the_backend_names_a_bad_setting_when_built(monkeypatch):
    """It failed only at the first compile, inside a long traceback."""
    import commfuse

    monkeypatch.setenv("COMMFUSE_TIMEOUT_S", "10m")
    with pytest.raises(ValueError, match=r"^commfuse: COMMFUSE_TIMEOUT_S='10m' is not a number$"):
        commfuse.backend()
    monkeypatch.setenv("COMMFUSE_TIMEOUT_S", "30")
    monkeypatch.setenv("COMMFUSE_CE_TAIL", "nccl")
    with pytest.raises(ValueError, match="COMMFUSE_CE_TAIL"):
        commfuse.backend()


def test_an_unknown_setting_name_warns_once_with_the_close_names(monkeypatch):
    import warnings

    import commfuse

    monkeypatch.setattr(env, "_warned", set())
    monkeypatch.setenv("COMMFUSE_LAUNCH_BOUND_BYTE", "0")  # the trailing S left off
    with pytest.warns(UserWarning, match=r"COMMFUSE_LAUNCH_BOUND_BYTE is not a commfuse setting and is "
                                         r"ignored; did you mean COMMFUSE_LAUNCH_BOUND_BYTES\?"):
        commfuse.backend()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        commfuse.backend()  # once per name
        env.validate()


def test_the_known_names_are_every_name_the_package_reads():
    """``env.KNOWN`` is what the unknown-name warning trusts: every quoted ``COMMFUSE_*`` name in
    the package's code, and no other."""
    read = set()
    for path in (ROOT / "commfuse").rglob("*.py"):
        read |= set(re.findall(r'["\'](COMMFUSE_[A-Z0-9_]+)["\']', path.read_text()))
    assert read == set(env.KNOWN), (sorted(read - set(env.KNOWN)), sorted(set(env.KNOWN) - read))
    readme = (ROOT / "README.md").read_text()
    assert not [name for name in env.KNOWN if name not in readme]
