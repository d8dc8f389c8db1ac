"""The one executor: runs a lowered :class:`~pipetrain.plan.Schedule` action by action.

Every schedule class is only a way to build a ``Schedule``; what happens at run time is decided
here once, for all of them. The executor makes no scheduling decision: it walks this rank's
program, posts sends and receives where the program says so (a run of consecutive SEND/RECV
actions is one batch), waits for received data only right before a compute action uses it, and
completes all sends by the end of the step. One exception, where operations match per peer and
tag (gloo): receives from a peer that sends this rank gradients are posted ahead of their place,
a few at a time, in program order (see ``_Program._early_receives`` and the runtime's
``recv_ahead``); that changes no matching and no wait.

``_Program`` holds one rank's per-step state and is written as a generator that yields whenever
it needs data that has not arrived. Over ``torch.distributed`` waiting blocks (so it never
yields); :class:`~pipetrain.local.LocalPipeline` interleaves the generators of all ranks in one
process instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
import weakref
from collections.abc import Callable, Generator, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map

from pipetrain.errors import PipelineError
from pipetrain.microbatch import (
    merge_chunks,
    requires_grad,
    split_args_kwargs_into_chunks,
    split_into_chunks,
    split_stage_kwargs,
)
from pipetrain.plan import Action, ActionKind, Schedule, ScheduleError
from pipetrain.plan.lower import forwards_only
from pipetrain.plan.timeline import Timeline, TimelineEvent
from pipetrain.stage import PipelineStage
from pipetrain.transport import (
    DistTransport,
    FailureChannel,
    RecvHandle,
    RecvItem,
    RemoteFailureError,
    SendItem,
    Waiter,
)

__all__ = ["PipelineScheduleRuntime", "announce_failure", "prepare_schedule", "require_autograd"]

LossFn = Callable[[Any, Any], torch.Tensor]
_K = ActionKind

# How many receives may be posted ahead of their place by default: each holds a buffer the size of
# its message, so a bound keeps that memory independent of the number of microbatches. Measured on
# 2 gloo ranks (benchmarks/runtime_vs_torch.py), 4 ahead was as fast as all of them at once.
DEFAULT_RECV_AHEAD = 4


def _recv_ahead(value: int | None) -> int:
    """The receive window: ``value``, else ``PIPETRAIN_RECV_AHEAD``, else :data:`DEFAULT_RECV_AHEAD`."""
    if value is None:
        env = os.environ.get("PIPETRAIN_RECV_AHEAD", "")
        if not env:
            return DEFAULT_RECV_AHEAD
        try:
            value = int(env)
        except ValueError:
            raise PipelineError(f"PIPETRAIN_RECV_AHEAD must be an integer >= 0, got {env!r}") from None
    if value < 0:
        raise PipelineError(f"recv_ahead (the receive window) must be >= 0, got {value}")
    return value


class Comm(Protocol):
    """What the executor needs from a transport (distributed or in-process).

    ``blocking``: ``take`` waits for the data itself (so the executor never yields). ``ahead``:
    how many receives may be posted ahead of their place in the program (0: none).
    """

    blocking: bool
    ahead: int

    def post(self, items: list[SendItem | RecvItem]) -> list[RecvHandle]: ...
    def ready(self, handle: RecvHandle) -> bool: ...
    def take(self, handle: RecvHandle) -> Any: ...
    def poll(self) -> None: ...
    def finish(self) -> None: ...


class _DistComm:
    blocking = True  # take() waits; ready() is always true and poll() has nothing to do mid-step

    def __init__(self, transport: DistTransport, recv_ahead: int | None = 0) -> None:
        self.transport = transport
        # Posting receives early leaves the matching alone only where it is per peer and tag (gloo).
        self.ahead = 0 if transport.single_tag else _recv_ahead(recv_ahead)

    def post(self, items: list[SendItem | RecvItem]) -> list[RecvHandle]:
        return self.transport.post(items)

    def ready(self, handle: RecvHandle) -> bool:
        return True  # take() blocks

    def take(self, handle: RecvHandle) -> Any:
        return self.transport.wait(handle)

    def poll(self) -> None:
        self.transport.waiter.run_callbacks()

    def finish(self) -> None:
        self.transport.finish()


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


_SEGMENTS: dict[int, tuple[Sequence[Action | None], list[tuple[int, int, list[Action]]]]] = {}


def _segments(program: Sequence[Action | None]) -> list[tuple[int, int, list[Action]]]:
    """``program`` cut into runs of SEND/RECV ``(start, end, actions)`` and compute actions
    ``(index, 0, [action])``, computed once per program rather than every step."""
    hit = _SEGMENTS.get(id(program))
    if hit is not None and hit[0] is program:
        return hit[1]
    out: list[tuple[int, int, list[Action]]] = []
    i, n = 0, len(program)
    while i < n:
        action = program[i]
        if action is None:
            i += 1
        elif action.kind.is_comm:
            j = i
            while j < n and (program[j] is None or program[j].kind.is_comm):  # type: ignore[union-attr]
                j += 1
            out.append((i, j, [a for a in program[i:j] if a is not None]))
            i = j
        else:
            out.append((i, 0, [action]))
            i += 1
    if len(_SEGMENTS) > 64:  # programs of discarded schedules
        _SEGMENTS.clear()
    _SEGMENTS[id(program)] = (program, out)
    return out


_SPLIT: dict[int, tuple[Sequence[Action | None], frozenset[int]]] = {}


def _split_stages(program: Sequence[Action | None]) -> frozenset[int]:
    """Stages whose backward ``program`` splits into I and W (cached per program): only their
    forwards need saved-tensor tracking (see ``PipelineStage.forward_one_chunk``)."""
    hit = _SPLIT.get(id(program))
    if hit is not None and hit[0] is program:
        return hit[1]
    split = frozenset(
        part.stage
        for action in program
        if action is not None
        for part in action.parts
        if part.kind is _K.I or part.kind is _K.W
    )
    if len(_SPLIT) > 64:
        _SPLIT.clear()
    _SPLIT[id(program)] = (program, split)
    return split


_PARTS: dict[int, tuple[Sequence[Action | None], list[tuple[list[Action], list[Action]]]]] = {}


def _comm_parts(
    program: Sequence[Action | None], stage_to_rank: dict[int, int]
) -> list[tuple[list[Action], list[Action]]]:
    """Per run of SEND/RECV actions of ``program``: the actions to post there, and the RECVs that
    may be posted ahead of it (cached per program).

    Receives are posted early per peer, all or none of a peer's, so their order per peer (which
    is what gloo matches by) never changes. Only peers that send this rank gradients get them:
    measured on 2 gloo ranks, posting a last stage's activation receives early as well made 1F1B
    about 1.9x slower, while early gradient receives made every schedule faster.
    """
    key = id(program)
    hit = _PARTS.get(key)
    if hit is not None and hit[0] is program:
        return hit[1]

    def peer(a: Action) -> int:
        return stage_to_rank[a.stage - 1] if a.kind is _K.RECV_F else stage_to_rank[a.stage + 1]

    recvs = [a for a in program if a is not None and (a.kind is _K.RECV_F or a.kind is _K.RECV_B)]
    early = {peer(a) for a in recvs if a.kind is _K.RECV_B}
    out = []
    for _, j, batch in _segments(program):
        if j:
            ahead = [a for a in batch if (a.kind is _K.RECV_F or a.kind is _K.RECV_B) and peer(a) in early]
            out.append(([a for a in batch if not any(a is b for b in ahead)], ahead))
    if len(_PARTS) > 64:
        _PARTS.clear()
    _PARTS[key] = (program, out)
    return out


class _Program:
    """One rank's program for one step: the per-microbatch state between actions."""

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
        self.program: Sequence[Action | None] = ()
        self.pos = 0
        self.step_index = -1
        self.events: list[tuple[Action, int, int]] = []
        self._reset()

    def _reset(self) -> None:
        self.inputs: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        self.targets: list[Any] | None = None
        self.fwd_local: dict[tuple[int, int], Any] = {}  # (stage, mb) -> input handed over in memory
        self.bwd_local: dict[tuple[int, int], Any] = {}  # (stage, mb) -> output grads handed over in memory
        self.to_send_f: dict[tuple[int, int], Any] = {}
        self.to_send_b: dict[tuple[int, int], Any] = {}
        self.recv_f: dict[tuple[int, int], RecvHandle] = {}
        self.recv_b: dict[tuple[int, int], RecvHandle] = {}
        self.out_specs: dict[tuple[int, int], list[tuple[torch.Size, torch.dtype]]] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, Any] = {}
        self.reduced: set[int] = set()
        self.stage_kwargs: dict[int, list[dict[str, Any]]] = {}  # stage -> per-microbatch extra keywords
        self.split: frozenset[int] = frozenset()  # stages whose backward this program splits (I, W)

    def where(self) -> str:
        action = "" if self.action is None else f", action {self.action}"
        return f"rank {self.rank}, step {self.step_index}{action}"

    # --------------------------------------------------------------- running
    def run(
        self,
        program: Sequence[Action | None],
        *,
        step_index: int,
        inputs: list[tuple[tuple[Any, ...], dict[str, Any]]] | None,
        targets: list[Any] | None,
        loss_fn: LossFn | None,
        loss_scale: float,
        train: bool,
        keep_outputs: bool,
        loss_kwargs: dict[str, Any] | None = None,
        stage_kwargs: dict[int, list[dict[str, Any]]] | None = None,
    ) -> Generator[None, None, None]:
        """Execute ``program``; yields while waiting for data (in-process mode only)."""
        self._reset()
        self.stage_kwargs = stage_kwargs or {}
        self.split = _split_stages(program)
        self.step_index = step_index
        self.events = []
        self.inputs = dict(enumerate(inputs)) if inputs is not None else {}
        self.targets = targets
        self.loss_fn = loss_fn
        self.loss_kwargs = loss_kwargs or {}
        self.loss_scale = loss_scale
        self.train = train
        self.keep_outputs = keep_outputs
        profiling = torch.autograd.profiler._is_profiler_enabled
        self.program = program
        self.pos = 0
        n = len(program)
        events = self.events
        clock = time.perf_counter_ns
        blocking = self.comm.blocking
        ahead = self.comm.ahead
        parts = _comm_parts(program, self.stage_to_rank) if ahead > 0 else []
        early: list[Action] = [a for _, recvs in parts for a in recvs]  # in program order
        if early:
            # Post the first `ahead` early receives now (see _early_receives).
            self._early_receives(early[:ahead], profiling)
        posted = min(ahead, len(early))  # early receives posted so far
        due = 0  # early receives whose place in the program has been reached
        part = 0
        for i, j, batch in _segments(program):
            action = batch[0]
            self.action = action
            self.pos = i
            if j:
                if parts:
                    # Post this run's other actions, and early receives up to `ahead` beyond
                    # those whose place is this run or earlier (this run's own are among them).
                    batch, own = parts[part]
                    part += 1
                    due += len(own)
                    target = min(due + ahead, len(early))
                    if target > posted:
                        batch = batch + early[posted:target]
                        posted = target
                    if not batch:
                        self.pos = j
                        continue
                t0 = clock()
                with _Label(profiling, batch):
                    self._post(batch)
                t1 = clock()
                events.extend((a, t0, t1) for a in batch)
                self.pos = j
                continue
            if not blocking:  # distributed waits block inside the action instead
                self.comm.poll()
                yield from self._wait_inputs(action)
            t0 = clock()
            # Grad mode is set per action, never across a yield (in-process ranks interleave).
            with torch.set_grad_enabled(train):
                if profiling:
                    with torch.profiler.record_function(str(action)):
                        self._compute(action)
                else:
                    self._compute(action)
            events.append((action, t0, clock()))
            self.pos = i + 1
        self.action = None
        if train and 0 in self.stages:
            self.stages[0].backward_into_inputs()
        self.pos = n

    def _early_receives(self, actions: list[Action], profiling: bool) -> None:
        """Post ``actions`` (RECVs, in program order) before the step's first action.

        A receive posted before the peer posts the matching send lets the data go out at once;
        posted where the program places it (often after the send), the data waits for a round
        trip (gloo sends once the receiver announced its buffer). Posting all of a peer's
        receives earlier, in the same order, changes no matching and no wait, so it is done only
        where operations match per peer and tag (gloo), never under order-only matching (NCCL).
        The price is memory: a buffer per early receive, from the moment it is posted; the
        runtime's ``recv_ahead`` bounds how many are posted ahead of their place.
        """
        if not actions:
            return
        self.action = actions[0]
        t0 = time.perf_counter_ns()
        with _Label(profiling, actions):
            self._post(actions)
        t1 = time.perf_counter_ns()
        self.events.extend((a, t0, t1) for a in actions)

    def unsent(self) -> list[tuple[tuple[str, int, int], int]]:
        """``(message key, peer)`` of the SEND actions this step has not posted yet."""
        out = []
        for action in self.program[self.pos :]:
            if action is None or action.microbatch is None:
                continue
            if action.kind is _K.SEND_F:
                out.append((("F", action.stage, action.microbatch), self.stage_to_rank[action.stage + 1]))
            elif action.kind is _K.SEND_B:
                out.append((("B", action.stage, action.microbatch), self.stage_to_rank[action.stage - 1]))
        return out

    def _wait_inputs(self, action: Action) -> Generator[None, None, None]:
        for part in action.parts:
            handle = None
            if part.kind is _K.F:
                handle = self.recv_f.get((part.stage, part.microbatch))  # type: ignore[arg-type]
            elif part.kind in (_K.B, _K.I):
                handle = self.recv_b.get((part.stage, part.microbatch))  # type: ignore[arg-type]
            if handle is not None:
                while not self.comm.ready(handle):
                    yield

    def _post(self, batch: list[Action]) -> None:
        items: list[SendItem | RecvItem] = []
        recvs: list[tuple[dict[tuple[int, int], RecvHandle], tuple[int, int]]] = []
        for action in batch:
            s, m = action.stage, action.microbatch
            assert m is not None
            kind = action.kind
            # No local keeps the sent object: once packed, a sent output may be freed (see free_output_storage).
            if kind is _K.SEND_F:
                stage = self.stages[s]
                done = (lambda st=stage, mb=m: st.free_output_storage(mb)) if self.train else None
                items.append(
                    SendItem(
                        ("F", s, m),
                        self.stage_to_rank[s + 1],
                        self._pop(self.to_send_f, (s, m), action, "no forward output to send (did F run?)"),
                        f"{action}",
                        done,
                    )
                )
            elif kind is _K.SEND_B:
                items.append(
                    SendItem(
                        ("B", s, m),
                        self.stage_to_rank[s - 1],
                        self._pop(self.to_send_b, (s, m), action, "no input gradient to send (did B or I run?)"),
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

    def _pop(self, table: dict[tuple[int, int], Any], key: tuple[int, int], action: Action, why: str) -> Any:
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
        kind = action.kind
        if kind is _K.OVERLAP_F_B:
            for part in action.parts:
                self._compute(part)
        elif kind is _K.F:
            self._forward(action.stage, action.microbatch)  # type: ignore[arg-type]
        elif kind is _K.B or kind is _K.I:
            self._backward(action.stage, action.microbatch, kind is _K.B)  # type: ignore[arg-type]
        elif kind is _K.W:
            self._stage(action.stage).backward_weight_one_chunk(action.microbatch)  # type: ignore[arg-type]
        elif kind is _K.UNSHARD:
            _unshard(self._stage(action.stage))
        elif kind is _K.RESHARD:
            _reshard(self._stage(action.stage))
        elif kind is _K.REDUCE_GRAD:
            _reduce_grad(self._stage(action.stage))
            self.reduced.add(action.stage)
        else:  # pragma: no cover - every kind is handled above
            raise PipelineError(f"{self.where()}: cannot execute {kind.value}")

    def _forward(self, s: int, m: int) -> None:
        stage = self._stage(s)
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
        extra = self.stage_kwargs.get(s)
        if extra is not None:
            kwargs = self._with_stage_kwargs(s, m, kwargs, extra[m])
        output = stage.forward_one_chunk(m, args, kwargs, track=s in self.split)
        if s == self.num_stages - 1:
            if self.loss_fn is not None:
                assert self.targets is not None
                target = self.targets[m]
                loss = (
                    self.loss_fn(output, target, **self.loss_kwargs)
                    if self.loss_kwargs
                    else self.loss_fn(output, target)
                )
                # Backward needs a scalar; eval keeps whatever loss_fn gives (per-sample losses, say), as torch does.
                if self.train and (not isinstance(loss, torch.Tensor) or loss.numel() != 1):
                    raise PipelineError(f"{self.where()}: loss_fn must return a scalar tensor, got {loss!r}")
                self.losses[m] = loss
            if self.keep_outputs:
                self.outputs[m] = _detach(output)
            return
        if self.train:
            self.out_specs[(s, m)] = _grad_specs(output)
        if self.stage_to_rank[s + 1] == self.rank:
            self.fwd_local[(s + 1, m)] = output
        else:
            self.to_send_f[(s, m)] = output

    def _with_stage_kwargs(self, s: int, m: int, kwargs: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
        clash = sorted(extra.keys() & kwargs.keys())
        if clash:
            given = "stage_kwargs" if s == 0 else "the keyword inputs given to step() (its keywords or stage_kwargs)"
            source = "step()'s keyword arguments" if s == 0 else f"stage {s - 1}'s output"
            raise PipelineError(
                f"{self.where()}: stage {s} microbatch {m} gets {clash} both from {given} and from {source}"
            )
        return {**kwargs, **extra}

    def _backward(self, s: int, m: int, full: bool) -> None:
        stage = self._stage(s)
        if s == self.num_stages - 1:
            loss = self.losses.get(m)
            if loss is None:
                raise PipelineError(
                    f"{self.where()}: no loss for microbatch {m} (a backward needs loss_fn and a target)"
                )
            self.losses[m] = loss.detach()
            grads = stage.backward_one_chunk(
                m, loss=loss * self.loss_scale if self.loss_scale != 1.0 else loss, full=full
            )
        else:
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
            grads = stage.backward_one_chunk(m, grad_outputs=list(grad_outputs), full=full)
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

    def __init__(self, profiling: bool, batch: list[Action]) -> None:
        self._stack = contextlib.ExitStack() if profiling else None
        self._batch = batch

    def __enter__(self) -> None:
        if self._stack is not None:
            for action in self._batch:
                self._stack.enter_context(torch.profiler.record_function(str(action)))

    def __exit__(self, *exc: object) -> None:
        if self._stack is not None:
            self._stack.close()


# ------------------------------------------------------------------- FSDP / DDP
def _dp_kind(module: torch.nn.Module) -> str | None:
    """ "fsdp" for an FSDP2 (fully_shard) module, "ddp" for DistributedDataParallel, else None."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, FSDPModule):
        return "fsdp"
    if isinstance(module, DistributedDataParallel):
        return "ddp"
    return None


def _unshard(stage: PipelineStage) -> None:
    if _dp_kind(stage.submodule) == "fsdp":
        stage.submodule.unshard()  # type: ignore[operator]


def _reshard(stage: PipelineStage) -> None:
    if _dp_kind(stage.submodule) == "fsdp":
        stage.submodule.reshard()  # type: ignore[operator]


def _hold_grad_sync(stage: PipelineStage) -> None:
    """Accumulate gradients locally over the microbatches: no data-parallel reduction per backward."""
    module: Any = stage.submodule
    kind = _dp_kind(module)
    if kind == "fsdp":
        module.set_is_last_backward(False)
        module.set_reshard_after_backward(False)
        module.set_requires_gradient_sync(False)
    elif kind == "ddp":
        module.require_backward_grad_sync = False


def _reduce_grad(stage: PipelineStage) -> None:
    """REDUCE_GRAD: the one data-parallel gradient reduction of the step for this stage."""
    module: Any = stage.submodule
    kind = _dp_kind(module)
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        module.set_is_last_backward(True)
        module.set_reshard_after_backward(True)
        module.set_requires_gradient_sync(True)
        state = fully_shard.state(module)  # type: ignore[attr-defined]
        for sub in state._state_ctx.all_states:
            for group in sub._fsdp_param_groups:
                group.post_backward()  # reduce-scatter what the microbatches accumulated
        state._root_post_backward_final_callback()
    elif kind == "ddp":
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        if grads:
            group = module.process_group
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group)
            flat /= dist.get_world_size(group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        module.require_backward_grad_sync = True


# ------------------------------------------------------------------- schedules
def read_torch_csv(filename: str, format: str, n_microbatches: int, where: str = "") -> Schedule:
    """A schedule file for ``_load_csv``: torch's CSV ``format`` ("compute_only" or
    "compute_comms", which must match whether it holds SEND/RECV), of ``n_microbatches``.
    ``where`` prefixes the errors (the rank)."""
    if format not in ("compute_only", "compute_comms"):
        raise ValueError(f"format must be 'compute_only' or 'compute_comms', got {format!r}")
    try:
        schedule = Schedule.from_csv(filename)
    except ScheduleError as err:
        raise PipelineError(f"{where}{err}") from None
    if (format == "compute_comms") != schedule.is_lowered:
        has = "holds" if schedule.is_lowered else "has no"
        raise PipelineError(
            f"{where}{filename} {has} SEND/RECV actions; load it with "
            f"format={'compute_comms' if schedule.is_lowered else 'compute_only'!r}"
        )
    if schedule.num_microbatches != n_microbatches:
        raise PipelineError(
            f"{where}{filename} is a schedule of {schedule.num_microbatches} microbatches, "
            f"but this schedule was built for n_microbatches={n_microbatches}"
        )
    return schedule


def prepare_schedule(schedule: Schedule, **lower_options: Any) -> Schedule:
    """Validate (before any communication) and lower a compute-only schedule; check a lowered one."""
    if not isinstance(schedule, Schedule):
        raise PipelineError(f"expected a pipetrain.plan.Schedule, got {type(schedule).__name__}")
    try:
        if schedule.is_lowered:
            schedule.validate()
            return schedule
        return schedule.lower(**lower_options)
    except ScheduleError as err:
        raise PipelineError(f"the schedule {schedule.name or ''} cannot run: {err}".replace("  ", " ")) from err


# ------------------------------------------------------------------- failures and agreement
def require_autograd(who: str) -> None:
    """A training step under ``torch.no_grad()`` is refused, as torch does (``eval`` runs forward only)."""
    if not torch.is_grad_enabled():
        raise PipelineError(
            f"{who} trains and needs autograd, but it was called under torch.no_grad(); call eval() to run forward only"
        )


def _failure_channel(group: dist.ProcessGroup | None, rank: int) -> FailureChannel | None:
    """The store where ranks of ``group`` leave the story of a failure (None without a default store)."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None
    return FailureChannel(store, _namespace(group), rank)


def _namespace(group: dist.ProcessGroup | None) -> str:
    group_obj = group if group is not None else dist.group.WORLD
    return str(getattr(group_obj, "group_name", "world"))


def _dead_group(story: str) -> str:
    return (
        f"the pipeline's process group already failed ({story}). Messages of the failed step may still be in "
        "flight on its connections, so it is not reused: build the stages on a new group (dist.new_group()) "
        "or restart the job"
    )


def announce_failure(group: dist.ProcessGroup | None, message: str) -> None:
    """Leave ``message`` as the group's failure story: for a rank that fails before its runtime
    exists (a schedule class refusing its arguments). The other ranks read it at their first step,
    while they wait for the ranks they exchange messages with (see ``_agree``)."""
    if dist.is_available() and dist.is_initialized():
        channel = _failure_channel(group, dist.get_rank(group))
        if channel is not None:
            channel.report(message)


_AGREEMENT: dict[str, list[int]] = {}  # per group namespace: how many first steps this process ran


def _neighbours(schedule: Schedule, rank: int) -> list[int]:
    """The ranks that exchange messages with ``rank`` under ``schedule`` (sorted)."""
    where = schedule.stage_to_rank
    out = set()
    for s, r in where.items():
        if r == rank:
            out.update(where[t] for t in (s - 1, s + 1) if t in where)
    out.discard(rank)
    return sorted(out)


def _summary(schedule: Schedule) -> str:
    return (
        f"{schedule.name or 'a custom schedule'} with {schedule.num_ranks} ranks, {schedule.num_stages} stages "
        f"and {schedule.num_microbatches} microbatches"
    )


def _messages_hash(schedule: Schedule, rank: int) -> str:
    """A digest of the SEND/RECV actions of ``rank``'s program, in order: what must match between
    neighbours (compute, FSDP and gradient-reduction actions may differ per rank)."""
    text = ",".join(str(a) for a in schedule.actions[rank] if a is not None and a.kind.is_comm)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


# Process groups on which a step failed in this process, with the story: no schedule object runs
# on them again (messages of the failed step may be in flight). Weak keys: a group name may be
# reused by a later group after destroy_process_group.
_DEAD_GROUPS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def _wait_keys(
    failure: FailureChannel, keys: list[str], timeout: float, poll: float, where: Callable[[], str]
) -> list[str]:
    """The values of ``keys`` once all are in the store; raises if a rank failed or after ``timeout``."""
    deadline = time.monotonic() + timeout
    store = failure.store
    pause = 0.0005  # doubled up to `poll`: peers usually arrive within milliseconds
    while keys and not store.check(keys):  # (store.wait would log a warning at each expiry)
        story = failure.check()
        if story is not None:
            raise RemoteFailureError(f"{where()}: stopped before the first step because {story}")
        if time.monotonic() > deadline:
            raise PipelineError(
                f"{where()}: timed out after {timeout:g} s waiting for ranks to start the schedule "
                "(no rank reported a failure)"
            )
        time.sleep(pause)
        pause = min(2 * pause, poll)
    return [bytes(store.get(k)).decode() for k in keys]


# ------------------------------------------------------------------- the runtime
class PipelineScheduleRuntime:
    """Run any :class:`~pipetrain.plan.Schedule` on this rank's ``stages`` over ``torch.distributed``.

    ``schedule`` may be compute-only (it is validated and lowered here, before any communication)
    or already lowered. ``step`` trains (forward, loss on the last stage, backward); ``eval``
    runs forward only, on every schedule. ``timeout`` bounds every wait for another rank; a failure
    on any rank makes every rank raise within about ``poll_interval`` seconds.

    ``recv_ahead`` (gloo only): how many receives from peers that send this rank gradients may be
    posted ahead of their place in the program. A receive posted before its send lets the data go
    out at once instead of after a round trip; each costs a buffer the size of its message from
    the moment it is posted. ``None``: the ``PIPETRAIN_RECV_AHEAD`` environment variable if set,
    else 4; ``0``: every receive where the program places it.
    """

    def __init__(
        self,
        stages: PipelineStage | Sequence[PipelineStage],
        schedule: Schedule,
        loss_fn: LossFn | None = None,
        scale_grads: bool = True,
        args_chunk_spec: tuple[Any, ...] | None = None,
        kwargs_chunk_spec: dict[str, Any] | None = None,
        output_merge_spec: Any = None,
        *,
        timeout: float | timedelta = 300.0,
        poll_interval: float = 0.05,
        group: dist.ProcessGroup | None = None,
        lower_options: dict[str, Any] | None = None,
        recv_ahead: int | None = None,
        backward_requires_autograd: bool = True,
    ) -> None:
        self._stage_list = [stages] if isinstance(stages, PipelineStage) else list(stages)
        if not self._stage_list:
            raise PipelineError("PipelineScheduleRuntime needs at least one PipelineStage")
        # As in torch: False lets step() run under torch.no_grad() (a backward that needs no autograd).
        self.backward_requires_autograd = backward_requires_autograd
        self._loss_fn = loss_fn
        self.scale_grads = scale_grads
        self._args_chunk_spec = args_chunk_spec
        self._kwargs_chunk_spec = kwargs_chunk_spec
        self._output_merge_spec = output_merge_spec
        self.timeout = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        self.poll_interval = min(poll_interval, self.timeout)
        self.group = group if group is not None else self._stage_list[0].group
        self.rank, self.world = self._rank_and_world()
        self.stages = {st.stage_index: st for st in self._stage_list}
        self._dp_stages = [st for st in self._stage_list if _dp_kind(st.submodule) is not None]
        if lower_options is None and self._dp_stages:
            # Data parallel stages: one gradient reduction per step, FSDP gathers planned by the schedule.
            fsdp = any(_dp_kind(st.submodule) == "fsdp" for st in self._dp_stages)
            lower_options = {"grad_reduce": True, "fsdp": fsdp}
        self._lower_options = dict(lower_options or {})
        self._failure = _failure_channel(self.group, self.rank)
        self._group_obj = self.group if self.group is not None else dist.group.WORLD
        story = _DEAD_GROUPS.get(self._group_obj)
        if story is None and self._failure is not None:
            story = self._failure.check()
        if story is not None:
            raise PipelineError(f"rank {self.rank}: {_dead_group(story)}")
        self._planned = schedule  # as given (what _dump_csv writes in compute_only form)
        try:
            self.schedule = prepare_schedule(schedule, **self._lower_options)
        except PipelineError as err:  # every rank refuses the same schedule, before any communication
            self._report(f"rank {self.rank} failed while building the runtime: {err}")
            raise
        try:
            self._check_stages(self.schedule)
        except PipelineError as err:
            # The other ranks will run their first step: wake those waiting for this rank's messages.
            self._report(f"rank {self.rank} failed while building the runtime: {err}")
            notices = DistTransport(self.group, self._stage_list[0].device, self._failure, self._new_waiter())
            first = _Program(
                self.rank, self.stages, self.schedule.stage_to_rank, self.schedule.num_stages, _DistComm(notices)
            )
            first.program = self.schedule.actions[self.rank]
            notices.poison(first.unsent())
            raise
        self.n_microbatches = self.schedule.num_microbatches
        self._forward_only = not self.schedule.has_backward
        self._eval_schedule: Schedule | None = None
        self._waiter = self._new_waiter()
        self._transport = DistTransport(self.group, self._stage_list[0].device, self._failure, self._waiter)
        self._program = _Program(
            self.rank,
            self.stages,
            self.schedule.stage_to_rank,
            self.schedule.num_stages,
            _DistComm(self._transport, recv_ahead),
        )
        self._step_count = 0
        self._last_events: tuple[list[tuple[Action, int, int]], int, Schedule] | None = None
        # The schedules the ranks have been checked to agree on, by id; held, so no id is reused.
        self._agreed: dict[int, Schedule] = {}

    # ------------------------------------------------- torch's names and CSV files
    @property
    def _stages(self) -> list[PipelineStage]:
        """This rank's stages (torch's attribute on multi-stage schedules)."""
        return self._stage_list

    @property
    def _stage(self) -> PipelineStage:
        """This rank's only stage (torch's attribute on single-stage schedules)."""
        return self._stage_list[0]

    @property
    def _n_microbatches(self) -> int:
        return self.n_microbatches

    @property
    def _num_stages(self) -> int:
        return self.schedule.num_stages

    @property
    def _has_backward(self) -> bool:
        return not self._forward_only

    @property
    def pp_group_size(self) -> int:
        return self.world

    @property
    def stage_index_to_group_rank(self) -> dict[int, int]:
        return dict(self.schedule.stage_to_rank)

    @property
    def pipeline_order(self) -> dict[int, list[Action | None]]:
        """Every rank's compute actions, step by step (torch's attribute; ``None`` is idle)."""
        return {r: list(a) for r, a in self._planned.actions.items()}

    @property
    def pipeline_order_with_comms(self) -> dict[int, list[Action | None]]:
        """Every rank's actions as this runtime runs them, SEND/RECV included."""
        return {r: list(a) for r, a in self.schedule.actions.items()}

    def _load_csv(self, filename: str, format: str = "compute_only") -> None:
        """Run the schedule in a CSV file in torch's format from now on (torch's method of the
        same name; ``pipetrain.plan.Schedule.from_csv`` reads the same files).

        ``format``: ``"compute_only"`` (F/B/I/W; SEND/RECV are added here) or ``"compute_comms"``
        (already holding them). The file must place this rank's stages where they are and have
        this runtime's number of microbatches; it is validated before anything runs.
        """
        self._use_schedule(read_torch_csv(filename, format, self.n_microbatches, f"rank {self.rank}: "), filename)

    def _use_schedule(self, schedule: Schedule, source: str) -> None:
        try:
            prepared = prepare_schedule(schedule, **self._lower_options)
            self._check_stages(prepared)
        except PipelineError as err:
            raise PipelineError(f"{source}: {err}") from None
        self._planned, self.schedule = schedule, prepared
        self._forward_only = not prepared.has_backward
        self._eval_schedule = None
        self._agreed.clear()  # every rank loads the same files in the same order: they agree afresh
        self._program = _Program(
            self.rank, self.stages, prepared.stage_to_rank, prepared.num_stages, self._program.comm
        )

    def _dump_csv(self, filename: str, format: str = "compute_only") -> None:
        """Write this runtime's schedule in torch's CSV format (torch's method of the same name)."""
        if format not in ("compute_only", "compute_comms"):
            raise ValueError(f"format must be 'compute_only' or 'compute_comms', got {format!r}")
        (self._planned if format == "compute_only" else self.schedule).to_csv(filename)

    # -------------------------------------------------------------- set-up
    def _rank_and_world(self) -> tuple[int, int]:
        if not dist.is_available() or not dist.is_initialized():
            raise PipelineError(
                "PipelineScheduleRuntime needs an initialised torch.distributed process group "
                "(torchrun or dist.init_process_group); use LocalPipeline to run all stages in one process"
            )
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    def _new_waiter(self) -> Waiter:
        return Waiter(self._failure, self.timeout, self.poll_interval, self._where)

    def _where(self) -> str:
        return self._program.where() if hasattr(self, "_program") else f"rank {self.rank}"

    def _report(self, message: str) -> None:
        if self._failure is not None:
            self._failure.report(message)

    def _check_stages(self, schedule: Schedule) -> None:
        if schedule.num_ranks != self.world:
            raise PipelineError(
                f"rank {self.rank}: the schedule has {schedule.num_ranks} ranks but the pipeline group has {self.world}"
            )
        expected = schedule.stages_of(self.rank)
        given = sorted(self.stages)
        if len(given) != len(self._stage_list):
            raise PipelineError(f"rank {self.rank}: two stages given with the same stage_index ({given})")
        if given != expected:
            raise PipelineError(
                f"rank {self.rank}: stages {given} were given, but the schedule {schedule.name!r} places stages "
                f"{expected} on this rank (placement {schedule.stage_to_rank})"
            )
        for st in self._stage_list:
            if st.num_stages != schedule.num_stages:
                raise PipelineError(
                    f"rank {self.rank}: stage {st.stage_index} was built with num_stages={st.num_stages}, "
                    f"but the schedule has {schedule.num_stages} stages"
                )

    def _agree(self, schedule: Schedule) -> None:
        """Check, before the first step of ``schedule``, that this rank's neighbours run the same one.

        Ranks that built different schedules (say, different ``n_microbatches``) would post
        operations that do not match: gloo then aborts the process on a size mismatch, or a rank
        waits forever. Each rank leaves in the store a summary of the schedule and a hash of its
        program's sends and receives; each checks its neighbours' against its own copy of the
        schedule. Once per schedule; skipped on a store that cannot hold keys.
        """
        failure = self._failure
        peers = _neighbours(schedule, self.rank)
        if failure is not None and peers:
            key = _AGREEMENT.setdefault(failure.namespace, [0])
            key[0] += 1  # the n-th first step on a group is collective, so every rank counts alike
            prefix = f"pipetrain/{failure.namespace}/plan/{key[0]}/"
            mine = _summary(schedule)
            # Sizes and messages must agree; names may not (the same CSV saved under two names).
            sizes = f"{schedule.num_ranks},{schedule.num_stages},{schedule.num_microbatches}"
            try:
                failure.store.set(f"{prefix}{self.rank}", f"{mine}#{sizes}#{_messages_hash(schedule, self.rank)}")
                ready = failure.store.check([f"{prefix}{self.rank}"])
            except Exception:  # a store without set/check (a fake backend's): nothing to compare with
                ready = False
            if not ready:
                self._agreed[id(schedule)] = schedule
                return
            theirs = _wait_keys(failure, [f"{prefix}{p}" for p in peers], self.timeout, self.poll_interval, self._where)
            for peer, value in zip(peers, theirs, strict=True):
                summary, their_sizes, digest = value.rsplit("#", 2)
                if their_sizes != sizes:
                    raise PipelineError(
                        f"{self._where()}: the ranks built different schedules: this rank runs {mine}, "
                        f"rank {peer} runs {summary}"
                    )
                if digest != _messages_hash(schedule, peer):
                    raise PipelineError(
                        f"{self._where()}: the ranks built different schedules: rank {peer}'s sends and receives "
                        f"differ from those this rank's schedule ({mine}) gives it"
                    )
        self._agreed[id(schedule)] = schedule

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stages

    @property
    def has_last_stage(self) -> bool:
        return self.schedule.num_stages - 1 in self.stages

    # -------------------------------------------------------------- running
    def step(
        self,
        *args: Any,
        target: Any = None,
        losses: list[Any] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        stage_kwargs: dict[int, dict[str, Any]] | None = None,
        stage_kwargs_chunk_spec: dict[int, dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> Any:
        """One training step (forward only when the runtime has no ``loss_fn``).

        Positional inputs go to stage 0; keyword arguments to every stage this rank holds, split
        into microbatches (torch's rule: each rank passes, say, the attention mask its blocks take).
        ``loss_kwargs`` go to every call of ``loss_fn``, as in torch. ``stage_kwargs``
        (``{stage index: {name: value}}``, beyond torch) gives any stage extra keyword inputs on
        the rank that holds it, split into microbatches like the first stage's (dim 0 unless
        ``stage_kwargs_chunk_spec`` says otherwise): data such as an attention mask that a later
        stage needs, without threading it through every stage's outputs.
        """
        extra = (stage_kwargs, stage_kwargs_chunk_spec)
        if self._loss_fn is None:
            return self._run(
                self._forward_schedule(), args, kwargs, None, None, return_outputs, train=False, extra=extra
            )
        train = not self._forward_only
        if train and self.backward_requires_autograd:
            require_autograd(f"rank {self.rank}: step()")
        # A forward-only schedule with a loss_fn computes losses (e.g. validation) without autograd.
        return self._run(
            self.schedule,
            args,
            kwargs,
            target,
            losses,
            return_outputs,
            train=train,
            loss_kwargs=loss_kwargs,
            extra=extra,
        )

    def eval(
        self,
        *args: Any,
        target: Any = None,
        losses: list[Any] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        stage_kwargs: dict[int, dict[str, Any]] | None = None,
        stage_kwargs_chunk_spec: dict[int, dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Forward only, without autograd, on any schedule; the merged output on the last rank.

        With a ``target`` (on the last stage's rank) and a ``loss_fn``, ``losses`` gets each
        microbatch's loss, as in torch. ``stage_kwargs`` as in :meth:`step`.
        """
        return self._run(
            self._forward_schedule(),
            args,
            kwargs,
            target,
            losses,
            return_outputs,
            train=False,
            loss_kwargs=loss_kwargs,
            extra=(stage_kwargs, stage_kwargs_chunk_spec),
        )

    def _forward_schedule(self) -> Schedule:
        if self._eval_schedule is None:
            self._eval_schedule = prepare_schedule(forwards_only(self.schedule))
        return self._eval_schedule

    def _run(
        self,
        schedule: Schedule,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        target: Any,
        losses: list[Any] | None,
        return_outputs: bool,
        *,
        train: bool,
        loss_kwargs: dict[str, Any] | None = None,
        extra: tuple[Any, Any] = (None, None),
    ) -> Any:
        dead = _DEAD_GROUPS.get(self._group_obj)
        if dead is not None:
            raise PipelineError(f"rank {self.rank}: this schedule cannot run: {_dead_group(dead)}")
        step_index = self._step_count
        self._step_count += 1
        program = self._program
        program.step_index = step_index
        program.action = None
        program.program = schedule.actions[self.rank]  # what a failure before the first action must cancel
        program.pos = 0
        program.events = []
        n = self.n_microbatches
        try:
            if id(schedule) not in self._agreed:
                self._agree(schedule)
            if losses is not None and not isinstance(losses, list):
                raise PipelineError(
                    f"rank {self.rank}: losses must be a list (step fills it in place), got {type(losses).__name__}"
                )
            inputs = self._split_inputs(args, kwargs)
            targets = self._split_target(target, train)
            stage_kwargs = self._stage_keywords(kwargs, inputs, extra)
            gen = program.run(
                schedule.actions[self.rank],
                step_index=step_index,
                inputs=inputs,
                targets=targets,
                loss_fn=self._loss_fn if targets is not None else None,
                loss_scale=1.0 / n if self.scale_grads else 1.0,
                train=train,
                keep_outputs=return_outputs,
                loss_kwargs=loss_kwargs,
                stage_kwargs=stage_kwargs,
            )
            if train:
                for st in self._dp_stages:
                    _hold_grad_sync(st)
            for _ in gen:  # pragma: no cover - distributed waits block instead of yielding
                pass
            self._transport.finish()
            if train:
                for st in self._dp_stages:  # a schedule lowered without REDUCE_GRAD still syncs once
                    if st.stage_index not in program.reduced:
                        _reduce_grad(st)
            else:
                for st in self._dp_stages:  # FSDP keeps a root module gathered after a forward; an
                    _reshard(st)  # optimizer step would then update shards the next step never reads
            result = self._finish(program, losses, return_outputs)
        except BaseException as exc:
            self._fail(program, exc)
            raise AssertionError("unreachable") from exc  # _fail always raises
        finally:
            self._last_events = (program.events, program.step_index, schedule)
            program.clear()
        return result

    def _split_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> list[tuple[tuple[Any, ...], dict[str, Any]]] | None:
        if not self.has_first_stage:
            return None
        if not args and not kwargs:
            raise PipelineError(f"{self._program.where()}: holds stage 0 but step() was given no inputs")
        a, k = split_args_kwargs_into_chunks(
            args, kwargs, self.n_microbatches, self._args_chunk_spec, self._kwargs_chunk_spec
        )
        return list(zip(a, k, strict=True))

    def _stage_keywords(
        self,
        kwargs: dict[str, Any],
        inputs: list[tuple[tuple[Any, ...], dict[str, Any]]] | None,
        extra: tuple[Any, Any],
    ) -> dict[int, list[dict[str, Any]]]:
        """Per stage held here (but stage 0, whose inputs carry them), the keyword inputs of each
        microbatch: ``step()``'s keyword arguments go to every stage of this rank, as in torch
        (an attention mask each block needs), and ``stage_kwargs`` to the stage it names."""
        n = self.n_microbatches
        per_stage = split_stage_kwargs(extra[0], n, self.schedule.num_stages, list(self.stages), extra[1])
        later = [s for s in self.stages if s != 0]
        if not kwargs or not later:
            return per_stage
        for name, value in kwargs.items():
            if requires_grad(value):
                raise PipelineError(
                    f"{self._program.where()}: keyword argument {name!r} requires grad, but step() also gives it to "
                    f"stage{'s' if len(later) > 1 else ''} {', '.join(map(str, later))}, whose keyword inputs get no "
                    "gradient (only the first stage's inputs do); detach it, or give it to stage 0 alone with "
                    "stage_kwargs={0: {...}}"
                )
        if inputs is not None:  # split once: the first stage's split has them
            chunks = [k for _, k in inputs]
        else:
            chunks = split_args_kwargs_into_chunks((), kwargs, n, None, self._kwargs_chunk_spec)[1]
        for s in later:
            own = per_stage.get(s)
            if own is not None:
                clash = sorted(own[0].keys() & kwargs.keys())
                if clash:
                    raise PipelineError(
                        f"{self._program.where()}: stage {s} gets {clash} both from step()'s keyword arguments "
                        "and from stage_kwargs"
                    )
                per_stage[s] = [{**chunk, **mine} for chunk, mine in zip(chunks, own, strict=True)]
            else:
                per_stage[s] = chunks
        return per_stage

    def _split_target(self, target: Any, train: bool) -> list[Any] | None:
        if not self.has_last_stage or self._loss_fn is None or (not train and target is None):
            return None
        if target is None:
            raise PipelineError(
                f"{self._program.where()}: holds the last stage ({self.schedule.num_stages - 1}) and loss_fn is "
                "set, but step() got no target"
            )
        return split_into_chunks(target, self.n_microbatches, None, "target")

    def _finish(self, program: _Program, losses: list[Any] | None, want_output: bool) -> Any:
        if not self.has_last_stage:
            return None
        if losses is not None and program.losses:
            losses.clear()
            losses.extend(program.losses[m] for m in sorted(program.losses))
        if want_output and program.outputs:
            return merge_chunks([program.outputs[m] for m in sorted(program.outputs)], self._output_merge_spec)
        return None

    def _fail(self, program: _Program, exc: BaseException) -> None:
        where = program.where()
        remote = isinstance(exc, RemoteFailureError)
        if isinstance(exc, PipelineError):
            message = str(exc) if str(exc).startswith("rank ") else f"{where}: {exc}"
        else:
            message = f"{where}: {type(exc).__name__}: {exc}"
            if program.action is not None and program.action.kind.is_compute:
                message += self._transport.input_note(program.action, self.schedule.stage_to_rank, self.rank)
        _DEAD_GROUPS.setdefault(self._group_obj, message)
        if not remote:
            self._report(message if message.startswith("rank ") else f"rank {self.rank}: {message}")
        # Wake whoever waits for a message of ours (after the report, so they can read it).
        self._transport.poison(program.unsent())
        # Receives posted but not taken may still be in flight: keep them alive (see reset()).
        self._transport.park([*program.recv_f.values(), *program.recv_b.values()])
        # Pending operations can never complete now: start afresh (the parked threads stay asleep).
        self._transport.reset()
        self._waiter.close()
        self._waiter = self._new_waiter()
        self._transport.waiter = self._waiter
        if isinstance(exc, PipelineError) and message == str(exc):
            raise exc
        raise PipelineError(message) from exc

    @property
    def last_timeline(self) -> Timeline | None:
        """When each action of the last step ran on this rank (built on demand: steps stay cheap)."""
        if self._last_events is None:
            return None
        events, step_index, schedule = self._last_events
        return self._timeline(events, step_index, schedule)

    def gather_timeline(self) -> Timeline | None:
        """The last step's timeline of every rank (a collective: call it on all ranks), times from 0."""
        if self.last_timeline is None:
            return None
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, [e.to_dict() for e in self.last_timeline.events], group=self.group)
        events = [TimelineEvent.from_dict(e) for part in parts for e in part]
        merged = Timeline(self.world, events, self.last_timeline.title.split(",")[0], "measured", "s")
        return merged.shifted(-merged.start)

    def _timeline(self, raw: list[tuple[Action, int, int]], step_index: int, schedule: Schedule) -> Timeline:
        events = [
            TimelineEvent(
                rank=self.rank,
                action=str(a),
                kind=a.kind.value,
                stage=a.stage,
                microbatch=a.microbatch,
                start=t0 / 1e9,
                end=t1 / 1e9,
            )
            for a, t0, t1 in raw
        ]
        return Timeline(
            schedule.num_ranks,
            events,
            title=f"{schedule.name} step {step_index}, rank {self.rank}",
            source="measured",
            unit="s",
        )
