"""How ``paths/nccl.py``'s path runs a call: the kernels it launches, imported here, never on
the deciding side."""

from __future__ import annotations

from .. import reference
from ..paths.base import Context


def run(path, ctx: Context, args):
    if path.op == "mm_all_reduce":
        return reference.mm_all_reduce(args.a, args.b, args.bias, args.group_name)
    if path.op == "all_gather_mm":
        out, gathered = reference.all_gather_mm(args.shard, args.b, args.bias, args.gather_dim, args.world_size,
                                                 args.group_name)
        return out, gathered
    return reference.mm_reduce_scatter(args.a, args.b, args.bias, args.shape, args.scatter_dim, args.world_size,
                                       args.group_name)
