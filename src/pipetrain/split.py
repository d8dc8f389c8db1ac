"""Cut a model into pipeline stages: an ``nn.Sequential`` or a list of blocks, balanced by weight.

A pipeline runs as fast as its slowest stage, so stages should carry equal work. The weight of
a layer is its parameter count (a cheap proxy, no data needed) or its measured forward+backward
time on a sample input (what actually matters, for layers whose cost is not in their weights,
such as attention). The cut itself is the classic contiguous partition that minimises the
heaviest part.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

__all__ = [
    "LayerStage",
    "layer_times",
    "parameter_counts",
    "partition_balanced",
    "split_layers",
    "split_sequential",
    "stage_boundaries",
]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Sizes of ``num_parts`` contiguous, non-empty parts of ``weights`` minimising the heaviest part.

    When several cuts are optimal, the one returned depends only on the input (the same weights
    always give the same cut). Raises ValueError when there are fewer items than parts or a
    weight is negative or not finite.
    """
    n = len(weights)
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    if n < num_parts:
        raise ValueError(f"cannot cut {n} layers into {num_parts} non-empty stages")
    for i, w in enumerate(weights):
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"layer weights must be finite and >= 0; weight {i} is {w}")
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
    layers: Iterable[nn.Module],
    sample_input: Any,
    *,
    repeats: int = 3,
    backward: bool = True,
) -> list[float]:
    """Median seconds of each layer's forward (+ backward) on the activations of ``sample_input``.

    Each layer gets the previous layer's output (any nesting of tensors), detached, so the time
    is its own. Backward runs from every floating-point output that requires grad when
    ``backward`` is true. Parameter gradients and buffers (BatchNorm's running statistics) are
    restored afterwards, so measuring leaves the model as it was.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    layers = list(layers)  # iterated more than once (a generator would be used up)
    grads = {id(p): (p, None if p.grad is None else p.grad.clone()) for layer in layers for p in layer.parameters()}
    buffers = {id(b): (b, b.clone()) for layer in layers for b in layer.buffers()}
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
                if backward:
                    roots = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and _differentiable(t)]
                    if roots:
                        torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
                if trial > 0:
                    samples.append(time.perf_counter() - t0)
            times.append(statistics.median(samples))
            x = tree_map_only(torch.Tensor, torch.Tensor.detach, out)
    finally:
        for p, grad in grads.values():
            p.grad = grad
        with torch.no_grad():
            for b, value in buffers.values():
                b.copy_(value)
    return times


def _differentiable(t: torch.Tensor) -> bool:
    return t.requires_grad and (t.is_floating_point() or t.is_complex())


def _fresh_input(x: Any) -> Any:
    """``x`` with every tensor a new leaf (floating-point ones requiring grad), so backward stops here."""

    def leaf(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return t.requires_grad_(True) if t.is_floating_point() or t.is_complex() else t

    return tree_map_only(torch.Tensor, leaf, x)


class _Path(nn.Module):
    """A container :class:`LayerStage` makes for one part of a dotted path (holds, never runs)."""


class LayerStage(nn.Module):
    """Layers run one after another, registered under their paths in the whole model.

    What :func:`split_layers` returns when an ``nn.Sequential`` cannot carry the names: a path
    with dots (``blocks.3``) or a layer that runs twice. ``state_dict()`` keys are then the whole
    model's keys; ``len``, iteration and integer indexing follow the run order.
    """

    def __init__(self, named_layers: Sequence[tuple[str, nn.Module]]) -> None:
        super().__init__()
        order: list[nn.Module] = []
        for path, layer in named_layers:
            _register(self, path, layer)
            order.append(layer)
        self._order = tuple(order)  # a tuple is not registered again: each layer appears once above

    def forward(self, x: Any) -> Any:
        for layer in self._order:
            x = layer(x)
        return x

    def __len__(self) -> int:
        return len(self._order)

    def __getitem__(self, index: int) -> nn.Module:
        return self._order[index]

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._order)


def _register(root: nn.Module, path: str, layer: nn.Module) -> None:
    """Register ``layer`` at dotted ``path`` under ``root``, making containers on the way."""
    *parents, name = path.split(".")
    node = root
    for part in parents:
        child = node._modules.get(part)
        if child is None:
            child = _Path()  # a plain module: any name fits (a ModuleDict refuses "keys", "items", …)
            node.add_module(part, child)
        elif not isinstance(child, _Path):
            raise ValueError(f"layer {path!r} lies inside another layer of the same stage ({part!r})")
        node = child
    existing = node._modules.get(name)
    if existing is None:
        node.add_module(name, layer)
    elif existing is not layer:
        raise ValueError(f"two different layers are named {path!r} (or one lies inside the other)")


def _named_layers(
    layers: Sequence[nn.Module] | Mapping[str, nn.Module] | nn.ModuleDict | nn.Sequential, model: nn.Module | None
) -> list[tuple[str, nn.Module]]:
    """Each layer with the name its stage registers it under (see :func:`split_layers`)."""
    named = _names(layers, model)
    # A layer inside another one given would put its parameters in two stages.
    names = {name for name, _ in named}
    for name in names:
        parts = name.split(".")
        for cut in range(1, len(parts)):
            outer = ".".join(parts[:cut])
            if outer in names:
                raise ValueError(f"layer {name!r} lies inside layer {outer!r}; give one or the other")
    return named


def _names(
    layers: Sequence[nn.Module] | Mapping[str, nn.Module] | nn.ModuleDict | nn.Sequential, model: nn.Module | None
) -> list[tuple[str, nn.Module]]:
    if model is not None:  # the model's paths win, whatever container holds the layers
        if isinstance(layers, nn.Sequential):
            layers = [m for m in layers._modules.values() if m is not None]
        elif isinstance(layers, (Mapping, nn.ModuleDict)):
            layers = list(layers.values())
    if isinstance(layers, nn.Sequential):
        # _modules, not named_children(): a module used twice (a shared activation) runs twice.
        return [(name, m) for name, m in layers._modules.items() if m is not None]
    if isinstance(layers, (Mapping, nn.ModuleDict)):
        return [(str(name), m) for name, m in layers.items()]
    if model is None:
        return [(str(i), m) for i, m in enumerate(layers)]
    paths: dict[int, str] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(m), path)
    named = []
    for i, m in enumerate(layers):
        path = paths.get(id(m))
        if not path:
            raise ValueError(f"layer {i} ({type(m).__name__}) is not a submodule of the model given as model=")
        named.append((path, m))
    return named


def split_layers(
    layers: Sequence[nn.Module] | Mapping[str, nn.Module] | nn.ModuleDict | nn.Sequential,
    num_stages: int,
    *,
    by: str | Sequence[float] = "params",
    sample_input: Any = None,
    repeats: int = 3,
    model: nn.Module | None = None,
) -> list[nn.Module]:
    """Cut ``layers`` (run one after another) into ``num_stages`` stages.

    ``by`` is ``"params"`` (parameter count), ``"time"`` (measured with ``sample_input``, the
    input of the first layer) or explicit per-layer weights. The stages share the layer
    objects: cutting copies nothing. Each stage registers its layers under a name, so that the
    stages' ``state_dict`` keys together are the whole model's:

    * an ``nn.Sequential``: its own keys;
    * a mapping ``{path: layer}``: the paths (``"blocks.0"`` is allowed);
    * a list with ``model=``: each layer's path in ``model`` (``[m.embed, *m.blocks, m.head]``);
      with ``model=`` the model's paths name the layers of a Sequential or mapping too;
    * a list alone: its positions (``"0"``, ``"1"``, …).

    A stage is an ``nn.Sequential`` when the names allow it, else a :class:`LayerStage`.
    """
    named = _named_layers(layers, model)
    modules = [m for _, m in named]
    weights: Sequence[float]
    if isinstance(by, str):
        if by == "params":
            weights = parameter_counts(modules)
            if not any(weights):
                weights = [1.0] * len(modules)
        elif by == "time":
            if sample_input is None:
                raise ValueError("split by='time' needs sample_input (the input of the first layer)")
            weights = layer_times(modules, sample_input, repeats=repeats)
        else:
            raise ValueError(f"by must be 'params', 'time' or a list of weights, got {by!r}")
    else:
        weights = list(by)
        if len(weights) != len(modules):
            raise ValueError(f"got {len(weights)} weights for {len(modules)} layers")
    sizes = partition_balanced(weights, num_stages)
    return [_stage(named[a:b]) for a, b in stage_boundaries(sizes)]


def _stage(named: Sequence[tuple[str, nn.Module]]) -> nn.Module:
    names = [name for name, _ in named]
    if len(set(names)) == len(names) and not any("." in name for name in names):
        return nn.Sequential(OrderedDict(named))
    return LayerStage(named)


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
    stages = split_layers(model, num_stages, by=by, sample_input=sample_input, repeats=repeats)
    # An nn.Sequential's keys are unique and hold no dots, so every stage is one.
    return [cast(nn.Sequential, s) for s in stages]
