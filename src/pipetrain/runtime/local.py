"""LocalPipeline: every stage of a schedule in one process, no process group.

For debugging a split model or a hand-written CSV schedule on a laptop, and for fast tests. It
runs the same executor as the distributed runtime, one program per simulated rank, interleaved
in a dependency order: a rank runs until it needs data that has not been produced yet, then the
next rank gets its turn. Messages are handed over in memory, first in, first out per rank pair,
exactly as the distributed transport matches them, so a schedule that runs here runs there.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from typing import Any

import torch
from torch import nn

from pipetrain.errors import PipelineError
from pipetrain.microbatch import merge_chunks, split_args_kwargs_into_chunks, split_into_chunks, split_stage_kwargs
from pipetrain.plan import Schedule, ScheduleError, build_schedule
from pipetrain.plan.generators import family
from pipetrain.plan.lower import forwards_only
from pipetrain.plan.timeline import Timeline, TimelineEvent
from pipetrain.runtime import LossFn, _Program, prepare_schedule, require_autograd
from pipetrain.stage import PipelineStage
from pipetrain.transport import LocalTransport, RecvHandle, RecvItem, SendItem

__all__ = ["LocalPipeline"]


class _LocalComm:
    blocking = False  # a rank yields while its data has not arrived
    ahead = 0

    def __init__(self, rank: int, transport: LocalTransport) -> None:
        self.rank = rank
        self.transport = transport

    def post(self, items: list[SendItem | RecvItem]) -> list[RecvHandle]:
        handles = []
        for item in items:
            if isinstance(item, SendItem):
                self.transport.send(self.rank, item.peer, item.obj)
            else:
                handles.append(self.transport.recv(item.peer, self.rank, item.key, item.what))
        return handles

    def ready(self, handle: RecvHandle) -> bool:
        return handle.resolved

    def take(self, handle: RecvHandle) -> Any:
        value = handle.value
        handle.value = None
        return value

    def poll(self) -> None:
        pass

    def finish(self) -> None:
        pass


def _build(name: str, num_modules: int, n_microbatches: int, num_ranks: int | None) -> Schedule:
    fam = family(name)
    if num_ranks is None:
        candidates = [num_modules // 2] if fam.placement == "v" else [num_modules, num_modules // 2]
    else:
        candidates = [num_ranks]
    error: ScheduleError | None = None
    for ranks in candidates:
        if ranks < 1 or num_modules % ranks:
            continue
        try:
            return build_schedule(name, ranks, n_microbatches, num_modules // ranks)
        except ScheduleError as err:
            error = err
    if error is not None:
        raise PipelineError(f"LocalPipeline: cannot build {fam.name} for {num_modules} stages: {error}") from error
    raise PipelineError(f"LocalPipeline: {num_modules} stages do not divide over num_ranks={num_ranks}")


class LocalPipeline:
    """Run ``modules`` (one per stage, in order) with ``schedule`` (a name or a Schedule) in one process.

    ``step`` and ``eval`` behave as those of :class:`~pipetrain.runtime.PipelineScheduleRuntime`
    on all ranks at once: the merged output and the losses are those of the last stage, and each
    parameter's gradient is what distributed training would give.
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        schedule: str | Schedule,
        n_microbatches: int | None = None,
        loss_fn: LossFn | None = None,
        num_ranks: int | None = None,
        *,
        scale_grads: bool = True,
        args_chunk_spec: tuple[Any, ...] | None = None,
        kwargs_chunk_spec: dict[str, Any] | None = None,
        output_merge_spec: Any = None,
        device: torch.device | str = "cpu",
        lower_options: dict[str, Any] | None = None,
        backward_requires_autograd: bool = True,
    ) -> None:
        modules = list(modules)
        if not modules:
            raise PipelineError("LocalPipeline needs at least one module")
        if isinstance(schedule, str):
            if n_microbatches is None:
                raise PipelineError("LocalPipeline: n_microbatches is needed to build a schedule by name")
            schedule = _build(schedule, len(modules), n_microbatches, num_ranks)
        elif n_microbatches is not None and n_microbatches != schedule.num_microbatches:
            raise PipelineError(
                f"LocalPipeline: n_microbatches={n_microbatches} but the schedule has {schedule.num_microbatches}"
            )
        if schedule.num_stages != len(modules):
            raise PipelineError(
                f"LocalPipeline: the schedule has {schedule.num_stages} stages but {len(modules)} modules were given"
            )
        self.schedule = prepare_schedule(schedule, **dict(lower_options or {}))
        self.n_microbatches = self.schedule.num_microbatches
        self.num_ranks = self.schedule.num_ranks
        self.stages = [PipelineStage(m, i, len(modules), device) for i, m in enumerate(modules)]
        self.loss_fn = loss_fn
        self.scale_grads = scale_grads
        self.backward_requires_autograd = backward_requires_autograd  # False: step() may run under no_grad
        self._args_chunk_spec = args_chunk_spec
        self._kwargs_chunk_spec = kwargs_chunk_spec
        self._output_merge_spec = output_merge_spec
        self._eval_schedule: Schedule | None = None
        self._step_count = 0
        self.last_timeline: Timeline | None = None

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
        """One training step over all stages (forward only without ``loss_fn``); ``stage_kwargs``
        as in :meth:`PipelineScheduleRuntime.step`."""
        extra = (stage_kwargs, stage_kwargs_chunk_spec)
        if self.loss_fn is None:
            return self._run(
                self._forward_schedule(),
                args,
                kwargs,
                None,
                None,
                train=False,
                return_outputs=return_outputs,
                extra=extra,
            )
        if target is None:
            raise PipelineError("LocalPipeline.step: loss_fn is set but no target was given")
        train = self.schedule.has_backward
        if train and self.backward_requires_autograd:
            require_autograd("LocalPipeline.step")
        return self._run(
            self.schedule,
            args,
            kwargs,
            target,
            losses,
            train=train,
            return_outputs=return_outputs,
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
        """Forward only, without autograd; the merged output of the last stage (and with a
        ``target`` and a ``loss_fn``, each microbatch's loss in ``losses``)."""
        return self._run(
            self._forward_schedule(),
            args,
            kwargs,
            target,
            losses,
            train=False,
            return_outputs=return_outputs,
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
        *,
        train: bool,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        extra: tuple[Any, Any] = (None, None),
    ) -> Any:
        step_index = self._step_count
        self._step_count += 1
        n = self.n_microbatches
        a, k = split_args_kwargs_into_chunks(args, kwargs, n, self._args_chunk_spec, self._kwargs_chunk_spec)
        inputs = list(zip(a, k, strict=True))
        targets = split_into_chunks(target, n, None, "target") if target is not None else None
        stage_kwargs = split_stage_kwargs(extra[0], n, schedule.num_stages, range(schedule.num_stages), extra[1])
        transport = LocalTransport()
        programs = []
        for rank in range(schedule.num_ranks):
            held = {s: self.stages[s] for s in schedule.stages_of(rank)}
            programs.append(
                _Program(rank, held, schedule.stage_to_rank, schedule.num_stages, _LocalComm(rank, transport))
            )
        last_rank = schedule.stage_to_rank[schedule.num_stages - 1]
        first_rank = schedule.stage_to_rank[0]
        gens: dict[int, Generator[None, None, None]] = {}
        for rank, program in enumerate(programs):
            gens[rank] = program.run(
                schedule.actions[rank],
                step_index=step_index,
                inputs=inputs if rank == first_rank else None,
                targets=targets if rank == last_rank else None,
                loss_fn=self.loss_fn if targets is not None else None,
                loss_scale=1.0 / n if self.scale_grads else 1.0,
                train=train,
                keep_outputs=return_outputs,
                loss_kwargs=loss_kwargs,
                stage_kwargs={s: stage_kwargs[s] for s in schedule.stages_of(rank) if s in stage_kwargs},
            )
        t_start = time.perf_counter_ns()
        try:
            self._interleave(gens, programs, transport)
            last = programs[last_rank]
            if losses is not None and last.losses:
                losses.clear()
                losses.extend(last.losses[m] for m in sorted(last.losses))
            result = None
            if return_outputs and last.outputs:
                result = merge_chunks([last.outputs[m] for m in sorted(last.outputs)], self._output_merge_spec)
        finally:
            self.last_timeline = self._timeline(programs, schedule, step_index, t_start)
            for program in programs:
                program.clear()
        return result

    @staticmethod
    def _interleave(
        gens: dict[int, Generator[None, None, None]], programs: list[_Program], transport: LocalTransport
    ) -> None:
        live = dict(gens)
        while live:
            progressed = False
            for rank in list(live):
                before = (len(programs[rank].events), transport.pending())
                try:
                    next(live[rank])
                except StopIteration:
                    del live[rank]
                    progressed = True
                    continue
                except PipelineError:
                    raise
                except Exception as exc:
                    raise PipelineError(f"{programs[rank].where()}: {type(exc).__name__}: {exc}") from exc
                if (len(programs[rank].events), transport.pending()) != before:
                    progressed = True
            if not progressed:
                stuck = ", ".join(programs[r].where() for r in live)
                raise PipelineError(f"the schedule deadlocked: every remaining rank waits for data ({stuck})")

    def _timeline(self, programs: list[_Program], schedule: Schedule, step_index: int, t_start: int) -> Timeline:
        events = [
            TimelineEvent(
                p.rank, str(a), a.kind.value, a.stage, a.microbatch, (t0 - t_start) / 1e9, (t1 - t_start) / 1e9
            )
            for p in programs
            for a, t0, t1 in p.events
        ]
        return Timeline(
            schedule.num_ranks, events, title=f"{schedule.name} (local) step {step_index}", source="measured", unit="s"
        )
