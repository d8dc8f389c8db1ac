"""``torch.compile`` that leaves a split backward its weight-gradient work.

A plain compiled region is one autograd node whose compiled backward computes every gradient of
the region in one call, so under a split backward all of it runs in I and W holds nothing for it
(docs/stage-and-split-backward.md). :func:`compile_for_split` compiles the module with a backend
that splits each region's backward graph in two (:mod:`pipetrain._aot_split`): the input
gradients (with what the weight gradients need from them) and the weight gradients. Under a split
backward I runs the first part and W the second; a plain ``loss.backward()`` (or B) runs both.

``split="linears"`` is the older way: every ``nn.Linear`` is left out of the compiled graphs (a
graph break at each) and its matmul stays an eager autograd node whose weight GEMM W runs.
Measure both with ``benchmarks/split_backward.py --compile graph|between``.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch
from torch import nn

from pipetrain.errors import PipelineError

__all__ = ["compile_for_split"]

_GRAPH_BACKENDS = ("inductor", "aot_eager")
_GRAPH_MODES = (None, "default", "max-autotune-no-cudagraphs")


def compile_for_split(
    module: nn.Module, *, split: Literal["graph", "linears"] = "graph", **compile_kwargs: Any
) -> nn.Module:
    """``torch.compile(module, **compile_kwargs)`` whose weight gradients a split backward's W computes.

    ``split="graph"`` (the default): the compiled backward is split into an input-gradient and a
    weight-gradient part, for ``backend`` ``"inductor"`` (the default) or ``"aot_eager"`` and
    modes without CUDA graphs; another backend or mode falls back to ``"linears"`` with a
    ``UserWarning`` naming the module. ``split="linears"``: every ``nn.Linear`` inside runs
    eagerly (``fullgraph=True`` is refused there: the Linears are graph breaks).

    The module's parameters, names and ``state_dict`` are unchanged (the returned module wraps it
    as ``torch.compile`` does).
    """
    if split not in ("graph", "linears"):
        raise PipelineError(f"compile_for_split: split={split!r}; choose 'graph' or 'linears'")
    label = type(module).__name__
    if split == "graph":
        why_not = _why_not_graph(compile_kwargs)
        if why_not is None:
            return _compile_graph_split(module, label, dict(compile_kwargs))
        if compile_kwargs.get("fullgraph"):
            raise PipelineError(
                f"compile_for_split: the graph split cannot take {why_not}, and split='linears' cannot hold "
                "fullgraph=True (every nn.Linear is a graph break); drop fullgraph or use backend inductor"
            )
        warnings.warn(
            f"compile_for_split({label}): the graph split cannot take {why_not}; compiling with split='linears' "
            "instead (each nn.Linear runs eagerly, so W gets its weight GEMM)",
            UserWarning,
            stacklevel=2,
        )
    return _compile_between_linears(module, compile_kwargs)


def _why_not_graph(compile_kwargs: dict[str, Any]) -> str | None:
    backend = compile_kwargs.get("backend", "inductor")
    if not isinstance(backend, str) or backend not in _GRAPH_BACKENDS:
        return f"backend {backend!r} (it compiles with inductor or aot_eager)"
    mode = compile_kwargs.get("mode")
    if mode not in _GRAPH_MODES:
        return f"mode {mode!r} (CUDA graphs replay a backward whole)"
    options = compile_kwargs.get("options") or {}
    if options.get("triton.cudagraphs"):
        return "options with triton.cudagraphs (CUDA graphs replay a backward whole)"
    if backend != "inductor" and (mode not in (None, "default") or options):
        return f"mode or options with backend {backend!r} (they are inductor's)"
    return None


def _compile_graph_split(module: nn.Module, label: str, kwargs: dict[str, Any]) -> nn.Module:
    from pipetrain._aot_split import split_backend

    backend = kwargs.pop("backend", "inductor")
    mode = kwargs.pop("mode", None)
    options = dict(kwargs.pop("options", None) or {})
    if mode not in (None, "default"):
        from torch._inductor import list_mode_options

        options = {**list_mode_options(mode), **options}
    compiled: nn.Module = torch.compile(  # type: ignore[assignment]
        module, backend=split_backend(backend, label, options or None), **kwargs
    )
    return compiled


def _compile_between_linears(module: nn.Module, compile_kwargs: dict[str, Any]) -> nn.Module:
    if compile_kwargs.get("fullgraph"):
        raise PipelineError(
            "compile_for_split(split='linears'): fullgraph=True cannot hold: every nn.Linear is left out of the "
            "graph so that a split backward's W can run its weight GEMM; compile without fullgraph, or use "
            "split='graph'"
        )
    for sub in module.modules():
        if isinstance(sub, nn.Linear) and "forward" not in sub.__dict__:
            sub.forward = torch.compiler.disable(sub.forward)  # type: ignore[method-assign,no-untyped-call]
    compiled: nn.Module = torch.compile(module, **compile_kwargs)  # type: ignore[assignment]
    return compiled
