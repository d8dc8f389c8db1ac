"""The distributed driver: :class:`PipelineScheduleRuntime`, one rank of a pipeline on ``torch.distributed``."""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterator, Sequence
from datetime import timedelta
from types import FunctionType
from typing import Any

import torch.distributed as dist

from pipetrain.errors import PipelineError
from pipetrain.plan import Action, Schedule
from pipetrain.plan.timeline import Timeline, TimelineEvent
from pipetrain.runtime.agreement import agree_stages
from pipetrain.runtime.data_parallel import default_lowering, dp_kind, hold_grad_sync
from pipetrain.runtime.device_timing import DeviceClock, device_clock, on_device_times
from pipetrain.runtime.driver import Events, StepDriver, events_timeline
from pipetrain.runtime.executor import LossFn, RankExecutor, StepData
from pipetrain.runtime.failures import (
    DEAD_GROUPS,
    RemoteFailureError,
    StoreWait,
    agree,
    dead_group,
    failure_channel,
    refuse,
)
from pipetrain.runtime.prepare import Prepared, prepare_for, read_torch_csv, recv_window, torch_csv_has_waits
from pipetrain.runtime.sharing import rank0_order
from pipetrain.runtime.tied import TiedGrads
from pipetrain.runtime.transport.completion import Waiter
from pipetrain.runtime.transport.p2p import DistTransport
from pipetrain.runtime.transport.wire import RecvHandle, RecvItem, SendItem
from pipetrain.stage import PipelineStage

__all__ = ["PipelineScheduleRuntime"]


def _release_world_defaults() -> None:
    """Make ``torch.distributed.nn.functional`` hold no process group, as if imported before
    ``init_process_group``.

    Its functions take ``group=group.WORLD`` as a default, evaluated when the module is imported:
    imported after ``init_process_group`` (``torch.distributed.fsdp`` imports it, and the check for
    FSDP stages imports that when a schedule is built), they hold the default group for the life of
    the process. ``dist.destroy_process_group()`` then cannot end the group: it and its gloo threads
    live into interpreter finalization, where a gloo worker thread that drops the last reference to a
    collective's tensor needs the GIL and aborts the process ("terminate called without an active
    exception", issue 37). Imported before ``init_process_group`` the default is None, which those
    functions read as the default group when called: so None replaces any group held there.
    """
    module = sys.modules.get("torch.distributed.nn.functional")
    if module is None:
        return
    for fn in list(vars(module).values()):
        defaults = getattr(fn, "__defaults__", None) if isinstance(fn, FunctionType) else None
        if defaults and any(isinstance(v, dist.ProcessGroup) for v in defaults):
            fn.__defaults__ = tuple(None if isinstance(v, dist.ProcessGroup) else v for v in defaults)


class _DistComm:
    blocking = True  # take() waits; ready() is always true; poll() releases the sends completed

    def __init__(self, transport: DistTransport) -> None:
        self.transport = transport

    def post(self, items: list[SendItem | RecvItem]) -> list[RecvHandle]:
        return self.transport.post(items)

    def ready(self, handle: RecvHandle) -> bool:
        return True  # take() blocks

    def take(self, handle: RecvHandle) -> Any:
        return self.transport.wait(handle)

    def confirm(self, keys: list[tuple[str, int, int]]) -> None:
        self.transport.waiter.confirm(keys)

    def poll(self) -> None:
        waiter = self.transport.waiter
        waiter.release_sent()
        waiter.run_callbacks()


class PipelineScheduleRuntime(StepDriver):
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
        self._setup(
            loss_fn, scale_grads, args_chunk_spec, kwargs_chunk_spec, output_merge_spec, backward_requires_autograd
        )
        self.timeout = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        self.poll_interval = min(poll_interval, self.timeout)
        self.group = group if group is not None else self._stage_list[0].group
        self.rank, self.world = self._rank_and_world()
        self.stages = {st.stage_index: st for st in self._stage_list}
        self._dp_stages = [st for st in self._stage_list if dp_kind(st.submodule) is not None]
        self._tied: TiedGrads | None = None  # (found at the first training step: _tied_grads)
        self._tied_for: tuple[tuple[int, int], ...] | None = None
        # Data-parallel stages: one gradient reduction per step, FSDP gathers planned by the schedule.
        self._lower_options = dict(default_lowering(self._stage_list) if lower_options is None else lower_options)
        self._failure = failure_channel(self.group, self.rank)
        # Held weakly, as the transport holds it: dist.destroy_process_group() ends the group (and its
        # gloo threads) at once, even while this schedule lives on (see DistTransport._pg).
        self._group_ref = weakref.ref(self.group if self.group is not None else dist.group.WORLD)
        _release_world_defaults()
        story = DEAD_GROUPS.get(self._group_obj)
        if story is not None:
            self._refuse(f"rank {self.rank}: {dead_group(story)}")
            raise PipelineError(f"rank {self.rank}: {dead_group(story)}")
        told = self._failure.check() if self._failure is not None else None
        if told is not None:  # a peer refused the round this schedule's first step would be: this rank too
            self._refuse(told)
            raise RemoteFailureError(f"rank {self.rank}: not started because {told}")
        self._waiter = self._new_waiter()
        self._transport = DistTransport(self.group, self._stage_list[0].device, self._failure, self._waiter)
        # Early receives leave the matching alone only where it is per peer and tag (gloo).
        self._recv_ahead = 0 if self._transport.single_tag else recv_window(recv_ahead)
        self._matching = "nccl" if self._transport.single_tag else "gloo"
        self._planned = schedule  # as given (what _dump_csv writes in compute_only form)
        try:
            self._prepared = prepare_for(
                schedule, self._lower_options, self._stage_list, self.rank, self._recv_ahead, self._matching
            )
        except PipelineError as err:  # every rank refuses the same schedule, before any communication
            self._refuse(f"rank {self.rank} failed while building the runtime: {err}")
            raise
        self._executor = RankExecutor(
            self.rank, self.stages, self.schedule.stage_to_rank, self.num_stages, _DistComm(self._transport)
        )
        try:
            self._check_stages(self.schedule)
        except PipelineError as err:
            # The other ranks stop at their first step, waiting to agree (no message was sent). Without
            # a store there is no agreement: wake those waiting for this rank's messages instead.
            self._refuse(f"rank {self.rank} failed while building the runtime: {err}")
            if self._failure is None:
                self._executor.begin(self._prepared.program(self.rank), 0)
                self._transport.poison(self._executor.unsent())
            raise
        self.n_microbatches = self.schedule.num_microbatches
        self._order_settled = False  # whether the ranks settled on one order (see _settle_order)
        # (events, their device marks, the clock that reads them, step index, schedule)
        self._last: tuple[list[tuple[Action, int, int]], list[Any], DeviceClock | None, int, Schedule] | None = None
        self.device_timing = False
        """On a GPU, time each compute action of the next steps on the device (CUDA events) instead of
        its launch on the host, for ``last_timeline``: costs a synchronisation at each step's start and
        one when the timeline is read (see :mod:`pipetrain.runtime.device_timing`). No effect on the CPU."""

    @property
    def _group_obj(self) -> Any:
        """The pipeline's process group (None once destroyed)."""
        return self._group_ref()

    @property
    def _held(self) -> list[int]:
        return sorted(self.stages)

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
        return self.schedule.has_backward

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
            prepared = prepare_for(
                schedule, self._lower_options, self._stage_list, self.rank, self._recv_ahead, self._matching
            )
            self._check_stages(prepared.schedule)
        except PipelineError as err:
            raise PipelineError(f"{source}: {err}") from None
        # Every rank loads the same files in the same order: they agree afresh on the new schedule.
        self._planned, self._prepared, self._eval_prepared = schedule, prepared, None
        self._executor = RankExecutor(
            self.rank, self.stages, prepared.schedule.stage_to_rank, prepared.schedule.num_stages, self._executor.comm
        )

    def _dump_csv(self, filename: str, format: str = "compute_only") -> None:
        """Write this runtime's schedule in torch's CSV format (torch's method of the same name).

        ``compute_comms`` writes the lowered schedule without the gloo-only early receives, so
        the file runs on any backend (loading it on gloo moves them again), in the format of the
        installed torch: with torch 2.15's waits (WAIT_SEND_F, WAIT_SEND_B, WAIT_REDUCE_GRAD) from
        torch 2.15 on, without them before. pipetrain reads both.
        """
        if format not in ("compute_only", "compute_comms"):
            raise ValueError(f"format must be 'compute_only' or 'compute_comms', got {format!r}")
        if format == "compute_only":
            self._planned.to_csv(filename)
        else:
            self._prepared.base.to_csv(filename, torch_waits=torch_csv_has_waits())

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

    def _store_wait(self) -> StoreWait:
        return StoreWait(self._failure, self.timeout, self.poll_interval, self._where)

    def _report(self, message: str) -> None:
        if self._failure is not None:
            self._failure.report(message)

    def _refuse(self, message: str) -> None:
        """This schedule is refused before any message: stop the peers' next round, and only it."""
        if self._failure is not None:
            refuse(self._failure, message)

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

    # -------------------------------------------------------------- running
    def _where(self) -> str:
        return self._executor.where() if hasattr(self, "_executor") else f"rank {self.rank}"

    def _settle_order(self, prepared: Prepared) -> Prepared:
        """Before the first step of a planner's schedule (``Schedule.planned``), run rank 0's order
        where this rank planned another order of the same actions (runtime.sharing: timed searches
        run on every rank may differ). Other schedules are compared by the agreement only."""
        if self._order_settled:
            return prepared
        self._order_settled = True
        group = self._group_obj
        if not self._planned.planned or prepared.agreed or group is None or DEAD_GROUPS.get(group) is not None:
            return prepared
        try:
            theirs = rank0_order(self._store_wait(), self._planned, self.rank)
        except Exception as exc:
            self._report(str(exc))
            raise
        if theirs is None:
            return prepared
        forward = prepared is not self._prepared
        self._use_schedule(theirs, "rank 0's schedule")
        return self._forward_prepared() if forward else self._prepared

    @contextlib.contextmanager
    def _guard(self, prepared: Prepared, step_index: int) -> Iterator[None]:
        """Refuse a dead group; agree on a new schedule; turn any failure into every rank's error."""
        group = self._group_obj
        if group is None:
            raise PipelineError(
                f"rank {self.rank}: this schedule cannot run: its process group was destroyed "
                "(dist.destroy_process_group()); build the stages and the schedule on a live group"
            )
        story = DEAD_GROUPS.get(group)
        if story is not None:
            raise PipelineError(f"rank {self.rank}: this schedule cannot run: {dead_group(story)}")
        executor = self._executor
        executor.begin(prepared.program(self.rank), step_index)  # what a failure before the first action cancels
        first = not prepared.agreed
        if first:
            try:
                # Stages cut from one model must come from one cut (runtime.agreement).
                wait = self._store_wait()
                with agree_stages(wait, prepared.base, self._stage_list, self.rank):
                    agree(wait, prepared.base, self.rank)
            except Exception as exc:
                # Nothing was posted yet, so the group stays usable (no failure notice is sent: a
                # peer that did not get past its agreement would take it in its next round). Peers
                # past their agreement wait for this rank's messages: the round's story wakes them,
                # as they watch it throughout their first step (below).
                message = str(exc) if str(exc).startswith("rank ") else f"rank {self.rank}: {type(exc).__name__}: {exc}"
                self._report(message)
                executor.clear()
                if isinstance(exc, PipelineError):
                    raise
                raise PipelineError(message) from exc
            prepared.agreed = True
        # The agreed step: a neighbour may still fail in its agreement (after this rank read its
        # key) and send no notice, so receives poll the story while they wait (see Waiter.watch).
        self._waiter.watch = first
        failed = False
        try:
            yield
        except BaseException as exc:
            failed = True
            self._fail(executor, exc)
            raise AssertionError("unreachable") from exc  # _fail always raises
        finally:
            self._waiter.watch = False
            # A timeline is built on demand (steps stay cheap), device times read then. A failed
            # step keeps its host times: its stream may wait forever for a dead peer's data.
            clock = None if failed else executor.clock
            timed = executor.timed if clock is not None else []
            self._last = (executor.events, timed, clock, step_index, prepared.schedule)
            executor.clear()

    def _execute(self, prepared: Prepared, data: StepData) -> RankExecutor | None:
        if data.train:
            for st in self._dp_stages:
                hold_grad_sync(st)
        executor = self._executor
        executor.clock = device_clock(self._stage_list[0].device) if self.device_timing else None
        for _ in executor.run(prepared.program(self.rank), data):  # pragma: no cover - waits block instead
            pass
        self._transport.finish()
        if data.train:
            tied = self._tied_grads()
            if tied is not None:
                tied.sync()
        return executor if self.has_last_stage else None

    def _tied_grads(self) -> TiedGrads | None:
        """The exchange of the weights this rank's stages share with another rank's (runtime.tied),
        found once per placement."""
        placement = tuple(sorted(self.schedule.stage_to_rank.items()))
        if self._tied_for != placement:
            group = self._group_obj
            assert group is not None  # (_guard refused a destroyed group)
            self._tied = TiedGrads.of(self._stage_list, dict(placement), self.rank, group)
            self._tied_for = placement
        return self._tied

    def _fail(self, executor: RankExecutor, exc: BaseException) -> None:
        where = executor.where()
        remote = isinstance(exc, RemoteFailureError)
        if isinstance(exc, PipelineError):
            message = str(exc) if str(exc).startswith("rank ") else f"{where}: {exc}"
        else:
            message = f"{where}: {type(exc).__name__}: {exc}"
            if executor.action is not None and executor.action.kind.is_compute:
                message += self._transport.input_note(executor.action, self.schedule.stage_to_rank, self.rank)
        group = self._group_obj
        if group is not None:
            DEAD_GROUPS.setdefault(group, message)
        if not remote:
            self._report(message if message.startswith("rank ") else f"rank {self.rank}: {message}")
        # Wake whoever waits for a message of ours (after the report, so they can read it).
        self._transport.poison(executor.unsent())
        # Receives posted but not taken may still be in flight: keep them alive (see reset()).
        self._transport.park([*executor.recv_f.values(), *executor.recv_b.values()])
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
        if self._last is None:
            return None
        raw, timed, clock, step_index, schedule = self._last
        if clock is not None:
            raw = on_device_times(raw, timed, clock)
            self._last = (raw, [], None, step_index, schedule)  # read once
        events: Events = [(self.rank, a, t0, t1) for a, t0, t1 in raw]
        return events_timeline(events, schedule, f"{schedule.name} step {step_index}, rank {self.rank}")

    def gather_timeline(self) -> Timeline | None:
        """The last step's timeline of every rank (a collective: call it on all ranks), times from 0."""
        if self.last_timeline is None:
            return None
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, [e.to_dict() for e in self.last_timeline.events], group=self.group)
        events = [TimelineEvent.from_dict(e) for part in parts for e in part]
        merged = Timeline(self.world, events, self.last_timeline.title.split(",")[0], "measured", "s")
        return merged.shifted(-merged.start)
