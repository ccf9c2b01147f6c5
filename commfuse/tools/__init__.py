"""The command line's tools and what the benchmarks share: ``explain``, the ops and model
benchmarks (``bench``, ``bench_model``), ``tune``, the GPU timer, the group facts the tools decide
with, per-call timing inside a model, the compute-only floor, a group of ranks emulated on one GPU.
Nothing in the compile-time, op or run-time layers imports this package."""


def count(n: int, noun: str) -> str:
    """``1 layer``, ``2 layers``: a count and its noun, agreeing."""
    return f"{n} {noun}{'' if n == 1 else 's'}"
