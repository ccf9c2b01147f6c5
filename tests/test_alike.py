"""Settings every rank must set alike (``runtime/alike.py``), on real ranks on the CPU (gloo, 2
processes): a setting that differs is one error on every rank naming it and each rank's value, at
the group's first call (run-time settings) or when a graph is compiled (compile-time ones), never a
hang or a silent wrong sum; settings that may differ do not stop anything."""

from __future__ import annotations

import datetime
import logging
import os
import re
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from commfuse.config import LAUNCH_BOUND
from helpers import spawn

WORLD = 2


def _start(rank: int, init_file: str) -> str:
    torch._inductor.config.fx_graph_cache = False
    # a collective that one rank never joins fails in half a minute, not gloo's 30
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=30))
    return dist.group.WORLD.group_name


def _settings(**values: str) -> None:
    """This rank's environment, read again (settings are read once)."""
    from commfuse import env

    for name in list(os.environ):
        if name.startswith("COMMFUSE_") and name != "COMMFUSE_LAUNCH_BOUND_BYTES":
            del os.environ[name]
    os.environ.update(values)
    env.reload()


def _names(*pairs: tuple[str, str, str]) -> str:
    """What the error says of each setting: its name and both ranks' values, in rank order."""
    return ".*".join(re.escape(f"{name} (rank 0: {zero}, rank 1: {one})") for name, zero, one in pairs)


def _call(group: str) -> torch.Tensor:
    torch.manual_seed(dist.get_rank())
    a, b = torch.randn(4, 8), torch.randn(8, 6)
    return torch.ops.commfuse.mm_all_reduce(a, b, None, group)


def _run_time_worker(rank: int, init_file: str) -> None:
    from commfuse import env

    group = _start(rank, init_file)
    mine = lambda zero, one: zero if rank == 0 else one  # noqa: E731
    cases = [
        # a margin that keeps the rules' path on one rank and a tuned one on its peer
        (dict(COMMFUSE_TUNE_MARGIN=mine("0.03", "0.01")), [("COMMFUSE_TUNE_MARGIN", "0.03", "0.01")]),
        (dict(COMMFUSE_ALGO=mine("one_shot", "two_shot")), [("COMMFUSE_ALGO", "one_shot", "two_shot")]),
        (dict(COMMFUSE_ALGO=mine("one_shot", "")), [("COMMFUSE_ALGO", "one_shot", "unset")]),
        # on one rank only, VERIFY's own collective would meet the peer's all-reduce: a hang before
        (dict(COMMFUSE_VERIFY=mine("1", "0")), [("COMMFUSE_VERIFY", "on", "off")]),
        (dict(COMMFUSE_PAIRING_CHECK=mine("0", "1")), [("COMMFUSE_PAIRING_CHECK", "off", "on")]),
        (dict(COMMFUSE_TUNE=mine("off", "cache")), [("COMMFUSE_TUNE", "off", "cache")]),
        (dict(COMMFUSE_GRAPH_BYTES=mine("4194304", "8388608")), [("COMMFUSE_GRAPH_BYTES", "4194304", "8388608")]),
        (dict(COMMFUSE_SYMM_PROVIDER=mine("torch", "iris")), [("COMMFUSE_SYMM_PROVIDER", "torch", "iris")]),
        (dict(COMMFUSE_ALGO=mine("fused", "split_k"), COMMFUSE_TUNE_MARGIN=mine("0.1", "0.2")),
         [("COMMFUSE_ALGO", "fused", "split_k"), ("COMMFUSE_TUNE_MARGIN", "0.1", "0.2")]),
    ]
    for values, named in cases:
        _settings(**values)
        with pytest.raises(RuntimeError, match=r"commfuse\.mm_all_reduce: the ranks of group .* differ in settings "
                                               r"that must be alike: " + _names(*named)) as caught:
            _call(group)
        others = {s.name for s in env.SETTINGS} - {name for name, _, _ in named}
        assert not any(f"{name} (" in str(caught.value) for name in others), caught.value

    # settings that may differ (a launch mechanism, the wait bound, logging, the cache's place) do not
    _settings(COMMFUSE_FAST_LAUNCH=mine("1", "0"), COMMFUSE_TIMEOUT_S=mine("600", "30"),
              COMMFUSE_CE_GRAPHS=mine("1", "0"), COMMFUSE_CACHE_DIR=mine("/tmp/a", "/tmp/b"))
    got = _call(group)
    torch.manual_seed(0)
    a0, b0 = torch.randn(4, 8), torch.randn(8, 6)
    torch.manual_seed(1)
    a1, b1 = torch.randn(4, 8), torch.randn(8, 6)
    torch.testing.assert_close(got, a0 @ b0 + a1 @ b1)

    # an override of a must-be-alike setting between calls is compared again at the next call:
    # made alike on every rank it goes through (what tests that force a path do) ...
    with env.override(algo="nccl", tune_margin="0.1"):
        torch.testing.assert_close(_call(group), got)
    # ... and made with different values on the ranks, it is an error on every rank naming it
    with env.override(algo=mine("one_shot", "two_shot")):
        with pytest.raises(RuntimeError, match=_names(("COMMFUSE_ALGO", "one_shot", "two_shot"))):
            _call(group)
    torch.testing.assert_close(_call(group), got)  # back to settings every rank agreed on

    # made on one rank only, while its peer goes on without comparing: the rank that changed waits
    # the bound, then names the peer and what it changed since the ranks last agreed
    with env.override(timeout_s=2, algo="nccl" if rank == 0 else None):
        if rank == 0:
            with pytest.raises(RuntimeError, match=r"commfuse\.mm_all_reduce: rank 0 of group .* waited 2 s "
                                                   r"\(COMMFUSE_TIMEOUT_S\) for rank\(s\) \[1\] to publish"
                                                   r".*this rank changed COMMFUSE_ALGO \(unset -> nccl\) since "
                                                   r"the ranks last agreed"):
                _call(group)
        dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_run_time_settings_that_differ_are_one_error_on_every_rank():
    """``COMMFUSE_TUNE_MARGIN``, ``COMMFUSE_ALGO``, ``COMMFUSE_VERIFY`` on one rank only, the
    pairing check, tuning, the graph lane's size and the provider, each set differently on the two
    ranks: the first call raises on both, naming the setting and both values (before, the call ran:
    a silent wrong sum on the GPU, or a hang in VERIFY's collective); an ``env.override`` made alike
    on every rank goes through, one made with different values raises on both; one made on one
    rank only, whose peer never compares, makes that rank wait ``COMMFUSE_TIMEOUT_S``, then raise
    naming the peer and the setting it changed (its peer, which compared nothing, cannot name it)."""
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_run_time_worker, args=(os.path.join(tmp, "rendezvous"),), nprocs=WORLD)


def _compile_worker(rank: int, init_file: str) -> None:
    import commfuse

    group = _start(rank, init_file)
    world = dist.group.WORLD
    mine = lambda zero, one: zero if rank == 0 else one  # noqa: E731

    def f(x, w):
        return funcol.all_reduce(x @ w, "sum", world)

    x, w = torch.randn(16, 32), torch.randn(32, 24)
    cases = [
        (dict(COMMFUSE_MERGE_SUMS=mine("1", "0")), {}, [("COMMFUSE_MERGE_SUMS", "on", "off")]),
        (dict(COMMFUSE_LAUNCH_BOUND_BYTES=mine("0", "1048576")), {}, [(LAUNCH_BOUND, "0", "1048576")]),
        ({}, dict(launch_bound_bytes=mine(None, 4096)), [(LAUNCH_BOUND, "0", "4096")]),
        ({}, dict(min_mnk=mine(0, 1 << 15)), [("backend(min_mnk=...)", "0", "32768")]),
        ({}, dict(patterns=mine(["mm_all_reduce"], ["all_gather_mm"])),
         [("backend(patterns=...)", "[mm_all_reduce]", "[all_gather_mm]")]),
        ({}, dict(exclude=mine(["layers.*"], [])), [("backend(exclude=...)", "[layers.*]", "[]")]),
    ]
    for environ, arguments, named in cases:
        _settings(**{"COMMFUSE_LAUNCH_BOUND_BYTES": "0", **environ})
        torch._dynamo.reset()
        commfuse.clear_report()
        backend = commfuse.backend(**{"min_mnk": 0, **arguments})
        with pytest.raises(Exception, match=r"compiling a graph: the ranks of group .* differ in settings that "
                                            r"must be alike: " + _names(*named)):
            torch.compile(f, backend=backend, fullgraph=True)(x, w)
        assert not commfuse.report()  # raised by the backend, before the graph pass saw the graph
    # alike on every rank: compiled, fused, and the sum of both ranks' products; the same launch
    # bound in force, from the environment on one rank and the backend's argument on the other, and
    # the same patterns in another order, are alike
    _settings(COMMFUSE_LAUNCH_BOUND_BYTES=mine("0", "1048576"))
    torch._dynamo.reset()
    commfuse.clear_report()
    torch.manual_seed(rank)
    x, w = torch.randn(16, 32), torch.randn(32, 24)
    backend = commfuse.backend(min_mnk=0, launch_bound_bytes=mine(None, 0),
                               patterns=mine(["mm_all_reduce", "merge_sums"], ["merge_sums", "mm_all_reduce"]))
    got = torch.compile(f, backend=backend, fullgraph=True)(x, w)
    every = [torch.empty_like(got) for _ in range(WORLD)]
    dist.all_gather(every, x @ w)
    torch.testing.assert_close(got, sum(every))
    assert [r.pattern for r in commfuse.report().fused] == ["mm_all_reduce"]
    assert group
    dist.destroy_process_group()


@pytest.mark.slow
def test_compile_time_settings_that_differ_are_one_error_on_every_rank():
    """The launch bound, merge sums and the backend's ``min_mnk``, ``patterns`` and ``exclude`` decide
    whether a call fuses: set differently, one rank called commfuse where its peer called NCCL, and
    no check of commfuse's ran on both. Now compiling the graph raises on both ranks, naming the
    setting and both values, before Inductor compiles anything. The launch bound compared is the
    one in force (the environment's on one rank and the backend's argument on the other, alike, is
    no error), and ``patterns`` in another order are alike."""
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_compile_worker, args=(os.path.join(tmp, "rendezvous"),), nprocs=WORLD)


def test_the_backend_finds_the_groups_of_collectives_and_of_dtensors(world2):
    """What the backend compares on: the group of a functional collective in Dynamo's graph, and
    the mesh groups of its DTensors (whose collectives appear only after AOT autograd), so a rank
    whose Inductor cache skips the graph pass still compares; the fake backend compares nothing."""
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from commfuse.inductor_plugin import alike

    seen = []

    def backend(gm, example_inputs, **_):
        seen.append(alike.graph_groups(gm.graph))
        alike.agree(gm.graph, __import__("commfuse").config.Settings())  # the fake group: no wait
        return gm.forward

    world = dist.group.WORLD
    torch.compile(lambda x, w: funcol.all_reduce(x @ w, "sum", world), backend=backend)(
        torch.randn(4, 4), torch.randn(4, 4))
    assert seen == [[world.group_name]]
    sub = dist.new_group([0, 1])
    mesh = init_device_mesh("cpu", (2,))
    mlp = parallelize_module(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)), mesh,
                             {"0": ColwiseParallel(), "2": RowwiseParallel()})
    torch.compile(mlp, backend=backend)(torch.randn(4, 8))
    assert seen[1] == [mesh.get_group().group_name]
    assert sub.group_name not in seen[1]  # only the groups the graph uses
    # a collective inside an autograd.Function (a tensor-parallel layer's): Dynamo's graph holds it
    # only in the subgraphs of a higher-order op
    torch.compile(lambda x, w: _Reduce.apply(x @ w, sub), backend=backend, fullgraph=True)(
        torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True))
    assert seen[2] == [sub.group_name]


class _Reduce(torch.autograd.Function):
    """A tensor-parallel layer's all-reduce (Megatron's g): summed forward, passed-through backward."""

    @staticmethod
    def forward(ctx, x, group):
        return funcol.all_reduce(x, "sum", group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Notes(logging.Handler):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def emit(self, record):
        self.seen.append(record.getMessage())


def _cache_worker(rank: int, init_files: list, caches: str) -> None:
    import commfuse
    from torch._dynamo.utils import counters

    from commfuse.config import Settings
    from commfuse.inductor_plugin import alike

    notes = _Notes()
    logging.getLogger("commfuse").addHandler(notes)

    torch._inductor.config.fx_graph_cache = True
    _settings(COMMFUSE_LAUNCH_BOUND_BYTES="0", COMMFUSE_TIMEOUT_S="10")
    fn = lambda x, w: _Reduce.apply(x @ w, dist.group.WORLD)  # noqa: E731
    for run, init_file in enumerate(init_files):
        # run 0 fills each rank's cache; run 1, a new process group (as a new process: nothing
        # compared yet), finds rank 0's cache full and rank 1's empty
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(caches, f"{rank}-{run if rank else 0}")
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=30))
        torch._dynamo.reset()
        commfuse.clear_report()
        counters.clear()
        torch.manual_seed(rank)
        x, w = torch.randn(16, 32, requires_grad=True), torch.randn(32, 24, requires_grad=True)
        got = torch.compile(fn, backend=commfuse.backend(min_mnk=0), fullgraph=True)(x, w)
        every = [torch.empty_like(got) for _ in range(WORLD)]
        dist.all_gather(every, (x @ w).detach())
        torch.testing.assert_close(got, sum(every))
        hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
        assert bool(hits) == (run == 1 and rank == 0), hits  # the pass ran on rank 1 only
        fused = commfuse.report().fused  # a rank whose cache served the graph reads its decisions back
        assert fused and all(r.cached for r in fused) == bool(hits), fused
        if run == 1:
            assert not any("did not compare" in note for note in notes.seen), notes.seen
            # settings the backend did not compare for a group the pass fused on: a warning, not a wait
            began = time.monotonic()
            alike.warn_unagreed([dist.group.WORLD.group_name], Settings(min_mnk=7), "a graph")
            assert time.monotonic() - began < 5
            assert any("a graph fused calls on group" in note and "did not compare" in note for note in notes.seen)
        dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_whose_inductor_caches_differ_compile_alike(tmp_path):
    """The backend compares the compile-time settings for a group used only inside an
    ``autograd.Function`` (in a higher-order op's subgraph) on every rank; the graph pass, which a
    rank whose Inductor cache holds the graph skips, compares nothing. Before, the backend did not
    see the group and the pass compared on the rank that compiled only: that rank waited for a
    peer that never published, and raised after ``COMMFUSE_TIMEOUT_S`` on settings that were alike."""
    files = [str(tmp_path / "rendezvous-0"), str(tmp_path / "rendezvous-1")]
    spawn(_cache_worker, args=(files, str(tmp_path)), nprocs=WORLD)


def _live_worker(rank: int, init_file: str, cache: str) -> None:
    from commfuse import env
    from commfuse.runtime import entry, groups, tuning  # noqa: F401  (entry: drops tuners on a change)
    from commfuse.runtime.facts import GroupFacts
    from commfuse.runtime.paths.base import Call

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=20))
    _settings(COMMFUSE_TUNE="cache", COMMFUSE_CACHE_DIR=cache)
    group = groups.get(dist.group.WORLD.group_name)
    facts, cpu = GroupFacts.simulated(WORLD), torch.device("cpu")
    call = Call("mm_all_reduce", 64, 64, 64, torch.bfloat16, WORLD)
    tuning.answer(group, call, facts, cpu, False)  # every rank: the group's tuner, its cache agreed
    tuner = group.tuner
    # settings that may differ, changed on rank 0 only: its next answer starts no collective
    with env.override(log="info" if rank == 0 else None, timeout_s=300 if rank == 0 else None):
        tuning.answer(group, call, facts, cpu, False)
    assert group.tuner is tuner
    mine = torch.tensor([float(10 + rank)])
    dist.all_reduce(mine)  # the program's next collective meets its peer's
    assert mine.item() == 21.0
    # a must-be-alike one, changed on every rank: a new tuner, its cache agreed anew
    with env.override(tune_margin="0.05"):
        tuning.answer(group, call, facts, cpu, False)
        assert group.tuner is not tuner
    dist.destroy_process_group()


def test_a_setting_that_may_differ_changed_on_one_rank_starts_no_collective(tmp_path):
    """``COMMFUSE_LOG`` or ``COMMFUSE_TIMEOUT_S`` changed on one rank mid-run keeps the tuners and the
    cache their ranks agreed on. Before, the change dropped that rank's tuner, and the next answer
    agreed on a cache again, alone: an all-reduce its peer never joined (a hang, or one that met the
    program's own next collective)."""
    spawn(_live_worker, args=(str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=WORLD)


def test_settings_that_fuse_alike_compare_alike(monkeypatch):
    """What the ranks compare at compile time is what decides the fusions: the launch bound in
    force, whether the environment or the backend's argument set it, and the set of patterns."""
    from commfuse import env
    from commfuse.config import PATTERNS, Settings

    monkeypatch.setenv("COMMFUSE_LAUNCH_BOUND_BYTES", "0")
    env.reload()
    from_env = Settings.build(patterns=PATTERNS).alike()
    monkeypatch.setenv("COMMFUSE_LAUNCH_BOUND_BYTES", "1048576")
    env.reload()
    from_argument = Settings.build(patterns=PATTERNS[::-1], launch_bound_bytes=0).alike()
    assert from_env == from_argument and from_env[LAUNCH_BOUND] == 0
    assert Settings.build(launch_bound_bytes=4096).alike()[LAUNCH_BOUND] == 4096
    assert Settings.build(patterns=["mm_all_reduce"], launch_bound_bytes=0).alike() != from_argument
    monkeypatch.delenv("COMMFUSE_LAUNCH_BOUND_BYTES")
    env.reload()
