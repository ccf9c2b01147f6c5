"""The fused all-gather kernel's chunks and sizes, apart from its Triton code
(``kernels/fused_all_gather.py``): what a path decides from imports no Triton."""

from __future__ import annotations

from .tiles import cdiv


#: Rows per pushed chunk (one flag each); a divisor of every tile height used here.
CHUNK_ROWS = 32
#: Programs that push the shard and then copy the peers' rows into the gathered tensor (ranks may
#: differ: chunk slots do not depend on it).
PUSHERS = 16


def data_elems(rows: int, k: int, world: int) -> int:
    """Workspace elements per parity: the gathered rows."""
    return world * rows * k


def rowwise_scales_offset(rows: int, k: int, world: int, itemsize: int) -> int:
    """Where the row-wise form's float32 row scales start in a parity half: after the gathered
    rows, 16-byte aligned."""
    return cdiv(data_elems(rows, k, world) * itemsize, 16) * 16


def rowwise_bytes(rows: int, k: int, world: int, itemsize: int) -> int:
    """Bytes per parity of the row-wise form: the gathered rows, then a float32 scale per row; a
    multiple of 16, so the second parity's rows start 16-byte aligned too (TMA descriptors)."""
    return cdiv(rowwise_scales_offset(rows, k, world, itemsize) + 4 * world * rows, 16) * 16


def chunk_flag_slots(rows: int, world: int) -> int:
    """Tile-flag slots a call may use: one per ``CHUNK_ROWS`` chunk of every rank's ``rows``
    (the programs' pushes), then as many again from ``ce_flag_base`` (the copy engines' pushes,
    whose chunks are never smaller)."""
    return 2 * ce_flag_base(rows, world)


def ce_flag_base(rows: int, world: int) -> int:
    """First tile-flag slot of the copy engines' chunk flags, past every slot the programs' pushes
    use (a multiple of ``world``: slot = writer mod world still holds). Two ranks that disagree on
    who pushes (the path configuration's ``push``, or a rank without peer views or the stream
    write, whose programs push instead) then wait for flags nobody writes and time out with an
    error, instead of one of them reading rows that were not pushed yet."""
    return world * cdiv(rows, CHUNK_ROWS)


def ce_chunks(rows: int, chunks: int = 1) -> int:
    """Row chunks of a copy-engine push of ``rows`` (one flag each): ``chunks``, at most one per
    ``CHUNK_ROWS`` rows. Each chunk costs a copy and a flag write per peer, and each copy its
    start-up latency: one by default."""
    return max(1, min(chunks, cdiv(rows, CHUNK_ROWS)))
