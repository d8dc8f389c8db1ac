"""The executor: the one interpreter of a rank's compiled program (:mod:`pipetrain.plan.program`).

It makes no scheduling decision. It walks the program step by step: a communication group is
posted as one batch, any other action runs on this rank's stages; it waits for received data
only right before a compute action uses it, and the driver completes all sends by the end of the
step. Which receives go early, which groups form and where gradients are reduced was decided by
the schedule and its lowering.

The executor is written as a generator that yields whenever it needs data that has not arrived.
Over ``torch.distributed`` waiting blocks (so it never yields); :class:`~pipetrain.runtime.local.LocalPipeline`
interleaves the generators of all ranks in one process instead. Functions registered with
``register_custom_function`` replace an action's compute here; what they receive is
:mod:`pipetrain.runtime.custom`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_flatten, tree_map

from pipetrain.errors import PipelineError
from pipetrain.plan import Action, ActionKind
from pipetrain.plan.program import RankProgram
from pipetrain.runtime.custom import CustomAction, CustomFunction, PipelineContext
from pipetrain.runtime.data_parallel import reduce_grad, reshard, unshard
from pipetrain.runtime.device_timing import DeviceClock
from pipetrain.runtime.transport.wire import RecvHandle, RecvItem, SendItem
from pipetrain.stage import PipelineStage

__all__ = ["Comm", "LossFn", "RankExecutor", "StepData"]

LossFn = Callable[..., torch.Tensor]
_K = ActionKind
_NO_PROGRAM = RankProgram(-1, (), frozenset(), ())


class Comm(Protocol):
    """What the executor needs from a transport (distributed or in-process).

    ``blocking``: ``take`` waits for the data itself (so the executor never yields).
    """

    blocking: bool

    def post(self, items: list[SendItem | RecvItem]) -> list[RecvHandle]: ...
    def ready(self, handle: RecvHandle) -> bool: ...
    def take(self, handle: RecvHandle) -> Any: ...
    def poll(self) -> None: ...
    def confirm(self, keys: list[tuple[str, int, int]]) -> None: ...


def _message_key(send: Action) -> tuple[str, int, int]:
    """The transport's key of the message a SEND action posts."""
    assert send.microbatch is not None
    return ("F" if send.kind is _K.SEND_F else "B", send.stage, send.microbatch)


@dataclass
class StepData:
    """What one step gives a rank: its share of the inputs, targets and options."""

    step_index: int
    train: bool
    keep_outputs: bool = True
    inputs: list[tuple[tuple[Any, ...], dict[str, Any]]] | None = None  # per microbatch, if stage 0 is here
    targets: list[Any] | None = None  # per microbatch, if the last stage is here and has a loss
    loss_fn: LossFn | None = None
    loss_scale: float = 1.0
    loss_kwargs: dict[str, Any] = field(default_factory=dict)
    stage_kwargs: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # stage -> per microbatch
    # For functions registered with register_custom_function: who runs the step, what it was given.
    custom: dict[ActionKind, CustomFunction] = field(default_factory=dict)
    schedule_ref: Any = None
    kwarg_mbs: list[dict[str, Any]] | None = None  # the step's keyword inputs per microbatch
    user_losses: list[Any] | None = None  # the list step() fills


def _as_inputs(obj: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A stage output as the next stage's inputs: a tuple is positional args, a dict keywords."""
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return obj, {}
    if isinstance(obj, dict):
        return (), dict(obj)
    return (obj,), {}


def _detach(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, obj)


def _grad_specs(obj: Any) -> list[tuple[torch.Size, torch.dtype]]:
    if isinstance(obj, torch.Tensor):
        return [(obj.shape, obj.dtype)] if obj.requires_grad else []
    leaves, _ = tree_flatten(obj)
    return [(t.shape, t.dtype) for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


class RankExecutor:
    """One rank's interpreter: the per-microbatch state between the actions of one step."""

    def __init__(
        self,
        rank: int,
        stages: dict[int, PipelineStage],
        stage_to_rank: dict[int, int],
        num_stages: int,
        comm: Comm,
    ) -> None:
        self.rank = rank
        self.stages = stages
        self.stage_to_rank = stage_to_rank
        self.num_stages = num_stages
        self.comm = comm
        self.action: Action | None = None
        self.program = _NO_PROGRAM
        self.pos = 0  # the program step being run (its sends not yet posted count as owed)
        self.step_index = -1
        self.events: list[tuple[Action, int, int]] = []
        # Device timing (see device_timing): the clock, and per compute action its index in
        # ``events`` and its two marks on the device.
        self.clock: DeviceClock | None = None
        self.timed: list[tuple[int, Any, Any]] = []
        self.data = StepData(-1, False)
        self.observe: Callable[[], None] | None = None  # called after every action (pipetrain.memory)
        self._reset()

    def _reset(self) -> None:
        self.inputs: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        self.fwd_local: dict[tuple[int, int], Any] = {}  # (stage, mb) -> input handed over in memory
        self.bwd_local: dict[tuple[int, int], Any] = {}  # (stage, mb) -> output grads handed over in memory
        self.to_send_f: dict[tuple[int, int], Any] = {}
        self.to_send_b: dict[tuple[int, int], Any] = {}
        self.recv_f: dict[tuple[int, int], RecvHandle] = {}
        self.recv_b: dict[tuple[int, int], RecvHandle] = {}
        self.out_specs: dict[tuple[int, int], list[tuple[torch.Size, torch.dtype]]] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, Any] = {}

    def where(self) -> str:
        action = "" if self.action is None else f", action {self.action}"
        return f"rank {self.rank}, step {self.step_index}{action}"

    def begin(self, program: RankProgram, step_index: int) -> None:
        """Set the program and step about to run (what a failure before its first action names)."""
        self.program = program
        self.step_index = step_index
        self.action = None
        self.pos = 0
        self.events = []
        self.timed = []

    # --------------------------------------------------------------- running
    def run(self, program: RankProgram, data: StepData) -> Generator[None, None, None]:
        """Execute ``program``; yields while waiting for data (in-process mode only)."""
        self._reset()
        self.begin(program, data.step_index)
        self.data = data
        self.inputs = dict(enumerate(data.inputs)) if data.inputs is not None else {}
        profiling = torch.autograd.profiler._is_profiler_enabled
        events = self.events
        clock = time.perf_counter_ns
        on_device = self.clock
        if on_device is not None:
            on_device.start()
        blocking = self.comm.blocking
        train = data.train
        for pos, step in enumerate(program.steps):
            self.pos = pos
            self.action = step.actions[0]
            if step.comm:
                t0 = clock()
                with _Label(profiling, step.actions):
                    self._post(step.actions)
                t1 = clock()
                events.extend((a, t0, t1) for a in step.actions)
                if self.observe is not None:
                    self.observe()
                continue
            action = self.action
            if not blocking:
                self.comm.poll()
                yield from self._wait_inputs(action)
            else:
                self._receive_inputs(action)  # waits end before the compute's clock starts
                # Sends surely delivered by now free their buffers before this action allocates,
                # as the memory model counts them (plan.delivery).
                sure = program.confirms.get(pos)
                if sure is not None:
                    self.comm.confirm([_message_key(a) for a in sure])
                self.comm.poll()
            t0 = clock()
            # (UNSHARD, RESHARD and REDUCE_GRAD keep host times)
            mark = on_device.mark() if on_device is not None and action.kind.is_compute else None
            # Grad mode is set per action, never across a yield (in-process ranks interleave).
            with torch.set_grad_enabled(train):
                if profiling:
                    with torch.profiler.record_function(str(action)):
                        self._compute(action)
                else:
                    self._compute(action)
            if mark is not None and on_device is not None:
                self.timed.append((len(events), mark, on_device.mark()))
            events.append((action, t0, clock()))
            if self.observe is not None:
                self.observe()
        self.action = None
        self.pos = len(program.steps)
        if train and 0 in self.stages:
            self.stages[0].backward_into_inputs()

    def unsent(self) -> list[tuple[tuple[str, int, int], int]]:
        """``(message key, peer)`` of the SEND actions this step has not posted yet."""
        out = []
        for pos, action in self.program.sends:
            if pos < self.pos or action.microbatch is None:
                continue
            peer = self.stage_to_rank[action.stage + 1 if action.kind is _K.SEND_F else action.stage - 1]
            out.append((_message_key(action), peer))
        return out

    def _receive_inputs(self, action: Action) -> None:
        """Blocking mode: take the action's messages before its compute is timed, so a measured
        timeline shows a wait as a gap and an action's box as its compute alone."""
        for part in action.parts:
            key = (part.stage, part.microbatch or 0)
            if part.kind is _K.F:
                handle = self.recv_f.pop(key, None)
                if handle is not None:
                    self.fwd_local[key] = self.comm.take(handle)
            elif part.kind in (_K.B, _K.I):
                handle = self.recv_b.pop(key, None)
                if handle is not None:
                    self.bwd_local[key] = self.comm.take(handle)

    def _wait_inputs(self, action: Action) -> Generator[None, None, None]:
        for part in action.parts:
            handle = None
            if part.kind is _K.F:
                handle = self.recv_f.get((part.stage, part.microbatch or 0))
            elif part.kind in (_K.B, _K.I):
                handle = self.recv_b.get((part.stage, part.microbatch or 0))
            if handle is not None:
                while not self.comm.ready(handle):
                    yield

    def _post(self, batch: Sequence[Action]) -> None:
        items: list[SendItem | RecvItem] = []
        recvs: list[tuple[dict[tuple[int, int], RecvHandle], tuple[int, int]]] = []
        for action in batch:
            s, m = action.stage, action.microbatch
            assert m is not None
            kind = action.kind
            # No local keeps the sent object: once packed, a sent output may be freed (see free_output_storage).
            if kind is _K.SEND_F:
                stage = self.stages[s]
                done = (lambda st=stage, mb=m: st.free_output_storage(mb)) if self.data.train else None
                items.append(
                    SendItem(
                        ("F", s, m),
                        self.stage_to_rank[s + 1],
                        self._pop(self.to_send_f, (s, m), "no forward output to send (did F run?)"),
                        f"{action}",
                        done,
                    )
                )
            elif kind is _K.SEND_B:
                items.append(
                    SendItem(
                        ("B", s, m),
                        self.stage_to_rank[s - 1],
                        self._pop(self.to_send_b, (s, m), "no input gradient to send (did B or I run?)"),
                        f"{action}",
                    )
                )
            elif kind is _K.RECV_F:
                items.append(
                    RecvItem(("F", s - 1, m), self.stage_to_rank[s - 1], f"{action} (output of stage {s - 1})")
                )
                recvs.append((self.recv_f, (s, m)))
            else:  # RECV_B
                items.append(
                    RecvItem(("B", s + 1, m), self.stage_to_rank[s + 1], f"{action} (gradient from stage {s + 1})")
                )
                recvs.append((self.recv_b, (s, m)))
        handles = self.comm.post(items)
        for (table, key), handle in zip(recvs, handles, strict=True):
            table[key] = handle

    def _pop(self, table: dict[tuple[int, int], Any], key: tuple[int, int], why: str) -> Any:
        try:
            return table.pop(key)
        except KeyError:
            raise PipelineError(f"{self.where()}: {why}") from None

    def _stage(self, s: int) -> PipelineStage:
        try:
            return self.stages[s]
        except KeyError:
            raise PipelineError(f"{self.where()}: stage {s} is not held by rank {self.rank}") from None

    # --------------------------------------------------------------- compute
    def _compute(self, action: Action) -> None:
        fn = self.data.custom.get(action.kind) if self.data.custom else None
        if fn is None:
            self._perform(action)
            return
        data = self.data
        fn(
            CustomAction.of(action),
            PipelineContext(
                data.schedule_ref,
                [a for a, _ in data.inputs] if data.inputs is not None else None,
                data.kwarg_mbs,
                data.targets,
                data.user_losses,
                dict(self.stages),
                self,
            ),
        )

    def _perform(self, action: Action) -> None:
        """pipetrain's own implementation of ``action`` (as torch, a custom function replaces
        only a top-level action: an OVERLAP_F_B's parts run here)."""
        kind = action.kind
        if kind is _K.OVERLAP_F_B:
            for part in action.parts:
                self._perform(part)
        elif kind is _K.UNSHARD:
            unshard(self._stage(action.stage))
        elif kind is _K.RESHARD:
            reshard(self._stage(action.stage))
        elif kind is _K.REDUCE_GRAD:
            reduce_grad(self._stage(action.stage))
        elif action.microbatch is None:  # pragma: no cover - parsing refuses F/B/I/W without one
            raise PipelineError(f"{self.where()}: {action} names no microbatch")
        elif kind is _K.F:
            s, m = action.stage, action.microbatch
            args, kwargs = self._forward_inputs(s, m)
            output = self._stage(s).forward_one_chunk(m, args, kwargs, track=(s, m) in self.program.split_cells)
            self._forward_output(s, m, output)
        elif kind is _K.B or kind is _K.I:
            s, m = action.stage, action.microbatch
            grads = self._stage(s).backward_one_chunk(m, **self._backward_inputs(s, m), full=kind is _K.B)
            self._backward_output(s, m, grads)
        elif kind is _K.W:
            self._stage(action.stage).backward_weight_one_chunk(action.microbatch)
        else:  # pragma: no cover - every kind is handled above
            raise PipelineError(f"{self.where()}: cannot execute {kind.value}")

    def _forward_inputs(self, s: int, m: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self._stage(s)
        if s == 0:
            try:
                args, kwargs = self.inputs.pop(m)
            except KeyError:
                raise PipelineError(
                    f"{self.where()}: no input for microbatch {m} of stage 0; pass the inputs to step() on rank {self.rank}"
                ) from None
        elif (s, m) in self.fwd_local:
            args, kwargs = _as_inputs(self.fwd_local.pop((s, m)))
        else:
            handle = self.recv_f.pop((s, m), None)
            if handle is None:
                raise PipelineError(
                    f"{self.where()}: input of stage {s} for microbatch {m} was never received (no {s}RECV_F{m})"
                )
            args, kwargs = _as_inputs(self.comm.take(handle))
        extra = self.data.stage_kwargs.get(s)
        if extra is not None:
            kwargs = self._with_stage_kwargs(s, m, kwargs, extra[m])
        return args, kwargs

    def _forward_output(self, s: int, m: int, output: Any) -> None:
        data = self.data
        if s == self.num_stages - 1:
            if data.loss_fn is not None and data.targets is not None:
                self.losses[m] = self._loss(output, data.targets[m])
            if data.keep_outputs:
                self.outputs[m] = _detach(output)
            if data.train:  # the stage's own reference: backward needs the loss, not the output (logits)
                self._stage(s).free_output_storage(m)
            return
        if data.train:
            self.out_specs[(s, m)] = _grad_specs(output)
        if self.stage_to_rank[s + 1] == self.rank:
            self.fwd_local[(s + 1, m)] = output
        else:
            self.to_send_f[(s, m)] = output

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        data = self.data
        assert data.loss_fn is not None
        loss = data.loss_fn(output, target, **data.loss_kwargs) if data.loss_kwargs else data.loss_fn(output, target)
        # Backward needs a scalar; eval keeps whatever loss_fn gives (per-sample losses, say), as torch does.
        if data.train and (not isinstance(loss, torch.Tensor) or loss.numel() != 1):
            raise PipelineError(f"{self.where()}: loss_fn must return a scalar tensor, got {loss!r}")
        return loss

    def _with_stage_kwargs(self, s: int, m: int, kwargs: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
        clash = sorted(extra.keys() & kwargs.keys())
        if clash:
            given = "stage_kwargs" if s == 0 else "the keyword inputs given to step() (its keywords or stage_kwargs)"
            source = "step()'s keyword arguments" if s == 0 else f"stage {s - 1}'s output"
            raise PipelineError(
                f"{self.where()}: stage {s} microbatch {m} gets {clash} both from {given} and from {source}"
            )
        return {**kwargs, **extra}

    def _backward_inputs(self, s: int, m: int) -> dict[str, Any]:
        self._stage(s)
        if s == self.num_stages - 1:
            loss = self.losses.get(m)
            if loss is None:
                raise PipelineError(
                    f"{self.where()}: no loss for microbatch {m} (a backward needs loss_fn and a target)"
                )
            self.losses[m] = loss.detach()
            return {"loss": loss * self.data.loss_scale if self.data.loss_scale != 1.0 else loss}
        if (s, m) in self.bwd_local:
            grad_outputs = self.bwd_local.pop((s, m))
        else:
            handle = self.recv_b.pop((s, m), None)
            if handle is None:
                raise PipelineError(
                    f"{self.where()}: gradient for stage {s}'s output of microbatch {m} was never received (no {s}RECV_B{m})"
                )
            grad_outputs = self.comm.take(handle)
        self._check_grads(s, m, grad_outputs)
        return {"grad_outputs": list(grad_outputs)}

    def _backward_output(self, s: int, m: int, grads: list[torch.Tensor | None]) -> None:
        if s == 0:
            return
        if self.stage_to_rank[s - 1] == self.rank:
            self.bwd_local[(s - 1, m)] = grads
        else:
            self.to_send_b[(s, m)] = grads

    def _check_grads(self, s: int, m: int, grads: Sequence[torch.Tensor | None]) -> None:
        specs = self.out_specs.pop((s, m), None)
        if specs is None:
            return
        if len(grads) != len(specs):
            raise PipelineError(
                f"{self.where()}: stage {s + 1} sent {len(grads)} input gradients for microbatch {m}, but stage {s} "
                f"produced {len(specs)} outputs that need a gradient"
            )
        for i, (grad, (shape, dtype)) in enumerate(zip(grads, specs, strict=True)):
            if grad is not None and (grad.shape != shape or grad.dtype != dtype):
                raise PipelineError(
                    f"{self.where()}: stage {s} output {i} of microbatch {m} is {dtype} {list(shape)}, but stage {s + 1} "
                    f"received it as {grad.dtype} {list(grad.shape)} (its input gradient has that shape)"
                )

    def clear(self) -> None:
        self._reset()
        for stage in self.stages.values():
            stage.clear()


class _Label:
    """``record_function(str(action))`` for each action of a comm batch, only while profiling."""

    def __init__(self, profiling: bool, batch: Sequence[Action]) -> None:
        self._stack = contextlib.ExitStack() if profiling else None
        self._batch = batch

    def __enter__(self) -> None:
        if self._stack is not None:
            for action in self._batch:
                self._stack.enter_context(torch.profiler.record_function(str(action)))

    def __exit__(self, *exc: object) -> None:
        if self._stack is not None:
            self._stack.close()
