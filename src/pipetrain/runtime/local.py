"""LocalPipeline: every stage of a schedule in one process, no process group.

For debugging a split model or a hand-written CSV schedule on a laptop, and for fast tests. It
runs the same executor as the distributed runtime, one program per simulated rank, interleaved
in a dependency order: a rank runs until it needs data that has not been produced yet, then the
next rank gets its turn. Messages are handed over in memory, first in, first out per rank pair,
exactly as the distributed transport matches them, so a schedule that runs here runs there.
``step`` and ``eval`` are the distributed runtime's (:class:`~pipetrain.runtime.driver.StepDriver`),
for a caller that holds every stage: keywords reach every stage, ``target`` goes to the last.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Generator, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from pipetrain.errors import PipelineError
from pipetrain.plan import Schedule, ScheduleError, build_schedule
from pipetrain.plan.generators import family
from pipetrain.plan.timeline import Timeline
from pipetrain.runtime.agreement import check_local
from pipetrain.runtime.driver import StepDriver, events_timeline
from pipetrain.runtime.executor import LossFn, RankExecutor, StepData
from pipetrain.runtime.prepare import Prepared, prepare_for
from pipetrain.runtime.transport.mailbox import LocalTransport
from pipetrain.runtime.transport.wire import RecvHandle, RecvItem, SendItem
from pipetrain.stage import PipelineStage

__all__ = ["LocalPipeline"]


class _LocalComm:
    blocking = False  # a rank yields while its data has not arrived

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

    def confirm(self, keys: list[tuple[str, int, int]]) -> None:
        pass  # messages are objects handed over in memory: nothing to wait for


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


class LocalPipeline(StepDriver):
    """Run ``modules`` (one per stage, in order) with ``schedule`` (a name or a Schedule) in one process.

    ``step`` and ``eval`` behave as those of :class:`~pipetrain.runtime.PipelineScheduleRuntime`
    on all ranks at once: the merged output and the losses are those of the last stage, and each
    parameter's gradient is what distributed training would give. The schedule is checked under
    gloo's matching model, which the in-process mailboxes follow (early receives included);
    ``validate(schedule)`` checks NCCL's stricter one.
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
        self._setup(
            loss_fn, scale_grads, args_chunk_spec, kwargs_chunk_spec, output_merge_spec, backward_requires_autograd
        )
        self.stages = [PipelineStage(m, i, len(modules), device) for i, m in enumerate(modules)]
        check_local(self.stages)  # modules cut by pipetrain.split: one cut, each at its place
        self._lower_options = dict(lower_options or {})
        # Its mailboxes pair a rank pair's messages in order and let each operation progress on its
        # own: gloo's matching model, early receives included.
        self._prepared = prepare_for(schedule, self._lower_options, self.stages, 0, 0, "gloo")
        self.n_microbatches = self.schedule.num_microbatches
        self.num_ranks = self.schedule.num_ranks
        self._transport = LocalTransport()
        self._executors = [
            RankExecutor(
                rank,
                {s: self.stages[s] for s in self.schedule.stages_of(rank)},
                self.schedule.stage_to_rank,
                self.num_stages,
                _LocalComm(rank, self._transport),
            )
            for rank in range(self.num_ranks)
        ]
        self._where_now = "LocalPipeline"
        self.last_timeline: Timeline | None = None

    @property
    def loss_fn(self) -> LossFn | None:
        return self._loss_fn

    @loss_fn.setter
    def loss_fn(self, value: LossFn | None) -> None:
        self._loss_fn = value

    @property
    def _held(self) -> list[int]:
        return list(range(len(self.stages)))

    def _where(self) -> str:
        return self._where_now

    @contextlib.contextmanager
    def _guard(self, prepared: Prepared, step_index: int) -> Iterator[None]:
        self._where_now = f"LocalPipeline, step {step_index}"
        for rank, executor in enumerate(self._executors):
            executor.begin(prepared.program(rank), step_index)
        t_start = time.perf_counter_ns()
        try:
            yield
        finally:
            events = [(e.rank, a, t0, t1) for e in self._executors for a, t0, t1 in e.events]
            title = f"{prepared.schedule.name} (local) step {step_index}"
            self.last_timeline = events_timeline(events, prepared.schedule, title, t_start)
            for executor in self._executors:
                executor.clear()
            self._transport.clear()  # what a failed step left in the mailboxes
            self._where_now = "LocalPipeline"

    def _execute(self, prepared: Prepared, data: StepData) -> RankExecutor | None:
        """Every rank's program, interleaved: a rank runs until it waits for data, then the next."""
        schedule = prepared.schedule
        first, last = schedule.stage_to_rank[0], schedule.stage_to_rank[schedule.num_stages - 1]
        gens: dict[int, Generator[None, None, None]] = {}
        for rank, executor in enumerate(self._executors):
            mine = dataclasses.replace(
                data,
                inputs=data.inputs if rank == first else None,
                targets=data.targets if rank == last else None,
                stage_kwargs={s: v for s, v in data.stage_kwargs.items() if s in executor.stages},
            )
            gens[rank] = executor.run(prepared.program(rank), mine)
        self._interleave(gens, self._executors, self._transport)
        return self._executors[last]

    @staticmethod
    def _interleave(
        gens: dict[int, Generator[None, None, None]], programs: list[RankExecutor], transport: LocalTransport
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
