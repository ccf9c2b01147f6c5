"""Run by test_tiles.py under TRITON_INTERPRET=1: the fused all-reduce kernel of
``fused_all_reduce.py``, its reduce-scatter form and the fused all-gather kernel of
``fused_all_gather.py`` as one rank of 2, 4 or 8, in one process. The other ranks are simulated:
what they push to this rank (partials of its tiles; the sums of their own tiles; their shard's
chunks) is written into this rank's workspace with their flags before the launch; this rank's
pushes are checked in their buffers after. The interpreter runs
programs one after another (no concurrent claims; no wait ever spins): those run on GPUs
(``tests/gpu/test_gpu_fused.py``). Exits non-zero on a mismatch."""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from commfuse.kernels import fused_all_gather, fused_all_reduce, launch, sync, tiles
from commfuse.kernels.codes import flag_value
from interpreter_peers import DT, group
BM = BN = 16


def block(full: torch.Tensor, off_m: int, pid_n: int) -> torch.Tensor:
    """The dense [BM, BN] block at rows off_m.., column block pid_n of ``full`` (zero-padded)."""
    out = torch.zeros(BM, BN, dtype=full.dtype)
    rows = full[off_m:off_m + BM, pid_n * BN:(pid_n + 1) * BN]
    out[:rows.shape[0], :rows.shape[1]] = rows
    return out


def _operands(m, k, n, world, bias, fp8):
    """Every rank's (a, weight, bias, scales or None) and its partial as the unfused graph makes
    it; ``fp8``: FP8 operands with ``_scaled_mm``'s scales, tensor-wise or row-wise, each rank
    its own (each quantised its own K share), the partial ``torch._scaled_mm``'s."""
    a = [torch.randn(m, k, dtype=DT) for _ in range(world)]
    w = [torch.randn(n, k, dtype=DT) / k ** 0.5 for _ in range(world)]
    c = [torch.randn(n, dtype=DT) if bias else None for _ in range(world)]
    if fp8 is None:
        partial = [(a[r].float() @ w[r].float().t() + (c[r].float() if bias else 0)).to(DT) for r in range(world)]
        return a, w, c, [None] * world, partial
    e4m3 = torch.float8_e4m3fn
    a = [(x * 8).to(e4m3) for x in a]
    w = [(x * 8).to(e4m3) for x in w]
    # each scale in [0.25, 0.5]: a scale dropped or applied twice is off by 2x or more
    if fp8 == "rowwise":
        scales = [(torch.rand(m, 1) / 4 + 0.25, torch.rand(1, n) / 4 + 0.25) for _ in range(world)]
    else:
        scales = [(torch.rand(()) / 4 + 0.25, torch.rand(()) / 4 + 0.25) for _ in range(world)]
    partial = [torch._scaled_mm(a[r], w[r].t(), *scales[r], c[r], out_dtype=DT, use_fast_accum=True)
               for r in range(world)]
    return a, w, c, scales, partial


def case(m: int, k: int, n: int, world: int, rank: int, scatter: bool, bias: bool, calls: int = 2,
         pull: bool = False, inline: bool = False, tma: bool = False, lag: float = 4.0,
         fp8: str | None = None) -> None:
    """``pull`` (reduce-scatter): the peers' partials of this rank's tiles wait in their own slabs,
    flagged in their own memory; this rank's partials of theirs must land in its own slabs.
    ``inline`` (all-reduce): no reducers, the copies of the pushed sums in the ticket order, ``lag``
    waves behind this rank's own tiles. ``tma``: pushes through device-made TMA descriptors (the
    pull ignores it). ``fp8``: FP8 operands (``_operands``). Programs start together (no stagger:
    the interpreter's clock stands still)."""
    torch.manual_seed(m + k + n + world + rank + scatter)
    cfg = tiles.TileConfig(bm=BM, bn=BN, bk=32 if fp8 else 16, stages=2, warps=4, group_m=1,
                           reducers=0 if inline else 1, per_sm=1)
    ran = []  # what each launch ran (``launch.variants``)
    opts = fused_all_reduce.Options(copy_lag_waves=lag, tma_push=tma, pull=pull)
    count = fused_all_reduce.num_tiles(m, n, world, cfg, scatter)
    slab_tiles = -(-count // world)
    result_at = world * slab_tiles
    num_n = -(-n // BN)
    share = m // world
    per = -(-share // BM) * num_n  # reduce-scatter: tiles per owner
    data_bytes = 1 << 17
    ws = group(world, data_bytes, 4)
    me = ws[rank]
    # programs per SM: the launcher asks the compiled kernel, which the interpreter does not make
    shape = None if fp8 is None else (fp8 == "rowwise", tiles.fp8_accumulation(True, cfg.bk))
    for traced in (False, True):
        fused_all_reduce._resident[(cfg, DT, world, True, bias, None, True, scatter, 0, pull and scatter, traced,
                                    tma and not (pull and scatter), False, shape)] = 1

    def place(t):
        """(owner, slot, first row, column block) of tile t."""
        if scatter:
            o, slot = t // per, t % per
            return o, slot, o * share + (slot // num_n) * BM, slot % num_n
        return t % world, t // world, (t // num_n) * BM, t % num_n

    for call in range(calls):
        a, w, c, scales, partial = _operands(m, k, n, world, bias, fp8)
        total = sum(x.float() for x in partial)
        epoch = me.epoch + 1
        data = [x.data(epoch % 2, (data_bytes // 2,), DT) for x in ws]
        slab = lambda r, p, slot: data[r][(p * slab_tiles + slot) * BM * BN:(p * slab_tiles + slot + 1) * BM * BN]
        result = lambda r, t: data[r][(result_at + t) * BM * BN:(result_at + t + 1) * BM * BN]
        for t in range(count):
            owner, slot, off_m, pid_n = place(t)
            if owner == rank:  # the peers' partials of this rank's tile, and their ready flags
                for p in range(world):
                    if p != rank:
                        # pulled from this rank's slab in the peer's memory, or pushed here
                        where, index = (p, rank) if pull else (rank, p)
                        slab(where, index, slot).copy_(block(partial[p], off_m, pid_n).flatten())
                        ws[where].tile_flags[t * world + p] = flag_value(epoch)
            elif not scatter:  # the owner's sum of its tile, pushed back, and its done flag
                result(rank, t).copy_(block(total, off_m, pid_n).to(DT).flatten())
                me.tile_flags[count * world + t] = flag_value(epoch)
        out = torch.full((share if scatter else m, n), float("nan"), dtype=DT)
        trace = torch.zeros(64 * sync.TRACE_SLOTS, dtype=torch.int64) if call else None
        launch = fused_all_reduce.prepare(me, a[rank], w[rank].t(), c[rank], out, cfg, scatter, opts=opts,
                                          trace=trace, scales=scales[rank])
        launch(*me.next_epoch())
        ran.extend(launch.variants)
        if trace is not None:  # the second call is traced: positions once each, with start and end
            slots = trace.view(-1, sync.TRACE_SLOTS)
            tiles_ = slots[:, 2:].reshape(slots.shape[0], -1, 3)
            positions = sorted(int(p) for p in tiles_[:, :, 0].flatten() if p >= 0)
            assert len(set(positions)) == len(positions) == min(count, sync.TRACE_TILES), positions
            assert bool(((tiles_[:, :, 0] >= 0) == (tiles_[:, :, 2] >= 0)).all()), "a tile without its end"
            assert bool((slots[:, 1] >= 0).any()), "no program recorded its end"
        want = total[rank * share:(rank + 1) * share] if scatter else total
        err = ((out.float() - want).norm() / want.norm()).item()
        # (FP8: the partials are bf16 as the unfused graph's; the interpreter's casts may truncate)
        assert err < (8e-3 if fp8 else 2e-3), (m, k, n, world, rank, scatter, fp8, call, err)
        for t in range(count):  # what this rank pushed into its peers
            owner, slot, off_m, pid_n = place(t)
            if owner != rank:
                # left in the owner's slab in this rank's memory, or pushed into the owner's
                where, index = (rank, owner) if pull else (owner, rank)
                got = slab(where, index, slot).view(BM, BN).float()
                mine = block(partial[rank], off_m, pid_n).float()
                rows = min(BM, (owner + 1) * share - off_m) if scatter else BM
                tol = 2e-2 if fp8 else 2e-3
                assert torch.allclose(got[:rows], mine[:rows], atol=tol, rtol=tol), (t, owner)
                assert int(ws[where].tile_flags[t * world + rank]) == flag_value(epoch), ("ready", t, owner)
            elif not scatter:
                for p in range(world):
                    if p != rank:
                        got = result(p, t).view(BM, BN).float()
                        assert torch.allclose(got, block(total, off_m, pid_n), atol=2e-2, rtol=2e-2), (t, p)
                        assert int(ws[p].tile_flags[count * world + t]) == flag_value(epoch), ("done", t, p)
        assert int(me.ticket.item()) == me.ticket_base, "each position claimed once"
        assert int(me.err[0]) == 0
    assert ran.count("inline") == (calls if inline else 0), "inline copies ran"
    assert ran.count("tma") == (calls if tma and not (pull and scatter) else 0), "TMA pushes ran"
    assert ran.count("pull") == (calls if pull and scatter else 0), "the owners pulled"


def gather_case(rows: int, k: int, n: int, world: int, rank: int, bias: bool, gathered: bool,
                calls: int = 2, fp8: bool = False, rowwise: bool = False) -> None:
    """``fp8``: e4m3 shards and weight with one float32 scale each: the FP8 bytes gathered, the
    product ``torch._scaled_mm``'s. ``rowwise`` too: a scale per row of every shard, gathered with
    its rows (pushed beside them under the same flags), and one per column of the weight."""
    torch.manual_seed(rows + k + n + world + rank)
    cfg = tiles.TileConfig(bm=fused_all_gather.CHUNK_ROWS, bn=16, bk=32 if fp8 else 16, stages=2, warps=4,
                           group_m=1, reducers=0, per_sm=1)
    dt = torch.float8_e4m3fn if fp8 else DT
    chunks = -(-rows // fused_all_gather.CHUNK_ROWS)
    ws = group(world, 1 << 17, 8)
    me = ws[rank]
    push_k = min(256, triton.next_power_of_2(k))
    imprecise = tiles.fp8_accumulation(True, cfg.bk) if fp8 else None
    for traced in (False, True):
        fused_all_gather._resident[(cfg, dt, DT, world, True, bias, None, push_k, gathered, traced, fp8,
                                    imprecise, rowwise)] = 1
    for call in range(calls):
        shards = [(torch.randn(rows, k) * (8 if fp8 else 1)).to(dt) for _ in range(world)]
        w = ((torch.randn(n, k) * 8).to(dt) if fp8 else torch.randn(n, k, dtype=DT) / k ** 0.5)
        c = torch.randn(n, dtype=DT) if bias else None
        scales = (torch.rand(()) / 4 + 0.25, torch.rand(()) / 4 + 0.25) if fp8 else None
        if rowwise:  # every rank's row scales (in [0.25, 0.5], so a scale lost is off by 2x or more)
            row_scales = [torch.rand(rows) / 4 + 0.25 for _ in range(world)]
            scales = (row_scales[rank], torch.rand(n) / 4 + 0.25)
        full = torch.cat([x.view(torch.uint8) for x in shards]).view(dt)
        epoch = me.epoch + 1
        area = [x.data(epoch % 2, (world * rows, k), dt) for x in ws]
        if rowwise:
            at = fused_all_gather.rowwise_scales_offset(rows, k, world, 1)
            scale_area = [x.data(epoch % 2, (world * rows,), torch.float32, offset_bytes=at) for x in ws]
        for p in range(world):
            if p != rank:  # rank p's chunks, pushed into this rank's gathered rows, and their flags
                area[rank][p * rows:(p + 1) * rows].copy_(shards[p])
                if rowwise:
                    scale_area[rank][p * rows:(p + 1) * rows].copy_(row_scales[p])
                for ch in range(chunks):
                    me.tile_flags[ch * world + p] = flag_value(epoch)
        out = torch.full((world * rows, n), float("nan"), dtype=DT)
        got_rows = torch.full((world * rows, k), float("nan")).to(dt) if gathered else None
        trace = torch.zeros(64 * sync.TRACE_SLOTS, dtype=torch.int64) if call else None
        launch = fused_all_gather.prepare(me, shards[rank], w.t(), c, got_rows, out, cfg, trace, scales=scales,
                                          rowwise=rowwise)
        launch(*me.next_epoch())
        if trace is not None:  # the second call is traced: positions once each, with their times
            # (the interpreter runs programs one by one: the first claims every position, and the
            # trace holds a program's first TRACE_TILES)
            slots = trace.view(-1, sync.TRACE_SLOTS)
            tiles_ = slots[:, 2:].reshape(slots.shape[0], -1, 3)
            positions = sorted(int(p) for p in tiles_[:, :, 0].flatten() if p >= 0)
            count = world * -(-rows // cfg.bm) * -(-n // 16)
            assert len(set(positions)) == len(positions) == min(count, sync.TRACE_TILES), positions
            assert positions[-1] < count, positions
            assert bool(((tiles_[:, :, 0] >= 0) == (tiles_[:, :, 2] >= 0)).all()), "a tile without its end"
            assert int((slots[:, 0] >= 0).sum()) >= 2 and int((slots[:, 1] >= 0).sum()) >= 1
        if rowwise:
            want = torch._scaled_mm(full, w.t(), torch.cat(row_scales).reshape(-1, 1), scales[1].reshape(1, -1), c,
                                    out_dtype=DT, use_fast_accum=True).float()
        elif fp8:
            want = torch._scaled_mm(full, w.t(), *scales, c, out_dtype=DT, use_fast_accum=True).float()
        else:
            want = full.float() @ w.float().t() + (c.float() if bias else 0)
        err = ((out.float() - want).norm() / want.norm()).item()
        assert err < (8e-3 if fp8 else 2e-3), (rows, k, n, world, rank, call, fp8, err)
        bits = (lambda t: t.view(torch.uint8)) if fp8 else (lambda t: t)  # noqa: E731
        if gathered:
            assert torch.equal(bits(got_rows), bits(full)), "the gathered rows, in rank order"
        for p in range(world):  # this rank's shard and chunk flags in every peer
            if p != rank:
                assert torch.equal(bits(area[p][rank * rows:(rank + 1) * rows]), bits(shards[rank])), p
                if rowwise:  # its rows' scales beside them
                    assert torch.equal(scale_area[p][rank * rows:(rank + 1) * rows], row_scales[rank]), p
                assert all(int(ws[p].tile_flags[ch * world + rank]) == flag_value(epoch) for ch in range(chunks)), p
        assert int(me.ticket.item()) == me.ticket_base, "each position claimed once"
        assert int(me.err[0]) == 0


class _PeerViews:
    """The provider's ``get_buffer`` over one process's simulated ranks (the copy-engine push)."""

    def __init__(self, bufs):
        self.bufs = bufs

    def get_buffer(self, peer, sizes, dtype, offset):
        assert dtype == torch.uint8
        return self.bufs[peer][offset:offset + sizes[0]]


class _NoStream:
    def wait_stream(self, other):
        pass


def ce_gather_case(rows: int, k: int, n: int, world: int, bm: int, gathered: bool, chunks: int,
                   calls: int = 3) -> None:
    """The copy-engine push, every rank in this process: each rank's host push (copies into the
    peers' rows and stream writes of their flags, here plain writes) runs first, then each
    rank's kernel, which waits on the copy engines' flags only. Rows not pushed are NaN."""
    import contextlib

    saved = (torch.cuda.current_stream, torch.cuda.stream, fused_all_gather.copy_engine_flags)
    torch.cuda.current_stream = lambda *a, **kw: _NoStream()
    torch.cuda.stream = lambda stream: contextlib.nullcontext()

    def write_flag(flags, offset, value):
        flags[offset] = value

    fused_all_gather.copy_engine_flags = lambda: write_flag
    try:
        torch.manual_seed(rows + k + n + world + chunks)
        cfg = tiles.TileConfig(bm=bm, bn=16, bk=16, stages=2, warps=4, group_m=1, reducers=0, per_sm=1)
        ws = group(world, 1 << 17, 8)
        for x in ws:
            x._keepalive = _PeerViews([y.buffer for y in ws])
        push_k = min(256, triton.next_power_of_2(k))
        fused_all_gather._resident[(cfg, DT, DT, world, True, False, None, push_k, False, False, False, None, False)] = 1
        for call in range(calls):
            shards = [torch.randn(rows, k, dtype=DT) for _ in range(world)]
            w = torch.randn(n, k, dtype=DT) / k ** 0.5
            epoch = ws[0].epoch + 1
            for x in ws:  # rows nobody pushed would show
                x.data(epoch % 2, (world * rows, k), DT).fill_(float("nan"))
            outs = [torch.full((world * rows, n), float("nan"), dtype=DT) for _ in range(world)]
            got = [torch.full((world * rows, k), float("nan"), dtype=DT) if gathered else None
                   for _ in range(world)]
            launches = [fused_all_gather.prepare(ws[r], shards[r], w.t(), None, got[r], outs[r], cfg,
                                                 side=_NoStream(), ce_chunk_count=chunks) for r in range(world)]
            kernels = []  # the kernels wait until every rank has pushed (one process): deferred
            launch_kept = launch.Bound.__call__
            launch.Bound.__call__ = lambda bound, **kw: kernels.append((bound, kw))
            epochs = [x.next_epoch() for x in ws]
            try:
                for r in range(world):
                    launches[r](*epochs[r])
            finally:
                launch.Bound.__call__ = launch_kept
            assert len(kernels) == world
            for bound, kw in kernels:
                bound(**kw)
            full = torch.cat(shards)
            want = full.float() @ w.float().t()
            for r in range(world):
                err = ((outs[r].float() - want).norm() / want.norm()).item()
                assert err < 2e-3, (rows, world, chunks, r, call, err)
                if gathered:  # its copy ran before the deferred kernel: the rows it copies are there now
                    got[r].copy_(ws[r].data(epochs[r][1], (world * rows, k), DT))
                    assert torch.equal(got[r], full), (rows, world, chunks, r, call)
                base = fused_all_gather.ce_flag_base(rows, world)
                flags = ws[r].tile_flags
                assert int((flags[:base] != 0).sum()) == 0, "a copy-engine flag below its base"
                written = {(c, p) for c in range(fused_all_gather.ce_chunks(rows, chunks))
                           for p in range(world) if p != r}
                assert all(int(flags[base + c * world + p]) == epochs[r][0] for c, p in written), (r, call)
            assert int(ws[0].err[0]) == 0
    finally:
        torch.cuda.current_stream, torch.cuda.stream, fused_all_gather.copy_engine_flags = saved


_peers_ready = fused_all_reduce._peers_ready


_SPY: dict = {}


def _copy_arrives(flag, epoch) -> None:
    """At a copy's wait: every tile this rank finished must be released by now (a copy never
    waits holding one), then the peer "arrives": its sum is written and its flag raised."""
    s = _SPY
    tile = (int(np.asarray(flag.handle.data).reshape(-1)[0]) - s["flags"].data_ptr()) // 4 - s["count"] * s["world"]
    ep = int(np.asarray(epoch.handle.data).reshape(-1)[0])
    world, rank = s["world"], s["rank"]
    assert 0 <= tile < s["count"] and tile % world != rank, tile
    for u in range(s["count"]):
        owner, slot, off_m, pid_n = s["place"](u)
        if owner == rank and not torch.isnan(s["out"][off_m:off_m + BM, pid_n * BN:(pid_n + 1) * BN]).any():
            for p in range(world):  # a finished own tile: its sum released to every peer
                if p != rank:
                    assert int(s["ws"][p].tile_flags[s["count"] * world + u]) == ep, ("held across a wait", u)
        elif owner != rank and bool(s["slab"](owner, rank, slot).abs().sum() > 0):  # a pushed partial
            assert int(s["ws"][owner].tile_flags[u * world + rank]) == ep, ("held across a wait", u)
    s["result"](rank, tile).copy_(s["sums"][tile])
    s["flags"][s["count"] * world + tile] = ep
    s["waits"] += 1


@triton.jit
def _spy_wait(ptr, epoch, start, timeout, err, OP: tl.constexpr, rank, peer):
    _copy_arrives(ptr, epoch)
    return sync.wait_or_record(ptr, epoch, start, timeout, err, OP, rank, peer)


def waiting_copies_case(m: int, k: int, n: int, world: int, rank: int) -> None:
    """The inline copies against peers that have not pushed their sums at the launch: the result
    area holds garbage and the done flags are down until a copy waits (``_copy_arrives``), so a
    copy that does not wait, accepts a stale flag or waits holding an unreleased tile fails."""
    torch.manual_seed(m + world + rank)
    cfg = tiles.TileConfig(bm=BM, bn=BN, bk=16, stages=2, warps=4, group_m=1, reducers=0, per_sm=1)
    count = fused_all_reduce.num_tiles(m, n, world, cfg)
    slab_tiles, num_n, data_bytes = -(-count // world), -(-n // BN), 1 << 17
    result_at = world * slab_tiles
    ws = group(world, data_bytes, 4)
    me = ws[rank]
    for traced in (False, True):
        fused_all_reduce._resident[(cfg, DT, world, True, True, None, True, False, 0, False, traced,
                                    False, False, None)] = 1
    place = lambda u: (u % world, u // world, (u // num_n) * BM, u % num_n)  # noqa: E731
    saved, fused_all_reduce.wait_or_record = fused_all_reduce.wait_or_record, _spy_wait
    try:
        for lag in (0.0, 0.25, 40.0):  # right behind, spread, after the own tiles (see ``main``)
            a = [torch.randn(m, k, dtype=DT) for _ in range(world)]
            w = [torch.randn(n, k, dtype=DT) / k ** 0.5 for _ in range(world)]
            c = [torch.randn(n, dtype=DT) for _ in range(world)]
            partial = [(a[r].float() @ w[r].float().t() + c[r].float()).to(DT) for r in range(world)]
            total = sum(x.float() for x in partial)
            epoch = me.epoch + 1
            data = [x.data(epoch % 2, (data_bytes // 2,), DT) for x in ws]
            for d in data:
                d.zero_()
            slab = lambda r, p, slot: data[r][(p * slab_tiles + slot) * BM * BN:(p * slab_tiles + slot + 1) * BM * BN]  # noqa: E731,E501
            result = lambda r, u: data[r][(result_at + u) * BM * BN:(result_at + u + 1) * BM * BN]  # noqa: E731
            sums = {}
            for u in range(count):
                owner, slot, off_m, pid_n = place(u)
                if owner == rank:  # the peers' partials are there, as in ``case``
                    for p in range(world):
                        if p != rank:
                            slab(rank, p, slot).copy_(block(partial[p], off_m, pid_n).flatten())
                            me.tile_flags[u * world + p] = flag_value(epoch)
                else:  # the sums are not: garbage until the peer arrives
                    sums[u] = block(total, off_m, pid_n).to(DT).flatten()
                    result(rank, u).fill_(1234.0)
            out = torch.full((m, n), float("nan"), dtype=DT)
            _SPY.update(ws=ws, flags=me.tile_flags, world=world, rank=rank, count=count, place=place,
                        out=out, slab=slab, result=result, sums=sums, waits=0)
            launch = fused_all_reduce.prepare(me, a[rank], w[rank].t(), c[rank], out, cfg, False,
                                              opts=fused_all_reduce.Options(copy_lag_waves=lag))
            launch(*me.next_epoch())
            err = ((out.float() - total).norm() / total.norm()).item()
            assert err < 2e-3, ("wrong result", world, rank, lag, err)
            assert _SPY["waits"] == len(sums), ("copies that did not wait", _SPY["waits"], len(sums))
            assert int(me.ticket.item()) == me.ticket_base
            assert int(me.err[0]) == 0
    finally:
        fused_all_reduce.wait_or_record = saved


@triton.jit
def _never_ready(flags, tile, epoch, rank, heap_bases, WORLD: tl.constexpr):
    return rank * 0


#: (world, rank) of the cases: both ranks of 2, a middle rank of 4, a late rank of 8.
EVERY = ((2, 0), (2, 1), (4, 2), (8, 5))


def main() -> None:
    """The main forms run at every (world, rank) of ``EVERY``; their variants at 2 ranks and at
    4 or 8 (the interpreter runs every program of every position one by one: each case costs
    about a second at 8 ranks). The calls of 9 tiles run on 4 programs, so a lag of w waves is
    round(4 w) tiles: 0.25 waves (1 tile) spreads the copies among the own tiles where a rank
    owns more than one (2 ranks, and rank 2 of 4; rank 5 of 8 owns one), and a lag of at least
    the rank's own tiles (5 or 4 at 2 ranks, 2 at rank 2 of 4) puts them all after those."""
    at = {"every": EVERY, "2+4": ((2, 1), (4, 2)), "2+8": ((2, 1), (8, 5)), "0+4": ((2, 0), (4, 2)),
          "0+8": ((2, 0), (8, 5)), "not 0": EVERY[1:]}
    runs = [
        ("every", lambda w, r: case(40, 48, 40, w, r, scatter=False, bias=True)),  # reducers copy the sums
        # the inline copies right behind this rank's own tiles, spread among them, all after them
        ("every", lambda w, r: case(40, 48, 40, w, r, scatter=False, bias=True, inline=True, lag=0.0)),
        ("2+4", lambda w, r: case(40, 48, 40, w, r, scatter=False, bias=True, inline=True, lag=0.25)),
        ("every", lambda w, r: case(40, 48, 40, w, r, scatter=False, bias=True, inline=True, lag=40.0)),
        ("not 0", lambda w, r: waiting_copies_case(40, 32, 40, w, r)),
        # pushes through device-made TMA descriptors (the pull ignores them)
        ("2+8", lambda w, r: case(40, 48, 40, w, r, scatter=False, bias=True, inline=True, tma=True)),
        ("0+4", lambda w, r: case(40, 48, 40, w, r, scatter=False, bias=False, tma=True)),
        ("2+8", lambda w, r: case(3 * w, 32, 40, w, r, scatter=True, bias=True, tma=True)),
        ("0+4", lambda w, r: case(16 * w, 32, 24, w, r, scatter=True, bias=False, pull=True, tma=True)),
        # the reduce-scatter: pushed, 3-row shares (ragged tiles), pulled
        ("every", lambda w, r: case(16 * w, 32, 24, w, r, scatter=True, bias=False)),
        ("every", lambda w, r: case(3 * w, 32, 40, w, r, scatter=True, bias=True)),
        ("every", lambda w, r: case(16 * w, 32, 24, w, r, scatter=True, bias=False, pull=True)),
        ("0+8", lambda w, r: case(3 * w, 32, 40, w, r, scatter=True, bias=True, pull=True)),
        ("not 0", never_ready_case),  # the pull after the K loop
        # FP8 operands, each rank's scales on its own partial before it is pushed
        ("2+8", lambda w, r: case(40, 64, 40, w, r, scatter=False, bias=True, inline=True, fp8="tensorwise")),
        ("2+4", lambda w, r: case(40, 64, 40, w, r, scatter=False, bias=False, fp8="rowwise")),
        ("0+4", lambda w, r: case(3 * w, 64, 40, w, r, scatter=True, bias=True, fp8="rowwise")),
        ("0+8", lambda w, r: case(16 * w, 32, 24, w, r, scatter=True, bias=False, pull=True, fp8="tensorwise")),
        # the all-gather: 2 chunks, the last short; a shard of one short chunk
        ("every", lambda w, r: gather_case(40, 48, 24, w, r, bias=True, gathered=True)),
        ("every", lambda w, r: gather_case(7, 32, 16, w, r, bias=False, gathered=False)),
        # FP8 shards: the bytes gathered, the scales on every tile
        ("2+4", lambda w, r: gather_case(40, 64, 24, w, r, bias=True, gathered=True, fp8=True)),
        ("0+8", lambda w, r: gather_case(40, 64, 24, w, r, bias=False, gathered=False, fp8=True, rowwise=True)),
    ]
    for world, rank in EVERY:
        for where, run in runs:
            if (world, rank) in at[where]:
                run(world, rank)
    # the copy-engine push; at 8 ranks a tile of 64 rows over a 40-row shard of two chunks
    for rows, world, bm, gathered, chunks in ((40, 2, 32, True, 1), (7, 3, 32, True, 1), (100, 4, 64, False, 3),
                                              (70, 2, 32, True, 2), (40, 8, 64, False, 2)):
        ce_gather_case(rows, 32, 16, world, bm, gathered, chunks)
    print("ok")


def never_ready_case(world: int, rank: int) -> None:
    """The pull when no peer's partial is ready at the tile's start: pulled after the K loop."""
    fused_all_reduce._peers_ready = _never_ready
    try:
        case(16 * world, 32, 24, world, rank, scatter=True, bias=True, pull=True)
    finally:
        fused_all_reduce._peers_ready = _peers_ready


if __name__ == "__main__":
    main()
