"""CUDA implementations of the ops through a symmetric workspace (``dispatch.py`` picks the path).

``mm_all_reduce``: cuBLAS writes the partial straight into the workspace, then a Triton kernel
reduces it over the peers (one-shot or two-shot); or, for large GEMMs, cuBLAS in row chunks while
the copy engines pull each finished chunk from the peers (``ce_overlap``). ``all_gather_mm``: the
shard is copied into the workspace (one copy); a Triton kernel pulls every shard, then cuBLAS
multiplies; or the local shard multiplies while the copy engines pull the others (``overlap``).
``mm_reduce_scatter``: the same two shapes of path, pulling only this rank's share. Every rank
returns the reduced / gathered result, never its own partial. Side-stream work is joined back to
the caller's stream before returning.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from . import dispatch, exchange, reference, symm
from .sync import ErrorWord

_OP_MM_ALL_REDUCE, _OP_ALL_GATHER_MM, _OP_MM_REDUCE_SCATTER = 1, 2, 3
_side_streams: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device.index not in _side_streams:
        _side_streams[device.index] = torch.cuda.Stream(device)
    return _side_streams[device.index]


def _matmul_into(a, b, bias, out) -> None:
    reference.matmul(a, b, bias, out=out)


def mm_all_reduce(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group_name: str) -> torch.Tensor:
    ErrorWord.check("mm_all_reduce")
    group = _resolve_process_group(group_name)
    m, n = a.shape[0], b.shape[1]
    algo = dispatch.mm_all_reduce(m, a.shape[1], n, a.dtype, group.size())
    if algo == "nccl":
        return reference.mm_all_reduce(a, b, bias, group_name)
    ws = symm.workspace(group_name, m * n * a.dtype.itemsize, a.device)
    epoch, parity = ws.next_epoch()
    partial = ws.data(parity, (m, n), a.dtype)
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if algo == "overlap":
        _overlapped(ws, a, b, bias, partial, out, epoch)
        return out
    if algo == "ce_overlap":
        peers = [ws.peer_data(p, parity, (m, n), a.dtype) for p in range(ws.world)]
        if all(p is not None for p in peers):
            _copy_engine_overlapped(ws, a, b, bias, partial, out, peers, epoch)
            return out
        algo = "one_shot"  # the provider has no peer views for the copy engines
    _matmul_into(a, b, bias, partial)
    exchange.all_reduce(ws, partial, out, epoch, algo, _OP_MM_ALL_REDUCE)
    return out


def _gather_overlapped(ws, shard, b, bias, gathered, peers, epoch) -> torch.Tensor:
    """Multiply the local shard at once while the copy engines pull the peers' shards (no SMs)
    on a side stream; then multiply the peers' rows."""
    k, rows = shard.shape[-1], shard.numel() // shard.shape[-1]
    g2 = gathered.view(-1, k)
    out = torch.empty((g2.shape[0], b.shape[1]), dtype=shard.dtype, device=shard.device)
    side = _side_stream(shard.device)
    main = torch.cuda.current_stream(shard.device)
    side.wait_stream(main)  # the shard is in the workspace; gathered and out were allocated on main
    with torch.cuda.stream(side):
        exchange.barrier(ws, epoch, _OP_ALL_GATHER_MM)
        for p, view in enumerate(peers):
            if p != ws.rank:
                g2[p * rows:(p + 1) * rows].copy_(view.view(rows, k), non_blocking=True)
    lo, hi = ws.rank * rows, (ws.rank + 1) * rows
    g2[lo:hi].copy_(shard.reshape(rows, k))  # the shard may be a strided view
    _matmul_into(g2[lo:hi], b, bias, out[lo:hi])
    main.wait_stream(side)
    for start, stop in ((0, lo), (hi, g2.shape[0])):  # the peers' rows, in at most two GEMMs
        if stop > start:
            _matmul_into(g2[start:stop], b, bias, out[start:stop])
    return out


def _copy_engine_overlapped(ws, a, b, bias, partial, out, peers, epoch) -> None:
    """cuBLAS per row chunk; as each chunk lands, the copy engines (no SMs) pull the peers' rows
    of it on a side stream and one local add sums them, while the next chunk multiplies."""
    chunks = dispatch.copy_engine_chunks(a.shape[0])
    side = _side_stream(a.device)
    main = torch.cuda.current_stream(a.device)
    recv = torch.empty((ws.world - 1, *out.shape), dtype=out.dtype, device=out.device)
    side.wait_stream(main)  # out and recv were allocated on main
    rows = -(-a.shape[0] // chunks)
    others = [p for p in range(ws.world) if p != ws.rank]
    for i, lo in enumerate(range(0, a.shape[0], rows)):
        hi = min(lo + rows, a.shape[0])
        _matmul_into(a[lo:hi], b, bias, partial[lo:hi])
        side.wait_stream(main)
        with torch.cuda.stream(side):
            exchange.barrier(ws, epoch, _OP_MM_ALL_REDUCE, slot=i)  # every rank's chunk i is ready
            for j, p in enumerate(others):
                recv[j, lo:hi].copy_(peers[p][lo:hi], non_blocking=True)
            torch.add(partial[lo:hi], recv[0, lo:hi], out=out[lo:hi])
            for j in range(1, len(others)):
                out[lo:hi].add_(recv[j, lo:hi])
    main.wait_stream(side)


def _overlapped(ws, a, b, bias, partial, out, epoch) -> None:
    """cuBLAS per row chunk on the current stream; each finished chunk is reduced one-shot by a
    few programs on a side stream while the next chunk multiplies. The chunks' kernels reuse the
    call's epoch in disjoint flag slots, so the call still costs one epoch and one parity."""
    chunks, programs = dispatch.overlap_config(a.shape[0])
    side = _side_stream(a.device)
    main = torch.cuda.current_stream(a.device)
    side.wait_stream(main)  # out was allocated on main
    rows = -(-a.shape[0] // chunks)
    for i, lo in enumerate(range(0, a.shape[0], rows)):
        hi = min(lo + rows, a.shape[0])
        _matmul_into(a[lo:hi], b, bias, partial[lo:hi])
        side.wait_stream(main)
        with torch.cuda.stream(side):
            exchange.all_reduce(ws, partial[lo:hi], out[lo:hi], epoch, "one_shot", _OP_MM_ALL_REDUCE,
                                block=8192, max_programs=programs, num_warps=16,
                                slot_base=i * programs)
    main.wait_stream(side)


def all_gather_mm(shard: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, gather_dim: int,
                  world_size: int, group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    ErrorWord.check("all_gather_mm")
    k = shard.shape[-1]
    rows = shard.numel() // k * world_size if k else 0
    algo = dispatch.all_gather_mm(rows, k, b.shape[1], shard.dtype, world_size, gather_dim)
    if algo == "nccl":
        return reference.all_gather_mm(shard, b, bias, gather_dim, world_size, group_name)
    ws = symm.workspace(group_name, shard.numel() * shard.element_size(), shard.device)
    epoch, parity = ws.next_epoch()
    mine = ws.data(parity, shard.shape, shard.dtype)
    mine.copy_(shard)
    shape = list(shard.shape)
    shape[gather_dim] *= world_size
    gathered = torch.empty(shape, dtype=shard.dtype, device=shard.device)
    if algo == "overlap" and gather_dim == 0:
        peers = [ws.peer_data(p, parity, shard.shape, shard.dtype) for p in range(ws.world)]
        if all(p is not None for p in peers):
            out = _gather_overlapped(ws, shard, b, bias, gathered, peers, epoch)
            return out, gathered
    outer = math.prod(shard.shape[:gather_dim])
    inner = math.prod(shard.shape[gather_dim:])
    exchange.gather(ws, mine, gathered, outer, inner, epoch, _OP_ALL_GATHER_MM)
    return reference.matmul(gathered.view(-1, k), b, bias), gathered


def mm_reduce_scatter(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, shape: list[int],
                      scatter_dim: int, world_size: int, group_name: str) -> torch.Tensor:
    ErrorWord.check("mm_reduce_scatter")
    m, n = a.shape[0], b.shape[1]
    shape = reference.resolve_shape(shape, m * n)
    algo = dispatch.mm_reduce_scatter(m, a.shape[1], n, a.dtype, world_size, scatter_dim)
    if algo == "nccl":
        return reference.mm_reduce_scatter(a, b, bias, shape, scatter_dim, world_size, group_name)
    ws = symm.workspace(group_name, m * n * a.dtype.itemsize, a.device)
    epoch, parity = ws.next_epoch()
    partial = ws.data(parity, (m, n), a.dtype)
    out_shape = list(shape)
    out_shape[scatter_dim] //= world_size
    out = torch.empty(out_shape, dtype=a.dtype, device=a.device)
    if algo == "ce_overlap" and scatter_dim == 0:
        peers = [ws.peer_data(p, parity, (m, n), a.dtype) for p in range(ws.world)]
        if all(p is not None for p in peers):
            _scatter_overlapped(ws, a, b, bias, partial, out.view(-1, n), peers, epoch)
            return out
    _matmul_into(a, b, bias, partial)
    outer = math.prod(shape[:scatter_dim])
    exchange.reduce_scatter(ws, partial, out, outer, m * n // outer // world_size, epoch,
                            _OP_MM_REDUCE_SCATTER)
    return out


def _scatter_overlapped(ws, a, b, bias, partial, out, peers, epoch) -> None:
    """Multiply the peers' shares of the rows first, each in turn; as share p lands, rank p's copy
    engines pull it on their side stream while this rank multiplies the next share, its own last.
    Then one local add sums this rank's share with what it pulled."""
    world, rank, rows = ws.world, ws.rank, a.shape[0] // ws.world
    side = _side_stream(a.device)
    main = torch.cuda.current_stream(a.device)
    recv = torch.empty((world - 1, rows, out.shape[1]), dtype=out.dtype, device=out.device)
    side.wait_stream(main)  # out and recv were allocated on main
    mine = slice(rank * rows, (rank + 1) * rows)
    for step in range(1, world):
        p = (rank + step) % world
        _matmul_into(a[p * rows:(p + 1) * rows], b, bias, partial[p * rows:(p + 1) * rows])
        side.wait_stream(main)
        with torch.cuda.stream(side):
            exchange.barrier(ws, epoch, _OP_MM_REDUCE_SCATTER, slot=step)
            q = (rank - step) % world  # at this step rank q multiplied this rank's share
            recv[step - 1].copy_(peers[q][mine], non_blocking=True)
    _matmul_into(a[mine], b, bias, partial[mine])
    main.wait_stream(side)
    torch.add(partial[mine], recv[0], out=out)
    for j in range(1, world - 1):
        out.add_(recv[j])
