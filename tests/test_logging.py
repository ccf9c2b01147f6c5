"""The ``commfuse`` logger: ``TORCH_LOGS=commfuse`` / ``+commfuse`` and its alias ``COMMFUSE_LOG``."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest

import commfuse

report = sys.modules["commfuse.report"]  # the package's ``report`` is the function of that name

SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    torch._inductor.config.fx_graph_cache = False
    f = lambda a, w: funcol.all_reduce(a @ w, "sum", dist.group.WORLD)
    torch.compile(f, backend="commfuse")(torch.randn(64, 128), torch.randn(128, 64))
""")


def _run(**env):
    full = {k: v for k, v in os.environ.items() if k not in ("TORCH_LOGS", "COMMFUSE_LOG")}
    full.update(env, COMMFUSE_LAUNCH_BOUND_BYTES="0")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=full, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("torch_logs, commfuse_log, debug", [("commfuse", None, False), ("+commfuse", "1", True)])
def test_torch_logs_names_the_commfuse_log(torch_logs, commfuse_log, debug):
    """INFO: each decision; DEBUG (``+``): also the pass's own lines. With ``COMMFUSE_LOG`` set as
    well, ``TORCH_LOGS`` decides the level and each line is written once."""
    env = {"TORCH_LOGS": torch_logs} | ({"COMMFUSE_LOG": commfuse_log} if commfuse_log else {})
    err = _run(**env)
    fused = [line for line in err.splitlines() if "FUSED   mm_all_reduce" in line]
    assert len(fused) == 1, err[-3000:]
    assert ("pass on forward#" in err) is debug


def test_a_bad_commfuse_log_changes_nothing_at_import_and_fails_when_the_backend_is_built(monkeypatch):
    """``verbose`` switched logging on at import and failed at the first compile, in a traceback."""
    saved = report.log.level, list(report.log.handlers)
    monkeypatch.setenv("COMMFUSE_LOG", "verbose")
    monkeypatch.delenv("TORCH_LOGS", raising=False)
    try:
        report.log.setLevel(logging.NOTSET)
        for handler in saved[1]:
            report.log.removeHandler(handler)
        report.configure_logging()  # what importing commfuse runs
        assert report.log.level == logging.NOTSET and not report.log.handlers
        with pytest.raises(ValueError, match=r"^commfuse: COMMFUSE_LOG='verbose' is not one of .*debug"):
            commfuse.backend()
        monkeypatch.setenv("COMMFUSE_LOG", "debug")
        report.configure_logging()
        assert report.log.level == logging.DEBUG and len(report.log.handlers) == 1
    finally:
        report.log.setLevel(saved[0])
        for handler in list(report.log.handlers):
            report.log.removeHandler(handler)
        for handler in saved[1]:
            report.log.addHandler(handler)


def test_commfuse_is_a_registered_torch_log():
    from torch._logging import _internal

    assert _internal.log_registry.is_log("commfuse")
