"""Recompute a module's activations in backward (activation checkpointing), with split backward too.

``recompute(module)`` makes ``module`` keep only its inputs from its forward: what autograd would
save inside it is rebuilt by running its forward again when a backward first needs it. It is how a
stage that a plan marks ``recompute`` runs (:func:`pipetrain.split.split_by_names`), and
:func:`checkpoint` is the same for a function, with ``torch.utils.checkpoint.checkpoint``'s
signature (selective checkpointing's ``context_fn`` included).

Under a split backward the rebuild happens once per microbatch, in I (or B), and W rebuilds
nothing: I keeps each weight GEMM's operands for W (pipetrain._backward), reading them from the
rebuilt tensors without consuming them. torch's own non-reentrant checkpoint cannot be read that
way (a saved tensor may be unpacked once per backward call), so under it the weight gradients are
computed in I; :class:`~pipetrain.PipelineStage` therefore moves torch's ``checkpoint_wrapper``
modules (torchtitan's ``apply_ac``, full and selective) and Hugging Face's gradient checkpointing
(``use_reentrant=False``) onto :func:`checkpoint` when it is built (:func:`adopt_checkpointing`).

Between F and I the module holds only its inputs; from I to W the operands of its weight GEMMs
(what any split backward keeps for W). The module's class is swapped for a subclass (as FSDP's
``fully_shard`` does), so parameter names, ``state_dict`` keys and ``isinstance`` checks are
unchanged; ``recompute(module, enabled=False)`` undoes it. The forward runs again with the random
state and autocast settings of the first run (dropout draws the same mask); anything else it
changes (a BatchNorm's running statistics) changes again, as with torch's checkpointing.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from pipetrain import _backward
from pipetrain.errors import PipelineError

__all__ = ["adopt_checkpointing", "checkpoint", "is_recomputed", "recompute"]

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
        replay_context: contextlib.AbstractContextManager[Any] | None = None,
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
        self.replay_context = replay_context  # selective checkpointing: what the rebuild reuses
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
                # What the pass rebuilt and did not use goes when it ends.
                torch.autograd.Variable._execution_engine.queue_callback(self.end_first_pass)
            if self.tensors is None or self.tensors[i] is None:
                self.fill()
            assert self.tensors is not None
            tensor = self.tensors[i]
            assert tensor is not None
            # I reads a GEMM's operand for W just before the GEMM's node does (pipetrain._backward).
            if not _backward.peeking():
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
            if self.replay_context is not None:
                stack.enter_context(self.replay_context)
            yield


def _unpack(slot: _Slot) -> torch.Tensor:
    return slot.region.unpack(slot)


class _Recomputed(nn.Module):
    """Mixin placed before a module's class by :func:`recompute` (see the module docs)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        run = super().forward
        if not torch.is_grad_enabled():
            return run(*args, **kwargs)
        first = next(self.parameters(), None)
        name = f"recomputed {type(self).__mro__[2].__name__}"  # the module's own class (after this mixin)
        return _run_region(name, run, args, kwargs, [] if first is None else [first], None)


def _run_region(
    name: str,
    run: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    params: Sequence[torch.Tensor],
    context_fn: Callable[[], tuple[Any, Any]] | None,
) -> Any:
    """Run ``run`` keeping nothing it saves for backward but the way to rebuild it."""
    first_context, replay_context = context_fn() if context_fn is not None else (contextlib.nullcontext(), None)
    region = _Region(name, run, args, kwargs, params, replay_context)
    with first_context, torch.autograd.graph.saved_tensors_hooks(region.pack, _unpack):
        return run(*args, **kwargs)


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    use_reentrant: bool | None = None,
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
    determinism_check: str = "default",
    debug: bool = False,
    preserve_rng_state: bool = True,
    early_stop: bool = True,
    **kwargs: Any,
) -> Any:
    """``torch.utils.checkpoint.checkpoint`` (non-reentrant) whose rebuild a split backward shares:
    one recompute per microbatch, I and W together (the module docs). ``context_fn`` takes
    selective checkpointing's ``create_selective_checkpoint_contexts(policy)``. The random state
    is always restored for the rebuild and the rebuild stops once every saved tensor is back, so
    ``preserve_rng_state``, ``determinism_check``, ``debug`` and ``early_stop`` change nothing;
    ``use_reentrant=True`` is handed to torch's reentrant checkpoint as asked."""
    del determinism_check, debug, preserve_rng_state, early_stop
    if use_reentrant:
        from torch.utils.checkpoint import checkpoint as torch_checkpoint

        return torch_checkpoint(function, *args, use_reentrant=True, **kwargs)
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    name = f"checkpointed {getattr(function, '__qualname__', type(function).__name__)}"
    first = next(function.parameters(), None) if isinstance(function, nn.Module) else None
    return _run_region(name, function, args, kwargs, [] if first is None else [first], context_fn)


def adopt_checkpointing(module: nn.Module) -> int:
    """Move torch's non-reentrant checkpointing inside ``module`` onto :func:`checkpoint`: its
    ``checkpoint_wrapper`` modules (what torchtitan's ``apply_ac`` makes, full or selective) and
    Hugging Face layers' ``_gradient_checkpointing_func``. Same recompute, same memory; under a
    split backward the weight GEMMs can then wait for W. Returns how many it moved."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    moved = 0
    for sub in module.modules():
        for attr in ("checkpoint_fn", "_gradient_checkpointing_func"):
            fn = sub.__dict__.get(attr)
            if (
                isinstance(fn, functools.partial)
                and fn.func is torch_checkpoint
                and fn.keywords.get("use_reentrant") is False
                and not fn.args
            ):
                sub.__dict__[attr] = functools.partial(checkpoint, **fn.keywords)
                moved += 1
    return moved


_CLASSES: dict[type, type] = {}


def recompute(module: nn.Module, *, enabled: bool = True, weight_grads: str = "recompute") -> nn.Module:
    """Make ``module`` recompute its activations in backward (in place; returns ``module``).

    ``enabled=False`` makes the module plain again. ``weight_grads`` ("recompute" or "keep")
    chose, before W became the deferred GEMMs alone, whether W rebuilt the activations again; both
    now rebuild once and keep W's operands from I to W (the module docs).
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
    return module


def is_recomputed(module: nn.Module) -> bool:
    """Whether :func:`recompute` made ``module`` recompute its activations."""
    return isinstance(module, _Recomputed)
