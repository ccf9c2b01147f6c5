"""Run by test_tiles.py under TRITON_INTERPRET=1: the split-K kernel of ``fused_split_k.py`` as
one rank of 2, 4 or 8, in one process. The other ranks are simulated: their sums and flags are
written into this rank's workspace before the launch, as their pushes would have left them, and
this rank's pushes are checked in their buffers after. Both epoch modes: host epochs (a workspace) and device epochs (a graph
lane, two calls in a row). Exits non-zero on a mismatch.

What the interpreter cannot show: it runs programs one after another, so in a call of more
units than programs the first program claims every unit (no concurrent claims, no arrival
races, the deferred tile output always follows the next unit of the same program), in a
one-wave call each program runs its own unit alone, and the peers' flags are set before the
launch, so no wait ever spins. Those run on GPUs (``tests/gpu/test_gpu_split_k.py``)."""

from __future__ import annotations

import torch

from commfuse.kernels import fused_split_k, tiles
from commfuse.kernels.codes import ERR_MISMATCH, GRAPH_LANE_OP, flag_value
from interpreter_peers import DT, group


def blocks(full: torch.Tensor, bm: int, bn: int, group_m: int = 1) -> torch.Tensor:
    """``full`` [M, N] as the kernel's dense [tiles, bm, bn] blocks in ``tiles.tile_coords``'s
    order (``group_m`` 1: tile t = (t // num_n, t % num_n))."""
    m, n = full.shape
    num_m, num_n = -(-m // bm), -(-n // bn)
    pad = torch.zeros(num_m * bm, num_n * bn, dtype=full.dtype)
    pad[:m, :n] = full
    grid = pad.view(num_m, bm, num_n, bn).permute(0, 2, 1, 3)
    order = []
    for t in range(num_m * num_n):  # tile_coords, written out again
        per_group = group_m * num_n
        first_m = (t // per_group) * group_m
        size_m = min(num_m - first_m, group_m)
        order.append((first_m + (t % per_group) % size_m, (t % per_group) // size_m))
    return torch.stack([grid[i, j] for i, j in order])


def ll_flag(epoch: int) -> int:
    """An LL word's flag bits (the high 32 of the int64 word) as a signed int64 value."""
    word = (0xFFA00000 | (epoch & ((1 << fused_split_k.LL_EPOCH_BITS) - 1))) << 32
    return word - (1 << 64) if word >= 1 << 63 else word


def ll_words(values: torch.Tensor, epoch: int) -> torch.Tensor:
    """[..., 16] 16-bit values as the kernel's LL words: columns 2j, 2j + 1 and the flag."""
    bits = values.view(torch.int16).view(*values.shape[:-1], -1, 2).to(torch.int64) & 0xFFFF
    return bits[..., 0] | (bits[..., 1] << 16) | ll_flag(epoch)


def ll_values(words: torch.Tensor, epoch: int) -> torch.Tensor:
    """``ll_words`` back to [..., 16] values; every word must carry ``epoch``'s flag."""
    assert (words & -(1 << 32)).eq(ll_flag(epoch)).all(), "a word without the call's flag"
    pairs = torch.stack([words & 0xFFFF, (words >> 16) & 0xFFFF], -1).to(torch.int16)
    return pairs.view(DT).reshape(*words.shape[:-1], -1)


def case(m: int, k: int, n: int, split: int, bias: bool, lane: bool, calls: int = 1, world: int = 2,
         rank: int = 0, ll: bool | None = False, group_m: int = 1, fp8: str | None = None) -> None:
    """``rank`` of ``world`` runs the kernel; every other rank's pushes are simulated. ``ll``:
    the sums travel as LL words (not in a lane: there the kernel keeps its flags); None: where
    ``uses_ll`` says. ``group_m``: the tiles' grouped order (``tiles.tile_coords``). ``fp8``:
    e4m3 operands with ``_scaled_mm``'s scales, ``"tensorwise"`` or ``"rowwise"``, each rank its
    own (drawn from [0.25, 0.5]: a scale lost is off by 2x or more), the partials
    ``torch._scaled_mm``'s."""
    torch.manual_seed(m * 1000 + k + n + split + world)
    tile = tiles.TileConfig(bm=16, bn=16, bk=32 if fp8 else 16, stages=2, warps=4, group_m=group_m, reducers=0)
    cfg = fused_split_k.config(m, k, n, 3, split, tile, ll=ll)
    ll = fused_split_k.uses_ll(cfg, m, n, world, DT, lane)
    count = fused_split_k.num_tiles(m, n, cfg)
    data_bytes = 1 << 17
    ws = group(world, data_bytes, 3, lane)
    me = ws[rank]
    for call in range(calls):
        c = [torch.randn(n, dtype=DT) if bias else None for _ in range(world)]
        scales = [None] * world
        if fp8:
            a = [(torch.randn(m, k) * 8).to(torch.float8_e4m3fn) for _ in range(world)]
            w = [(torch.randn(n, k) * 8).to(torch.float8_e4m3fn) for _ in range(world)]
            shapes = ((m, 1), (1, n)) if fp8 == "rowwise" else ((), ())
            scales = [tuple(torch.rand(shape) / 4 + 0.25 for shape in shapes) for _ in range(world)]
            partial = [torch._scaled_mm(a[r], w[r].t(), *scales[r], c[r], out_dtype=DT, use_fast_accum=True)
                       for r in range(world)]
        else:
            a = [torch.randn(m, k, dtype=DT) for _ in range(world)]
            w = [(torch.randn(n, k, dtype=DT) / k ** 0.5) for _ in range(world)]
            partial = [(a[r].float() @ w[r].float().t() + (c[r].float() if bias else 0)).to(DT)
                       for r in range(world)]
        if lane:
            epoch = int(me.counter[0]) + 1
            sums = [x.data(DT) for x in ws]
            flags = [x.flags for x in ws]
            half = me.half_elems(DT)
        else:
            epoch = me.epoch + 1
            half = data_bytes // 2
            sums = [x.buffer[-2 * data_bytes:].view(DT) for x in ws]  # both parities
            flags = [x.tile_flags for x in ws]
        at = (epoch % 2) * half
        # the other ranks' pushes, as they would have landed in this rank's workspace
        for p in range(world):
            if p != rank and ll:
                words = sums[rank][at:].view(torch.int64)
                words[p * count * 128:(p + 1) * count * 128].copy_(ll_words(blocks(partial[p], 16, 16, group_m), epoch).flatten())
            elif p != rank:
                sums[rank][at + p * count * 256:at + (p + 1) * count * 256].copy_(
                    blocks(partial[p], 16, 16, group_m).flatten())
                for t in range(count):
                    flags[rank][t * world + p] = flag_value(epoch)
        out = torch.full((m, n), float("nan"), dtype=DT)
        launch = fused_split_k.prepare(me, a[rank], w[rank].t(), c[rank], out, cfg, lane=lane, scales=scales[rank])
        if lane:
            launch()
        else:
            launch(*me.next_epoch())
        want = sum(x.float() for x in partial)  # the rank-order sum of rounded partials
        err = ((out.float() - want).norm() / want.norm()).item()
        # (FP8: the interpreter's casts to bf16 may truncate where _scaled_mm rounds)
        assert err < (8e-3 if fp8 else 2e-3), (m, k, n, split, bias, lane, call, world, rank, fp8, err)
        # what this rank pushed into every peer: its rounded sum in slot [rank, tile], its flags
        mine = blocks(partial[rank], 16, 16, group_m)
        for p in range(world):
            if p != rank and ll:
                words = sums[p][at:].view(torch.int64)[rank * count * 128:(rank + 1) * count * 128]
                got = ll_values(words.view(count, 16, 8), epoch)
                assert ((got.float() - mine.float()).norm() / mine.float().norm()).item() < (8e-3 if fp8 else 2e-3), p
                assert all(int(flags[p][t * world + rank]) != flag_value(epoch) for t in range(count)), "no flag store"
            elif p != rank:
                got = sums[p][at + rank * count * 256:at + (rank + 1) * count * 256].view(count, 16, 16)
                assert ((got.float() - mine.float()).norm() / mine.float().norm()).item() < (8e-3 if fp8 else 2e-3), p
                assert all(int(flags[p][t * world + rank]) == flag_value(epoch) for t in range(count)), p
        assert me.tile_counters.eq(0).all(), "arrival counters back at zero"
        if lane:
            assert me.counter.eq(epoch).all(), "the lane's epoch advanced in every slot"
            assert me.ticket.eq(0).all(), "ticket and exits back at zero"
        else:
            assert int(me.ticket.item()) == me.ticket_base, "each unit claimed once"
        assert int(me.err[0]) == 0


def stale_words_are_not_taken(world: int = 2, rank: int = 0, stale: int | None = None) -> None:
    """LL: a peer's words from the call before with this parity (epoch - 2) are not the call's
    sums: the wait for them times out (a bound below zero: at once), the outputs are NaN and the
    error word names the first peer whose words are stale (``stale``: that peer's only, the
    others' are the call's)."""

    m, k, n = 16, 64, 32
    tile = tiles.TileConfig(bm=16, bn=16, bk=16, stages=2, warps=4, group_m=1, reducers=0)
    cfg = fused_split_k.config(m, k, n, 3, 1, tile, ll=True)
    count = fused_split_k.num_tiles(m, n, cfg)
    # a bound already past (the interpreter's clock stands still)
    ws = group(world, 1 << 17, 3, False, timeout_ns=-1_000_000_000)
    me = ws[rank]
    me.epoch = 4  # the call is epoch 5; its parity last held epoch 3's words
    a, w = torch.randn(m, k, dtype=DT), torch.randn(n, k, dtype=DT)
    for p in range(world):
        if p != rank:
            words = me.buffer[-2 * (1 << 17):].view(DT)[(5 % 2) * (1 << 16):].view(torch.int64)
            epoch = 3 if stale is None or p == stale else 5
            words[p * count * 128:(p + 1) * count * 128].copy_(ll_words(blocks(a @ w.t(), 16, 16), epoch).flatten())
    out = torch.zeros(m, n, dtype=DT)
    fused_split_k.prepare(me, a, w.t(), None, out, cfg)(*me.next_epoch())
    assert out.isnan().all(), "stale sums were taken"
    first = min(p for p in range(world) if p != rank) if stale is None else stale
    assert me.err.tolist() == [1, 8, rank, first, 5, 0, 0, 0], me.err.tolist()


TAG, OTHER = 0x155, 0x2AA


def another_call_is_not_summed(world: int, rank: int, lane: bool) -> None:
    """The pairing check with flags (``COMMFUSE_PAIRING_CHECK`` asks for them, not LL words): a
    peer whose tile flags carry this call's count under another tag made another call; every
    output is NaN and the error word names the mismatch, both ranks, the count and both tags."""
    m, k, n = 16, 64, 32
    tile = tiles.TileConfig(bm=16, bn=16, bk=16, stages=2, warps=4, group_m=1, reducers=0)
    cfg = fused_split_k.config(m, k, n, 3, 1, tile, ll=False)
    count = fused_split_k.num_tiles(m, n, cfg)
    ws = group(world, 1 << 17, 3, lane)
    me = ws[rank]
    odd = (rank + 1) % world
    call = int(me.counter[0]) + 1 if lane else me.epoch + 1
    flags = me.flags if lane else me.tile_flags
    for p in range(world):
        if p != rank:
            for t in range(count):
                flags[t * world + p] = flag_value(call, OTHER if p == odd else TAG)
    a, w = torch.randn(m, k, dtype=DT), torch.randn(n, k, dtype=DT)
    out = torch.zeros(m, n, dtype=DT)
    launch = fused_split_k.prepare(me, a, w.t(), None, out, cfg, lane=lane)
    if lane:
        launch(flag_value(0, TAG))
    else:
        launch(*me.next_epoch(tag=TAG))
    assert out.isnan().all(), "another call's sums were taken"
    op = GRAPH_LANE_OP if lane else 8
    assert me.err.tolist()[:7] == [ERR_MISMATCH, op, rank, odd, call, TAG, OTHER], me.err.tolist()


def main() -> None:
    for lane in (False, True):
        another_call_is_not_summed(2, 0, lane)
        another_call_is_not_summed(4, 3, lane)
    stale_words_are_not_taken()
    stale_words_are_not_taken(world=4, rank=2)
    for m, k, n, split, bias in [(5, 96, 40, 2, True), (16, 64, 32, 1, False), (20, 80, 48, 3, False),
                                 (33, 128, 16, 4, True)]:
        case(m, k, n, split, bias, lane=False)
        case(m, k, n, split, bias, lane=False, calls=2, ll=True)  # both parities
        case(m, k, n, split, bias, lane=False, ll=None)  # the default rule
        case(m, k, n, split, bias, lane=True, calls=2, ll=True)  # (a lane keeps its flags)
    case(20, 80, 48, 3, True, lane=False, world=3, rank=1, ll=True)  # LL reads padded to 4 ranks
    default = fused_split_k.LL_GROUP_VALUES
    # LL reads of 2 ranks at a time (at 3 ranks the second group padded) and of 1
    for values, world, rank, stale in ((512, 8, 7, 5), (512, 3, 0, 2), (256, 3, 1, None)):
        fused_split_k.LL_GROUP_VALUES = values
        try:
            case(20, 80, 48, 3, True, lane=False, world=world, rank=rank, ll=True)
            stale_words_are_not_taken(world=world, rank=rank)
            if stale is not None:  # a late peer in a later group is the one named
                stale_words_are_not_taken(world=world, rank=rank, stale=stale)
        finally:
            fused_split_k.LL_GROUP_VALUES = default
    for lane in (False, True):  # one wave of two slices (the defaults' form): no claims
        case(16, 64, 16, 2, True, lane=lane, calls=2)
    for ll in (False, True):  # tiles in groups of 2 row blocks (3 row blocks: the last group short)
        case(40, 64, 48, 2, True, lane=False, ll=ll, group_m=2)
    # FP8 operands: this rank's scales on each tile's sum of slices, before it is pushed
    case(20, 128, 48, 2, True, lane=False, fp8="tensorwise")
    case(20, 128, 48, 2, False, lane=False, ll=True, fp8="rowwise", world=4, rank=2)
    case(16, 128, 32, 2, True, lane=True, calls=2, fp8="tensorwise", world=8, rank=7)
    for world, rank in ((4, 2), (8, 7)):  # the world-dependent slots and pushes, at 4 and 8 ranks
        case(20, 80, 48, 3, True, lane=False, world=world, rank=rank)
        case(20, 80, 48, 3, True, lane=False, world=world, rank=rank, ll=True)
        case(20, 80, 48, 3, True, lane=True, calls=2, world=world, rank=rank)
    print("ok")


if __name__ == "__main__":
    main()
