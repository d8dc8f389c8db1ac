"""Measure a :class:`~pipetrain.plan.LayerCost` per layer, for :func:`~pipetrain.plan.plan_pipeline`.

``profile_layers(layers, sample_input, loss_fn=..., target=...)`` runs each layer on the output
of the one before (the first on ``sample_input``, one microbatch) and measures, per layer:

* ``f``, ``i``, ``w``, ``b``: median seconds of its forward, its input-gradient backward (I), its
  weight-gradient backward (W) and its whole backward in one pass (B), run by
  :class:`~pipetrain.stage.PipelineStage` exactly as a pipeline stage runs them (pipetrain's split
  backward, or one pass), over ``repeats`` pairs of rounds that each run one microbatch through
  every layer (all F, then all I and all W in reverse; then all F and all B in reverse) after two
  untimed pairs: each action meets the caches as a pipeline leaves them, and drift touches all
  alike. Split is not free: on the bpe preset a block's I + W takes 1.26-1.31x its B, which the
  planner weighs against the bubbles a split fills. On a GPU each is timed between
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
* ``workspace_bytes``: the most its F, its I or its W allocates beyond what is held before and
  after the action, freed by the action's end (a head's loss backward makes the logits' gradient
  and the softmax's: 2 x rows x vocabulary floats over what it holds); ``i_workspace_bytes`` the
  same for its I alone. On a GPU by the allocator (``reset_peak_memory_stats`` and
  ``max_memory_allocated``); on the CPU, which keeps no peak, by :class:`count_peak_bytes`: every
  storage the action's operators make, the autograd engine's included, is counted from its
  creation until it is freed, and so is every older storage they read that is freed during the
  action.
* ``i_saved_bytes``: the saved tensors its I frees, what only I reads (a finalizer on each saved
  storage). A split backward frees them when its stage's whole I ends, so while a stage of
  several layers runs its I the layers it already went through still hold theirs (on the bpe
  preset 0.77 MiB a block beside a block's 0.99 MiB of I workspace; a 5-block stage's I peaked
  4.0 MiB above what it held after). Its input and output count for neither (they stay held
  here): a tensor between two layers that only their I reads (an activation function's input,
  as a layer of its own) is left out.

* ``optimizer``: median seconds of the optimizer's update of its parameters and their
  ``zero_grad`` (Adam, or SGD with momentum for ``optimizer="sgd"``), per training step, timed on
  copies of its parameters with random gradients after one untimed update (which makes the
  optimizer's state), then scaled so that the layers sum to one update of all of them at once
  (as a rank runs it: a layer timed alone finds its state in the caches). A step pays it once per rank after the pipeline; the planner spreads it
  over the microbatches (:func:`pipetrain.plan.pipeline.layers.with_optimizer`).

Measuring leaves the layers as they were: parameter gradients and buffers are restored.
"""

from __future__ import annotations

import functools
import statistics
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

from pipetrain.errors import PipelineError
from pipetrain.memory import allocated_bytes, retain_freed_memory
from pipetrain.plan import LayerCost, static_bytes_for
from pipetrain.split import _fresh_input, _named_layers
from pipetrain.stage import PipelineStage

__all__ = ["count_peak_bytes", "count_saved_bytes", "profile_layers"]

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


class count_peak_bytes:  # noqa: N801 - used as a context manager, like count_saved_bytes
    """Within the block, the bytes its operators allocate and free, for a CPU, which keeps no peak.

    Every operator runs through a dispatch mode (those autograd's backward runs too: on the CPU
    the engine runs them in the calling thread, under the caller's modes). A storage an operator
    returns that none of its inputs has is new: it counts from then until it is freed (a
    finalizer on the storage, whose Python object lives as long as the storage does). A storage
    from before the block that an operator reads counts as freed if it goes during the block.
    ``peak`` is the most allocated beyond what was held at the start, ``end`` what stays at the
    end (negative when the block freed more than it kept): ``workspace`` is ``peak - max(0, end)``,
    what went beyond both the start and the end. Scratch a kernel allocates inside itself (not
    through an operator) is not seen, nor the freeing of an older storage no operator read; views
    and in-place results are not new storages.
    """

    def __init__(self) -> None:
        self.end = 0
        self.peak = 0
        self._live: dict[int, Any] = {}  # storage pointer -> its finalizer, while counted
        self._open = False
        self._mode = _Dispatch(self._seen)

    @property
    def workspace(self) -> int:
        return max(0, self.peak - max(0, self.end))

    def _watch(self, storage: torch.UntypedStorage) -> int:
        key, nbytes = storage.data_ptr(), storage.nbytes()
        self._live[key] = weakref.finalize(storage, self._freed, key, nbytes)
        return nbytes

    def _freed(self, key: int, nbytes: int) -> None:
        self._live.pop(key, None)
        if self._open:
            self.end -= nbytes

    def _seen(self, args: Any, out: Any) -> None:
        """One operator ran on ``args`` and returned ``out``."""
        if not self._open:
            return
        inputs: set[int] = set()
        for t in tree_leaves(args):
            storage = _cpu_storage(t)
            if storage is not None:
                key = storage.data_ptr()
                inputs.add(key)
                if key not in self._live:  # older than the block: counted if it is freed in it
                    self._watch(storage)
        for t in tree_leaves(out):
            storage = _cpu_storage(t)
            if storage is not None and storage.data_ptr() not in inputs and storage.data_ptr() not in self._live:
                self.end += self._watch(storage)
                self.peak = max(self.peak, self.end)

    def __enter__(self) -> count_peak_bytes:
        self.end = self.peak = 0
        self._open = True
        self._mode.__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)  # type: ignore[no-untyped-call]
        self._open = False
        for fin in list(self._live.values()):
            fin.detach()
        self._live.clear()


class _Dispatch(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Runs every operator and tells ``seen(args, out)``."""

    def __init__(self, seen: Callable[[Any, Any], None]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.seen = seen

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.seen((args, kwargs), out)
        return out


def _cpu_storage(t: object) -> torch.UntypedStorage | None:
    """The storage of a dense CPU tensor that holds bytes, else None."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.layout != torch.strided:
        return None
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return storage if storage.nbytes() > 0 else None


class _Workspace:
    """The most one action allocates beyond what is held before and after it, freed by its end:
    by the allocator's peak on a GPU, by :class:`count_peak_bytes` on the CPU (None where
    neither can be read)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.bytes: float | None = 0.0

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, its workspace noted (the largest so far is ``bytes``)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            result = fn(*args)
            torch.cuda.synchronize(self.device)
            peak, after = torch.cuda.max_memory_allocated(self.device), torch.cuda.memory_allocated(self.device)
            self._note(peak - max(before, after))
            return result
        if self.device.type != "cpu":
            self.bytes = None
            return fn(*args)
        with count_peak_bytes() as counted:
            result = fn(*args)
        self._note(counted.workspace)
        return result

    def _note(self, value: float) -> None:
        if self.bytes is not None:
            self.bytes = max(self.bytes, float(max(0.0, value)))


class _Freed:
    """Which of the storages autograd saved (``saved``'s, this microbatch's) are freed until
    :meth:`close`, and their bytes (a finalizer on each: its Python object lives as long as the
    storage does)."""

    def __init__(self, saved: Any) -> None:
        self.gone: list[int] = []
        self._watch: list[Any] = []
        seen: set[int] = set()
        for holder in getattr(saved, "holders", ()):
            t = holder.tensor
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.layout == torch.strided:
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen and storage.nbytes() > 0:
                    seen.add(storage.data_ptr())
                    self._watch.append(weakref.finalize(storage, self.gone.append, storage.nbytes()))

    def close(self) -> float:
        for fin in self._watch:
            fin.detach()
        return float(sum(self.gone))


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


def _optimizer_seconds(params: Sequence[nn.Parameter], optimizer: str, repeats: int) -> float:
    """Median seconds of one optimizer step and ``zero_grad`` over copies of ``params`` (0 for none)."""
    if not params:
        return 0.0
    copies = [nn.Parameter(p.detach().clone()) for p in params]
    kind = optimizer.lower()
    opt: torch.optim.Optimizer = (
        torch.optim.SGD(copies, lr=1e-3, momentum=0.9) if kind == "sgd" else torch.optim.Adam(copies, lr=1e-3)
    )
    samples = []
    device = copies[0].device
    for trial in range(repeats + 1):  # the first makes the optimizer's state and is not counted
        for p in copies:
            p.grad = torch.randn_like(p)
        _sync(device)
        t0 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        if trial:
            samples.append(time.perf_counter() - t0)
    return float(statistics.median(samples))


def _scale_optimizer(costs: list[dict[str, Any]], params: Sequence[nn.Parameter], optimizer: str, repeats: int) -> None:
    """Scale the layers' optimizer times so that they sum to one update of all their parameters
    at once: a rank updates all of its parameters in one call, and a layer timed alone finds its
    parameters and state in the caches (on the bpe preset the whole model's Adam step took
    1.1-1.7x its layers' sum)."""
    total = sum(c["optimizer"] for c in costs)
    unique = list({id(p): p for p in params}.values())
    if total <= 0 or len(costs) < 2:
        return
    whole = _optimizer_seconds(unique, optimizer, repeats)
    for c in costs:
        c["optimizer"] *= whole / total


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
        self.times: tuple[list[float], list[float], list[float], list[float]] = ([], [], [], [])
        self._out: Any = None

    def _timed(self, kind: int, record: bool, fn: Callable[[], Any]) -> Any:
        _sync(self.device)
        t0 = time.perf_counter()
        result = fn()
        _sync(self.device)
        if record:
            self.times[kind].append(time.perf_counter() - t0)
        return result

    def forward(self, trial: int, record: bool, track: bool = True) -> None:
        inp = _fresh_input(self.x)
        self._out = self._timed(0, record, lambda: self.stage.forward_one_chunk(trial, (inp,), track=track))

    def input_grad(self, trial: int, record: bool) -> None:
        out, self._out = self._out, None
        self._timed(1, record, lambda: self._input_grad(trial, out))

    def weight_grad(self, trial: int, record: bool) -> None:
        self._timed(2, record, lambda: self.stage.backward_weight_one_chunk(trial))

    def full_backward(self, trial: int, record: bool) -> None:
        """The whole backward in one pass (a schedule's B), after an untracked forward (as the runtime runs it)."""
        out, self._out = self._out, None
        self._timed(3, record, lambda: self._input_grad(trial, out, full=True))

    def _input_grad(
        self, trial: int, out: Any, given: list[torch.Tensor | None] | None = None, full: bool = False
    ) -> None:
        if self.with_loss:
            self.stage.backward_one_chunk(trial, loss=out, full=full)
            return
        if self.grads is None:
            roots = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            gen = torch.Generator(device="cpu").manual_seed(0)
            self.grads = [torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device) for t in roots]
        self.stage.backward_one_chunk(trial, grad_outputs=list(self.grads) if given is None else given, full=full)

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
        self._input_grad(trial, out, self._given())
        del out
        after = _allocated(device)
        self.stage.backward_weight_one_chunk(trial)
        return None if before is None or after is None else float(max(0, after - before))

    def workspace(self, trial: int) -> tuple[float | None, float | None, float]:
        """(workspace, I's workspace, I-only saved bytes): the most its F, I, W or B (and its I alone)
        allocates beyond what is held before and after the action (:class:`_Workspace`; None
        where it cannot be measured), and the bytes of saved tensors its I frees (what only I
        reads: a split backward frees them when the stage's whole I ends). Its input and output
        gradient are made before the actions that take them."""
        work, work_i = _Workspace(self.device), _Workspace(self.device)
        inp = _fresh_input(tree_map_only(torch.Tensor, torch.clone, self.x))
        out = work.run(self.stage.forward_one_chunk, trial, (inp,))
        del inp
        state = self.stage._mbs.get(trial)  # what the stage keeps of this microbatch: its saved tensors
        freed = _Freed(None if state is None else state.saved)
        del state
        work_i.run(self._input_grad, trial, out, self._given())
        i_saved = freed.close()  # (its output is still held here, as the next layer's input would be)
        del out
        work.run(self.stage.backward_weight_one_chunk, trial)
        # B's own temporaries: autograd makes each weight gradient before adding it, W adds in place.
        inp = _fresh_input(tree_map_only(torch.Tensor, torch.clone, self.x))
        out = self.stage.forward_one_chunk(trial, (inp,), track=False)
        del inp
        work.run(functools.partial(self._input_grad, full=True), trial, out, self._given())
        del out
        if work.bytes is None or work_i.bytes is None:
            return None, None, i_saved
        return max(work.bytes, work_i.bytes), work_i.bytes, i_saved

    def _given(self) -> list[torch.Tensor | None] | None:
        """Copies of the output gradients I is given (None for the last layer: it starts from the loss)."""
        return None if self.grads is None else [g.clone() for g in self.grads]

    def medians(self) -> tuple[float, float, float, float]:
        f, i, w, b = (statistics.median(t) for t in self.times)
        return f, i, w, b

    def close(self) -> None:
        self.stage.clear()
        if isinstance(self.stage.submod, _WithLoss):
            self.stage.submod.output = None


def _time_all(timed: Sequence[_Timed], repeats: int, warmup: int = 2) -> list[tuple[float, float, float, float]]:
    """Median F, I, W and B seconds of every layer over ``repeats`` pairs of rounds (see
    :class:`_Timed`): one with the backward split (every F, then every I and every W in reverse),
    one with it whole (every F untracked, then every B in reverse), after ``warmup`` untimed pairs
    (one is not enough: measured, the first layers of a fresh process ran 40 % slower in the
    second round than in the third, a head 30 %). F's median is over both kinds of round."""
    for round_ in range(warmup + repeats):
        trial, record = 3 + 2 * round_, round_ >= warmup  # chunk ids 0, 1, 2: each layer's warm-up and bytes
        for t in timed:
            t.forward(trial, record)
        for t in reversed(timed):
            t.input_grad(trial, record)
        for t in reversed(timed):
            t.weight_grad(trial, record)
        for t in timed:
            t.forward(trial + 1, record, track=False)
        for t in reversed(timed):
            t.full_backward(trial + 1, record)
    return [t.medians() for t in timed]


def _allocated(device: torch.device) -> int | None:
    """Bytes allocated now (pipetrain.memory), or None where this machine's allocator cannot be read."""
    try:
        _sync(device)
        return allocated_bytes(device)
    except PipelineError:
        return None


def _checked(
    layers: Layers, model: nn.Module | None, repeats: int, loss_fn: Any, target: Any
) -> list[tuple[str, nn.Module]]:
    """``profile_layers``' arguments checked; its layers, named."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if (loss_fn is None) != (target is None):
        raise ValueError("give loss_fn and target together (the loss is counted in the last layer)")
    named = _named_layers(layers, model)
    if not named:
        raise ValueError("profile_layers needs at least one layer")
    return named


def _layer_failed(k: int, name: str, named: Sequence[tuple[str, Any]], x: Any, err: Exception) -> str:
    """What to tell a user whose layer ``k`` refused the previous layer's output."""
    shapes = [tuple(t.shape) for t in tree_leaves(x) if isinstance(t, torch.Tensor)]
    given = "the sample input" if k == 0 else f"the output of layer {k - 1} ({named[k - 1][0]!r})"
    return (
        f"profile_layers: layer {k} ({name!r}) failed on {given}, tensor shapes {shapes}: {err}. "
        "The layers must be given in the order the model runs them, each taking the one before's "
        "output (a layer needing other inputs, such as rotary embeddings or a mask, needs a wrapper)"
    )


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
    Times are in seconds. On the CPU it first calls :func:`pipetrain.memory.retain_freed_memory`
    (process-wide): timed one microbatch at a time, a layer with large temporaries would otherwise
    page-fault them in every round, which a pipeline's steady state does not (a bpe head's
    backward measured 1.4x slower that way).
    """
    named = _checked(layers, model, repeats, loss_fn, target)
    modules = [m for _, m in named]
    device = _device_of(modules, sample_input)
    if device.type == "cpu":
        retain_freed_memory()
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
                try:
                    out = module(_fresh_input(x))
                except (RuntimeError, TypeError, ValueError, IndexError) as err:
                    raise PipelineError(_layer_failed(k, name, named, x, err)) from err
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
            workspace, i_workspace, i_saved = stage.workspace(2)
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
                    "workspace_bytes": workspace or 0.0,
                    "i_workspace_bytes": i_workspace,
                    "i_saved_bytes": i_saved,
                    "optimizer": _optimizer_seconds(mine, optimizer, repeats),
                }
            )
            prev_out_keys, prev_saved = set(out_storages), saved.storages
            x = output
        _scale_optimizer(costs, [p for _, layer in named for p in layer.parameters()], optimizer, repeats)
        # Times, every layer once per round (see _Timed).
        for cost, (f, i, w, whole) in zip(costs, _time_all(timed, repeats), strict=True):
            cost.update(f=f, i=i, w=w, b=whole)
    finally:
        for t in timed:
            t.close()
        for p, grad in state:
            p.grad = grad
        with torch.no_grad():
            for b, value in buffers.values():
                b.copy_(value)
    return [LayerCost(**c) for c in costs]
