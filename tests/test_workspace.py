"""``runtime/workspace.py``: epochs, halves, allocation and growth, the provider, a failed call.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from commfuse import env
from commfuse.kernels import fused_split_k
from commfuse.kernels.codes import TAG_MASK, flag_value
from commfuse.runtime import entry  # noqa: F401  (a changed setting reaches the buffers through entry.forget)
from commfuse.runtime import capture, counters, groups, plans
from commfuse.runtime import workspace as wsmod
from commfuse.runtime.facts import GroupFacts
from commfuse.runtime.paths import common
from commfuse.runtime.paths.base import Context
from helpers import group_name

from choosing import (  # noqa: F401  (_quiet_policy, fresh_groups: fixtures, found by name)
    AR, _call, _quiet_policy, _workspace, fresh_groups)


def test_workspace_epochs_and_parity():
    ws = _workspace()
    # the flag value is the call count above the pairing tag's bits (no tag: the check is off)
    assert [ws.next_epoch() for _ in range(3)] == [(1 << 10, 1), (2 << 10, 0), (3 << 10, 1)]
    assert ws.next_epoch(tag=5) == ((4 << 10) | 5, 0) and ws.epoch == 4
    assert ws.flags.numel() == (wsmod.FLAG_BYTES - wsmod.BASES_BYTES) // 4


def test_workspace_halves_do_not_overlap():
    ws = _workspace()
    a = ws.data(0, (32, 32), torch.float32)
    b = ws.data(1, (32, 32), torch.float32)
    a.fill_(1)
    b.fill_(2)
    assert a.eq(1).all() and b.eq(2).all() and ws.flags.eq(0).all()
    with pytest.raises(RuntimeError, match="too small"):
        ws.data(0, (33, 32), torch.float32)


def test_provider_setting(world2):
    """The provider is a setting read once, and a group's state is kept per provider."""
    torch_group = groups.get(group_name())
    with env.override(symm_provider="iris") as settings:
        assert settings.symm_provider == "iris"
        iris_group = groups.get(group_name())
        assert iris_group.provider == "iris" and iris_group is not torch_group
    assert groups.get(group_name()) is torch_group
    with pytest.raises(ValueError, match="COMMFUSE_SYMM_PROVIDER"):
        with env.override(symm_provider="nvshmem"):
            pass
    groups.release_all()


def test_epochs_restart_collectively_before_the_int32_flags_overflow(world2, monkeypatch):
    ws = _workspace()
    monkeypatch.setattr(wsmod, "EPOCH_LIMIT", 3)
    ws.flags[:8] = 3  # what peers' signals leave behind
    ws.tile_flags[:8] = 3  # and the fused kernel's
    ws.buffer[wsmod.FLAG_BYTES - wsmod.BASES_BYTES:wsmod.FLAG_BYTES] = 7  # stands for the heap bases
    assert [ws.next_epoch()[0] for _ in range(3)] == [flag_value(1), flag_value(2), flag_value(3)]
    assert ws.next_epoch() == (flag_value(1), 1)  # restarted, flags zeroed on every rank (fake group: this one)
    assert ws.flags.eq(0).all() and ws.tile_flags.eq(0).all()
    assert ws.buffer[wsmod.FLAG_BYTES - wsmod.BASES_BYTES:wsmod.FLAG_BYTES].eq(7).all()  # bases kept
    # a path's exchange restarts over the call's group (its process-group object, not its name)
    ws.epoch, ws.flags[:8] = 3, 3
    barriers = []
    real_barrier = dist.barrier
    monkeypatch.setattr(dist, "barrier", lambda group=None, **kw: barriers.append(group) or real_barrier(group=group))
    ctx = Context(_call(AR, 8, 8, 8), GroupFacts.simulated(2), groups.get(group_name()))
    with common.exchange(ctx, ws, AR) as (epoch, parity):
        assert (epoch, parity) == (flag_value(1), 1) and ws.flags.eq(0).all()
    assert barriers == [dist.group.WORLD] * 2


def test_epochs_restart_before_the_split_k_ll_flags_repeat_and_zero_the_data(world2):
    """The LL words' flags hold an epoch's low bits: within one run of epochs no two calls share
    them, and a restart leaves no word of the run before it."""
    assert wsmod.EPOCH_LIMIT < 1 << fused_split_k.LL_EPOCH_BITS
    # the largest flag value, the count above the tag's bits, fits the int32 flags
    assert flag_value(wsmod.EPOCH_LIMIT, TAG_MASK) <= torch.iinfo(torch.int32).max
    ws = _workspace()
    ws.data(0, (64,), torch.uint8).fill_(0xFF)
    ws.data(1, (64,), torch.uint8).fill_(0xFF)
    ws.epoch = wsmod.EPOCH_LIMIT
    assert ws.next_epoch() == (flag_value(1), 1)
    assert ws.buffer[wsmod.HEADER_BYTES:].eq(0).all()


def test_a_failed_call_blocks_the_workspace(world2):
    """Once a call fails after its epoch began, ranks may disagree: refuse, with a remedy."""
    ws = _workspace()
    ctx = Context(_call(AR, 8, 8, 8), GroupFacts.simulated(2), groups.get(group_name()))
    with pytest.raises(MemoryError):
        with common.exchange(ctx, ws, AR):
            raise MemoryError("out of memory")
    with pytest.raises(RuntimeError, match=r"mm_all_reduce: an earlier call on group '0' failed .*release_all"):
        ws.next_epoch()
    groups.release_all()


@pytest.fixture
def fake_allocation(fresh_groups, monkeypatch):
    """Symmetric allocation stood in for by plain CPU buffers (heap bases 1000 * n, 1000 * n + 1),
    recording the thread of each; small minimum sizes."""
    threads, buffers = [], []

    def fake_alloc(pg, nbytes, device):
        threads.append(threading.get_ident())
        buffers.append(torch.zeros(nbytes, dtype=torch.uint8))
        return buffers[-1], [1000 * len(buffers), 1000 * len(buffers) + 1], None

    monkeypatch.setattr(groups, "allocate_torch", fake_alloc)
    monkeypatch.setattr(groups, "MIN_DATA_BYTES", 4096)
    monkeypatch.setattr(plans, "_planned", {})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)

    def group():
        g = groups.get(group_name())
        g.facts = GroupFacts.simulated(2, sms=78, lane_bytes=1 << 16)  # as agreed on its first call
        return g

    return threads, buffers, group


def test_workspace_allocation_runs_off_the_callers_thread(fake_allocation, monkeypatch):
    """A CUDA-graph warm-up sends its thread's allocations to the graph's pool, which captures
    reuse: allocation happens on a helper thread, and the tables live inside the buffers."""
    threads, buffers, group = fake_allocation
    cpu = torch.device("cpu")
    with env.override(timeout_s=2.5):
        g = group()
        ws = groups.workspace(g, 1024, cpu)
        lane = capture.lane(g)
        bounds = (ws.timeout_ns, lane.timeout_ns)
    assert bounds == (2_500_000_000, 2_500_000_000)  # the bound in force
    assert (ws.timeout_ns, lane.timeout_ns) == (600 * 10**9, 600 * 10**9)  # a changed setting reaches them
    assert len(threads) == 2 and threading.get_ident() not in threads  # workspace, then lane
    for holder, buf, ptrs in ((ws, buffers[0], [1000, 1001]), (lane, buffers[1], [2000, 2001])):
        assert holder.heap_bases.tolist() == ptrs
        assert holder.heap_bases.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        assert holder.err is g.err  # the group's word
    assert lane.counter.untyped_storage().data_ptr() == buffers[1].untyped_storage().data_ptr()
    assert lane.counter.eq(0).all() and lane.counter.numel() == wsmod.GRAPH_SLOTS
    assert (ws.data_bytes, ws.max_programs, lane.data_bytes) == (4096, 78, 1 << 16)
    assert groups.workspace(g, 1024, cpu) is ws  # no second allocation
    monkeypatch.setattr(groups, "allocate_torch", lambda *a: (_ for _ in ()).throw(RuntimeError("no memory")))
    with pytest.raises(RuntimeError, match="no memory"):  # the helper thread's error reaches the caller
        groups.workspace(g, 1 << 30, cpu)


def test_workspaces_grow_at_least_twofold_and_start_at_the_planned_size(fake_allocation):
    """A larger call grows the workspace (collectively: every rank waits for the old one's users)
    to at least twice its size, keeping the lane; a compiled graph's plan sizes the group's first
    allocation, so its fused ops need no growth."""
    threads, buffers, group = fake_allocation
    cpu = torch.device("cpu")
    g = group()
    first = groups.workspace(g, 1024, cpu)
    lane = capture.lane(g)
    generation = counters.generation
    grown = groups.workspace(g, 5000, cpu)
    assert grown is not first and grown.data_bytes == 8192 and g.workspace is grown
    assert capture.lane(g) is lane and len(buffers) == 3  # the lane is never regrown
    assert counters.generation > generation  # kept plans (which hold sizes) are decided anew
    assert groups.workspace(g, 20000, cpu).data_bytes == wsmod.round_up(20000, wsmod.ALIGN)
    groups.release_all()
    plans.register(group_name(), 50000)
    plans.register(group_name(), 30000)  # the largest plan counts
    assert plans.planned(group_name()) == 50000
    g = group()
    assert groups.workspace(g, 1024, cpu).data_bytes == wsmod.round_up(50000, wsmod.ALIGN)


def test_split_k_counters_sit_between_the_tile_flags_and_the_ticket():
    ws = _workspace()
    flags, counters, ticket = ws.tile_flags, ws.tile_counters, ws.ticket
    base_ptr = ws.buffer.data_ptr()
    assert flags.data_ptr() - base_ptr == wsmod.FLAG_BYTES and flags.numel() == wsmod.TILE_FLAG_SLOTS
    assert counters.data_ptr() >= flags.data_ptr() + 4 * flags.numel()
    assert counters.data_ptr() + 4 * counters.numel() <= ticket.data_ptr()
    assert ticket.data_ptr() + 8 == base_ptr + wsmod.HEADER_BYTES


def test_the_workspaces_views_are_kept_per_parity_shape_dtype_and_offset():
    """``Workspace.data`` keeps the views it makes: the same request gives the same view, any other
    parity, shape, dtype or offset its own, at its own place in the buffer; a view first asked for
    under ``torch.inference_mode`` takes in-place writes outside it."""
    data = 1 << 12
    ws = wsmod.Workspace("0", 0, 2, torch.zeros(wsmod.HEADER_BYTES + 2 * data, dtype=torch.uint8),
                         torch.zeros(2, dtype=torch.int64), data)
    base = ws.buffer.data_ptr() + wsmod.HEADER_BYTES
    with torch.inference_mode():
        first = ws.data(1, (4, 8), torch.float32, 64)
    first.fill_(1.0)  # outside inference mode
    assert ws.data(1, (4, 8), torch.float32, 64) is first and first.data_ptr() == base + data + 64
    others = {"parity": ws.data(0, (4, 8), torch.float32, 64), "shape": ws.data(1, (8, 4), torch.float32, 64),
              "dtype": ws.data(1, (4, 8), torch.float16, 64), "offset": ws.data(1, (4, 8), torch.float32, 128)}
    assert all(v is not first for v in others.values())
    assert others["parity"].data_ptr() == base + 64 and others["offset"].data_ptr() == base + data + 128
    assert others["shape"].shape == (8, 4) and others["dtype"].dtype == torch.float16
    with pytest.raises(RuntimeError, match="too small"):
        ws.data(0, (data,), torch.float32)
