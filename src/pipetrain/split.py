"""Cut a model into pipeline stages: an ``nn.Sequential`` or a list of blocks, balanced by weight.

A pipeline runs as fast as its slowest stage, so stages should carry equal work. The weight of
a layer is its parameter count (a cheap proxy, no data needed) or its measured forward+backward
time on a sample input (what actually matters, for layers whose cost is not in their weights,
such as attention). The cut itself is the classic contiguous partition that minimises the
heaviest part.

A plan (:func:`pipetrain.plan.plan_pipeline`) names the layers of each stage instead:
:func:`split_by_names` builds those stages, recomputing the activations of the stages the plan
marks (:func:`recompute`), and :func:`stages_for_rank` picks a rank's stages under the plan's
placement. Every stage built here remembers the whole cut it belongs to, so ranks that cut one
model differently are refused before their first step (:mod:`pipetrain.runtime.agreement`).
"""

from __future__ import annotations

import inspect
import math
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from pipetrain.provenance import StageCut, TiedParameter, digest, stage_cut, tied_parameters, unwrapped
from pipetrain.recompute import is_recomputed, recompute

if TYPE_CHECKING:
    import torch.distributed as dist

_T = TypeVar("_T")

__all__ = [
    "CalledLayer",
    "LayerStage",
    "StageCut",
    "TiedParameter",
    "decide_once",
    "is_recomputed",
    "layer_times",
    "parameter_counts",
    "partition_balanced",
    "recompute",
    "split_by_names",
    "split_layers",
    "split_sequential",
    "stage_boundaries",
    "stage_cut",
    "stages_for_rank",
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
    loss_fn: Callable[..., torch.Tensor] | None = None,
    target: Any = None,
) -> list[float]:
    """Median seconds of each layer's forward (+ backward) on the activations of ``sample_input``.

    Each layer gets the previous layer's output (any nesting of tensors), detached, so the time
    is its own. Backward runs from every floating-point output that requires grad when
    ``backward`` is true. With ``loss_fn`` (and ``target``), the last layer's time includes
    ``loss_fn(output, target)`` and the backward from it, as the last stage of a pipeline runs
    them. Parameter gradients and buffers (BatchNorm's running statistics) are restored
    afterwards, so measuring leaves the model as it was.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if (loss_fn is None) != (target is None):
        raise ValueError("give loss_fn and target together (the loss is counted in the last layer)")
    layers = list(layers)  # iterated more than once (a generator would be used up)
    grads = {id(p): (p, None if p.grad is None else p.grad.clone()) for layer in layers for p in layer.parameters()}
    buffers = {id(b): (b, b.clone()) for layer in layers for b in layer.buffers()}
    times: list[float] = []
    x = sample_input
    try:
        for k, layer in enumerate(layers):
            with_loss = loss_fn is not None and k == len(layers) - 1
            samples = []
            out: Any = None
            for trial in range(repeats + 1):  # the first run warms up and is not counted
                inp = _fresh_input(x)
                t0 = time.perf_counter()
                out = layer(inp)
                roots: list[torch.Tensor] = []
                if with_loss:
                    assert loss_fn is not None
                    roots = [loss_fn(out, target)]
                elif backward:
                    roots = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and _differentiable(t)]
                if backward and roots:
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


class CalledLayer(nn.Module):
    """A layer that needs more than the previous layer's output, with how its model calls it:
    ``call(layer, x)`` (e.g. a decoder layer given rotary embeddings and a causal mask made from
    ``x``, see :func:`pipetrain.hf.decoder_layers`). Stages register ``layer`` itself under the
    layer's name and each of ``shared`` (modules the call uses, by their paths in the model) under
    its path, so a stage's parameter names stay the model's.

    Keyword inputs of a step (a padding mask, a document mask: ``schedule.step(x,
    attention_mask=m)`` gives them to every stage) reach ``call`` as keywords where it takes them
    (``call(layer, x, attention_mask=None)``); a stage's other layers get ``x`` alone."""

    def __init__(
        self, layer: nn.Module, call: Callable[..., Any], shared: Mapping[str, nn.Module] | None = None
    ) -> None:
        super().__init__()
        self.layer = layer
        self.shared = tuple((shared or {}).items())
        for k, (_, module) in enumerate(self.shared):
            self.add_module(f"shared_{k}", module)  # moved with the layer when used on its own
        self.call = call
        try:
            params = list(inspect.signature(call).parameters.values())[2:]  # (after the layer and x)
        except (TypeError, ValueError):  # a callable without a signature: it takes x alone
            params = []
        self._any_keyword = any(p.kind is p.VAR_KEYWORD for p in params)
        self._keywords = frozenset(p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))

    def forward(self, x: Any, **kwargs: Any) -> Any:
        taken = kwargs if self._any_keyword else {k: v for k, v in kwargs.items() if k in self._keywords}
        return self.call(self.layer, x, **taken)


class LayerStage(nn.Module):
    """Layers run one after another, registered under their paths in the whole model.

    What :func:`split_layers` returns when an ``nn.Sequential`` cannot carry the names: a path
    with dots (``blocks.3``), a layer that runs twice, or a :class:`CalledLayer` (which takes a
    step's keyword inputs). ``state_dict()`` keys are then the whole model's keys; ``len``,
    iteration and integer indexing follow the run order.
    """

    def __init__(self, named_layers: Sequence[tuple[str, nn.Module]]) -> None:
        super().__init__()
        order: list[nn.Module] = []
        for path, layer in named_layers:
            _register(self, path, layer)
            order.append(layer)
        self._order = tuple(order)  # a tuple is not registered again: each layer appears once above

    def forward(self, x: Any, **kwargs: Any) -> Any:
        for layer in self._order:
            x = layer(x, **kwargs) if kwargs and isinstance(unwrapped(layer), CalledLayer) else layer(x)
        return x

    def __len__(self) -> int:
        return len(self._order)

    def __getitem__(self, index: int) -> nn.Module:
        return self._order[index]

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._order)


def _register(root: nn.Module, path: str, layer: nn.Module) -> None:
    """Register ``layer`` at dotted ``path`` under ``root``, making containers on the way (a
    :class:`CalledLayer`'s layer at ``path`` and what it shares at their own paths)."""
    if isinstance(layer, CalledLayer):
        _register(root, path, layer.layer)
        for shared_path, module in layer.shared:
            _register(root, shared_path, module)
        return
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


Layers = Sequence[nn.Module] | Sequence[tuple[str, nn.Module]] | Mapping[str, nn.Module] | nn.ModuleDict | nn.Sequential
"""What names a list of layers: see :func:`split_layers`."""


def _named_layers(layers: Layers, model: nn.Module | None) -> list[tuple[str, nn.Module]]:
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


def _names(layers: Layers, model: nn.Module | None) -> list[tuple[str, nn.Module]]:
    if model is not None and not _pairs(layers):  # the model's paths win, whatever container holds the layers
        if isinstance(layers, nn.Sequential):
            layers = [m for m in layers._modules.values() if m is not None]
        elif isinstance(layers, (Mapping, nn.ModuleDict)):
            layers = list(layers.values())
    if isinstance(layers, nn.Sequential):
        # _modules, not named_children(): a module used twice (a shared activation) runs twice.
        return [(name, m) for name, m in layers._modules.items() if m is not None]
    if isinstance(layers, (Mapping, nn.ModuleDict)):
        return [(str(name), m) for name, m in layers.items()]
    if _pairs(layers):
        return _checked_pairs(cast(Sequence[tuple[str, nn.Module]], layers))
    modules = cast(Sequence[nn.Module], layers)
    if model is None:
        return [(str(i), m) for i, m in enumerate(modules)]
    paths: dict[int, str] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(m), path)
    named = []
    for i, m in enumerate(modules):
        path = paths.get(id(m))
        if not path:
            raise ValueError(f"layer {i} ({type(m).__name__}) is not a submodule of the model given as model=")
        named.append((path, m))
    return named


def _checked_pairs(pairs: Sequence[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    for item in pairs:
        if len(item) != 2 or not isinstance(item[0], str) or not isinstance(item[1], nn.Module):
            raise TypeError(f"a layer given as a pair must be (name, module), got {item!r:.80}")
    return list(pairs)


def _pairs(layers: Layers) -> bool:
    """Whether ``layers`` are ``(name, layer)`` pairs."""
    return isinstance(layers, Sequence) and bool(layers) and all(isinstance(item, tuple) for item in layers)


def split_layers(
    layers: Layers,
    num_stages: int,
    *,
    by: str | Sequence[float] = "params",
    sample_input: Any = None,
    repeats: int = 3,
    model: nn.Module | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    target: Any = None,
    group: dist.ProcessGroup | None = None,
) -> list[nn.Module]:
    """Cut ``layers`` (run one after another) into ``num_stages`` stages.

    ``by`` is ``"params"`` (parameter count), ``"time"`` (measured with ``sample_input``, the
    input of the first layer, and ``loss_fn(output, target)`` counted in the last layer when
    given) or explicit per-layer weights. A time cut is decided once for all ranks: when
    ``torch.distributed`` is initialised, rank 0 of ``group`` measures and the others receive
    its cut (every rank of ``group`` must call this; measuring on each rank gave ranks different
    cuts). The stages share the layer objects: cutting copies nothing. Each stage registers its
    layers under a name, so that the stages' ``state_dict`` keys together are the whole model's:

    * an ``nn.Sequential``: its own keys;
    * a mapping ``{path: layer}`` or ``(path, layer)`` pairs: the paths (``"blocks.0"`` is allowed);
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
            if (loss_fn is None) != (target is None):
                raise ValueError("give loss_fn and target together (the loss is counted in the last layer)")
            if num_stages < 1 or len(modules) < num_stages:
                partition_balanced([1.0] * len(modules), num_stages)  # raises the usual error, before measuring

            def measure() -> list[int]:
                times = layer_times(modules, sample_input, repeats=repeats, loss_fn=loss_fn, target=target)
                return partition_balanced(times, num_stages)

            sizes = decide_once(measure, group)
            return _mark([named[a:b] for a, b in stage_boundaries(sizes)])
        else:
            raise ValueError(f"by must be 'params', 'time' or a list of weights, got {by!r}")
    else:
        weights = list(by)
        if len(weights) != len(modules):
            raise ValueError(f"got {len(weights)} weights for {len(modules)} layers")
    sizes = partition_balanced(weights, num_stages)
    return _mark([named[a:b] for a, b in stage_boundaries(sizes)])


def decide_once(decide: Callable[[], _T], group: dist.ProcessGroup | None = None) -> _T:
    """``decide()`` run on rank 0 of ``group`` only, its result given to every rank (pickled).

    For what must be the same on every rank but comes from a measurement: a time cut, a profile
    and the plan made from it (``decide_once(lambda: plan_pipeline(profile_layers(...), ...))``).
    Every rank of ``group`` must call it; without an initialised ``torch.distributed`` it just
    returns ``decide()``. A failure on rank 0 is raised on every rank.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return decide()
    box: list[Any] = [None]
    if dist.get_rank(group) == 0:
        try:
            box[0] = ("ok", decide())
        except Exception as exc:
            box[0] = ("error", f"{type(exc).__name__}: {exc}")
            dist.broadcast_object_list(box, group=group, group_src=0)
            raise
    dist.broadcast_object_list(box, group=group, group_src=0)
    status, value = box[0]
    if status != "ok":
        raise RuntimeError(f"rank 0 failed while deciding for every rank: {value}")
    return cast(_T, value)


def _mark(parts: Sequence[Sequence[tuple[str, nn.Module]]]) -> list[nn.Module]:
    """One stage module per part, each remembering the whole cut (:class:`StageCut`)."""
    layers = tuple(tuple(name for name, _ in part) for part in parts)
    digests = tuple(digest(part) for part in parts)
    plain = not any(isinstance(unwrapped(m), CalledLayer) for part in parts for _, m in part)
    stages = [_stage(part, plain) for part in parts]
    tied = tied_parameters(stages)
    for index, stage in enumerate(stages):
        stage.__dict__["_pipetrain_cut"] = StageCut(layers, index, digests, tied)
    return stages


def _stage(named: Sequence[tuple[str, nn.Module]], plain: bool = True) -> nn.Module:
    """An ``nn.Sequential`` where it can carry the names and no stage of the cut takes keyword
    inputs (``plain``: no :class:`CalledLayer` in the whole cut, since a step gives its keywords
    to every stage), else a :class:`LayerStage`."""
    names = [name for name, _ in named]
    if plain and len(set(names)) == len(names) and not any("." in name for name in names):
        return nn.Sequential(OrderedDict(named))
    return LayerStage(named)


def split_by_names(
    layers: nn.Module | Layers,
    stage_layers: Sequence[Sequence[str]],
    *,
    recompute: Iterable[int] = (),
    model: nn.Module | None = None,
    weight_grads: str = "recompute",
) -> list[nn.Module]:
    """The stage modules of a cut given by layer names, e.g. a plan's ``stage_layers``.

    ``layers`` names the layers as :func:`split_layers` and :func:`pipetrain.profile_layers`
    do (an ``nn.Sequential``, a mapping or ``(name, layer)`` pairs, a list with ``model=``), or is
    any other module whose submodule paths are the names (``"layers.3"``). The stages must take
    every layer once, in order (for a plain module: each named submodule once). The stages whose
    index is in ``recompute`` (a plan's ``recompute``) recompute their activations in backward
    (:func:`recompute`; ``weight_grads`` is passed on and no longer changes anything).
    """
    wanted = [list(names) for names in stage_layers]
    if not wanted:
        raise ValueError("stage_layers is empty: give one list of layer names per stage")
    for s, names in enumerate(wanted):
        if not names:
            raise ValueError(f"stage {s} has no layers; every stage needs at least one")
    flat = [name for names in wanted for name in names]
    twice = sorted({n for n in flat if flat.count(n) > 1})
    if twice:
        raise ValueError(f"layers {twice} are given to more than one stage (or twice to one)")
    plain = isinstance(layers, nn.Module) and not isinstance(layers, (nn.Sequential, nn.ModuleDict))
    if plain:
        root = cast(nn.Module, layers)
        by_name: dict[str, nn.Module] = {}
        for name in flat:
            try:
                by_name[name] = root.get_submodule(name)
            except AttributeError:
                raise ValueError(f"the model has no submodule {name!r} (a name in stage_layers)") from None
        named = [(name, by_name[name]) for name in flat]
        _named_layers(dict(named), None)  # refuses a layer inside another one
    else:
        named = _named_layers(cast(Layers, layers), model)
        names = [name for name, _ in named]
        if flat != names:
            raise ValueError(
                f"stage_layers do not cut these layers ({_mismatch(flat, names)}); the layers are {names}"
                " (a plan must come from a profile of the same layers)"
            )
    parts: list[list[tuple[str, nn.Module]]] = []
    k = 0
    for names in wanted:
        parts.append(named[k : k + len(names)])
        k += len(names)
    stages = _mark(parts)
    chosen = sorted(set(recompute))
    for s in chosen:
        if not 0 <= s < len(stages):
            raise ValueError(f"recompute names stage {s}, but there are {len(stages)} stages")
        _recompute(stages[s], weight_grads=weight_grads)
    return stages


def _mismatch(given: list[str], names: list[str]) -> str:
    missing = [n for n in names if n not in given]
    unknown = [n for n in given if n not in names]
    parts = [f"missing {missing}" if missing else "", f"not layers of the model {unknown}" if unknown else ""]
    return ", ".join(p for p in parts if p) or "the layers are out of order"


_recompute = recompute  # split_by_names's keyword of the same name hides it


def stages_for_rank(
    stages: Sequence[nn.Module], stage_to_rank: Mapping[int, int] | Any, rank: int
) -> list[tuple[int, nn.Module]]:
    """The ``(stage_index, module)`` pairs ``rank`` holds under a placement, in stage order.

    ``stage_to_rank`` is a schedule's (``plan.schedule.stage_to_rank``, or the schedule itself):
    ``loop`` placements give rank r stages r, r+P, …; ``v`` gives it r and 2P-1-r. Build each
    pair's :class:`~pipetrain.PipelineStage` with that ``stage_index`` and ``len(stages)`` stages.
    """
    where = cast(Mapping[int, int], getattr(stage_to_rank, "stage_to_rank", stage_to_rank))
    if sorted(where) != list(range(len(stages))):
        raise ValueError(f"the placement covers stages {sorted(where)}, but there are {len(stages)} stages")
    return [(s, stages[s]) for s in sorted(where) if where[s] == rank]


def split_sequential(
    model: nn.Sequential,
    num_stages: int,
    *,
    by: str | Sequence[float] = "params",
    sample_input: Any = None,
    repeats: int = 3,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    target: Any = None,
    group: dist.ProcessGroup | None = None,
) -> list[nn.Sequential]:
    """Cut an ``nn.Sequential`` into ``num_stages`` balanced ``nn.Sequential`` stages (see :func:`split_layers`)."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"split_sequential needs an nn.Sequential, got {type(model).__name__}; use split_layers")
    stages = split_layers(
        model,
        num_stages,
        by=by,
        sample_input=sample_input,
        repeats=repeats,
        loss_fn=loss_fn,
        target=target,
        group=group,
    )
    # An nn.Sequential's keys are unique and hold no dots, so every stage is one.
    return [cast(nn.Sequential, s) for s in stages]
