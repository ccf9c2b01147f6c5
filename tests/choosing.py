"""What the tests of choosing and running a path share: calls as the entry builds them, the
policy's choice and the rules' on a simulated H200 group, workspaces over CPU memory, and group
state cleared around a test."""

from __future__ import annotations

import pytest
import torch

from commfuse.runtime import groups, policy
from commfuse.runtime import workspace as wsmod
from commfuse.runtime.facts import GroupFacts
from commfuse.runtime.paths import REGISTRY
from commfuse.runtime.paths.base import Call

BF16 = torch.bfloat16
AR, AG, RS = "mm_all_reduce", "all_gather_mm", "mm_reduce_scatter"


def _call(op, m, k, n, dtype=BF16, world=2, rows_dim=0, slabs=None):
    """A call as the entry builds it (``slabs``: 1 along the rows, else unknown unless given)."""
    if slabs is None:
        slabs = 1 if rows_dim == 0 else 0
    return Call(op, m, k, n, dtype, world, rows_dim=rows_dim, slabs=slabs)


def choose(op, m, k, n, dtype=BF16, world=2, rows_dim=0, slabs=None, *, forced=None, capturing=False,
           lane_bytes=0, facts=None):
    """The path name ``policy.choose`` gives on a simulated H200 group of ``world`` ranks."""
    call = _call(op, m, k, n, dtype, world, rows_dim, slabs)
    return policy.choose(call, facts or GroupFacts.simulated(world), capturing=capturing, lane_bytes=lane_bytes,
                         forced=forced).name


def rules(op, m, k, n, dtype=BF16, world=2, rows_dim=0, slabs=None) -> str:
    """What the rules alone pick (what a forced path that cannot take a call falls back to)."""
    return policy.rules_choice(_call(op, m, k, n, dtype, world, rows_dim, slabs), GroupFacts.simulated(world)).name


def supports(op, name, m, k, n, dtype=BF16, world=2, **kw):
    return REGISTRY[(op, name)].supports(_call(op, m, k, n, dtype, world, **kw), GroupFacts.simulated(world))


@pytest.fixture(autouse=True)
def _quiet_policy(monkeypatch):
    """Each test sees the policy's once-per-reason warnings afresh."""
    monkeypatch.setattr(policy, "_warned", set())


def _workspace(data_bytes=1 << 12, name="0", **kw):
    """A workspace over plain CPU memory (group "0" is the fake WORLD when one is initialised)."""
    buf = torch.zeros(wsmod.HEADER_BYTES + 2 * data_bytes, dtype=torch.uint8)
    return wsmod.Workspace(name, 0, 2, buf, torch.zeros(2, dtype=torch.int64), data_bytes, **kw)


@pytest.fixture
def fresh_groups(world2):
    """No group state from earlier tests, and none left behind."""
    groups.release_all()
    yield
    groups.release_all()
