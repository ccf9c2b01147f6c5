"""CUDA implementations of the ops through a symmetric workspace.

``mm_all_reduce``: cuBLAS writes the partial straight into the workspace, then one Triton kernel
reduces it over the peers (one-shot or two-shot). ``all_gather_mm``: the shard is copied into the
workspace (one copy), one Triton kernel pulls every rank's shard into the gathered tensor, then
cuBLAS multiplies. Every rank returns the reduced / gathered result, never its own partial.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from . import dispatch, exchange, reference, symm
from .sync import ErrorWord

_OP_MM_ALL_REDUCE, _OP_ALL_GATHER_MM = 1, 2


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
    if bias is None:
        torch.mm(a, b, out=partial)
    else:
        torch.addmm(bias, a, b, out=partial)
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    exchange.all_reduce(ws, partial, out, epoch, algo, _OP_MM_ALL_REDUCE)
    return out


def all_gather_mm(shard: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, gather_dim: int,
                  world_size: int, group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    ErrorWord.check("all_gather_mm")
    k = shard.shape[-1]
    rows = shard.numel() // k * world_size if k else 0
    algo = dispatch.all_gather_mm(rows, k, b.shape[1], shard.dtype, world_size)
    if algo == "nccl":
        return reference.all_gather_mm(shard, b, bias, gather_dim, world_size, group_name)
    ws = symm.workspace(group_name, shard.numel() * shard.element_size(), shard.device)
    epoch, parity = ws.next_epoch()
    mine = ws.data(parity, shard.shape, shard.dtype)
    mine.copy_(shard)
    shape = list(shard.shape)
    shape[gather_dim] *= world_size
    gathered = torch.empty(shape, dtype=shard.dtype, device=shard.device)
    outer = math.prod(shard.shape[:gather_dim])
    inner = math.prod(shard.shape[gather_dim:])
    exchange.gather(ws, mine, gathered, outer, inner, epoch, _OP_ALL_GATHER_MM)
    return reference.matmul(gathered.view(-1, k), b, bias), gathered
