"""``torch.compile`` that leaves a split backward its weight GEMMs.

A compiled region is one autograd node whose compiled backward computes every gradient of the
region in one call, so under a split backward all of it runs in I and W holds nothing for it
(docs/stage-and-split-backward.md). :func:`compile_for_split` compiles the module with its
``nn.Linear`` layers left out of the compiled graphs: what lies between them (norms, attention,
activations, residuals) is compiled, and each Linear's matmul stays an eager autograd node whose
weight GEMM W can run. The price is a graph break at each Linear (the compiled pieces are smaller,
and a Linear's epilogue is not fused with what follows); measure it with
``benchmarks/split_backward.py --compile between``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipetrain.errors import PipelineError

__all__ = ["compile_for_split"]


def compile_for_split(module: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """``torch.compile(module, **compile_kwargs)`` with every ``nn.Linear`` inside run eagerly.

    The module's parameters, names and ``state_dict`` are unchanged (the returned module wraps it
    as ``torch.compile`` does). ``fullgraph=True`` is refused: the Linears are graph breaks.
    """
    if compile_kwargs.get("fullgraph"):
        raise PipelineError(
            "compile_for_split: fullgraph=True cannot hold: every nn.Linear is left out of the graph so that a "
            "split backward's W can run its weight GEMM; compile without fullgraph, or use torch.compile (then "
            "the region's weight gradients are computed in I)"
        )
    for sub in module.modules():
        if isinstance(sub, nn.Linear) and "forward" not in sub.__dict__:
            sub.forward = torch.compiler.disable(sub.forward)  # type: ignore[method-assign,no-untyped-call]
    compiled: nn.Module = torch.compile(module, **compile_kwargs)  # type: ignore[assignment]
    return compiled
