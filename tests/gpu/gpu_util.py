"""Helpers of the GPU tests: poisoning, gathering from every rank, relative error, the run-time's
state of a group, and a path run with a configuration of the test's choosing."""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

import commfuse
from commfuse import env
from commfuse.runtime import groups, policy, reference, running
from commfuse.runtime.paths import REGISTRY
from commfuse.runtime.paths.base import (AllGatherMmArgs, Call, Context, MmAllReduceArgs, MmReduceScatterArgs,
                                         row_slabs, rows_dim)
from commfuse.runtime.counters import PATHS

AR, AG, RS = "mm_all_reduce", "all_gather_mm", "mm_reduce_scatter"
_ARGS = {AR: MmAllReduceArgs, AG: AllGatherMmArgs, RS: MmReduceScatterArgs}


def poison():
    """Fill freed allocator blocks with NaN so an output element nobody writes shows up."""
    blocks = [torch.full((1 << 26,), float("nan"), device="cuda", dtype=torch.float32) for _ in range(4)]
    del blocks


def gather_all(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def relerr(got, want):
    assert torch.isfinite(got).all(), "unwritten (NaN-poisoned) or non-finite output"
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def group_state(group_name: str):
    """(the run-time's state of the group, its agreed facts): agreed now, collectively, on the
    group's first use, as its first call through the entry would."""
    group = groups.get(group_name)
    return group, groups.group_facts(group, device(), capturing=False)


def workspaces() -> list:
    """Every group's symmetric workspace on this rank (groups without one left out)."""
    return [g.workspace for g in groups.all_groups() if g.workspace is not None]


def start_over() -> None:
    """On every rank: nothing in flight, then every group's state dropped (``release_all``), so the
    next call agrees its facts and allocates afresh under the settings now in force (a workspace's
    wait bound, ``COMMFUSE_TIMEOUT_S``, is fixed when it is allocated). Also what a test whose
    ranks' epochs now differ (a skipped call) ends with."""
    torch.cuda.synchronize()
    dist.barrier()
    commfuse.release_all()


def timed_out(op: str, group_name: str, seconds: str = "1") -> str:
    """The error of rank 0 whose wait for rank 1 timed out (``runtime.errors``), as a pattern;
    ``op`` as the error word names it, e.g. ``mm_all_reduce (fused tile kernel)``."""
    return (rf"commfuse\.{re.escape(op)}: on group {re.escape(repr(group_name))}, rank 0 timed out after "
            rf"{re.escape(seconds)} s waiting for rank 1")


def call_of(op: str, args, world: int) -> Call:
    """The ``Call`` the entry (``runtime/entry.py``) makes of these arguments."""
    if op == AR:
        return Call(op, args.a.shape[0], args.a.shape[1], args.b.shape[1], args.a.dtype, world, args.bias is not None)
    if op == AG:
        shard, k = args.shard, args.shard.shape[-1]
        dim = rows_dim(shard.shape, args.gather_dim)
        return Call(op, shard.numel() // k * args.world_size, k, args.b.shape[1], shard.dtype, args.world_size,
                    args.bias is not None, dim, row_slabs(shard.shape, dim))
    m, n = args.a.shape[0], args.b.shape[1]
    shape = reference.resolve_shape(args.shape, m * n)
    dim = rows_dim(shape, args.scatter_dim)
    return Call(op, m, args.a.shape[1], n, args.a.dtype, args.world_size, args.bias is not None, dim,
                row_slabs(shape, dim))


def _prepared(op: str, name: str, args: tuple, config):
    args = _ARGS[op](*args)
    group, facts = group_state(args.group_name)
    call = call_of(op, args, group.world)
    path = REGISTRY[(op, name)]
    own = path.config(call, facts) if path.symmetric else None
    return args, group, facts, call, path, own, own if config is None else config(call, facts)


def decided(op: str, *args) -> str:
    """The path the policy picks for this call on the group under the settings in force: what the
    entry runs where no captured graph replays the group's lane and nothing is tuned."""
    args, group, facts, call, *_ = _prepared(op, "nccl", args, None)
    return policy.choose(call, facts, forced=env.current().algo, quiet=True).name


def run_path(op: str, name: str, *args, config=None):
    """Path ``name`` of ``op`` run as a sweep tool runs it: straight into the path object, with a
    ``Context`` holding ``config(call, facts)`` (where ``config`` is None, the path's own
    configuration for the call) on the group's state and agreed facts. ``args``: the op's, as
    ``torch.ops.commfuse.<op>`` takes them. The entry's dispatch is not involved: ``PATHS`` does
    not count the call, and nothing checks the group's error word before it."""
    args, group, facts, call, path, _, cfg = _prepared(op, name, args, config)
    return running.run(path, Context(call, facts, group, cfg), args)


def run_forced(op: str, name: str, *args, config=None):
    """Path ``name`` of ``op`` with ``config`` (as ``run_path``): where that is the path's own
    configuration for the call, through the op and the run-time's entry with
    ``COMMFUSE_ALGO=name``, which must take it (``PATHS`` counts one call of it); else straight
    into the path (``run_path``). Returns (the op's result, whether the entry ran it)."""
    _, _, facts, call, path, own, cfg = _prepared(op, name, args, config)
    if cfg != own:
        return run_path(op, name, *args, config=config), False
    before = PATHS[f"{op}:{name}"]
    with env.override(algo=name):
        out = getattr(torch.ops.commfuse, op)(*args)
    assert PATHS[f"{op}:{name}"] == before + 1, (
        f"COMMFUSE_ALGO={name} did not run {op}:{name} for {call.short()} ({path.supports(call, facts)})")
    return out, True
