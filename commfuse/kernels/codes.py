"""The op codes the kernels write into a group's error word when a wait times out, and the names
they stand for (read by the run-time without importing Triton)."""

OP_MM_ALL_REDUCE, OP_ALL_GATHER_MM, OP_MM_REDUCE_SCATTER, GRAPH_LANE_OP = 1, 2, 3, 4
FUSED_AR_OP, FUSED_RS_OP, FUSED_AG_OP, FUSED_SPLIT_K_OP = 5, 6, 7, 8
OPS = {OP_MM_ALL_REDUCE: "mm_all_reduce", OP_ALL_GATHER_MM: "all_gather_mm",
       OP_MM_REDUCE_SCATTER: "mm_reduce_scatter", GRAPH_LANE_OP: "mm_all_reduce (graph lane)",
       FUSED_AR_OP: "mm_all_reduce (fused tile kernel)",
       FUSED_RS_OP: "mm_reduce_scatter (fused tile kernel)",
       FUSED_AG_OP: "all_gather_mm (fused tile kernel)",
       FUSED_SPLIT_K_OP: "mm_all_reduce (fused split-K kernel)"}
