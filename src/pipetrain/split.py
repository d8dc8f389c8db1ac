"""Cut a model into pipeline stages: an ``nn.Sequential`` or a list of blocks, balanced by weight.

A pipeline runs as fast as its slowest stage, so stages should carry equal work. The weight of
a layer is its parameter count (a cheap proxy, no data needed) or its measured forward+backward
time on a sample input (what actually matters, for layers whose cost is not in their weights,
such as attention). The cut itself is the classic contiguous partition that minimises the
heaviest part.
"""

from __future__ import annotations

import statistics
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "layer_times",
    "parameter_counts",
    "partition_balanced",
    "split_layers",
    "split_sequential",
    "stage_boundaries",
]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Sizes of ``num_parts`` contiguous, non-empty parts of ``weights`` minimising the heaviest part.

    Among optimal cuts the one with the earliest-possible heaviest part is not required; the
    result is deterministic for a given input. Raises ValueError when there are fewer items
    than parts or a weight is negative.
    """
    n = len(weights)
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    if n < num_parts:
        raise ValueError(f"cannot cut {n} layers into {num_parts} non-empty stages")
    if any(w < 0 for w in weights):
        raise ValueError(f"layer weights must be >= 0, got {list(weights)}")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")
    # best[k][i]: smallest possible heaviest part when the first i items form k parts.
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0.0
    for k in range(1, num_parts + 1):
        for i in range(k, n - (num_parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i] = cost
                    cut[k][i] = j
    sizes: list[int] = []
    i = n
    for k in range(num_parts, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    sizes.reverse()
    return sizes


def stage_boundaries(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` layer index ranges for part sizes from :func:`partition_balanced`."""
    bounds = []
    start = 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def parameter_counts(layers: Sequence[nn.Module]) -> list[int]:
    """Parameters per layer; a parameter shared by several layers counts once, for the first."""
    seen: set[int] = set()
    counts = []
    for layer in layers:
        total = 0
        for p in layer.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
        counts.append(total)
    return counts


def layer_times(
    layers: Sequence[nn.Module],
    sample_input: Any,
    *,
    repeats: int = 3,
    backward: bool = True,
) -> list[float]:
    """Median seconds of each layer's forward (+ backward) on the activations of ``sample_input``.

    Each layer gets the previous layer's output, detached, so the time is its own. Backward
    runs when the output is a floating-point tensor and ``backward`` is true. Parameter
    gradients are restored afterwards, so measuring leaves the model as it was.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    saved = {id(p): (p, None if p.grad is None else p.grad.clone()) for layer in layers for p in layer.parameters()}
    times: list[float] = []
    x = sample_input
    try:
        for layer in layers:
            samples = []
            out: Any = None
            for trial in range(repeats + 1):  # the first run warms up and is not counted
                inp = _fresh_input(x)
                t0 = time.perf_counter()
                out = layer(inp)
                if backward and isinstance(out, torch.Tensor) and out.is_floating_point() and out.requires_grad:
                    out.backward(torch.ones_like(out))
                if trial > 0:
                    samples.append(time.perf_counter() - t0)
            times.append(statistics.median(samples))
            x = out.detach() if isinstance(out, torch.Tensor) else out
    finally:
        for p, grad in saved.values():
            p.grad = grad
    return times


def _fresh_input(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        x = x.detach()
        return x.requires_grad_(True) if x.is_floating_point() else x
    return x


def split_layers(
    layers: Sequence[nn.Module] | nn.Sequential,
    num_stages: int,
    *,
    by: str | Sequence[float] = "params",
    sample_input: Any = None,
    repeats: int = 3,
) -> list[nn.Sequential]:
    """Cut ``layers`` (run one after another) into ``num_stages`` ``nn.Sequential`` stages.

    ``by`` is ``"params"`` (parameter count), ``"time"`` (measured with ``sample_input``, the
    input of the first layer) or explicit per-layer weights. The stages share the layer
    objects: cutting copies nothing. Layers keep their names (an ``nn.Sequential``'s keys, or
    their list index), so the stages' ``state_dict`` keys together are the whole model's.
    """
    named = list(layers.named_children()) if isinstance(layers, nn.Sequential) else list(enumerate(layers))
    layers = [layer for _, layer in named]
    weights: Sequence[float]
    if isinstance(by, str):
        if by == "params":
            weights = parameter_counts(layers)
            if not any(weights):
                weights = [1.0] * len(layers)
        elif by == "time":
            if sample_input is None:
                raise ValueError("split by='time' needs sample_input (the input of the first layer)")
            weights = layer_times(layers, sample_input, repeats=repeats)
        else:
            raise ValueError(f"by must be 'params', 'time' or a list of weights, got {by!r}")
    else:
        weights = list(by)
        if len(weights) != len(layers):
            raise ValueError(f"got {len(weights)} weights for {len(layers)} layers")
    sizes = partition_balanced(weights, num_stages)
    # Keep each layer's name so stage state_dict keys are the whole model's keys.
    return [nn.Sequential(OrderedDict((str(k), m) for k, m in named[a:b])) for a, b in stage_boundaries(sizes)]


def split_sequential(
    model: nn.Sequential,
    num_stages: int,
    *,
    by: str | Sequence[float] = "params",
    sample_input: Any = None,
    repeats: int = 3,
) -> list[nn.Sequential]:
    """Cut an ``nn.Sequential`` into ``num_stages`` balanced ``nn.Sequential`` stages (see :func:`split_layers`)."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"split_sequential needs an nn.Sequential, got {type(model).__name__}; use split_layers")
    return split_layers(model, num_stages, by=by, sample_input=sample_input, repeats=repeats)
