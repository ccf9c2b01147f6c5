"""The settings registry (``commfuse/env.py``): every ``COMMFUSE_*`` variable parsed once into typed
values; a value it does not understand raises naming the variable (never read as the default); an
unknown or removed name warns once; ``docs/settings.md`` lists exactly the registry."""

from __future__ import annotations

import pathlib
import re
import warnings

import pytest
import torch.fx as fx

from commfuse import config, env
from commfuse.tools import timing

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    """Each test reads the environment it sets, and leaves no value kept for the next one."""
    monkeypatch.setattr(env, "_warned", set())
    env.reload()
    yield
    monkeypatch.undo()
    env.reload()


@pytest.mark.parametrize("value, want", [("1", True), ("true", True), (" On ", True), ("YES", True),
                                         ("0", False), ("false", False), ("off", False), ("no", False)])
def test_switch_words(monkeypatch, value, want):
    monkeypatch.setenv("COMMFUSE_VERIFY", value)
    assert env.reload().verify is want


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_setting_is_the_default(monkeypatch, value):
    monkeypatch.setenv("COMMFUSE_MERGE_SUMS", value)
    monkeypatch.setenv("COMMFUSE_TIMEOUT_S", value)
    values = env.reload()
    assert values.merge_sums is True and values.timeout_s == 600.0
    assert config.merge_sums_allowed()


def test_the_settings_are_read_once(monkeypatch):
    """A call reads typed values, not the environment: a change counts from ``reload``."""
    first = env.current()
    monkeypatch.setenv("COMMFUSE_TIMEOUT_S", "5")
    assert env.current() is first and first.timeout_s == 600.0
    assert env.reload().timeout_s == 5.0


@pytest.mark.parametrize("name, value, message", [
    ("COMMFUSE_LAUNCH_BOUND_BYTES", "1MiB", "is not a whole number"),
    ("COMMFUSE_LAUNCH_BOUND_BYTES", "-1", "must be at least 0"),
    ("COMMFUSE_GRAPH_BYTES", "0", "must be at least 1"),
    ("COMMFUSE_TIMEOUT_S", "0", "must be at least"),
    ("COMMFUSE_TIMEOUT_S", "inf", "must be a finite number"),
    ("COMMFUSE_TIMEOUT_S", "10m", "is not a number"),
    ("COMMFUSE_TIMEOUT_S", "2e9", "must be at most"),
    ("COMMFUSE_FAST_LAUNCH", "off-ish", "is not a switch"),
    ("COMMFUSE_LOG", "verbose", "is not one of"),
    ("COMMFUSE_SYMM_PROVIDER", "nvshmem", "is not one of"),
    ("COMMFUSE_ALGO", "fastest", "is not one of"),
    ("COMMFUSE_TUNE", "always", "is not one of"),
    ("COMMFUSE_TUNE_MARGIN", "0.9", "must be at most"),
])
def test_bad_values_raise_naming_the_variable(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(name) + ".*" + re.escape(message)):
        env.validate()


def test_override_parses_as_the_environment_does_and_restores():
    before = env.current()
    with env.override(timeout_s="2.5", algo="fused", verify=True) as values:
        assert values.timeout_s == 2.5 and values.algo == "fused" and values.verify is True
        assert env.current() is values
        with pytest.raises(ValueError, match="COMMFUSE_ALGO"):
            with env.override(algo="nope"):
                pass
    assert env.current() == before
    with pytest.raises(TypeError, match="no setting 'timeout'"):
        with env.override(timeout=1):
            pass


def test_override_drops_what_was_decided_under_the_old_settings():
    seen = []
    env.on_change(lambda: seen.append(1))
    with env.override(algo="nccl"):
        pass
    assert len(seen) >= 2  # entering and leaving


def test_the_graph_pass_names_a_bad_setting_before_any_rewrite(monkeypatch):
    """A malformed size failed inside the sum merging, whose message blamed the merging."""
    from commfuse.inductor_plugin import graph_pass

    monkeypatch.setenv("COMMFUSE_LAUNCH_BOUND_BYTES", "1MiB")
    graph = fx.Graph()
    graph.output(graph.placeholder("x"))
    with pytest.raises(ValueError, match="COMMFUSE_LAUNCH_BOUND_BYTES='1MiB' is not a whole number"):
        graph_pass.rewrite(graph, config.Settings())


def test_the_backend_names_a_bad_setting_when_built(monkeypatch):
    """It failed only at the first compile, inside a long traceback."""
    import commfuse

    monkeypatch.setenv("COMMFUSE_TIMEOUT_S", "10m")
    with pytest.raises(ValueError, match=r"^commfuse: COMMFUSE_TIMEOUT_S='10m' is not a number$"):
        commfuse.backend()
    monkeypatch.setenv("COMMFUSE_TIMEOUT_S", "30")
    monkeypatch.setenv("COMMFUSE_ALGO", "nccl-ish")
    with pytest.raises(ValueError, match="COMMFUSE_ALGO"):
        commfuse.backend()


def test_an_unknown_setting_name_warns_once_with_the_close_names(monkeypatch):
    import commfuse

    monkeypatch.setenv("COMMFUSE_LAUNCH_BOUND_BYTE", "0")  # the trailing S left off
    with pytest.warns(UserWarning, match=r"COMMFUSE_LAUNCH_BOUND_BYTE is not a commfuse setting and is "
                                         r"ignored; did you mean COMMFUSE_LAUNCH_BOUND_BYTES"):
        commfuse.backend()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        commfuse.backend()  # once per name
        env.validate()


def test_a_misspelt_name_is_told_only_of_settings_that_exist_at_the_callers_line(monkeypatch):
    """``COMMFUSE_RS_PUL`` was told "did you mean COMMFUSE_RS_PULL", a setting removed long ago, and
    the warning named commfuse's own line."""
    import commfuse

    monkeypatch.setenv("COMMFUSE_RS_PUL", "1")
    monkeypatch.setenv("COMMFUSE_TIMEOUT", "5")
    with pytest.warns(UserWarning) as got:
        commfuse.backend()
    messages = sorted(str(w.message) for w in got)
    assert messages == ["commfuse: COMMFUSE_RS_PUL is not a commfuse setting and is ignored",
                        "commfuse: COMMFUSE_TIMEOUT is not a commfuse setting and is ignored; did you mean "
                        "COMMFUSE_TIMEOUT_S?"]
    assert {w.filename for w in got} == {__file__}


def test_a_removed_setting_still_set_warns_once_with_its_fate(monkeypatch):
    monkeypatch.setenv("COMMFUSE_RS_PULL", "1")
    with pytest.warns(UserWarning, match="COMMFUSE_RS_PULL no longer exists.*lost on every shape"):
        env.validate()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        env.validate()


def test_every_name_the_package_reads_is_a_setting():
    """Every quoted ``COMMFUSE_*`` name in the package (but its tools, which may read their own) is in
    the registry or in ``REMOVED``; the code reads settings only through ``env.current()``, never
    ``os.environ`` (but for ``env.py``)."""
    names = {s.name for s in env.SETTINGS}
    for path in (ROOT / "commfuse").rglob("*.py"):
        if "tools" in path.parts or path.name in ("bench.py", "bench_model.py"):
            continue
        text = path.read_text()
        quoted = set(re.findall(r'["\'`](COMMFUSE_[A-Z0-9_]+)["\'`]', text))
        assert quoted <= names | set(env.REMOVED), (path, sorted(quoted - names - set(env.REMOVED)))
        if path.name != "env.py":
            assert not re.search(r'environ(?:\.get)?\(?\[?\s*["\']COMMFUSE_', text), path


def _documented() -> dict[str, tuple[str, str, str, str]]:
    """The rows of docs/settings.md's table: name -> (kind, default, ranks, when the ranks differ)."""
    rows = {}
    for line in (ROOT / "docs" / "settings.md").read_text().splitlines():
        if line.startswith("| `COMMFUSE_"):
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            rows[cells[0].strip("`")] = (cells[1].strip("`"), cells[2].strip("`"), cells[4], cells[5])
    return rows


def test_the_settings_page_lists_exactly_the_registry():
    """Each setting's kind, default, whether the ranks must set it alike and what happens when they
    do not, as the registry says."""
    documented = _documented()
    want = {name: (kind, default, ranks, unlike) for name, kind, default, _, ranks, unlike in env.describe()}
    assert documented == want, (sorted(set(documented) ^ set(want)),
                                [n for n in want if documented.get(n) != want[n]])


def test_every_setting_has_a_scope():
    """Whether the ranks of a group may set it differently is part of a setting: one added without a
    scope (or without saying what happens when ranks differ) fails here."""
    for setting in env.SETTINGS:
        assert setting.scope in env.SCOPES, f"{setting.name} has no scope (one of {env.SCOPES})"
        assert setting.unlike, f"{setting.name} does not say what happens when the ranks set it differently"
        assert not setting.paths or setting.scope == env.ALIKE, f"{setting.name} keys the tuning cache: alike"
        assert not setting.compile or setting.scope == env.ALIKE, f"{setting.name} decides what fuses: alike"


def test_the_settings_the_ranks_compare_are_the_must_be_alike_ones():
    """The run-time comparison takes every must-be-alike setting that acts at a call (the tuning
    margin and the forced path among them); the compile-time one those that act when compiling."""
    values = env.current()
    at_call = dict(values.alike(compile=False))
    at_compile = dict(values.alike(compile=True))
    assert {"COMMFUSE_TUNE_MARGIN", "COMMFUSE_ALGO", "COMMFUSE_VERIFY", "COMMFUSE_TUNE", "COMMFUSE_PAIRING_CHECK",
            "COMMFUSE_GRAPH_BYTES", "COMMFUSE_SYMM_PROVIDER"} <= set(at_call)
    assert set(at_compile) == {"COMMFUSE_LAUNCH_BOUND_BYTES", "COMMFUSE_MERGE_SUMS"}
    assert not {"COMMFUSE_TIMEOUT_S", "COMMFUSE_LOG", "COMMFUSE_FAST_LAUNCH"} & (set(at_call) | set(at_compile))
    assert config.Settings().alike()["COMMFUSE_MERGE_SUMS"] is True
    # the launch bound in force, under one name wherever it came from
    assert config.Settings(launch_bound_bytes=0).alike()[config.LAUNCH_BOUND] == 0
    assert config.Settings().alike()[config.LAUNCH_BOUND] == values.launch_bound_bytes
    assert "COMMFUSE_LAUNCH_BOUND_BYTES" not in config.Settings().alike()


def test_the_benchmarks_commit_is_a_setting():
    """The documented benchmark command sets ``COMMFUSE_COMMIT``: a setting, so no warning."""
    assert env.unknown_names({"COMMFUSE_COMMIT": "abc1234"}) == []
    with env.override(commit="abc1234"):
        assert timing.commit() == "abc1234"


@pytest.mark.parametrize("former, now", [("symm", "pull"), ("overlap", "ce_overlap"), ("SYMM", "pull")])
def test_commfuse_algo_takes_the_former_path_names(monkeypatch, former, now):
    monkeypatch.setenv("COMMFUSE_ALGO", former)
    env.reload()
    try:
        assert env.current().algo == now
    finally:
        monkeypatch.delenv("COMMFUSE_ALGO")
        env.reload()
