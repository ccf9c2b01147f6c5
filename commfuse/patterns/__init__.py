"""One module per rewrite. Each exposes NAME, ANCHORS (the collective ops it starts from) and a
match class MATCH with ``from_anchor(node, settings)`` (raises ``Skip``) and ``replace(graph)``."""

from . import all_gather_mm, mm_all_reduce, mm_reduce_scatter

#: In application order; names match ``commfuse.config.PATTERNS``.
ALL = (mm_all_reduce, all_gather_mm, mm_reduce_scatter)
