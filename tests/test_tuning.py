"""The tuner's agreement, on the CPU: real ranks (gloo, 2 and 4 processes), injected timings.

Every rank must take the same path even when their own timings disagree (the argmin of the
slowest rank's time), a candidate that fails or is wrong on one rank only must be excluded on all,
ranks tuning different signatures must all get a clear error, and the cache must survive a round
trip and be ignored (with a warning) when corrupt or made for another machine.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from commfuse import env
from commfuse.runtime import groups, tuning
from commfuse.runtime.facts import GroupFacts
from commfuse.runtime.paths.base import Call
from helpers import spawn

BF16 = torch.bfloat16


def test_buckets_are_powers_of_two_and_the_bucket_top_is_timed():
    assert [tuning.bucket(m) for m in (1, 2, 3, 4, 5, 100, 4096, 4097)] == [1, 2, 4, 4, 8, 128, 4096, 8192]
    sig = tuning.Signature.of(Call("mm_all_reduce", 100, 4096, 4096, BF16, 2))
    assert sig.m == 128 and sig.call().m == 128
    assert tuning.Signature.of(Call("mm_all_reduce", 65, 4096, 4096, BF16, 2)).text() == sig.text()


def _tuner(group_name, world, timer, tmp, **facts):
    with env.override(cache_dir=tmp):
        group = groups.get(group_name)
        return tuning.Tuner(group, GroupFacts.simulated(world, **facts), torch.device("cpu"), timer=timer)


def _worker(rank: int, world: int, init_file: str, tmp: str, results: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    name = dist.group.WORLD.group_name
    out = {}
    with env.override(cache_dir=tmp, tune_margin="0.03"):
        # 1. timings that disagree between ranks: each rank finds another path fastest
        call = Call("mm_all_reduce", 4096, 4096, 8192, BF16, world)
        mine = {"nccl": 500.0, "one_shot": 300.0 + 200 * (rank % 2), "two_shot": 450.0, "ce_overlap": 900.0,
                "fused": 250.0 + 300 * (rank == 0), "graph": 800.0}

        def timer(path, sig, variant=None):
            return mine.get(path.name, 1000.0) * (1 + 0.001 * rank)

        tuner = _tuner(name, world, timer, tmp)
        entry = tuner.tune(tuning.Signature.of(call))
        out["choice"] = entry.choice
        out["times"] = entry.times_us
        # 2. a candidate that fails on one rank only is excluded everywhere
        def flaky(path, sig, variant=None):
            if path.name == "fused" and rank == world - 1:
                raise RuntimeError("wrong on this rank")
            return {"fused": 10.0, "nccl": 100.0}.get(path.name, 50.0)

        dist.barrier()  # (rank 0 has written the cache: every rank's next tuner reads the same file)
        entry = _tuner(name, world, flaky, tmp).tune(tuning.Signature.of(Call("mm_all_reduce", 8192, 2048, 4096, BF16,
                                                                             world)))
        out["flaky"] = (entry.choice, entry.failed)
        # 3. the rules' choice is kept unless beaten by the margin
        def close(path, sig, variant=None):
            return {"split_k": 100.0, "one_shot": 98.5}.get(path.name, 500.0)

        dist.barrier()
        entry = _tuner(name, world, close, tmp).tune(tuning.Signature.of(Call("mm_all_reduce", 16, 4096, 8192, BF16,
                                                                             world)))
        out["margin"] = (entry.rules, entry.choice)
        # 4. ranks tuning different signatures: an error on every rank
        sig = tuning.Signature.of(Call("mm_all_reduce", 1024 if rank == 0 else 2048, 4096, 8192, BF16, world))
        dist.barrier()
        try:
            _tuner(name, world, timer, tmp).tune(sig)
            out["mismatch"] = "no error"
        except RuntimeError as exc:
            out["mismatch"] = str(exc).replace(sig.text(), "<this rank's>")
        # 5. the cache written by rank 0 is read back by every rank
        dist.barrier()
        again = _tuner(name, world, timer, tmp)
        out["cached"] = sorted(again.entries)
        out["cached_choice"] = again.answer(call, capturing=False, may_tune=False)
        # 6. measurements in phases, with collectives of their own (as the NCCL candidate's), that
        # fail on one rank in different phases: every rank leaves the candidate after the same
        # phase, so the collectives stay paired and the job neither aborts nor hangs
        def phased(path, prepared, group, facts, device, variant=None):
            t = torch.ones(4)
            dist.all_reduce(t, group=group.pg())
            if path.name == "one_shot" and rank == 0:
                raise RuntimeError("the warm-up fails on rank 0")
            yield
            if path.name == "two_shot" and rank == world - 1:
                raise RuntimeError("wrong on the last rank")
            yield
            dist.all_reduce(t, group=group.pg())
            return {"nccl": 100.0, "one_shot": 10.0, "two_shot": 20.0}.get(path.name, 50.0) + float(t[0])

        saved = tuning.measure, tuning.prepare
        tuning.measure, tuning.prepare = phased, (lambda *a, **k: "prepared")
        try:
            dist.barrier()
            entry = _tuner(name, world, None, tmp).tune(
                tuning.Signature.of(Call("mm_all_reduce", 2048, 4096, 8192, BF16, world)))
        finally:
            tuning.measure, tuning.prepare = saved
        out["phased"] = (entry.choice, sorted(entry.failed), sorted(entry.times_us))
        # 8. (before 7, which leaves the group refusing calls) the inputs cannot be made on one rank:
        # every rank leaves before any other collective, and the rules decide, untimed
        real_inputs = tuning._inputs

        def short_of_memory(sig, group, device, seed):
            if rank == 0:
                raise torch.OutOfMemoryError("no memory for the inputs")
            return real_inputs(sig, group, device, seed)

        tuning._inputs = short_of_memory
        try:
            dist.barrier()
            entry = _tuner(name, world, None, tmp).tune(
                tuning.Signature.of(Call("mm_all_reduce", 512, 4096, 8192, BF16, world)))
        finally:
            tuning._inputs = real_inputs
        out["no_inputs"] = (entry.choice == entry.rules, sorted(entry.failed) == sorted(entry.times_us))
        # 7. a wait of an earlier call timed out on one rank: tuning raises on every rank (it would
        # otherwise clear that record while recovering from a failed candidate)
        if rank == world - 1:
            groups.get(name).err[:5] = torch.tensor([1, 4, 0, 1, 3], dtype=torch.int32)
        dist.barrier()
        try:
            _tuner(name, world, timer, tmp).tune(tuning.Signature.of(Call("mm_all_reduce", 64, 4096, 8192, BF16,
                                                                          world)))
            out["dirty"] = "no error"
        except RuntimeError:
            out["dirty"] = "raised"
    with open(os.path.join(results, f"{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def _run(world: int):
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as results:
        init = os.path.join(tmp, "init")
        spawn(_worker, args=(world, init, tmp, results), nprocs=world)
        return [json.load(open(os.path.join(results, f"{r}.json"))) for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_agree_on_every_answer(world):
    outs = _run(world)
    first = outs[0]
    for out in outs[1:]:  # every rank took the same answers, and saw the same reduced times
        assert out == first
    # the argmin of the slowest rank's time: one_shot is 500 on odd ranks, fused 550 on rank 0
    times = first["times"]
    finite = {k: v for k, v in times.items() if v is not None and not math.isinf(v)}
    assert first["choice"] == min(finite, key=finite.get)
    assert times["one_shot"] == pytest.approx(500 * (1 + 0.001 * (world - 1)), rel=1e-6)
    assert times["fused"] == pytest.approx(550, rel=1e-2)
    # the failing candidate is excluded on every rank though it was the fastest elsewhere
    choice, failed = first["flaky"]
    assert "fused" in failed and choice != "fused"
    # 98.5 against 100 is within the 3% margin: the rules' split_k stays
    assert first["margin"] == ["split_k", "split_k"]
    assert "tuning different call signatures" in first["mismatch"]
    assert len(first["cached"]) == 3 and first["cached_choice"] == first["choice"]
    choice, failed, timed = first["phased"]
    assert {"one_shot", "two_shot"} <= set(timed)
    assert failed == ["one_shot", "two_shot"] and choice not in failed
    assert first["dirty"] == "raised"
    assert first["no_inputs"] == [True, True]


def _compile_first_worker(rank: int, world: int, init_file: str, tmp: str, results: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    name = dist.group.WORLD.group_name
    group = groups.get(name)
    out = {}
    with env.override(cache_dir=tmp, tune_margin="0.03"):
        # 1. every candidate compiled on every rank, under the ordinary bound, then a barrier,
        # then the timings under the tuning bound
        events = []
        real_barrier = dist.barrier

        def barrier(*a, **k):
            events.append(["barrier"])
            return real_barrier(*a, **k)

        def compiler(path, sig, variant=None):
            events.append(["compile", path.name, group.tuning_timeout_ns])

        def timer(path, sig, variant=None):
            events.append(["time", path.name, group.tuning_timeout_ns])
            return {"fused": 10.0, "nccl": 100.0}.get(path.name, 50.0)

        dist.barrier = barrier
        try:
            with env.override(cache_dir=tmp):
                tuner = tuning.Tuner(group, GroupFacts.simulated(world), torch.device("cpu"), timer=timer,
                                     compiler=compiler)
            tuner.tune(tuning.Signature.of(Call("mm_all_reduce", 4096, 4096, 8192, BF16, world)))
        finally:
            dist.barrier = real_barrier
        out["events"] = events
        # 2. a candidate whose wait timed out on one rank is excluded from this run and kept as
        # transient: later runs (new processes: new tuners reading the cache) tune it again, up to
        # TRANSIENT_TRIES runs; a candidate that failed otherwise stays excluded
        calls = []

        def times_out(path, sig, variant=None):
            calls.append(path.name)
            if path.name == "fused" and rank == 0:  # what a kernel whose wait timed out leaves
                group.err[:5] = torch.tensor([1, 1, 0, 1, 5], dtype=torch.int32)
            if path.name == "one_shot" and rank == world - 1:
                raise RuntimeError("wrong on this rank")
            return {"fused": 10.0, "one_shot": 5.0, "nccl": 100.0}.get(path.name, 50.0)

        call = Call("mm_all_reduce", 8192, 2048, 4096, BF16, world)
        runs = []
        for _ in range(tuning.TRANSIENT_TRIES + 1):
            dist.barrier()  # (rank 0 wrote the cache: every rank's next tuner reads the same file)
            calls.clear()
            tuner = _tuner(name, world, times_out, tmp)
            first = tuner.answer(call, capturing=False, may_tune=True)
            again = tuner.answer(call, capturing=False, may_tune=True)  # this run tuned it: kept
            entry = tuner.entries[tuning.Signature.of(call).text()]
            runs.append([first, again, bool(calls), sorted(entry.failed), entry.transient, entry.tries])
        out["transient"] = runs
        # 3. a retry that succeeds keeps the candidate for good
        healthy = {"fused": 10.0, "nccl": 100.0}
        other = Call("mm_all_reduce", 8192, 2048, 2048, BF16, world)
        dist.barrier()
        first = _tuner(name, world, times_out, tmp).answer(other, capturing=False, may_tune=True)
        dist.barrier()
        retried = _tuner(name, world, lambda path, sig, variant=None: healthy.get(path.name, 50.0), tmp)
        second = retried.answer(other, capturing=False, may_tune=True)
        entry = retried.entries[tuning.Signature.of(other).text()]
        out["recovered"] = [first, second, entry.transient, entry.failed]
    with open(os.path.join(results, f"{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def test_candidates_compile_before_any_bounded_wait_and_timeouts_are_retried_later():
    """A first compile that takes one rank longer than the tuning bound more than its peer must not
    decide the answer: every candidate runs once (its compile) on every rank under the ordinary
    bound, then a barrier, then the bounded warm-up and timing. A timed-out wait during tuning is
    cached as transient, not as a permanent exclusion."""
    world = 2
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as results:
        spawn(_compile_first_worker, args=(world, os.path.join(tmp, "init"), tmp, results), nprocs=world)
        outs = [json.load(open(os.path.join(results, f"{r}.json"))) for r in range(world)]
    assert outs[1]["transient"] == outs[0]["transient"] and outs[1]["recovered"] == outs[0]["recovered"]
    events = outs[0]["events"]
    kinds = [e[0] for e in events]
    compiled = kinds.index("barrier")
    assert set(kinds[:compiled]) == {"compile"} and set(kinds[compiled + 1:]) == {"time"}
    assert [e[1] for e in events[:compiled]] == [e[1] for e in events[compiled + 1:]]  # every candidate
    assert {e[2] for e in events[:compiled]} == {None}  # the ordinary bound
    assert {e[2] for e in events[compiled + 1:]} == {int(tuning.TUNING_TIMEOUT_S * 1e9)}
    runs = outs[0]["transient"]
    tries = tuning.TRANSIENT_TRIES
    for i, (first, again, tuned, failed, transient, count) in enumerate(runs):
        assert first == again and first not in ("fused", "one_shot")
        assert failed == ["fused", "one_shot"] and transient == ["fused"]  # one_shot: not a timeout
        assert tuned == (i < tries) and count == min(i + 1, tries)  # tuned again until the last try
    first, second, transient, failed = outs[0]["recovered"]
    assert first != "fused" and second == "fused" and transient == [] and failed == []


def _timeout_fails_check_worker(rank: int, world: int, init_file: str, tmp: str, results: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    group = groups.get(dist.group.WORLD.group_name)

    def timer(path, sig, variant=None):
        if path.name == "fused":  # rank 0's wait timed out: NaN in its output, and in what rank 1 read of it
            if rank == 0:
                group.err[:5] = torch.tensor([1, 1, 0, 1, 5], dtype=torch.int32)
            raise RuntimeError("fused is wrong on this rank (relative error nan)")
        if path.name == "one_shot" and rank == 1:  # wrong with no timeout anywhere
            raise RuntimeError("one_shot is wrong on this rank (relative error 1.0)")
        return {"nccl": 100.0}.get(path.name, 50.0)

    with env.override(cache_dir=tmp):
        tuner = tuning.Tuner(group, GroupFacts.simulated(world), torch.device("cpu"), timer=timer)
        entry = tuner.tune(tuning.Signature.of(Call("mm_all_reduce", 8192, 2048, 4096, BF16, world)))
    with open(os.path.join(results, f"{rank}.json"), "w") as f:
        json.dump([sorted(entry.failed), entry.transient], f)
    dist.destroy_process_group()


def test_a_check_that_fails_with_a_timed_out_wait_is_transient():
    """A wait that times out leaves NaN where the late peer's data would go, so the candidate's
    check fails in the same phase, on the rank that timed out and on a peer that read its output:
    that failure is the timeout's (transient), not the candidate's. A wrong result with no timeout
    on any rank stays excluded."""
    world = 2
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as results:
        spawn(_timeout_fails_check_worker, args=(world, os.path.join(tmp, "init"), tmp, results), nprocs=world)
        outs = [json.load(open(os.path.join(results, f"{r}.json"))) for r in range(world)]
    assert outs[0] == outs[1] == [["fused", "one_shot"], ["fused"]]


def _cache_worker(rank: int, world: int, init_file: str, tmp: str, results: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    name = dist.group.WORLD.group_name
    facts = GroupFacts.simulated(world)
    entry = tuning.Entry("fused", "fused", {"fused": 1.0, "nccl": 2.0}, [], 0.03)
    out = {}
    for case, written in (("same", {"sig": entry}), ("differ", {"sig": entry} if rank == 0 else {})):
        cache = os.path.join(tmp, case, str(rank))  # each rank's own cache directory
        os.makedirs(cache)
        with env.override(cache_dir=cache):
            if written:
                tuning.write(tuning.cache_path(tuning.machine_key(facts)), tuning.machine_key(facts), written)
            tuner = tuning.Tuner(groups.get(name), facts, torch.device("cpu"),
                                 timer=lambda path, sig, variant=None: 1.0)
            out[case] = sorted(tuner.entries)
    with open(os.path.join(results, f"{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def test_cache_reads_agree_or_are_dropped():
    """Ranks whose files hold the same answers use them; ranks whose files differ (one rank's
    cache written mid-run, another's missing) agree to use none, on every rank."""
    world = 2
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as results:
        spawn(_cache_worker, args=(world, os.path.join(tmp, "init"), tmp, results), nprocs=world)
        outs = [json.load(open(os.path.join(results, f"{r}.json"))) for r in range(world)]
    assert [o["same"] for o in outs] == [["sig"], ["sig"]]
    assert [o["differ"] for o in outs] == [[], []]


def test_a_corrupt_or_foreign_cache_is_ignored_with_a_warning(tmp_path, caplog):
    key = {"gpu": "test", "world": 2}
    path = tmp_path / "tuned.json"
    entry = tuning.Entry("fused", "one_shot", {"fused": 1.0, "one_shot": 2.0, "nccl": math.inf}, ["nccl"], 0.03)
    tuning.write(path, key, {"sig": entry})
    back = tuning.read(path, key)
    assert back["sig"].choice == "fused" and math.isinf(back["sig"].times_us["nccl"])
    assert tuning.read(path, {"gpu": "other", "world": 2}) == {}  # another machine's (or version's) file
    assert "another machine" in caplog.text
    path.write_text("{not json")
    assert tuning.read(path, key) == {}
    assert "corrupt" in caplog.text
    tuning.write(path, key, {"sig": entry})  # a corrupt file is replaced, not merged
    assert set(tuning.read(path, key)) == {"sig"}


def test_the_machine_key_changes_with_versions_topology_and_settings():
    facts = GroupFacts.simulated(2)
    base = tuning.machine_key(facts)
    assert tuning.machine_key(GroupFacts.simulated(2, peer_access=False)) != base
    assert tuning.machine_key(GroupFacts.simulated(4)) != base
    assert tuning.machine_key(GroupFacts.simulated(2, name="NVIDIA H100")) != base
    with env.override(algo="fused"):
        assert tuning.machine_key(facts) != base
    assert "commfuse" in base and "triton" in base and "nccl" in base


def test_the_tuning_margin_is_part_of_the_cache_key():
    """A margin of 0.03 keeps the rules' path where 0.01 takes a tuned one: an answer tuned under
    one margin must not be read under another (it was not part of the key)."""
    with env.override(tune_margin="0.03"):
        base = tuning.machine_key(GroupFacts.simulated(2))
        path = tuning.cache_path(base)
    with env.override(tune_margin="0.01"):
        key = tuning.machine_key(GroupFacts.simulated(2))
        assert key != base and tuning.cache_path(key) != path
        assert ["tune_margin", 0.01] in key["settings"]


def test_nothing_is_tuned_inside_a_capture(monkeypatch, tmp_path):
    from helpers import init_fake_pg

    init_fake_pg(2)
    calls = []
    with env.override(cache_dir=str(tmp_path), tune="first-use"):
        group = groups.get(dist.group.WORLD.group_name)
        tuner = tuning.Tuner(group, GroupFacts.simulated(2), torch.device("cpu"),
                             timer=lambda *a, **k: calls.append(a) or 1.0)
        monkeypatch.setattr(group, "tuner", tuner)
        call = Call("mm_all_reduce", 16, 4096, 8192, BF16, 2)
        assert tuning.answer(group, call, GroupFacts.simulated(2), torch.device("cpu"), capturing=True) is None
        assert calls == []


def test_slab_signatures_are_timed_in_their_own_layout():
    """A collective that cuts every rank's rows into slabs (a batch of sequences) is tuned on
    inputs in that layout, cut along dim 1, as the slab paths read them."""
    from helpers import init_fake_pg

    init_fake_pg(2)
    group = groups.get(dist.group.WORLD.group_name)
    cpu = torch.device("cpu")
    ag = tuning.Signature.of(Call("all_gather_mm", 64, 32, 16, BF16, 2, rows_dim=1, slabs=2))
    call, args = tuning._inputs(ag, group, cpu, seed=0)
    assert tuple(args.shard.shape) == (2, 16, 32) and args.gather_dim == 1 and call.slabs == 2
    rs = tuning.Signature.of(Call("mm_reduce_scatter", 64, 32, 16, BF16, 2, rows_dim=1, slabs=4))
    call, args = tuning._inputs(rs, group, cpu, seed=0)
    assert tuple(args.a.shape) == (64, 32) and args.shape == [4, 16, 16] and args.scatter_dim == 1
    for sig in (ag, rs):  # the unfused op takes them (its checks are the schema's)
        op = getattr(torch.ops.commfuse, sig.op)
        with torch.no_grad():
            out = op(*tuning._inputs(sig, group, cpu, seed=0)[1])
        assert _first(out).dtype == BF16
    flat = tuning.Signature.of(Call("all_gather_mm", 64, 32, 16, BF16, 2))
    assert tuple(tuning._inputs(flat, group, cpu, seed=0)[1].shard.shape) == (32, 32)
    # slab counts and world sizes that do not divide the bucket: the timed M is the bucket's
    # largest that every rank's block and slab cut whole
    for op, m, world, slabs, timed in [("mm_reduce_scatter", 60, 2, 3, 60), ("all_gather_mm", 60, 2, 3, 60),
                                       ("all_gather_mm", 96, 3, 1, 126), ("mm_all_reduce", 100, 3, 1, 128)]:
        sig = tuning.Signature.of(Call(op, m, 32, 16, BF16, world, rows_dim=1 if slabs > 1 else 0, slabs=slabs))
        assert sig.call().m == timed, (op, m, world, slabs)
    sig = tuning.Signature.of(Call("mm_reduce_scatter", 60, 32, 16, BF16, 2, rows_dim=1, slabs=3))
    with torch.no_grad():
        out = torch.ops.commfuse.mm_reduce_scatter(*tuning._inputs(sig, group, cpu, seed=0)[1])
    assert tuple(out.shape) == (3, 10, 16)


def _first(out):
    return out[0] if isinstance(out, tuple) else out
