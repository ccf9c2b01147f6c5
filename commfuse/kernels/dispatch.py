"""Which implementation runs a call: decided from (op, shape, dtype, world size) and, for
``mm_all_reduce``, whether this process captured a graph-lane call on the group (ranks capture
alike), so every rank of a group takes the same path and enters the same collective.

The thresholds come from the ops benchmark on 2xH200 (``benchmarks/results/h200x2``).
``COMMFUSE_ALGO`` forces a path for benchmarking and tests; it must be set alike on every rank.
"""

from __future__ import annotations

import math
import os

import torch

from .. import env
from ..report import log
from . import symm

MM_ALL_REDUCE_ALGOS = ("nccl", "one_shot", "two_shot", "overlap", "ce_overlap", "graph", "fused",
                       "split_k")
ALL_GATHER_MM_ALGOS = ("nccl", "symm", "overlap", "fused")
MM_REDUCE_SCATTER_ALGOS = ("nccl", "symm", "ce_overlap", "fused")

#: Outputs up to this size reduce one-shot (latency-bound); larger ones two-shot (above 2 ranks).
ONE_SHOT_MAX_BYTES = 1 << 20
#: Above this the symmetric workspace would be large; NCCL's ring bandwidth is then competitive.
SYMM_MAX_BYTES = 1 << 30
#: The copy-engine overlapped all-reduce (``ce_overlap``) is taken by GEMM-bound calls only
#: (``CE_MIN_M``, ``CE_MIN_K``): its extra launches (chunked GEMMs, barrier kernels, copies) cost
#: host time, which inside models, where steps are partly launch-bound, made smaller calls slower
#: than one-shot (7.41 vs 7.07 ms prefill, 23.7 vs 22.4 ms training when it took every call).
#: Overlap an all-gather / reduce-scatter with one shard's GEMM from this much work per shard
#: (rows/world * K * N): below it the split GEMMs and the side stream cost more than they hide.
OVERLAP_MIN_SHARD_MNK = 1 << 33


#: The fused tile kernel (``fused_all_reduce.py``) from this many rows, when K <= M: it gave up
#: ~12% of the SMs to the reducers (until the copies went inline, 6e0500b) and pays some epilogue
#: stores, which the hidden exchange repays
#: when the exchange is large against the GEMM (K small against M; exchange ~ M*N, GEMM ~ M*N*K)
#: and there are enough waves of tiles. Every measured shape agrees with the rule (2xH200,
#: benchmarks/results/h200x2/explore/ops_2f01995.json and sweep4.log, fused against one-shot, us;
#: the final ops.json of de7b7b9 agrees):
#: 8192x2048x4096 318/401, 4096x4096x8192 510/573, 8192x7168x4096 796/834 fuse;
#: 4096x7168x4096 448/421, 4096x14336x8192 1491/1478, 8192x14336x8192 2977/2972 and every
#: M = 1024 shape (too few waves) did not, with the reducers; below M = 1024 the tile GEMM is 2-3x slower
#: than cuBLAS (no split-K).
FUSED_MIN_M = 4096

#: Since the copies went inline (6e0500b) the fused kernel also wins calls of 1024 to 4095 rows
#: with K up to 4096 at 2 ranks once the output is more than 128 tiles of 128x256 (over 2^22
#: elements); at 128 tiles, one wave, it is within 3% of cuBLAS + one-shot either way (129-132
#: tiles, still one wave on 132 SMs, were not measured). Interleaved sweeps, us, fused /
#: one-shot (``explore/paths_mid_rows_ac8d005.json``): 2048x4096x8192 251 / 292, 3072x4096x4096
#: 194 / 223, 1024x4096x16384 252 / 292, 2048x2048x4096 104 / 109, 1024x1024x8192 83 / 88,
#: 1536x2048x4096 84 / 86, 1024x2048x8192 106 / 109; 1024x4096x8192 148-150 / 152-155 (three
#: sweeps); 128 tiles: 1024x4096x4096 82.9 / 82.0, 1024x512x4096 46.8 / 45.6, 2048x1024x2048
#: 51.6 / 50.5, 1024x2048x4096 59.4-60.4 / 61.1-61.8. K = 7168 ties at 1024 rows (113.4 / 113.1).
#: With the programs' staggered start (``fused_all_reduce.stagger_ns``) it also wins K = 14336 at
#: 1024 rows, two waves (346 / 359 µs, ``explore/paths_stagger_ar_7d8a496``), as it does at 4096
#: rows (1329-1366 / 1427), so the rule takes K up to 16384.
FUSED_MID_M, FUSED_MID_MAX_K, FUSED_MID_MORE_THAN = 1024, 16384, 1 << 22


#: The split-K kernel (``fused_split_k.py``) up to this many rows and output elements: it beat
#: cuBLAS + one-shot on every such shape measured (2xH200, ``benchmarks/results/h200x2/explore/
#: split_k_sweep1.json`` and ``split_k_sweep2.json``, us, split-K / one-shot: 1x2048x4096 13.8 /
#: 15.5, 16x7168x4096 26.1 / 31.0, 16x14336x8192 66.0 / 71.2, 32x7168x4096 27.6 / 31.4,
#: 64x2048x4096 15.8 / 18.2, 64x14336x8192 67.7 / 76.1, 128x2048x4096 17.8 / 21.2, 128x7168x4096
#: 35.1 / 36.1) and lost on the larger outputs (128x4096x8192 38.7 at best / 39.0,
#: 128x14336x8192 84.2 / 78.7, 256x7168x4096 45.9 / 45.4, 256x4096x8192 52.8 / 49.9): its one
#: wave of tiles ends together, so the exchange of a larger output is no longer pure latency.
SPLIT_K_MAX_ROWS, SPLIT_K_MAX_ELEMS = 128, 1 << 19
#: With 65-128 rows and K from ``fused_split_k.NARROW_MIN_K`` its 128 x 64 blocks beat one-shot on
#: outputs up to this size too (``explore/split_k_sweep3_128``, µs, split-K / one-shot:
#: 128x4096x8192 35.5 / 40.1, 128x14336x8192 76.8 / 79.7; measured at 128 rows, taken for 65-127
#: alike: the same blocks, the weight streamed the same way).
SPLIT_K_NARROW_MAX_ELEMS = 1 << 20


def tile_config_override():
    """``COMMFUSE_TILE_CONFIG`` (e.g. ``128x256x64s3w8g8r16o1``): every fused kernel's tiling."""
    from .tiles import TileConfig

    given = os.environ.get("COMMFUSE_TILE_CONFIG", "").strip()
    try:
        return TileConfig.parse(given) if given else None
    except ValueError as exc:
        raise ValueError(f"COMMFUSE_TILE_CONFIG: {exc}") from None



def tile_config(m: int, k: int, n: int, scatter: bool = False):
    """The fused all-reduce / reduce-scatter kernel's tiling (shape only: the same on every
    rank): 128x256 tiles with no reducers (the all-reduce copies the pushed sums inline:
    ``explore/paths_inline_1ba9d08``, ``paths_early_19ac9eb``, us, inline / 16 reducers:
    4096x4096x8192 463 / 509, 8192x4096x8192 905 / 963, 8192x2048x4096 290 / 320,
    4096x2048x4096 165 / 183), but 64x128 tiles for a reduce-scatter of at most
    ``SMALL_TILES_ELEMS`` outputs, where 128x256 ones would be too few to overlap anything;
    ``COMMFUSE_TILE_CONFIG`` overrides."""
    from .tiles import TileConfig

    if scatter and m * n <= SMALL_TILES_ELEMS:
        return tile_config_override() or TileConfig(bm=64, bn=128, stages=4, warps=4, reducers=0)
    return tile_config_override() or TileConfig(reducers=0)


#: Outputs up to this many elements take 64x128 tiles in the fused reduce-scatter and all-gather
#: (2xH200, interleaved rounds, ``explore/paths_tilings_a87251c.json``, us, 1024^3: reduce-scatter
#: 17.2 against 26.4 with 128x256 tiles and 19.5 for the symmetric pull; all-gather 18.8 against
#: 20.8 with 128x128); at 2048^3 they lose (reduce-scatter 54.5 against 46.2, all-gather 53.2
#: against 47.8).
SMALL_TILES_ELEMS = 1 << 20


#: The fused all-gather kernel (``fused_all_gather.py``) for gathered rows in this range whose
#: output has at most ``FUSED_SMALL_ELEMS`` elements (2xH200, de7b7b9 ``ops.json``, fused against
#: the path it replaced, us: 1024^3 21 / 22 (symm), 2048^3 49 / 53 (symm)); from 4096 rows the
#: overlap stays ahead (4096^3 216 / 210, 4096x8192x5120 494 / 490; ``explore/ag_sweep3_315f2b7.json``
#: 212 / 207, 484 / 477): the kernel's shard copy into the workspace and its tile GEMM cost more
#: there than the side-stream pull. 2048x4096x7168 (a larger output) goes to the overlap too: it
#: was ahead in three of five runs (``explore/paths_tilings_a87251c.json`` 183.7 / 194.3, ops
#: runs c89064a 188.9 / 194.3 and 2df67b4 188 / 195; behind by 3 us in ``ag_sweep3`` and
#: ``ag_sweep4``). Below 1024 rows it is not measured.
FUSED_AG_ROWS = (1024, 2048)
FUSED_SMALL_ELEMS = 2048 * 2048


#: From this many gathered rows the fused all-gather is ahead of the copy-engine overlap again
#: (2xH200, 16384x4096x7168, us, fused / overlap: ``explore/paths_tilings_a87251c.json`` 1382 /
#: 1437 in interleaved rounds, ops runs c89064a 1369 / 1423 and 2df67b4 1386 / 1436): with 8192-row
#: shards its shard copy is small against the GEMM, and the overlap's two half GEMMs lose a
#: little to one persistent kernel.
FUSED_AG_MIN_LARGE_ROWS = 16384


#: The fused tile kernel's reduce-scatter form takes the same small calls as the all-gather
#: (``FUSED_AG_ROWS`` rows, at most ``FUSED_SMALL_ELEMS`` outputs; 2xH200, interleaved rounds,
#: ``explore/paths_tilings_a87251c.json``, us, fused / symmetric pull: 1024^3 17.2 / 19.5 with
#: ``SMALL_TILES_ELEMS``' 64x128 tiles, 2048^3 46.2 / 49.2; ops run 2df67b4 46.4 / 48.0), and
#: everything from this many rows (2xH200, 2b5d2e9 ``ops.json``,
#: fused against the default, us): 16384x4096x7168 1409 / 1582 (the copy-engine overlap; 1374 at
#: 2f01995, so its runs vary) and torch's fused_matmul_reduce_scatter 1484; between the two it
#: loses (4096^3 228 / 216, 4096x8192x5120 490 / 455, 2048x4096x7168 217 / 208). 8192x8192x28672 (6048 / 5922) has fewer rows but a far larger
#: GEMM, which the reducer-free form still pays its own-tile epilogue on. At 2 ranks the
#: copy-engine overlap in 4 chunks per share now beats it there (interleaved rounds,
#: ``explore/paths_8f97686.json``: 1388 +-12 against 1452 +-1 us, 2 chunks 1462 +-17), so at 2
#: ranks the rule holds only where the overlap does not apply (a share under 2^33 of GEMM work).
FUSED_RS_MIN_M = 16384


def gather_tile_config(rows: int, k: int, n: int):
    """The fused all-gather's tiling: 64x128 tiles up to ``SMALL_TILES_ELEMS`` outputs, 128x128
    while 128x256 ones would not fill the GPU (two ranks' 2048x2048 outputs are 128 such tiles),
    else the default; ``COMMFUSE_TILE_CONFIG`` overrides."""
    from .tiles import TileConfig

    if rows * n <= SMALL_TILES_ELEMS:
        return tile_config_override() or TileConfig(bm=64, bn=128, stages=4, warps=4, reducers=0)
    if rows * n <= 2048 * 2048:
        return tile_config_override() or TileConfig(bm=128, bn=128, stages=4, reducers=0)
    return tile_config_override() or TileConfig(reducers=0)


#: Who pushes the fused all-gather's shard into the peers' workspaces: ``ce``, the copy engines
#: on a side stream, each chunk's flag a stream write (no SMs taken from the GEMM), from shards of
#: ``AG_CE_MIN_SHARD_BYTES``; ``sm``, ``fused_all_gather.PUSHERS`` programs of the kernel, below.
#: 2xH200, interleaved rounds (``explore/paths_ce_pull_d912fa0.json``, us, programs / copy
#: engines in one chunk): 2048^3 49.6 / 40.1 (the 16 pushers' SMs cost a third wave of tiles,
#: ``explore/ag_trace_*``), 16384x4096x7168 1383 / 1370, 4096^3 213 / 201; 1024^3 (1 MiB shards)
#: 19.5 / 21.7: the copy's start-up latency is more than the pushers cost there. More chunks
#: lose (2048^3: 2 / 4 / 8 chunks 44.6 / 55.7 / 78.9): each copy adds its latency.
#: ``COMMFUSE_AG_PUSH=ce|sm`` forces one (set alike on every rank).
AG_PUSH_MODES = ("ce", "sm")
AG_CE_MIN_SHARD_BYTES = 2 << 20


def _env_choice(name: str, choices: tuple[str, ...]) -> str | None:
    """A setting that names one of ``choices``, or None when unset; anything else raises."""
    given = os.environ.get(name, "").strip()
    if given and given not in choices:
        raise ValueError(f"{name}={given!r} is not one of {choices}")
    return given or None


def gather_push(shard_bytes: int) -> str:
    return _env_choice("COMMFUSE_AG_PUSH", AG_PUSH_MODES) or (
        "ce" if shard_bytes >= AG_CE_MIN_SHARD_BYTES else "sm")


#: The fused reduce-scatter's owners pull the peers' partials of their tiles, loads started
#: before each own tile's K loop, instead of the peers pushing them from their epilogues
#: (``COMMFUSE_RS_PULL=1``; read per call, set alike on every rank). Off: it lost on every shape
#: (2xH200, interleaved rounds, ``explore/paths_ce_pull_d912fa0.json``, us, push / pull: 1024^3
#: 17.0 / 18.9, 2048^3 46.1 / 50.9, 16384x4096x7168 1440 / 1499).
RS_PULL = False


def scatter_pull() -> bool:
    return env.flag("COMMFUSE_RS_PULL", RS_PULL)


def fused_unsupported(m: int, k: int, n: int, dtype: torch.dtype, world: int,
                      scatter: bool = False, gather: bool = False) -> str | None:
    """Why the fused tile kernel cannot take this call (shape and dtype only, so every rank
    agrees), or None. ``scatter``: its reduce-scatter form (rows split into world shares);
    ``gather``: the all-gather kernel (``fused_all_gather.py``; ``m`` rows gathered)."""
    from . import fused_all_gather, fused_all_reduce
    from .tiles import FUSABLE_DTYPES, TensorDescriptor

    if TensorDescriptor is None:
        return "this Triton has no tensor descriptors"
    if world < 2:
        return "one rank"
    if dtype not in FUSABLE_DTYPES:
        return f"{dtype} (the tile kernel takes fp16 and bf16)"
    if min(m, k, n) < 1:
        return "an empty dimension"
    if (k * dtype.itemsize) % 16 or (n * dtype.itemsize) % 16:
        return "K or N rows are not 16-byte multiples (TMA descriptors)"
    if (scatter or gather) and m % world:
        return "rows that do not split into world shares"
    cfg = gather_tile_config(m, k, n) if gather else tile_config(m, k, n, scatter)
    if gather:
        if cfg.bm % fused_all_gather.CHUNK_ROWS:
            return f"tile height {cfg.bm} is not a multiple of {fused_all_gather.CHUNK_ROWS} rows"
        if fused_all_gather.chunk_flag_slots(m // world, world) > symm.TILE_FLAG_SLOTS:
            return "more row chunks than the workspace has tile flags"
        if fused_all_gather.data_elems(m // world, k, world) * dtype.itemsize > 2 * SYMM_MAX_BYTES:
            return "the workspace would be too large"
        return None
    if fused_all_reduce.tile_flag_slots(m, n, world, cfg, scatter) > symm.TILE_FLAG_SLOTS:
        return "more tiles than the workspace has tile flags"
    if fused_all_reduce.data_elems(m, n, world, cfg, scatter) * dtype.itemsize > 2 * SYMM_MAX_BYTES:
        return "the workspace would be too large"
    return None


def split_k_unsupported(m: int, k: int, n: int, dtype: torch.dtype, world: int) -> str | None:
    """Why the split-K kernel (``fused_split_k.py``) cannot take this call, or None."""
    from . import fused_split_k

    return fused_unsupported(m, k, n, dtype, world) or fused_split_k.unsupported(
        m, k, n, dtype, world, symm.COUNTER_BYTES // 4, symm.TILE_FLAG_SLOTS)


def split_k_by_default(m: int, k: int, n: int, dtype: torch.dtype, world: int) -> bool:
    """Whether a call of this shape takes the split-K kernel (eagerly, or in the graph lane)."""
    from . import fused_split_k

    wide = fused_split_k.one_row_block(m, k)
    return (m <= SPLIT_K_MAX_ROWS and m * n <= (SPLIT_K_NARROW_MAX_ELEMS if wide else SPLIT_K_MAX_ELEMS)
            and split_k_unsupported(m, k, n, dtype, world) is None)


def graph_split_k(m: int, k: int, n: int, dtype: torch.dtype, lane):
    """The split-K kernel's config if a graph-lane call runs it in the lane, else None
    (``COMMFUSE_GRAPH_SPLIT_K=0`` keeps cuBLAS + the staged one-shot): the eager rule, and the
    lane holds its flags, counters and data. Shape and lane size only, so every rank agrees, in
    capture and in re-warming alike."""
    from . import fused_split_k

    if not env.flag("COMMFUSE_GRAPH_SPLIT_K", True):
        return None
    if not split_k_by_default(m, k, n, dtype, lane.world):
        return None
    cfg = split_k_config(m, k, n, lane.max_programs)
    return None if fused_split_k.misfit(lane, m, n, cfg, dtype, lane=True) else cfg


def split_k_config(m: int, k: int, n: int, programs: int, tile=None):
    """The split-K kernel's tiling for a group whose smallest GPU has ``programs`` SMs (``tile``:
    these blocks); ``COMMFUSE_SPLIT_K`` forces the number of K slices and ``COMMFUSE_SPLIT_K_LL`` (0 or 1)
    whether the sums travel as LL words (sweeps; alike on every rank)."""
    from . import fused_split_k

    split = env.integer("COMMFUSE_SPLIT_K", None, minimum=1)
    return fused_split_k.config(m, k, n, programs, split, tile, ll=split_k_ll())


def split_k_ll() -> bool | None:
    """``COMMFUSE_SPLIT_K_LL``: a switch (the split-K sums as LL words or not), None when unset."""
    return env.flag("COMMFUSE_SPLIT_K_LL", None)


#: The split-K kernel's workspace is sized for this many programs, more than any GPU has SMs: a
#: group's agreed count (its smallest GPU's) never needs more slices, hence never more bytes, and
#: the request is the same on every rank whatever its GPU (allocation is collective).
SPLIT_K_PLAN_PROGRAMS = 1024


def split_k_workspace_bytes(m: int, k: int, n: int, dtype: torch.dtype, world: int) -> int:
    """Per-parity bytes the split-K kernel may use for this shape on any group: those of its wide
    blocks with their most slices (``SPLIT_K_PLAN_PROGRAMS``), which no tiling of fewer SMs
    exceeds (a narrow one is no taller or wider and has no slices)."""
    from . import fused_split_k

    wide = split_k_config(m, k, n, SPLIT_K_PLAN_PROGRAMS, fused_split_k.wide_tile(m, k, n))
    return fused_split_k.data_bytes(m, n, world, wide, dtype)


def fused_by_default(m: int, k: int, n: int, dtype: torch.dtype, world: int) -> bool:
    """Whether an eager call of this shape takes the fused tile kernel (the graph pass sizes the
    workspace by it, too)."""
    many_rows = m >= FUSED_MIN_M and k <= m
    mid_rows = world == 2 and m >= FUSED_MID_M and k <= FUSED_MID_MAX_K and m * n > FUSED_MID_MORE_THAN
    return (many_rows or mid_rows) and fused_unsupported(m, k, n, dtype, world) is None


def fused_workspace_bytes(m: int, k: int, n: int, dtype: torch.dtype, world: int,
                          scatter: bool = False) -> int:
    """Per-parity bytes of the fused tile kernel (``scatter``: its reduce-scatter form)."""
    from . import fused_all_reduce

    return fused_all_reduce.data_elems(m, n, world, tile_config(m, k, n, scatter), scatter) * dtype.itemsize


def fused_gather_workspace_bytes(rows: int, k: int, dtype: torch.dtype, world: int) -> int:
    """Per-parity bytes of the fused all-gather kernel (``rows`` gathered: all of them)."""
    from . import fused_all_gather

    return fused_all_gather.data_elems(rows // max(world, 1), k, world) * dtype.itemsize


def all_reduce_workspace_bytes(m: int, k: int, n: int, dtype: torch.dtype, world: int) -> int:
    """Per-parity symmetric bytes an ``mm_all_reduce`` call of this shape uses (as the call's
    dispatch decides, ``COMMFUSE_ALGO`` included)."""
    algo = mm_all_reduce(m, k, n, dtype, world)
    if algo == "fused":
        return fused_workspace_bytes(m, k, n, dtype, world)
    if algo == "split_k":
        return split_k_workspace_bytes(m, k, n, dtype, world)
    return m * n * dtype.itemsize


def gather_workspace_bytes(rows: int, k: int, n: int, dtype: torch.dtype, world: int,
                           gather_dim: int = 0) -> int:
    """Per-parity symmetric bytes an ``all_gather_mm`` call uses (``rows`` gathered): all the
    rows for the fused kernel, else this rank's shard."""
    if all_gather_mm(rows, k, n, dtype, world, gather_dim) == "fused":
        return fused_gather_workspace_bytes(rows, k, dtype, world)
    return rows // max(world, 1) * k * dtype.itemsize


def scatter_workspace_bytes(m: int, k: int, n: int, dtype: torch.dtype, world: int,
                            scatter_dim: int = 0) -> int:
    """Per-parity symmetric bytes an ``mm_reduce_scatter`` call uses: the fused form's slabs,
    else the partial."""
    if mm_reduce_scatter(m, k, n, dtype, world, scatter_dim) == "fused":
        return fused_workspace_bytes(m, k, n, dtype, world, scatter=True)
    return m * n * dtype.itemsize


def _warn_once(op: str, key: str, message: str, *args) -> None:
    """Log ``message`` the first time (op, key) comes up: the dispatch runs on every call."""
    if (op, key) not in _warned:
        _warned.add((op, key))
        log.warning(message, op, *args)


def rows_dim(shape, dim: int) -> int:
    """0 when every dimension before ``dim`` has size 1 (a sequence-parallel ``[1, S, H]``
    gathered or scattered along S): the collective then moves the same blocks of rows as one
    along dim 0, so the row-splitting paths take it; else ``dim``."""
    return 0 if row_slabs(shape, dim) == 1 else dim


#: At most this many row slabs (``row_slabs``) for the copy-engine overlaps: each slab costs one
#: more GEMM and copy per rank block, launches that a larger batch would multiply.
MAX_ROW_SLABS = 8


def row_slabs(shape, dim: int) -> int:
    """Into how many slabs of rows a collective along ``dim`` of ``shape`` (the rows being every
    dimension but the last) cuts every rank's block: 1 along the rows (``rows_dim`` 0), else the
    product of the dimensions before ``dim`` (a batch of sequences gathered along the sequence);
    0 when that is unknown or above ``MAX_ROW_SLABS``."""
    if dim == 0:
        return 1
    lead = shape[:dim]
    if not all(isinstance(s, int) and s > 0 for s in lead):
        return 0
    slabs = math.prod(lead)
    return slabs if slabs <= MAX_ROW_SLABS else 0


def _fused_along_rows(what: str, dim: int, m: int, k: int, n: int, dtype: torch.dtype, world: int
                      ) -> str | None:
    """``fused_unsupported`` for the kernels that split the rows (``what``: "gather" or
    "scatter"): a collective along another dimension is not theirs either."""
    if dim != 0:
        return f"a {what} along a dimension other than the rows"
    return fused_unsupported(m, k, n, dtype, world, **{what: True})


def _forced_fused(op: str, why: str | None, instead: str, algo: str = "fused") -> str:
    """``COMMFUSE_ALGO=fused`` (or ``split_k``): that tile kernel, or where it cannot take the
    call, ``instead`` (logged once per op and reason)."""
    if why is None:
        return algo
    _warn_once(op, f"{algo}: {why}", f"commfuse.%s: COMMFUSE_ALGO={algo} cannot take this call (%s); "
               "running %s instead", why, instead)
    return instead


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def nccl_fallback(op: str, why: str) -> str:
    """Inside CUDA-graph capture the host-epoch paths are unsafe (a replay would not advance their
    epochs), so a call there takes NCCL, which captures correctly; logged once per op and reason."""
    _warn_once(op, why, "commfuse.%s: this call runs the unfused NCCL path (%s)", why)
    return "nccl"


_warned: set[tuple[str, str]] = set()


def _forced(valid: tuple[str, ...]) -> str | None:
    algo = os.environ.get("COMMFUSE_ALGO", "").strip()
    if not algo:
        return None
    known = set(MM_ALL_REDUCE_ALGOS + ALL_GATHER_MM_ALGOS + MM_REDUCE_SCATTER_ALGOS)
    if algo not in known:
        raise ValueError(f"COMMFUSE_ALGO={algo!r} is not one of {sorted(known)}")
    return algo if algo in valid else None  # another op's algorithm leaves this op alone


def _symmetric_possible(nbytes: int, world: int) -> bool:
    return world > 1 and 0 < nbytes <= SYMM_MAX_BYTES


def mm_all_reduce(m: int, k: int, n: int, dtype: torch.dtype, world: int, lane_bytes: int = 0) -> str:
    """``lane_bytes``: the group's graph-lane size once this process captured a call on it, else 0."""
    nbytes = m * n * dtype.itemsize
    if capturing():  # the graph lane keeps its epochs on the device: replays need no host step
        if world > 1 and 0 < nbytes <= symm.graph_data_bytes():
            return "graph"
        why = ("one rank" if world <= 1 else "empty output" if not nbytes else
               f"{nbytes} bytes is past the graph lane's COMMFUSE_GRAPH_BYTES")
        return nccl_fallback("mm_all_reduce", f"in a CUDA-graph capture: {why}")
    forced = _forced(MM_ALL_REDUCE_ALGOS)
    if forced in ("fused", "split_k"):
        why = (fused_unsupported(m, k, n, dtype, world) if forced == "fused"
               else split_k_unsupported(m, k, n, dtype, world))
        forced = _forced_fused("mm_all_reduce", why, "one_shot" if _symmetric_possible(nbytes, world) else "nccl",
                               forced)
    if forced:
        return forced
    if not _symmetric_possible(nbytes, world):
        return "nccl"
    if nbytes <= lane_bytes:  # replays use the lane; a rank re-warming its graphs must meet them
        return "graph"
    if world == 2 and m >= CE_MIN_M and 0 < ce_min_k(m) <= k:
        return "ce_overlap"
    if fused_by_default(m, k, n, dtype, world):
        return "fused"
    if split_k_by_default(m, k, n, dtype, world):
        return "split_k"
    if world == 2:  # both read the same remote bytes at 2 ranks; one-shot has one wait less
        return "one_shot"
    return "one_shot" if nbytes <= ONE_SHOT_MAX_BYTES else "two_shot"


def overlap_config(m: int) -> tuple[int, int]:
    """(row chunks, exchange programs) of the SM-overlapped all-reduce; ``COMMFUSE_OVERLAP=CxP``."""
    given = os.environ.get("COMMFUSE_OVERLAP", "").strip()
    if given:
        parts = given.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"commfuse: COMMFUSE_OVERLAP={given!r} is not CxP (row chunks x exchange "
                             "programs, both at least 1, e.g. 4x32)")
        return int(parts[0]), int(parts[1])
    return 4, 32


def scatter_chunks(rows: int, world: int, slabs: int = 1) -> int:
    """Row chunks per share of the copy-engine overlapped reduce-scatter: each chunk's pull
    overlaps the next chunk's GEMM, and the last share's GEMMs add what was pulled in their
    epilogue, so the pull of the last chunk is what stays exposed; ``COMMFUSE_RS_CHUNKS``. One
    barrier flag slot per chunk, slab and step: at most what the flag area holds (0: none fits).
    With slabs, one chunk per slab (``explore/paths_batch4_e84201d.json``, [4, S, .], us, 1 / 2 / 4
    chunks: 16384x4096x7168 1341 / 1555 / 1525, 4096^3 227 / 299 / 533)."""
    given = env.integer("COMMFUSE_RS_CHUNKS", None, minimum=1)
    slots = (symm.FLAG_BYTES - symm.BASES_BYTES) // 4 // max(world, 1) // max(world - 1, 1) // max(slabs, 1)
    if slots < 1 or rows < 1:  # not even one chunk per slab, or no rows: no overlap
        return 0
    default = 1 if slabs > 1 else RS_CHUNKS_LARGE if rows >= RS_LARGE_SHARE else 2
    return max(1, min(given or default, rows, 64, slots))


#: Shares of this many rows and more use 4 row chunks, smaller ones 2 (2xH200, interleaved rounds,
#: ``explore/paths_8f97686.json``, us, 2 / 4 chunks: 8192-row shares 1462 / 1388; 2048-row shares
#: 206 / 231 and 474 / 527; 1024-row 206 / 226).
RS_LARGE_SHARE, RS_CHUNKS_LARGE = 8192, 4


def copy_engine_chunks(m: int) -> int:
    """Row chunks of the copy-engine overlapped all-reduce: 1024-row chunks, 2 to 8 of them
    (2xH200, interleaved rounds, ``explore/paths_8f97686.json``, us, 4 / 8 chunks: 8192 rows
    2684 / 2647 and 737 / 714, 4096 rows 1340 / 1353 and 370 / 916 +-1024: 512-row chunks
    sometimes run several times slower); ``COMMFUSE_CE_CHUNKS`` overrides."""
    given = env.integer("COMMFUSE_CE_CHUNKS", None, minimum=1)
    return max(1, min(given or min(8, max(2, m // 1024)), m, 256))  # a flag slot per chunk


def copy_engine_rows(m: int) -> tuple[int, ...]:
    """Each chunk's rows, in order: ``copy_engine_chunks(m)`` equal chunks (the last one shorter
    by the remainder); ``COMMFUSE_CE_LAST_ROWS`` (read per call, alike on every rank) sets the last
    chunk's rows instead, the others sharing the rest in multiples of 64 rows (a value that leaves
    them no rows, or a call of one chunk, keeps the even chunks). What comes after the last GEMM
    is that chunk's exchange, so a shorter last chunk shortens the call's tail; a shorter chunk's
    GEMM runs less efficiently (no default: ``NOTES.md`` §35)."""
    chunks = copy_engine_chunks(m)
    last = env.integer("COMMFUSE_CE_LAST_ROWS", 0, minimum=0)
    if chunks < 2 or not 0 < last < m - (chunks - 2):
        rows = max(1, -(-m // chunks))
        return tuple(min(rows, m - lo) for lo in range(0, m, rows))
    rest = m - last
    rows = -(-rest // ((chunks - 1) * 64)) * 64
    return tuple(min(rows, rest - lo) for lo in range(0, rest, rows)) + (last,)


#: How the copy-engine overlapped all-reduce sums its last chunk: ``copy`` (the copy engines pull
#: it and a local add sums it, as every other chunk) or ``one_shot`` (the one-shot kernel pulls and
#: sums it on the SMs, which the GEMMs have left by then: the tail after the last GEMM is that one
#: chunk's exchange, and SM loads move it faster than one copy engine). ``COMMFUSE_CE_TAIL``, read
#: per call and set alike on every rank (the ranks must run the same kernels). ``one_shot`` timed
#: faster on every shape tried (2xH200, 8192x7168x4096 8 chunks 693 -> 686 µs, 4096x7168x4096 4
#: chunks 363 -> 356, 8192x2048x4096 4 chunks 399 -> 366; ``explore/paths_stagger_tail_7d8a496``).
CE_TAILS = ("copy", "one_shot")
CE_TAIL = "one_shot"


def ce_tail() -> str:
    return _env_choice("COMMFUSE_CE_TAIL", CE_TAILS) or CE_TAIL


#: How many side streams the copy-engine overlapped all-reduce spreads each chunk's work over:
#: ``1``: the barrier, the pull and the add of each chunk in turn on one stream (before session
#: 17); ``2``: the adds on a stream of their own, so a pull need not wait for the add before it,
#: which shares the SMs with the next GEMM (29-41 µs beside it against 7 alone,
#: ``explore/trace_9afec9a``); ``3``: the barriers on a third, each pull waiting on an event its
#: barrier recorded, so the copy engines go from pull to pull (2xH200, ``explore/ce_rate_d2c7c0f``:
#: 8 pulls of 8 MB beside the chunked GEMM 251 µs back to back, 360 with a barrier before each).
#: ``COMMFUSE_CE_STREAMS``, read per call; the ranks may differ (the protocol is the same).
CE_STREAMS = ("1", "2", "3")
CE_STREAM_COUNT = 3


def ce_streams() -> int:
    return int(_env_choice("COMMFUSE_CE_STREAMS", CE_STREAMS) or CE_STREAM_COUNT)


#: From this many rows an all-reduce whose K is at least ``ce_min_k()`` takes the copy-engine
#: overlap (2 ranks): such GEMM-bound calls lost to the fused kernel's reducer SMs (still ahead
#: of its inline form, 6e0500b: 8192x7168x4096 705 / 723, 4096x14336x8192 1316 / 1365) and win when
#: the copy engines, which take no SMs, move the partials (``explore/paths_8f97686.json``, us,
#: fused / ce: 4096x14336x8192 1510 / 1340, 4096x7168x4096 443 / 370, 8192x14336x8192 3032 / 2647,
#: 8192x7168x4096 800 / 714; one-shot is the default for the first three, 1443, 419, 2954).
CE_MIN_M = 4096


def ce_min_k(m: int = CE_MIN_M) -> int:
    """The K from which ``m``-row all-reduces (at least ``CE_MIN_M``) take the copy-engine
    overlap: ``CE_MIN_K``, ``CE_WIDE_MIN_K`` from ``CE_WIDE_M`` rows; ``COMMFUSE_CE_MIN_K`` sets
    it for every row count (0 turns the rule off)."""
    given = env.integer("COMMFUSE_CE_MIN_K", None, minimum=0)
    if given is not None:
        return given
    return CE_WIDE_MIN_K if m >= CE_WIDE_M else CE_MIN_K


#: Inside the DTensor model (2 layers, 4x2048 tokens, 2xH200, ``model/model_ce_e84201d.json``, ms,
#: without / with the rule at 7168): prefill 7.45 / 7.22, training step 21.29 / 21.26. Before the
#: copy-engine call's host work was cut (one stream switch per call, peer views kept) the
#: training step lost (21.99 / 23.76, ``model/model_f24116a.json``) while prefill gained (7.34 / 6.94).
CE_MIN_K = 7168

#: From this many rows the copy-engine overlap from a smaller K: with its barriers on a stream of
#: their own (``ce_streams``) it beat the fused kernel at 8192x4096x8192, while at 4096 rows and at
#: K = 2048 the fused kernel stayed ahead (2xH200, 3 interleaved rounds,
#: ``explore/paths_streams_c3ed0ea``, µs, fused / copy engines 8 chunks: 8192x4096x8192 869.8 /
#: 849.4, 4096x4096x8192 444.5 / 449.4, 8192x2048x4096 274.0 / 286.3). 8192x3072x4096 tied (351.7 /
#: 350.1) and stays fused: it is a model's input gradient, whose in-step times were not compared.
#: Measured at N = 8192 only; other N from 8192 rows are taken alike.
CE_WIDE_M, CE_WIDE_MIN_K = 8192, 4096


#: A GEMM-bound all-gather (large N: each gathered element feeds 2N flops) is still overlapped: the
#: gather is a few % of the GEMM, but the copy-engine overlap took that much off in every sweep
#: (8192x8192x28672 against unfused, interleaved rounds: 1.029x / 1.034x / 1.010x for the
#: workspace source in ``explore/paths_8f97686``, ``paths_batch4_e84201d``, ``paths_f24116a``),
#: where the unfused path timed 0.985-0.99x of itself. (It was left unfused until session 9.) The
#: other paths were never timed at such N: calls the overlap does not take stay unfused.
AG_GEMM_BOUND_N = 16384


#: What the all-gather overlap's local GEMM reads (``COMMFUSE_AG_LOCAL``): ``workspace``, the copy
#: the peers pull from, or ``copy``, the local rows copied into the gathered tensor first. Over two
#: runs of interleaved rounds (``explore/paths_{8f97686,f24116a}.json``, us, workspace / copy):
#: 4096^3 207 / 203 and 204 / 215, 4096x8192x5120 471 / 486 and 457 / 474, 2048x4096x7168 187 / 192
#: and 183 / 189, 16384x4096x7168 1411 / 1345 and 1407 / 1447. Multiplying the caller's shard
#: while the side stream made the workspace copy ran slowest (4096^3 247, 4096x8192x5120 544): that
#: copy and the barrier wait behind the GEMM for SMs, so the peers' pulls start late.
AG_LOCAL_SOURCES = ("workspace", "copy")


def gather_local_source() -> str:
    return _env_choice("COMMFUSE_AG_LOCAL", AG_LOCAL_SOURCES) or "workspace"


#: A batch of sequences gathered or scattered along the sequence (``row_slabs`` > 1) could take
#: the copy-engine overlaps slab by slab. Alone they win from 512-row blocks ([4, S, .] along S,
#: 2xH200, interleaved rounds, ``explore/paths_batch4_e84201d.json``, us, symmetric pull /
#: overlap: all-gather 4096^3 253 / 214, 16384x4096x7168 1510 / 1276; reduce-scatter in one chunk
#: per slab 16384x4096x7168 1597 / 1341; 256-row blocks lose), but inside the sequence-parallel
#: model they made prefill 12.15 ms against Inductor's 8.27 and the training step 26.41 against
#: 22.60 (``model/model_91f403e.json``): they stay forced-only (``COMMFUSE_ALGO``) until that is
#: understood. ``COMMFUSE_SLAB_OVERLAP=1`` turns them on for both ops (read per call).
SLAB_OVERLAP = False


def slab_overlap() -> bool:
    return env.flag("COMMFUSE_SLAB_OVERLAP", SLAB_OVERLAP)


def _overlaps_rows(dim: int, rows: int, k: int, n: int, world: int, slabs: int) -> bool:
    """Whether a gather / scatter of ``rows`` (all ranks) along ``dim`` takes its copy-engine
    overlap: enough GEMM work per shard to hide the exchange, and rows in one block per rank
    (``dim`` 0; in ``slabs`` slabs only when ``SLAB_OVERLAP``)."""
    if (rows // world) * k * n < OVERLAP_MIN_SHARD_MNK:
        return False
    return dim == 0 or (slab_overlap() and slabs > 0 and rows // world // slabs >= SLAB_MIN_ROWS)


#: With ``SLAB_OVERLAP``, each rank's block in a slab needs this many rows.
SLAB_MIN_ROWS = 512


def all_gather_mm(rows: int, k: int, n: int, dtype: torch.dtype, world: int, gather_dim: int = 0,
                  slabs: int = 0) -> str:
    """``rows``: of the gathered tensor (all ranks); ``slabs``: ``row_slabs`` of the shard along
    ``gather_dim`` (0, unknown: no overlap slab by slab)."""
    if capturing():
        return nccl_fallback("all_gather_mm", "in a CUDA-graph capture: no graph-lane path for this op yet")
    forced = _forced(ALL_GATHER_MM_ALGOS)
    if forced == "fused":  # the tile kernel (fused_all_gather.py)
        why = _fused_along_rows("gather", gather_dim, rows, k, n, dtype, world)
        forced = _forced_fused("all_gather_mm", why,
                               "symm" if _symmetric_possible(rows * k * dtype.itemsize, world) else "nccl")
    if forced:
        return forced
    if not _symmetric_possible(rows * k * dtype.itemsize, world):
        return "nccl"
    if n >= AG_GEMM_BOUND_N:  # only the overlap was timed there; the others gain nothing measurable
        return "overlap" if _overlaps_rows(gather_dim, rows, k, n, world, slabs) else "nccl"
    if ((FUSED_AG_ROWS[0] <= rows <= FUSED_AG_ROWS[1] and rows * n <= FUSED_SMALL_ELEMS
         or rows >= FUSED_AG_MIN_LARGE_ROWS)
            and _fused_along_rows("gather", gather_dim, rows, k, n, dtype, world) is None):
        return "fused"
    if _overlaps_rows(gather_dim, rows, k, n, world, slabs):
        return "overlap"
    return "symm"


def mm_reduce_scatter(m: int, k: int, n: int, dtype: torch.dtype, world: int, scatter_dim: int = 0,
                      slabs: int = 0) -> str:
    """``slabs``: ``row_slabs`` of the product's shape along ``scatter_dim`` (0, unknown: no
    overlap slab by slab)."""
    if capturing():
        return nccl_fallback("mm_reduce_scatter", "in a CUDA-graph capture: no graph-lane path for this op yet")
    forced = _forced(MM_REDUCE_SCATTER_ALGOS)
    if forced == "fused":  # the tile kernel's reduce-scatter form
        forced = _forced_fused("mm_reduce_scatter",
                               _fused_along_rows("scatter", scatter_dim, m, k, n, dtype, world),
                               "symm" if _symmetric_possible(m * n * dtype.itemsize, world) else "nccl")
    if forced:
        return forced
    if not _symmetric_possible(m * n * dtype.itemsize, world):  # the partial every rank exposes
        return "nccl"
    overlap = _overlaps_rows(scatter_dim, m, k, n, world, slabs)
    small = FUSED_AG_ROWS[0] <= m <= FUSED_AG_ROWS[1] and m * n <= FUSED_SMALL_ELEMS
    if ((small or m >= FUSED_RS_MIN_M and (world > 2 or not overlap))
            and _fused_along_rows("scatter", scatter_dim, m, k, n, dtype, world) is None):
        return "fused"
    return "ce_overlap" if overlap else "symm"
