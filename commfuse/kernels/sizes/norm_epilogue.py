"""The norm epilogue's size bound, apart from its Triton code (``kernels/norm_epilogue.py``): what
a path decides from imports no Triton."""

from __future__ import annotations

#: The largest row one program holds in registers (bf16: 16 fp32 values per thread at 16 warps).
MAX_HIDDEN = 8192
