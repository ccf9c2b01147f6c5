"""Benchmarks, diagnostics and test helpers: the ops and model benchmarks, per-call timing inside a
model, the compute-only floor, a group of ranks emulated on one GPU, ``explain``. Nothing in the
compile-time, op or run-time layers imports this package."""
