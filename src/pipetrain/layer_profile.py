"""Measure a :class:`~pipetrain.plan.LayerCost` per layer, for :func:`~pipetrain.plan.plan_pipeline`.

``profile_layers(layers, sample_input, loss_fn=..., target=...)`` runs each layer on the output
of the one before (the first on ``sample_input``, one microbatch) and measures, per layer:

* ``f``, ``i``, ``w``: median seconds of its forward, its input-gradient backward (I) and its
  weight-gradient backward (W), run by :class:`~pipetrain.stage.PipelineStage` exactly as a
  pipeline stage runs them (pipetrain's split backward), over ``repeats`` rounds that each run
  one microbatch through every layer (all F, then all I and all W in reverse) after two untimed
  rounds: each action meets the caches as a pipeline leaves them, and drift touches all alike. On a GPU each is timed between
  ``synchronize`` calls. A layer whose input needs no gradient (an embedding of token ids) does
  all its backward in W, as a first stage does. The last layer's costs include ``loss_fn``.
* ``activation_bytes``: what its forward keeps for backward, counted (not guessed from shapes):
  every tensor autograd saves goes through ``saved_tensors_hooks`` and the distinct storages are
  summed, parameters and buffers left out. A storage that a layer saves of its own output and the
  next layer saves of its input counts once, for the next layer (the one whose input it is).
* ``weight_grad_bytes``: what it still holds once its input-gradient backward ran, its input and
  output gradient included: what W reads, held until W under a split backward (by the
  allocator, :func:`pipetrain.memory.allocated_bytes`; the activation bytes where it cannot be read).
* ``output_bytes``: its output's distinct storages (what crosses a cut; a recomputed stage keeps
  only its input, the previous layer's output).
* ``static_bytes``: its parameters and buffers held for the whole step: weights, gradients and
  optimizer state, by :func:`pipetrain.plan.static_bytes_for` (Adam by default; precision from
  the parameters' dtype). A parameter shared by several layers counts once, for the first.

Measuring leaves the layers as they were: parameter gradients and buffers are restored.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from pipetrain.errors import PipelineError
from pipetrain.plan import LayerCost, static_bytes_for
from pipetrain.split import _fresh_input, _named_layers
from pipetrain.stage import PipelineStage

__all__ = ["count_saved_bytes", "profile_layers"]

Layers = nn.Sequential | nn.ModuleDict | Mapping[str, nn.Module] | Sequence[nn.Module] | Sequence[tuple[str, nn.Module]]


def _storage_key(t: torch.Tensor) -> tuple[torch.device, int]:
    return (t.device, t.untyped_storage().data_ptr())


def _storages(value: Any) -> dict[tuple[torch.device, int], int]:
    """Distinct storages of the tensors in ``value`` (any nesting), with their sizes in bytes."""
    out: dict[tuple[torch.device, int], int] = {}
    for t in tree_leaves(value):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            out[_storage_key(t)] = t.untyped_storage().nbytes()
    return out


class count_saved_bytes:  # noqa: N801 - used as a context manager, like torch's hook contexts
    """Within the block, record the distinct storages of the tensors autograd saves for backward.

    ``exclude``: tensors not to count (parameters and buffers). ``storages`` maps each storage
    to its bytes; ``nbytes`` is their sum.
    """

    def __init__(self, exclude: Sequence[torch.Tensor] = ()) -> None:
        self._exclude = {_storage_key(t) for t in exclude if t.device.type != "meta"}
        self.storages: dict[tuple[torch.device, int], int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "meta":
            key = _storage_key(tensor)
            if key not in self._exclude:
                self.storages[key] = tensor.untyped_storage().nbytes()
        return tensor

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self) -> count_saved_bytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


class _WithLoss(nn.Module):
    """The last layer followed by the loss: the stage returns the loss (as the last stage does)."""

    def __init__(self, layer: nn.Module, loss_fn: Callable[..., torch.Tensor], target: Any) -> None:
        super().__init__()
        self.layer = layer
        self.loss_fn = loss_fn
        self.target = target
        self.output: Any = None

    def forward(self, x: Any) -> torch.Tensor:
        self.output = self.layer(x)
        return self.loss_fn(self.output, self.target)


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        module = getattr(torch, device.type, None)
        synchronize = getattr(module, "synchronize", None)
        if synchronize is not None:
            synchronize()


def _device_of(layers: Sequence[nn.Module], sample_input: Any) -> torch.device:
    for t in tree_leaves(sample_input):
        if isinstance(t, torch.Tensor):
            return t.device
    for layer in layers:
        for p in layer.parameters():
            return p.device
    return torch.device("cpu")


def _precision(params: Sequence[torch.Tensor]) -> str:
    return "fp32" if not params or all(p.dtype == torch.float32 for p in params) else "bf16"


def _default_static(params: Sequence[nn.Parameter], optimizer: str) -> float:
    """Weights + gradients + optimizer state, by the planner's accounting (``static_bytes_for``)."""
    count = sum(p.numel() for p in params)
    return float(static_bytes_for(count, optimizer=optimizer, precision=_precision(params)))


class _Timed:
    """One layer run as a (middle or last) pipeline stage, for timing its F, I and W.

    The layers are timed as a pipeline runs them, not each on its own: a round is one microbatch
    through the whole model (every layer's F in order, then every I and every W in reverse), so
    each action starts with what the others left in the caches, as in a stage that runs other
    microbatches and stages in between (timed back to back instead, measured on the bpe preset, a
    block came out 15-20 % faster than it ran in the pipeline, a head within 3 %). Rounds also
    spread whatever drifts while profiling (a clock speeding up, the allocator warming, another
    rank's work beside this one) over every layer alike."""

    def __init__(self, module: nn.Module, device: torch.device, x: Any, with_loss: bool) -> None:
        self.stage = PipelineStage(module, 1, 3, device)
        self.device = device
        self.x = x
        self.with_loss = with_loss
        self.grads: list[torch.Tensor] | None = None
        self.times: tuple[list[float], list[float], list[float]] = ([], [], [])
        self._out: Any = None

    def _timed(self, kind: int, record: bool, fn: Callable[[], Any]) -> Any:
        _sync(self.device)
        t0 = time.perf_counter()
        result = fn()
        _sync(self.device)
        if record:
            self.times[kind].append(time.perf_counter() - t0)
        return result

    def forward(self, trial: int, record: bool) -> None:
        inp = _fresh_input(self.x)
        self._out = self._timed(0, record, lambda: self.stage.forward_one_chunk(trial, (inp,)))

    def input_grad(self, trial: int, record: bool) -> None:
        out, self._out = self._out, None
        self._timed(1, record, lambda: self._input_grad(trial, out))

    def weight_grad(self, trial: int, record: bool) -> None:
        self._timed(2, record, lambda: self.stage.backward_weight_one_chunk(trial))

    def _input_grad(self, trial: int, out: Any, copy: bool = False) -> None:
        if self.with_loss:
            self.stage.backward_one_chunk(trial, loss=out, full=False)
            return
        roots = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if self.grads is None:
            gen = torch.Generator(device="cpu").manual_seed(0)
            self.grads = [torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device) for t in roots]
        given: list[torch.Tensor | None] = [g.clone() if copy else g for g in self.grads]
        self.stage.backward_one_chunk(trial, grad_outputs=given, full=False)

    def held_until_w(self, trial: int) -> float | None:
        """The bytes held once I ran (until W, under a split backward), its input and output gradient
        included, by the allocator (None where it cannot be read). Summed over a stage's layers
        that counts each boundary inside the stage once and the stage's own input and output
        gradient too (which the memory model also counts as messages: a conservative overlap)."""
        device = self.device
        before = _allocated(device)
        inp = _fresh_input(tree_map_only(torch.Tensor, torch.clone, self.x))
        out = self.stage.forward_one_chunk(trial, (inp,))
        del inp
        self._input_grad(trial, out, copy=True)
        del out
        after = _allocated(device)
        self.stage.backward_weight_one_chunk(trial)
        return None if before is None or after is None else float(max(0, after - before))

    def medians(self) -> tuple[float, float, float]:
        f, i, w = (statistics.median(t) for t in self.times)
        return f, i, w

    def close(self) -> None:
        self.stage.clear()
        if isinstance(self.stage.submod, _WithLoss):
            self.stage.submod.output = None


def _time_all(timed: Sequence[_Timed], repeats: int, warmup: int = 2) -> list[tuple[float, float, float]]:
    """Median F, I, W seconds of every layer over ``repeats`` rounds (see :class:`_Timed`), after
    ``warmup`` untimed rounds (one is not enough: measured, the first layers of a fresh process
    ran 40 % slower in the second round than in the third, a head 30 %)."""
    for round_ in range(warmup + repeats):
        trial, record = 2 + round_, round_ >= warmup  # chunk ids 0 and 1: each layer's warm-up and bytes
        for t in timed:
            t.forward(trial, record)
        for t in reversed(timed):
            t.input_grad(trial, record)
        for t in reversed(timed):
            t.weight_grad(trial, record)
    return [t.medians() for t in timed]


def _allocated(device: torch.device) -> int | None:
    """Bytes allocated now (pipetrain.memory), or None where this machine's allocator cannot be read."""
    from pipetrain.memory import allocated_bytes

    try:
        _sync(device)
        return allocated_bytes(device)
    except PipelineError:
        return None


def profile_layers(
    layers: Layers,
    sample_input: Any,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    target: Any = None,
    model: nn.Module | None = None,
    repeats: int = 5,
    optimizer: str = "adam",
    static_bytes: Callable[[list[nn.Parameter]], float] | None = None,
) -> list[LayerCost]:
    """One :class:`~pipetrain.plan.LayerCost` per layer, in order (see the module docs).

    ``layers`` run one after another: an ``nn.Sequential``, an ``nn.ModuleDict`` or mapping
    ``{name: layer}``, ``(name, layer)`` pairs, or a list of layers (named by their paths in
    ``model=`` when given, else by position) — the names :func:`pipetrain.split.split_layers`
    and :func:`pipetrain.split.split_by_names` give, so a plan's ``stage_layers`` names them.
    ``sample_input`` is the first layer's input for one microbatch; ``loss_fn(output, target)``
    (optional) is counted in the last layer. ``static_bytes(params)`` replaces the default count
    (weights + gradients + ``optimizer`` state, :func:`pipetrain.plan.static_bytes_for`).
    Times are in seconds.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if (loss_fn is None) != (target is None):
        raise ValueError("give loss_fn and target together (the loss is counted in the last layer)")
    named = _named_layers(layers, model)
    if not named:
        raise ValueError("profile_layers needs at least one layer")
    modules = [m for _, m in named]
    device = _device_of(modules, sample_input)
    params = {id(p): p for m in modules for p in m.parameters()}
    state = [(p, None if p.grad is None else p.grad.clone()) for p in params.values()]
    buffers = {id(b): (b, b.clone()) for m in modules for b in m.buffers()}
    held = [*params.values(), *(b for b, _ in buffers.values())]

    costs: list[dict[str, Any]] = []
    timed: list[_Timed] = []
    counted: set[int] = set()
    prev_out_keys: set[tuple[torch.device, int]] = set()
    prev_saved: dict[tuple[torch.device, int], int] = {}
    x = sample_input
    try:
        # Bytes, layer by layer: each layer's input is the output of the one before.
        for k, (name, layer) in enumerate(named):
            last = k == len(named) - 1
            module: nn.Module = _WithLoss(layer, loss_fn, target) if last and loss_fn is not None else layer
            # Bytes: one forward under counting hooks, graph dropped unused.
            with count_saved_bytes(exclude=held) as saved:
                out = module(_fresh_input(x))
            # The output of this forward (its storage alive) is the next layer's input.
            output = module.output if isinstance(module, _WithLoss) else out
            del out
            if isinstance(module, _WithLoss):
                module.output = None
            output = tree_map_only(torch.Tensor, torch.Tensor.detach, output)
            shared = prev_out_keys & prev_saved.keys() & saved.storages.keys()
            if shared:  # the previous layer saved its output and this one its input: count it here only
                costs[-1]["activation_bytes"] -= sum(prev_saved[key] for key in shared)
            stage = _Timed(module, device, x, isinstance(module, _WithLoss))
            timed.append(stage)
            stage.forward(0, record=False)  # warm, so that the allocator reading below is of a steady layer
            stage.input_grad(0, record=False)
            stage.weight_grad(0, record=False)
            wgrad = stage.held_until_w(1)
            mine = [p for p in layer.parameters() if id(p) not in counted]
            counted.update(id(p) for p in mine)
            if static_bytes is not None:
                static = float(static_bytes(mine))
            else:
                static = _default_static(mine, optimizer)
                static += sum(b.numel() * b.element_size() for b in layer.buffers())
            out_storages = _storages(output)
            costs.append(
                {
                    "name": name,
                    "activation_bytes": float(saved.nbytes),
                    "output_bytes": float(sum(out_storages.values())),
                    "static_bytes": static,
                    "weight_grad_bytes": wgrad,
                }
            )
            prev_out_keys, prev_saved = set(out_storages), saved.storages
            x = output
        # Times, every layer once per round (see _Timed).
        for cost, (f, i, w) in zip(costs, _time_all(timed, repeats), strict=True):
            cost.update(f=f, i=i, w=w)
    finally:
        for t in timed:
            t.close()
        for p, grad in state:
            p.grad = grad
        with torch.no_grad():
            for b, value in buffers.values():
                b.copy_(value)
    return [LayerCost(**c) for c in costs]
