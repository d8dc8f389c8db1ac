"""Recompute a module's activations in backward (activation checkpointing), with split backward too.

``recompute(module)`` makes ``module`` keep only its inputs from its forward: what autograd would
save inside it is rebuilt by running its forward again when a backward first needs it. It is how a
stage that a plan marks ``recompute`` runs (:func:`pipetrain.split.split_by_names`).

Why not ``torch.utils.checkpoint`` (non-reentrant): its rebuilt tensors live per autograd *graph
task*, and pipetrain's split backward runs a microbatch's backward as several tasks (I, then one
per group of weights in W). Under it, what I rebuilt but did not use stays until W, and W rebuilds
once per weight group (four Linear layers: six forwards in all). Worse, the inputs it saves go
through the stage's saved-tensor tracking, which releases them after I when I read them outside
an entry node, so W fails ("already released"). Here the rebuilt tensors belong to the microbatch:

* ``weight_grads="recompute"`` (the default): the first backward pass (B, or I) rebuilds the
  activations once, frees each as it is used and the rest when the pass ends; W rebuilds them once
  more, for all its weight groups together. Between F and the end of W the module holds only its
  inputs (what the plan's memory model assumes); W costs one more forward of the module.
* ``weight_grads="keep"``: the first pass rebuilds once and keeps what W needs (the tensors only
  the weight gradients use), as a stage without recompute does after I. One forward more in all,
  but between I and W the module holds W's share of its activations.

A full backward (B) rebuilds once either way. The module's class is swapped for a subclass (as
FSDP's ``fully_shard`` does), so parameter names, ``state_dict`` keys and ``isinstance`` checks
are unchanged; ``recompute(module, enabled=False)`` undoes it. The forward runs again with the
random state and autocast settings of the first run (dropout draws the same mask); anything else
it changes (a BatchNorm's running statistics) changes again, as with torch's checkpointing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from pipetrain import _backward
from pipetrain.errors import PipelineError

__all__ = ["is_recomputed", "recompute"]

_WEIGHT_GRADS = ("recompute", "keep")


class _StopRebuildError(Exception):
    """Raised from the rebuild's pack hook once every saved tensor is back (skips the rest)."""


class _Slot:
    """What autograd holds for one saved tensor of a recomputed forward: its place, not the tensor."""

    __slots__ = ("index", "region")

    def __init__(self, region: _Region, index: int) -> None:
        self.region = region
        self.index = index


def _device_rng_states(tensors: list[torch.Tensor]) -> list[tuple[torch.device, torch.Tensor]]:
    """The random state of each accelerator device among ``tensors`` (dropout on a GPU draws from it)."""
    states = []
    seen: set[torch.device] = set()
    for t in tensors:
        device = t.device
        if device.type in ("cpu", "meta") or device in seen:
            continue
        seen.add(device)
        module = torch.get_device_module(device.type)
        with module.device(device):
            states.append((device, module.get_rng_state()))
    return states


class _Region:
    """One forward call of a recomputed module: its inputs, and how to rebuild what it saved."""

    def __init__(
        self,
        name: str,
        run: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        params: Sequence[torch.Tensor],
        keep_for_weights: bool,
    ) -> None:
        self.name = name
        self.run = run
        self.leaves, self.spec = tree_flatten((args, kwargs))
        tensors = [t for t in self.leaves if isinstance(t, torch.Tensor)]
        self.versions = [t._version for t in tensors]
        self.cpu_rng = torch.get_rng_state()
        self.device_rng = _device_rng_states([*tensors, *params[:1]])
        device_type = self.device_rng[0][0].type if self.device_rng else None
        self.autocast: list[tuple[str, dict[str, Any]]] = []
        for kind in ("cpu", device_type):
            if kind is not None and torch.amp.is_autocast_available(kind):
                self.autocast.append(
                    (
                        kind,
                        {
                            "enabled": torch.is_autocast_enabled(kind),
                            "dtype": torch.get_autocast_dtype(kind),
                            "cache_enabled": torch.is_autocast_cache_enabled(),
                        },
                    )
                )
        self.keep_for_weights = keep_for_weights
        self.meta: list[tuple[torch.Size, torch.dtype]] = []  # per saved tensor, checked on rebuild
        self.tensors: list[torch.Tensor | None] | None = None  # the rebuilt tensors, while held
        self.first_task: int | None = None  # the autograd graph task of the first backward pass
        self.lock = threading.RLock()

    # ------------------------------------------------------------ forward
    def pack(self, tensor: torch.Tensor) -> _Slot:
        self.meta.append((tensor.shape, tensor.dtype))
        return _Slot(self, len(self.meta) - 1)

    # ------------------------------------------------------------ backward
    def unpack(self, slot: _Slot) -> torch.Tensor:
        i = slot.index
        with self.lock:
            task = torch._C._current_graph_task_id()
            if task == -1:  # read outside a backward (a grad_fn's _saved_* attribute): rebuild, keep nothing
                return self.rebuild()[i]
            if self.first_task is None:
                self.first_task = task
                if not self.keep_for_weights:
                    # What the first pass rebuilt and did not use goes when it ends; W rebuilds.
                    torch.autograd.Variable._execution_engine.queue_callback(self.end_first_pass)
            if self.tensors is None or self.tensors[i] is None:
                self.fill()
            assert self.tensors is not None
            tensor = self.tensors[i]
            assert tensor is not None
            # W re-runs I's entry nodes (pipetrain._backward): under "keep", what they read stays.
            if not (self.keep_for_weights and task == self.first_task and getattr(_backward._tls, "in_entry", False)):
                self.tensors[i] = None
            return tensor

    def end_first_pass(self) -> None:
        with self.lock:
            self.tensors = None

    def fill(self) -> None:
        """Rebuild, filling the places that are empty (a place still held keeps its tensor)."""
        rebuilt = self.rebuild()
        if self.tensors is None:
            self.tensors = list(rebuilt)
        else:
            self.tensors = [t if t is not None else r for t, r in zip(self.tensors, rebuilt, strict=True)]

    def rebuild(self) -> list[torch.Tensor]:
        """Run the forward again from the saved inputs and random state; what it saves, in order."""
        tensors = [t for t in self.leaves if isinstance(t, torch.Tensor)]
        for t, version in zip(tensors, self.versions, strict=True):
            if t._version != version:
                raise PipelineError(
                    f"{self.name}: an input of a recomputed module (shape {tuple(t.shape)}, {t.dtype}) was modified "
                    f"in place after its forward (version {version} -> {t._version}); its activations cannot be rebuilt"
                )
        leaves = [t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in self.leaves]
        args, kwargs = tree_unflatten(leaves, self.spec)
        wanted = len(self.meta)
        got: list[torch.Tensor] = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            # Detached: a rebuilt output kept with its grad_fn would hold the rebuilt graph in a cycle.
            tensor = tensor.detach()
            got.append(tensor)
            if len(got) == wanted:
                raise _StopRebuildError
            return tensor

        if wanted:
            with self._replay(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                try:
                    self.run(*args, **kwargs)
                except _StopRebuildError:
                    pass
        if len(got) != wanted:
            raise PipelineError(
                f"{self.name}: recomputing the forward saved {len(got)} tensors for backward where the first run saved "
                f"{wanted}: its forward must do the same operations when run again"
            )
        for k, (t, (shape, dtype)) in enumerate(zip(got, self.meta, strict=True)):
            if t.shape != shape or t.dtype != dtype:
                raise PipelineError(
                    f"{self.name}: recomputing the forward saved tensor {k} as {tuple(t.shape)} {t.dtype} where the "
                    f"first run saved {tuple(shape)} {dtype}: its forward must do the same operations when run again"
                )
        return got

    @contextlib.contextmanager
    def _replay(self) -> Iterator[None]:
        devices = [d for d, _ in self.device_rng]
        device_type = devices[0].type if devices else "cuda"
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=devices, device_type=device_type))
            torch.set_rng_state(self.cpu_rng)
            for device, state in self.device_rng:
                module = torch.get_device_module(device.type)
                with module.device(device):
                    module.set_rng_state(state)
            stack.enter_context(torch.enable_grad())
            for kind, settings in self.autocast:
                stack.enter_context(torch.autocast(kind, **settings))
            yield


def _unpack(slot: _Slot) -> torch.Tensor:
    return slot.region.unpack(slot)


class _Recomputed(nn.Module):
    """Mixin placed before a module's class by :func:`recompute` (see the module docs)."""

    _pipetrain_recompute_keep: bool = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        run = super().forward
        if not torch.is_grad_enabled():
            return run(*args, **kwargs)
        first = next(self.parameters(), None)
        region = _Region(
            f"recomputed {type(self).__mro__[2].__name__}",  # the module's own class (after this mixin)
            run,
            args,
            kwargs,
            [] if first is None else [first],
            self._pipetrain_recompute_keep,
        )
        with torch.autograd.graph.saved_tensors_hooks(region.pack, _unpack):
            return run(*args, **kwargs)


_CLASSES: dict[type, type] = {}


def recompute(module: nn.Module, *, enabled: bool = True, weight_grads: str = "recompute") -> nn.Module:
    """Make ``module`` recompute its activations in backward (in place; returns ``module``).

    ``weight_grads``: ``"recompute"`` (hold only the inputs until the last backward; a split
    backward's W rebuilds again) or ``"keep"`` (rebuild once; after I keep what W needs). See the
    module docs. ``enabled=False`` makes the module plain again.
    """
    if weight_grads not in _WEIGHT_GRADS:
        raise ValueError(f"weight_grads must be 'recompute' or 'keep', got {weight_grads!r}")
    if not isinstance(module, nn.Module):
        raise TypeError(f"recompute needs an nn.Module, got {type(module).__name__}")
    cls = type(module)
    base: type = cls.__dict__.get("_pipetrain_base", cls) if isinstance(module, _Recomputed) else cls
    if not enabled:
        if base is not cls:
            module.__class__ = base
            module.__dict__.pop("_pipetrain_recompute_keep", None)
        return module
    if "forward" in module.__dict__:
        raise ValueError(
            f"recompute: this {cls.__name__}'s forward was replaced on the instance; recompute needs its class's forward"
        )
    sub = _CLASSES.get(base)
    if sub is None:
        sub = type(
            f"Recomputed{base.__name__}", (_Recomputed, base), {"__module__": base.__module__, "_pipetrain_base": base}
        )
        _CLASSES[base] = sub
    module.__class__ = sub
    module.__dict__["_pipetrain_recompute_keep"] = weight_grads == "keep"
    return module


def is_recomputed(module: nn.Module) -> bool:
    """Whether :func:`recompute` made ``module`` recompute its activations."""
    return isinstance(module, _Recomputed)
