"""The ``torch.compile`` backend: Inductor, unchanged, plus the commfuse post-grad pass.

``torch.compile(model, backend="commfuse")`` finds this module through the
``torch_dynamo_backends`` entry point, so no import of commfuse is needed. Importing it registers
the ``torch.ops.commfuse`` ops that compiled (and cached) code calls.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..config import DEFAULT_MIN_MNK, Settings
from .graph_pass import CommfusePass


class CommfuseBackend:
    """A configured backend: ``torch.compile(model, backend=commfuse.backend(...))``."""

    def __init__(self, settings: Settings, inductor_config: dict[str, Any] | None = None):
        self.settings = settings
        self.inductor_config = dict(inductor_config or {})
        if "post_grad_custom_post_pass" in self.inductor_config:
            raise ValueError(
                "commfuse: set your own post_grad_custom_post_pass in torch._inductor.config; "
                "commfuse chains it before its own pass"
            )

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        patches = dict(self.inductor_config)
        user_pass = inductor_config.post_grad_custom_post_pass
        if isinstance(user_pass, CommfusePass):  # nested commfuse backends: keep the outer chain
            user_pass = user_pass.chained
        patches["post_grad_custom_post_pass"] = CommfusePass(self.settings, chained=user_pass)
        # compile_fx applies the patches to the lazily compiled backward graph as well.
        return compile_fx(gm, example_inputs, config_patches=patches)

    def __repr__(self) -> str:
        return f"CommfuseBackend({self.settings!r})"


def backend(
    *,
    exclude: Iterable[Any] = (),
    patterns: Iterable[str] | None = None,
    min_mnk: int = DEFAULT_MIN_MNK,
    launch_bound_bytes: int | None = None,
    mode: str | None = None,
    inductor_config: dict[str, Any] | None = None,
) -> CommfuseBackend:
    """A commfuse backend with settings, for ``torch.compile(model, backend=...)``.

    Args:
        exclude: module classes, module instances, or qualified-name patterns (``fnmatch``, relative
            to the compiled module, e.g. ``"layers.0.*"``) whose matmuls stay unfused.
        patterns: which rewrites run, from ``commfuse.PATTERNS`` (default: all).
        min_mnk: matmuls with M*N*K below this stay unfused (the dimension a rank's shard may size
            differently from its peers', K of an all-reduced or reduce-scattered product, N of an
            all-gathered one, counts as 64: ranks with unevenly sharded layers decide alike).
        launch_bound_bytes: without CUDA graphs, matmuls whose exchanged tensor (the output; an
            all-gather's gathered operand) has at most this many bytes
            stay unfused (launch-bound: the fused op's host cost outweighs its GPU saving); 0 fuses
            them too. Default: ``COMMFUSE_LAUNCH_BOUND_BYTES`` or 1 MiB. With
            ``mode="reduce-overhead"`` they fuse.
        mode: an Inductor mode, as ``torch.compile(mode=...)`` takes for Inductor (which it
            refuses for other backends): ``"reduce-overhead"`` runs the graphs as CUDA graphs, where
            ``mm_all_reduce`` uses the graph lane (device-side epochs).
        inductor_config: extra ``torch._inductor.config`` settings for this compile (they win over
            ``mode``'s).
    """
    from torch._inductor import list_mode_options

    settings = Settings.build(patterns=patterns, exclude=exclude, min_mnk=min_mnk,
                              launch_bound_bytes=launch_bound_bytes)
    config = dict(list_mode_options(mode)) if mode else {}
    config.update(inductor_config or {})
    return CommfuseBackend(settings, config)


#: What ``backend="commfuse"`` resolves to: default settings.
commfuse_backend = CommfuseBackend(Settings())
