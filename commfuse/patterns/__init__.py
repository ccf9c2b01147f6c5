"""One module per rewrite. Each exposes NAME, ANCHORS (the collective ops it starts from) and a
match class MATCH with ``from_anchor(node, settings)`` (raises ``Skip``) and ``replace(graph)``."""

from . import add_rms_norm, all_gather_mm, mm_all_reduce, mm_reduce_scatter

#: In application order; names match ``commfuse.config.PATTERNS``. ``add_rms_norm`` first: it takes
#: the matmul and all-reduce of a chain it fuses, and leaves the others to ``mm_all_reduce``. A
#: module with ``OPT_IN`` set runs only where the settings name it (or a rule asks for it).
ALL = (add_rms_norm, mm_all_reduce, all_gather_mm, mm_reduce_scatter)
