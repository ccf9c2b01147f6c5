"""Run by test_tiles.py under TRITON_INTERPRET=1: the fused all-reduce's inline-copy order
(``fused_all_reduce._interleaved``, the jitted function itself, with Triton's C-style integer
division) and a model of the protocol the kernel runs on it.

1. For 2, 3, 4 and 8 ranks, ragged tile counts, every rank and lags from 0 past the own tiles:
   each tile multiplied at exactly one position, each peer-owned tile copied exactly once, no
   copy among the peers' tiles, a copy of a peer's j-th own tile after this rank's own tile
   j + lag, at most world - 1 empty positions.
2. The protocol on that order, every interleaving of a few programs per rank (exhaustive search):
   claim in ticket order; a multiplication releases the previous tile after its K loop, an own
   tile then waits for the peers' partials; a copy whose flag is not out releases the pending tile
   and waits; a program releases its last tile when the order is exhausted. No reachable state is
   stuck, every tile is multiplied and copied once, and each ticket ends at positions + programs.
   With the copy's release before its wait removed, the search must find a stuck state (the
   model can tell). Exits non-zero on a failure.

``_interleaved`` is element-wise: the probe evaluates it for every (tile count, rank, lag) of a
world size in one launch (a row each), with the same int32 arithmetic as one call at a time."""

from __future__ import annotations

import functools
import itertools

import torch
import triton
import triton.language as tl

import interpreter_peers  # noqa: F401  (the interpreter's stand-ins)
from commfuse.kernels import fused_all_reduce as far

NQ = 512


@triton.jit
def _probe(kind_ptr, where_ptr, rank_ptr, tiles_ptr, lag_ptr, rows, NQ: tl.constexpr, ROWS: tl.constexpr,
           WORLD: tl.constexpr):
    """Row c: ``_interleaved`` at positions 0..NQ-1 for rank_ptr[c], tiles_ptr[c], lag_ptr[c]."""
    c = tl.arange(0, ROWS)
    ok = c < rows
    rank = tl.load(rank_ptr + c, mask=ok, other=0)[:, None]
    num_tiles = tl.load(tiles_ptr + c, mask=ok, other=1)[:, None]
    lag = tl.load(lag_ptr + c, mask=ok, other=0)[:, None]
    q = tl.arange(0, NQ)[None, :]
    kind, where = far._interleaved(q, rank, num_tiles, tl.cdiv(num_tiles, WORLD), lag, WORLD)
    at = c[:, None] * NQ + q
    tl.store(kind_ptr + at, kind, mask=ok[:, None])
    tl.store(where_ptr + at, where, mask=ok[:, None])


_probed: dict[tuple, tuple[list, list]] = {}


def probe(world: int, cases: list[tuple[int, int, int]]) -> None:
    """``_interleaved``'s (kinds, wheres) for each (tile count, rank, lag) of ``world``, one launch."""
    cases = [c for c in dict.fromkeys(cases) if (world, *c) not in _probed]
    if not cases:
        return
    rows = triton.next_power_of_2(len(cases))
    kind = torch.full((rows, NQ), -9, dtype=torch.int32)
    where = torch.full((rows, NQ), -9, dtype=torch.int32)
    n, rank, lag = (torch.tensor([c[i] for c in cases], dtype=torch.int32) for i in range(3))
    _probe[(1,)](kind, where, rank, n, lag, len(cases), NQ=NQ, ROWS=rows, WORLD=world)
    for c, kinds, wheres in zip(cases, kind.tolist(), where.tolist()):
        _probed[(world, *c)] = (kinds, wheres)


def schedule(i: int, rank: int, n: int, world: int) -> int:
    """``_schedule``: the tile at position i of the plain order (peers' tiles first, own last)."""
    start = 0
    for k in range(world):
        owner = (rank + 1 + k) % world
        size = (n - owner + world - 1) // world
        if start <= i < start + size:
            return owner + world * (i - start)
        start += size
    raise AssertionError(i)


@functools.lru_cache(maxsize=None)
def order(n: int, world: int, rank: int, lag: int) -> list[tuple[int, int]]:
    """The kernel's order as (kind, tile): 0 multiply, 1 copy, 2 nothing; checked (part 1)."""
    probe(world, [(n, rank, lag)])
    kind, where = _probed[(world, n, rank, lag)]
    positions = far.inline_positions(n, world, rank, lag)
    assert positions <= NQ
    own = (n - rank + world - 1) // world
    seq, multiplied, copied, own_at = [], [], [], {}
    for q in range(positions):
        k, w = int(kind[q]), int(where[q])
        assert k in (0, 1, 2), (n, world, rank, lag, q, k)
        if k == 0:
            tile = schedule(w, rank, n, world)
            multiplied.append(w)
            if tile % world == rank:
                own_at[tile // world] = q
            seq.append((0, tile))
        elif k == 1:
            assert q >= n - own, ("a copy among the peers' tiles", n, world, rank, lag, q)
            copied.append(w)
            seq.append((1, w))
        else:
            seq.append((2, -1))
    case = (n, world, rank, lag)
    assert sorted(multiplied) == list(range(n)), case
    assert sorted(copied) == [t for t in range(n) if t % world != rank], case
    assert sum(k == 2 for k, _ in seq) <= world - 1, case
    for q, (k, tile) in enumerate(seq):
        j = tile // world
        if k == 1 and j + lag < own:
            assert own_at[j + lag] < q, ("a copy before the own tile it trails", case, tile)
    return seq


class Protocol:
    """Ranks x programs following the kernel (``gemm_all_reduce_kernel`` with ``INLINE``)."""

    def __init__(self, world, n, programs, lags, release_before_wait=True):
        self.world, self.n, self.programs, self.rbw = world, n, programs, release_before_wait
        self.seq = [order(n, world, r, lags[r]) for r in range(world)]

    def start(self):
        # per program (phase, position, pending tile); ready: (owner, tile, writer); done: (rank, tile)
        progs = tuple(tuple(("claim", -1, -1) for _ in range(self.programs)) for _ in range(self.world))
        return progs, frozenset(), frozenset(), (0,) * self.world, frozenset(), frozenset()

    def release(self, r, tile, ready, done):
        owner = tile % self.world
        if owner == r:  # the sum pushed to every peer: done there
            return ready, done | {((r + k) % self.world, tile) for k in range(1, self.world)}
        return ready | {(owner, tile, r)}, done

    def moves(self, s):
        progs, ready, done, tickets, mult, cop = s
        for r, p in itertools.product(range(self.world), range(self.programs)):
            phase, q, prev = progs[r][p]
            rel = self.release(r, prev, ready, done) if prev >= 0 else (ready, done)
            if phase == "claim":
                t = tickets[r]
                nt = tickets[:r] + (t + 1,) + tickets[r + 1:]
                if t >= len(self.seq[r]):
                    yield self.set(s, r, p, ("end", t, -1), *rel, nt)
                    continue
                kind, tile = self.seq[r][t]
                if kind == 2:
                    yield self.set(s, r, p, ("claim", t, prev), ready, done, nt)
                elif kind == 0:  # the K loop, then the previous tile's release
                    phase = "own" if tile % self.world == r else "claim"
                    yield self.set(s, r, p, (phase, t, tile), *rel, nt, mult={(r, tile)})
                elif (r, tile) in done:  # the poll finds the sum out: copy, keep the pending tile
                    yield self.set(s, r, p, ("claim", t, prev), ready, done, nt, cop={(r, tile)})
                elif self.rbw:
                    yield self.set(s, r, p, ("copy", t, -1), *rel, nt)
                else:
                    yield self.set(s, r, p, ("copy", t, prev), ready, done, nt)
            elif phase == "own":  # waits for every peer's partial of its tile
                if all((r, prev, (r + k) % self.world) in ready for k in range(1, self.world)):
                    yield self.set(s, r, p, ("claim", q, prev), ready, done, tickets)
            elif phase == "copy":
                tile = self.seq[r][q][1]
                if (r, tile) in done:
                    yield self.set(s, r, p, ("claim", q, prev), ready, done, tickets, cop={(r, tile)})

    def set(self, s, r, p, state, ready, done, tickets, mult=(), cop=()):
        row = s[0][r][:p] + (state,) + s[0][r][p + 1:]
        return (s[0][:r] + (row,) + s[0][r + 1:], ready, done, tickets, s[4] | frozenset(mult),
                s[5] | frozenset(cop))

    def search(self) -> bool:
        """True if every reachable state moves on or is a correct end; False on a stuck state."""
        seen, stack = set(), [self.start()]
        while stack:
            s = stack.pop()
            if s in seen:
                continue
            seen.add(s)
            nxt = list(self.moves(s))
            if nxt:
                stack.extend(nxt)
                continue
            if not all(phase == "end" for row in s[0] for phase, _, _ in row):
                return False
            for r in range(self.world):
                assert {t for rr, t in s[4] if rr == r} == set(range(self.n)), "a tile not multiplied"
                assert {t for rr, t in s[5] if rr == r} == {t for t in range(self.n) if t % self.world != r}
                assert s[3][r] == len(self.seq[r]) + self.programs, "ticket"
        return True


def main() -> None:
    for world in (2, 3, 4, 8):
        cases = []
        for n in list(range(1, 26)) + [63, 64, 65, 129]:
            for rank in range(world):
                own = (n - rank + world - 1) // world
                for lag in sorted({0, 1, 2, own - 1, own, own + 1, 10 ** 6} - {-1}):
                    cases.append((n, rank, lag))
        probe(world, cases)
        for n, rank, lag in cases:
            order(n, world, rank, lag)
    cases = [(2, 3, 1), (2, 4, 1), (2, 4, 2), (2, 5, 2), (2, 6, 2), (3, 5, 1), (3, 6, 1), (4, 5, 1)]
    for world, n, programs in cases:
        for lags in itertools.product(range(3), repeat=world):
            if world > 2 and lags[1:] != lags[:-1]:
                continue  # beyond 2 ranks, equal lags only (the search grows fast)
            assert Protocol(world, n, programs, lags).search(), ("stuck", world, n, programs, lags)
    broken = [Protocol(world, n, programs, (0,) * world, release_before_wait=False).search()
              for world, n, programs in cases]
    assert not all(broken), "the model finds no stuck state even without the release before a copy's wait"
    print("ok")


if __name__ == "__main__":
    main()
