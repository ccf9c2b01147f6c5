"""Run by test_tiles.py under TRITON_INTERPRET=1: the exchange kernels of ``exchange.py`` (one-shot
and two-shot all-reduce, the pull gather, the reduce-scatter, the graph lane's staged one-shot) as one rank of 2, 4 or 8, in one
process. The other ranks are simulated: their workspaces hold what they would hold when this
rank reads them (their partials or shards; for two-shot's second phase, their reduced share in
place), and their flags are raised. This rank's signals are checked in their buffers after.
Exits non-zero on a mismatch."""

from __future__ import annotations

import torch
import triton

from commfuse.kernels import exchange
from commfuse.kernels.codes import ERR_MISMATCH, flag_value
from interpreter_peers import DT, group
BLOCK = 64  # elements per program per step: several programs and steps on small tensors


def raise_peer_flags(ws, me, epoch: int, slots: int) -> None:
    for p in range(me.world):
        if p != me.rank:
            me.flags.view(-1, me.world)[:slots, p] = epoch


def my_signals(ws, me, epoch: int, slots: int) -> bool:
    return all(bool(ws[p].flags.view(-1, me.world)[:slots, me.rank].eq(epoch).all())
               for p in range(me.world) if p != me.rank)


def all_reduce_case(world: int, rank: int, algo: str, numel: int) -> None:
    torch.manual_seed(world * 10 + rank + numel)
    ws = group(world, 1 << 16, 3)
    me = ws[rank]
    for _ in range(2):  # two calls: both parities
        epoch, parity = me.next_epoch()
        parts = [torch.randn(numel, dtype=DT) for _ in range(world)]
        total = sum(x.float() for x in parts).to(DT)
        views = [x.data(parity, (numel,), DT) for x in ws]
        for p in range(world):
            views[p].copy_(parts[p])
        if algo == "two_shot":  # by the second phase each peer has reduced its share in place
            share = triton.cdiv(triton.cdiv(numel, world), BLOCK) * BLOCK
            for p in range(world):
                if p != rank:
                    views[p][p * share:(p + 1) * share] = total[p * share:(p + 1) * share]
        raise_peer_flags(ws, me, epoch, 2 * me.max_programs)
        out = torch.full((numel,), float("nan"), dtype=DT)
        exchange.all_reduce(me, views[rank], out, epoch, algo, 1, block=BLOCK, max_programs=me.max_programs,
                            num_warps=4)
        want = sum(x.float() for x in parts)
        err = ((out.float() - want).norm() / want.norm()).item()
        assert err < 2e-3, (world, rank, algo, numel, err)
        if algo == "one_shot":
            assert my_signals(ws, me, epoch, exchange._programs(me, numel, BLOCK, me.max_programs))
        else:  # two phases, a slot per program each
            assert my_signals(ws, me, epoch, 2 * exchange._programs(me, share, BLOCK, me.max_programs))
        assert int(me.err[0]) == 0


def rowwise_case(world: int, rank: int, what: str, outer: int, inner: int) -> None:
    torch.manual_seed(world * 100 + rank + outer + inner)
    ws = group(world, 1 << 16, 3)
    me = ws[rank]
    for _ in range(2):
        epoch, parity = me.next_epoch()
        raise_peer_flags(ws, me, epoch, me.max_programs)
        if what == "gather":
            shards = [torch.randn(outer, inner, dtype=DT) for _ in range(world)]
            views = [x.data(parity, (outer, inner), DT) for x in ws]
            for p in range(world):
                views[p].copy_(shards[p])
            out = torch.full((outer, world, inner), float("nan"), dtype=DT)
            exchange.gather(me, views[rank], out, outer, inner, epoch, 2, block=BLOCK, num_warps=4)
            assert torch.equal(out, torch.stack(shards, dim=1)), (world, rank, "gather")
        else:
            parts = [torch.randn(outer, world, inner, dtype=DT) for _ in range(world)]
            views = [x.data(parity, (outer, world, inner), DT) for x in ws]
            for p in range(world):
                views[p].copy_(parts[p])
            out = torch.full((outer, inner), float("nan"), dtype=DT)
            exchange.reduce_scatter(me, views[rank], out, outer, inner, epoch, 3, block=BLOCK, num_warps=4)
            want = sum(x.float() for x in parts)[:, rank]
            assert ((out.float() - want).norm() / want.norm()).item() < 2e-3, (world, rank, "reduce_scatter")
        assert my_signals(ws, me, epoch, 1), (what, "signals")
        assert int(me.err[0]) == 0


def lane_case(world: int, rank: int, numel: int) -> None:
    """The graph lane's staged one-shot: the epoch from the device counters, advanced by the kernel."""
    torch.manual_seed(world * 1000 + rank + numel)
    lanes = group(world, 1 << 14, 3, lane=True)
    me = lanes[rank]
    for call in range(3):
        epoch = call + 1
        parts = [torch.randn(numel, dtype=DT) for _ in range(world)]
        half = me.half_elems(DT)
        at = (epoch % 2) * half
        for p in range(world):
            if p != rank:  # what rank p staged, and its flags
                lanes[p].data(DT)[at:at + numel].copy_(parts[p])
                me.flags.view(-1, world)[:me.max_programs, p] = flag_value(epoch)
        out = torch.full((numel,), float("nan"), dtype=DT)
        exchange.staged_all_reduce(me, parts[rank], out, 4, block=BLOCK, num_warps=4)
        want = sum(x.float() for x in parts)
        assert ((out.float() - want).norm() / want.norm()).item() < 2e-3, (world, rank, "lane", call)
        assert me.counter.eq(epoch).all(), "every epoch slot advanced"
        grid = exchange._programs(me, numel, BLOCK, me.flags.numel() // world)
        assert all(bool(lanes[p].flags.view(-1, world)[:grid, rank].eq(flag_value(epoch)).all())
                   for p in range(world) if p != rank), "signals"
        assert int(me.err[0]) == 0


def device_epoch_case(world: int, rank: int, numel: int) -> None:
    """The copy-engine call's kernels in their CUDA-graph form (``ce_graphs.py``): the one-shot and
    the barrier read the epoch from the workspace's epoch cell, not from their ``epoch`` argument
    (0 here: every wait would pass with it, so what shows a kernel that used it is the epoch it
    signals, 0 instead of the cell's)."""
    torch.manual_seed(world * 10000 + rank + numel)
    ws = group(world, 1 << 16, 3)
    me = ws[rank]
    for _ in range(2):
        epoch, parity = me.next_epoch()
        me.epoch_cell.fill_(epoch)
        parts = [torch.randn(numel, dtype=DT) for _ in range(world)]
        views = [x.data(parity, (numel,), DT) for x in ws]
        for p in range(world):
            views[p].copy_(parts[p])
        slots = 7 + me.max_programs  # a barrier at slot 6, the one-shot from slot 7 on
        raise_peer_flags(ws, me, epoch, slots)
        exchange.barrier(me, None, 1, slot=6)
        out = torch.full((numel,), float("nan"), dtype=DT)
        exchange.all_reduce(me, views[rank], out, None, "one_shot", 1, block=BLOCK, max_programs=me.max_programs,
                            num_warps=4, slot_base=7)
        want = sum(x.float() for x in parts)
        assert ((out.float() - want).norm() / want.norm()).item() < 2e-3, (world, rank, "device epoch")
        grid = exchange._programs(me, numel, BLOCK, me.max_programs)
        for p in range(world):
            if p != rank:
                mine = ws[p].flags.view(-1, world)[:, rank]
                assert int(mine[6]) == epoch and bool(mine[7:7 + grid].eq(epoch).all()), "signals"
        assert int(me.err[0]) == 0


def late_peer_case(world: int, rank: int) -> None:
    """A peer that never signals, its half holding an earlier call's bytes: every wait is past its
    bound at once. The kernels must leave NaN where that peer's data would go (one-shot, two-shot,
    reduce-scatter: every output; the gather: the peers' rows, its own copied), never a sum with
    the stale bytes, and name the late peer in the error word."""
    late = (rank + 1) % world
    ws = group(world, 1 << 16, 3, timeout_ns=-1)
    me = ws[rank]
    epoch, parity = me.next_epoch()

    def arm(shape):
        views = [x.data(parity, shape, DT) for x in ws]
        for p, v in enumerate(views):
            v.copy_(torch.randn(shape, dtype=DT) if p != late else torch.full(shape, 100.0, dtype=DT))
        me.flags.zero_()
        for p in range(world):
            if p not in (rank, late):
                me.flags.view(-1, world)[:2 * me.max_programs, p] = epoch
        me.err.zero_()
        return views

    for algo in ("one_shot", "two_shot"):
        views = arm((1000,))
        out = torch.zeros(1000, dtype=DT)
        exchange.all_reduce(me, views[rank], out, epoch, algo, 1, block=BLOCK,
                            max_programs=me.max_programs, num_warps=4)
        assert bool(out.isnan().all()), (world, rank, algo, "a late peer's call left values")
        assert me.err.tolist()[:3] == [1, 1, rank], (algo, me.err.tolist())
    views = arm((5, 48))
    out = torch.zeros(5, world, 48, dtype=DT)
    exchange.gather(me, views[rank], out, 5, 48, epoch, 2, block=BLOCK, num_warps=4)
    assert torch.equal(out[:, rank], views[rank]), (world, rank, "own rows")
    others = [p for p in range(world) if p != rank]
    assert bool(out[:, others].isnan().all()), (world, rank, "gather: a late peer's rows")
    # bytes (the row-wise FP8 gather's FP8 rows and float32 scales): all ones, NaN in both
    views = [x.data(parity, (5, 48), torch.uint8) for x in ws]
    for p, v in enumerate(views):
        v.copy_(torch.randint(0, 255, (5, 48), dtype=torch.uint8))
    me.err.zero_()
    out = torch.zeros(5, world, 48, dtype=torch.uint8)
    exchange.gather(me, views[rank], out, 5, 48, epoch, 2, block=BLOCK, num_warps=4)
    assert torch.equal(out[:, rank], views[rank]), (world, rank, "own bytes")
    assert bool((out[:, others] == 255).all()), (world, rank, "gather: a late peer's bytes")
    assert bool(out[:, others].reshape(-1).view(torch.float8_e4m3fn).float().isnan().all())
    assert bool(out[:, others].reshape(-1).view(torch.float32).isnan().all())
    views = arm((3, world, 40))
    out = torch.zeros(3, 40, dtype=DT)
    exchange.reduce_scatter(me, views[rank], out, 3, 40, epoch, 3, block=BLOCK, num_warps=4)
    assert bool(out.isnan().all()), (world, rank, "reduce_scatter")
    assert int(me.err[3]) in range(world) and int(me.err[3]) != rank


TAG, OTHER = 0x155, 0x2AA


def mismatch_case(world: int, rank: int) -> None:
    """The pairing check (``COMMFUSE_PAIRING_CHECK``): one peer signals this call's count under
    another tag (it makes another call: a rank skipped one). Every kernel leaves NaN where that
    peer's data would go, as for a late peer, and names the kind, the op, both ranks, the count
    and both tags in the error word, with no bound to wait out (the bound here is 600 s). A peer
    at the same count with tag 0 (its check off) or at a later count with another tag pairs."""
    odd = (rank + 1) % world
    ws = group(world, 1 << 16, 3)
    me = ws[rank]
    epoch, parity = me.next_epoch(tag=TAG)
    count = me.epoch

    def arm(shape, peer_value):
        parts = [torch.randn(shape, dtype=DT) for _ in range(world)]
        for p, x in enumerate(ws):
            x.data(parity, shape, DT).copy_(parts[p])
        me.flags.zero_()
        for p in range(world):
            if p != rank:
                me.flags.view(-1, world)[:2 * me.max_programs, p] = peer_value if p == odd else epoch
        me.err.zero_()
        return parts

    def named(op):
        assert me.err.tolist()[:7] == [ERR_MISMATCH, op, rank, odd, count, TAG, OTHER], me.err.tolist()

    for algo in ("one_shot", "two_shot"):
        arm((1000,), flag_value(count, OTHER))
        out = torch.zeros(1000, dtype=DT)
        exchange.all_reduce(me, me.data(parity, (1000,), DT), out, epoch, algo, 1, block=BLOCK,
                            max_programs=me.max_programs, num_warps=4)
        assert bool(out.isnan().all()), (world, rank, algo, "another call's data was summed")
        named(1)
    arm((5, 48), flag_value(count, OTHER))
    out = torch.zeros(5, world, 48, dtype=DT)
    exchange.gather(me, me.data(parity, (5, 48), DT), out, 5, 48, epoch, 2, block=BLOCK, num_warps=4)
    assert bool(out[:, [p for p in range(world) if p != rank]].isnan().all()), (world, rank, "gather")
    named(2)
    arm((3, world, 40), flag_value(count, OTHER))
    out = torch.zeros(3, 40, dtype=DT)
    exchange.reduce_scatter(me, me.data(parity, (3, world, 40), DT), out, 3, 40, epoch, 3, block=BLOCK,
                            num_warps=4)
    assert bool(out.isnan().all()), (world, rank, "reduce_scatter")
    named(3)
    for value in (flag_value(count, 0), flag_value(count + 1, OTHER)):  # check off there; a peer ahead
        parts = arm((1000,), value)
        out = torch.full((1000,), float("nan"), dtype=DT)
        exchange.all_reduce(me, me.data(parity, (1000,), DT), out, epoch, "one_shot", 1, block=BLOCK,
                            max_programs=me.max_programs, num_warps=4)
        want = sum(x.float() for x in parts)
        assert ((out.float() - want).norm() / want.norm()).item() < 2e-3 and int(me.err[0]) == 0, value
    # the graph lane: the count from the device, the tag fixed in the launch
    lanes = group(world, 1 << 14, 3, lane=True)
    lane = lanes[rank]
    for p in range(world):
        if p != rank:
            lane.flags.view(-1, world)[:lane.max_programs, p] = flag_value(1, OTHER if p == odd else TAG)
    out = torch.zeros(300, dtype=DT)
    exchange.staged_all_reduce(lane, torch.randn(300, dtype=DT), out, 4, tag=TAG, block=BLOCK, num_warps=4)
    assert bool(out.isnan().all()), (world, rank, "lane")
    assert lane.err.tolist()[:7] == [ERR_MISMATCH, 4, rank, odd, 1, TAG, OTHER], lane.err.tolist()


def main() -> None:
    for world, rank in ((2, 1), (4, 2), (8, 5)):
        for algo in ("one_shot", "two_shot"):
            all_reduce_case(world, rank, algo, 1000)  # not a multiple of the block or the world
        rowwise_case(world, rank, "gather", 5, 48)
        rowwise_case(world, rank, "reduce_scatter", 3, 40)
        lane_case(world, rank, 300)
        device_epoch_case(world, rank, 500)
        late_peer_case(world, rank)
        mismatch_case(world, rank)
    print("ok")


if __name__ == "__main__":
    main()
