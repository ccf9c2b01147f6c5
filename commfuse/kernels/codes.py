"""What the kernels and the run-time agree on without importing Triton: the op codes a kernel writes
into a group's error word, the names they stand for, the kinds of error, and how a flag value
carries its call.

A flag holds ``(count << TAG_BITS) | tag``: ``count`` numbers the group's calls (it only grows: a
wait is for the peer's count to reach the call's), ``tag`` names what the call is (its op, shapes
and path; 0 when the pairing check is off). A waiter that sees its peer at the same count with another nonzero tag
knows the two ranks paired different calls (a rank skipped or reordered one) and records
``ERR_MISMATCH`` instead of reading the peer's data.
"""

OP_MM_ALL_REDUCE, OP_ALL_GATHER_MM, OP_MM_REDUCE_SCATTER, GRAPH_LANE_OP = 1, 2, 3, 4
FUSED_AR_OP, FUSED_RS_OP, FUSED_AG_OP, FUSED_SPLIT_K_OP = 5, 6, 7, 8
OP_AR_NORM = 9
OP_RS_NORM = 16
OP_SCALED_GRAPH = 17
#: The FP8 ops' exchanges after cuBLAS's ``_scaled_mm`` (the after-GEMM and pull paths).
OP_SCALED_AR, OP_SCALED_AG, OP_SCALED_RS, OP_ROWWISE_AR, OP_ROWWISE_RS, OP_ROWWISE_AG = 10, 11, 12, 13, 14, 15
OPS = {OP_MM_ALL_REDUCE: "mm_all_reduce", OP_ALL_GATHER_MM: "all_gather_mm",
       OP_MM_REDUCE_SCATTER: "mm_reduce_scatter", GRAPH_LANE_OP: "mm_all_reduce (graph lane)",
       FUSED_AR_OP: "mm_all_reduce (fused tile kernel)",
       FUSED_RS_OP: "mm_reduce_scatter (fused tile kernel)",
       FUSED_AG_OP: "all_gather_mm (fused tile kernel)",
       FUSED_SPLIT_K_OP: "mm_all_reduce (fused split-K kernel)",
       OP_AR_NORM: "mm_all_reduce_add_rms_norm",
       OP_SCALED_AR: "scaled_mm_all_reduce", OP_SCALED_AG: "all_gather_scaled_mm",
       OP_SCALED_RS: "scaled_mm_reduce_scatter", OP_ROWWISE_AR: "rowwise_scaled_mm_all_reduce",
       OP_ROWWISE_RS: "rowwise_scaled_mm_reduce_scatter", OP_ROWWISE_AG: "all_gather_rowwise_scaled_mm",
       OP_RS_NORM: "mm_reduce_scatter_add_rms_norm", OP_SCALED_GRAPH: "scaled_mm_all_reduce (graph lane)"}
#: The code an op's exchange after a library GEMM writes (the after-GEMM and pull paths run for
#: several ops: an error names the op the user's graph called).
EXCHANGE_CODE = {name: code for code, name in OPS.items() if " " not in name}
#: The code the graph lane's staged all-reduce writes, by op.
LANE_CODE = {"mm_all_reduce": GRAPH_LANE_OP, "scaled_mm_all_reduce": OP_SCALED_GRAPH}

#: Error-word kinds (``err[0]``): a wait passed its bound; a peer reached the same call with
#: another tag.
ERR_TIMEOUT, ERR_MISMATCH = 1, 2

#: Low bits of a flag value that carry the call's tag. With epochs restarting below 2**21 calls
#: (``runtime.workspace.EPOCH_LIMIT``), every value fits a non-negative int32 flag.
TAG_BITS = 10
TAG_MASK = (1 << TAG_BITS) - 1


def flag_value(count: int, tag: int = 0) -> int:
    """The value call ``count`` with ``tag`` signals and waits for."""
    return (count << TAG_BITS) | (tag & TAG_MASK)


def count_of(value: int) -> int:
    return value >> TAG_BITS


def tag_of(value: int) -> int:
    return value & TAG_MASK
