"""torch.distributed.pipelining-compatible schedule classes.

Each class only chooses which :class:`~pipetrain.plan.Schedule` to build; all of them run on the
one executor, :class:`~pipetrain.runtime.PipelineScheduleRuntime`. Constructors take torch's
arguments ``(stage_or_stages, n_microbatches, loss_fn=None, args_chunk_spec=None,
kwargs_chunk_spec=None, output_merge_spec=None, scale_grads=True)`` and torch's keywords
``backward_requires_autograd``, ``defer_pp_recv`` and ``use_full_backward``, and torch 2.15's
``max_active_stages`` (FSDP stages gathered at once per rank: the lowering's ``max_unsharded``),
``unshard_lookahead``, ``defer_reduce_grad_wait`` and ``max_outstanding_sends`` (their defaults;
any other value is refused by name, see :func:`_torch_lowering`); extra keywords (``timeout``,
``poll_interval``, ``recv_ahead``, ``lower_options``) go to the runtime.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch.distributed as dist

from pipetrain._torch_lowering import (  # noqa: F401  (torch's private names, re-exported)
    _add_reduce_grad,
    _add_send_recv,
    _add_unshard_reshard,
    _batch_p2p,
    _defer_recv_ops,
    _format_pipeline_order,
    _merge_bw,
    _requires_reduce_grad,
    _simulate_comms_compute,
    _sorted_batch_p2p,
    _validate_schedule,
)
from pipetrain.errors import PipelineError
from pipetrain.liveness import PipelineActivationLiveness, analyze_pipeline_activation_liveness
from pipetrain.plan import Action, ActionKind, ScheduleError, build_schedule
from pipetrain.plan import Schedule as PlanSchedule
from pipetrain.plan.actions import parse_torch_wait
from pipetrain.plan.generators import ScheduleFamily, did_you_mean, family, schedule_names
from pipetrain.plan.passes.fsdp import DEFAULT_MAX_UNSHARDED
from pipetrain.runtime import LossFn, PipelineScheduleRuntime, announce_failure, read_torch_csv
from pipetrain.runtime.custom import CustomAction, PipelineContext
from pipetrain.runtime.data_parallel import default_lowering
from pipetrain.stage import PipelineStage

__all__ = [
    "BACKWARD_INPUT",
    "BACKWARD_WEIGHT",
    "FORWARD",
    "FULL_BACKWARD",
    "OVERLAP_F_B",
    "RECV_B",
    "RECV_F",
    "REDUCE_GRAD",
    "RESHARD",
    "SEND_B",
    "SEND_F",
    "UNSHARD",
    "PipelineActivationLiveness",
    "PipelineScheduleMulti",
    "PipelineScheduleSingle",
    "Schedule1F1B",
    "ScheduleDualPipeV",
    "ScheduleFlexibleInterleaved1F1B",
    "ScheduleForwardOnly",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleLoopedBFS",
    "ScheduleZBH1",
    "ScheduleZBH2",
    "ScheduleZBVZeroBubble",
    "analyze_pipeline_activation_liveness",
    "get_schedule_class",
]

# torch's names for the action kinds (``register_custom_function(OVERLAP_F_B, fn)``) and actions.
_ComputationType = ActionKind
FORWARD = ActionKind.F
FULL_BACKWARD = ActionKind.B
BACKWARD_INPUT = ActionKind.I
BACKWARD_WEIGHT = ActionKind.W
UNSHARD = ActionKind.UNSHARD
RESHARD = ActionKind.RESHARD
SEND_F = ActionKind.SEND_F
RECV_F = ActionKind.RECV_F
SEND_B = ActionKind.SEND_B
RECV_B = ActionKind.RECV_B
OVERLAP_F_B = ActionKind.OVERLAP_F_B
REDUCE_GRAD = ActionKind.REDUCE_GRAD
# torch's short names, left out of __all__ as torch does (a star import must not replace a user's F)
F, B, I, W = FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT  # noqa: E741
_Action = CustomAction
"""torch's action type: pipetrain's Action, also readable as ``stage_index``, ``computation_type``, ``microbatch_index``."""
_PipelineContext = PipelineContext
"""What a function registered with ``register_custom_function`` gets besides its action."""


def _wait_batch_p2p(work: Any) -> None:
    """torch's helper (torchtitan's custom functions import it): wait for each of a batch of
    ``torch.distributed`` works. pipetrain's context hands over data already waited for."""
    for w in work if isinstance(work, (list, tuple)) else [work]:
        w.wait()


_NOT_HERE = {
    "WAIT_SEND_F": "sends are waited for by the runtime itself, never by an action",
    "WAIT_SEND_B": "sends are waited for by the runtime itself, never by an action",
    "WAIT_REDUCE_GRAD": "its REDUCE_GRAD action finishes the reduction it starts",
}
"""torch 2.15's action kinds that pipetrain's schedules do not have, and why (see ``__getattr__``)."""


def _torch_lowering(
    name: str,
    stages: list[PipelineStage],
    options: dict[str, Any],
    max_active_stages: int,
    unshard_lookahead: Any,
    defer_reduce_grad_wait: bool,
    max_outstanding_sends: int | None,
) -> dict[str, Any]:
    """``options`` with torch 2.15's lowering keywords applied: ``max_active_stages`` is the FSDP
    pass's ``max_unsharded`` (the same cap on stages gathered at once per rank); the others are
    accepted at their defaults, and any other value is refused by name, since pipetrain's
    lowering plans those things its own way."""
    if isinstance(max_active_stages, bool) or not isinstance(max_active_stages, int) or max_active_stages < 1:
        raise ScheduleError(f"{name}: max_active_stages must be a positive integer, got {max_active_stages!r}")
    refused = []
    if unshard_lookahead != "full":
        refused.append(
            f"unshard_lookahead={unshard_lookahead!r} (pipetrain gathers each FSDP stage a fixed number of compute "
            "actions ahead of its use, within max_active_stages: lower_options={'fsdp': True, 'prefetch': k})"
        )
    if defer_reduce_grad_wait:
        refused.append(
            "defer_reduce_grad_wait=True (pipetrain's REDUCE_GRAD finishes its reduction; there is no "
            "WAIT_REDUCE_GRAD to defer)"
        )
    if max_outstanding_sends is not None:
        refused.append(
            f"max_outstanding_sends={max_outstanding_sends!r} (pipetrain's runtime waits for each send itself; "
            "there are no WAIT_SEND actions to budget)"
        )
    if refused:
        raise PipelineError(f"{name}: torch 2.15's " + "; ".join(refused) + " is not supported; leave it out")
    if max_active_stages == DEFAULT_MAX_UNSHARDED:
        return options
    given = options.get("lower_options")
    lowering = dict(default_lowering(stages) if given is None else given)
    if lowering.get("max_unsharded", max_active_stages) != max_active_stages:
        raise PipelineError(
            f"{name}: max_active_stages={max_active_stages} and lower_options' max_unsharded="
            f"{lowering['max_unsharded']} are the same setting; give one"
        )
    lowering["max_unsharded"] = max_active_stages
    return {**options, "lower_options": lowering}


class _NamedSchedule(PipelineScheduleRuntime):
    """A schedule chosen by name (``schedule_name``), built for this group's size and stages."""

    schedule_name: ClassVar[str] = ""
    one_stage_per_rank: ClassVar[bool] = False

    def __init__(
        self,
        stages: PipelineStage | Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: LossFn | None = None,
        args_chunk_spec: tuple[Any, ...] | None = None,
        kwargs_chunk_spec: dict[str, Any] | None = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
        max_active_stages: int = DEFAULT_MAX_UNSHARDED,
        unshard_lookahead: Any = "full",
        *,
        defer_reduce_grad_wait: bool = False,
        max_outstanding_sends: int | None = None,
        use_full_backward: bool | None = None,
        **options: Any,
    ) -> None:
        # torch's keywords with nothing to do here: use_full_backward is deprecated there, and the
        # runtime always waits for received data right before its use (what defer_pp_recv asks for).
        del use_full_backward, defer_pp_recv
        name = type(self).__name__
        stage_list = [stages] if isinstance(stages, PipelineStage) else list(stages)
        if not stage_list:
            raise PipelineError(f"{name} needs at least one PipelineStage")
        options = _torch_lowering(
            name,
            stage_list,
            options,
            max_active_stages,
            unshard_lookahead,
            defer_reduce_grad_wait,
            max_outstanding_sends,
        )
        # What the runtime is built from, kept while there is none yet (see _runtime_from).
        pending: dict[str, Any] = dict(
            stages=stage_list,
            loss_fn=loss_fn,
            scale_grads=scale_grads,
            args_chunk_spec=args_chunk_spec,
            kwargs_chunk_spec=kwargs_chunk_spec,
            output_merge_spec=output_merge_spec,
            backward_requires_autograd=backward_requires_autograd,
            **options,
        )
        if not self.schedule_name:
            # torch's CSV route: PipelineScheduleMulti(stages, n, loss_fn) then _load_csv(path).
            self._pending: dict[str, Any] | None = pending
            self.n_microbatches = n_microbatches
            return
        self._pending = None
        group = options.get("group", stage_list[0].group)
        if not dist.is_available() or not dist.is_initialized():
            self._plan_only(stage_list, n_microbatches, pending)
            return
        rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
        try:
            if self.one_stage_per_rank and len(stage_list) != 1:
                raise PipelineError(f"rank {rank}: {name} runs one stage per rank, got {len(stage_list)}")
            try:
                schedule = build_schedule(self.schedule_name, num_ranks, n_microbatches, len(stage_list))
            except ScheduleError as err:
                raise ScheduleError(f"rank {rank}: {name}: {err}") from err  # a ValueError, as torch's
        except PipelineError as err:
            # The other ranks learn of it at their first step instead of waiting for this rank.
            announce_failure(group, f"{err} (raised while building the schedule)")
            raise
        super().__init__(
            stage_list,
            schedule,
            loss_fn,
            scale_grads,
            args_chunk_spec,
            kwargs_chunk_spec,
            output_merge_spec,
            backward_requires_autograd=backward_requires_autograd,
            **options,
        )

    def _plan_only(self, stage_list: list[PipelineStage], n_microbatches: int, pending: dict[str, Any]) -> None:
        """No process group yet: the order alone, from the stages' ``group_size`` (as torch builds
        it; its visualiser and test doubles read ``pipeline_order`` this way). The runtime is
        made at the first step, once a group exists."""
        name = type(self).__name__
        try:
            num_ranks = stage_list[0].group_size
        except (RuntimeError, ValueError) as err:
            raise PipelineError(f"{name} needs an initialised torch.distributed process group") from err
        if self.one_stage_per_rank and len(stage_list) != 1:
            raise PipelineError(f"{name} runs one stage per rank, got {len(stage_list)}")
        schedule = build_schedule(self.schedule_name, num_ranks, n_microbatches, len(stage_list))
        if stage_list[0].num_stages != schedule.num_stages:
            raise ScheduleError(
                f"{name}: the stages say num_stages={stage_list[0].num_stages}, but {len(stage_list)} stage(s) "
                f"per rank on {num_ranks} ranks make {schedule.num_stages}"
            )
        self._pending = pending
        self.n_microbatches = n_microbatches
        self._adopt(schedule, name)  # (no group: kept for the first step)

    def _runtime_from(self, schedule: PlanSchedule) -> None:
        """Build the runtime now, from what ``__init__`` kept in ``_pending``."""
        args = dict(self._pending or {})
        stages, loss_fn, scale_grads = args.pop("stages"), args.pop("loss_fn"), args.pop("scale_grads")
        specs = args.pop("args_chunk_spec"), args.pop("kwargs_chunk_spec"), args.pop("output_merge_spec")
        PipelineScheduleRuntime.__init__(self, stages, schedule, loss_fn, scale_grads, *specs, **args)
        self._pending = None

    def _load_csv(self, filename: str, format: str = "compute_only") -> None:
        if self._pending is None:
            super()._load_csv(filename, format)
            return
        self._adopt(read_torch_csv(filename, format, self.n_microbatches), filename)

    def _prepare_schedule_with_comms(self, actions: dict[int, list[Any]], format: str = "compute_only") -> None:
        """torch's loader of a ``{rank: [action or None, ...]}`` order, what ``_load_csv`` reads
        from a file: compute actions only (lowered here) or, with ``format="compute_comms"``, with
        their SEND/RECV (torch 2.15's waits dropped, as a file's are)."""
        if format not in ("compute_only", "compute_comms"):
            raise ValueError(f"format must be 'compute_only' or 'compute_comms', got {format!r}")
        source = "_prepare_schedule_with_comms"
        rows = {
            r: [None if a is None else Action.parse(str(a)) for a in row if a is None or not parse_torch_wait(str(a))]
            for r, row in actions.items()
        }
        schedule = PlanSchedule(rows, num_microbatches=self.n_microbatches)
        if format == "compute_only" and schedule.is_lowered:
            raise PipelineError(f"{source}: the actions hold SEND/RECV; pass format='compute_comms'")
        if format == "compute_comms" and not schedule.is_lowered and schedule.num_ranks > 1:
            raise PipelineError(
                f"{source}: format='compute_comms' but the actions of {schedule.num_ranks} ranks hold no SEND/RECV; "
                "pass format='compute_only' to have them added"
            )
        if self._pending is not None:
            self._adopt(schedule, source)
        else:
            self._use_schedule(schedule, source)

    def _adopt(self, schedule: PlanSchedule, source: str) -> None:
        """Make the runtime for ``schedule`` (a file's, or a ``pipeline_order`` assigned), once it
        places this rank's stages where they are; without a process group yet, keep it for the
        first step."""
        pending = self._pending or {}
        stages = pending["stages"]
        if self.one_stage_per_rank and schedule.num_stages != schedule.num_ranks:
            raise PipelineError(
                f"{source} places {schedule.num_stages} stages on {schedule.num_ranks} ranks, but "
                f"{type(self).__name__} runs one stage per rank"
            )
        if not dist.is_available() or not dist.is_initialized():
            self._waiting = self._planned = schedule
            return
        self.__dict__.pop("_waiting", None)
        group = pending.get("group", stages[0].group)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        held = sorted(st.stage_index for st in stages)
        if schedule.num_ranks != world:
            raise PipelineError(
                f"rank {rank}: {source} is a schedule for {schedule.num_ranks} ranks, the group has {world}"
            )
        if sorted(schedule.stages_of(rank)) != held:
            # Checked here, before the runtime exists, so a wrong file can be swapped for the right one.
            raise PipelineError(
                f"rank {rank}: {source} places stages {schedule.stages_of(rank)} on this rank, but it holds {held}"
            )
        try:
            self._runtime_from(schedule)  # _pending cleared only now: a failed load can be retried with another file
        except PipelineError as err:
            err.args = (f"{source}: {err}",)  # (its type kept: a ScheduleError stays one)
            raise

    @property
    def pipeline_order(self) -> dict[int, list[Action | None]]:
        """Every rank's compute actions, step by step (torch's attribute; ``None`` is idle).
        Assignable, as in torch: a custom schedule class sets its compute-only order here
        (validated and lowered as a loaded CSV file is)."""
        return {r: list(a) for r, a in self._planned.actions.items()}

    @pipeline_order.setter
    def pipeline_order(self, order: dict[int, list[Any]]) -> None:
        rows = {r: [None if a is None else Action.parse(str(a)) for a in row] for r, row in order.items()}
        schedule = PlanSchedule(rows, num_microbatches=self.n_microbatches)
        if self._pending is not None:
            self._adopt(schedule, "pipeline_order")
        else:
            self._use_schedule(schedule, "pipeline_order")

    def __getattr__(self, name: str) -> Any:
        # Reached only for attributes that do not exist yet: those a loaded schedule would have.
        if self.__dict__.get("_waiting") is not None:
            raise AttributeError(
                f"{type(self).__name__}.{name} exists once a torch.distributed process group is initialised "
                "(the runtime is made at the first step; pipeline_order is there already)"
            )
        if self.__dict__.get("_pending") is not None:
            raise AttributeError(
                f"{type(self).__name__} names no schedule yet ({name!r} needs one): load one with _load_csv(path)"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _not_loaded(self) -> None:
        waiting = self.__dict__.get("_waiting")
        if self._pending is not None and waiting is not None:
            if not dist.is_available() or not dist.is_initialized():
                raise PipelineError(f"{type(self).__name__} needs an initialised torch.distributed process group")
            self._adopt(waiting, type(self).__name__)  # placement checked as for a loaded file
        if self._pending is not None:
            raise PipelineError(
                f"{type(self).__name__} names no schedule: load one with _load_csv(path) first, or use a "
                "concrete class (ScheduleInterleaved1F1B, ...) or PipelineScheduleRuntime(stages, schedule)"
            )

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """:meth:`PipelineScheduleRuntime.step`, once a schedule is there (see ``_load_csv``)."""
        self._not_loaded()
        return super().step(*args, **kwargs)

    def eval(self, *args: Any, **kwargs: Any) -> Any:
        """:meth:`PipelineScheduleRuntime.eval`, once a schedule is there (see ``_load_csv``)."""
        self._not_loaded()
        return super().eval(*args, **kwargs)

    def _initialize_stage(self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any = None) -> None:
        """torch's set-up before a first step, where torch runs the stages once to learn the
        shapes they exchange. pipetrain learns nothing that way (a message carries its shapes),
        so no module runs and no buffer changes: the ranks only settle on one order, as the
        first step would (every rank calls this, as in torch)."""
        del args, kwargs, target
        self._not_loaded()
        self._settle_order(self._prepared)


class PipelineScheduleMulti(_NamedSchedule):
    """A named schedule with any number of stages per rank (a list of this rank's stages).

    Built directly, it names no schedule: load one from torch's CSV format with ``_load_csv``, as
    with torch's ``PipelineScheduleMulti`` and ``_PipelineScheduleRuntime``.
    """

    def __init__(
        self,
        stages: PipelineStage | Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: LossFn | None = None,
        args_chunk_spec: tuple[Any, ...] | None = None,
        kwargs_chunk_spec: dict[str, Any] | None = None,
        output_merge_spec: Any = None,
        use_full_backward: bool | None = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        **options: Any,
    ) -> None:  # torch's positional order for this base class (its subclasses differ)
        super().__init__(
            stages,
            n_microbatches,
            loss_fn,
            args_chunk_spec,
            kwargs_chunk_spec,
            output_merge_spec,
            scale_grads,
            backward_requires_autograd,
            use_full_backward=use_full_backward,
            **options,
        )


_PipelineSchedule = PipelineScheduleRuntime
"""torch's base class of every schedule (torchtitan types its schedules with it): here the one runtime."""


class _PipelineScheduleRuntime(PipelineScheduleMulti):
    """torch's name for a multi-stage schedule that runs a CSV file (``_load_csv``)."""


class PipelineScheduleSingle(_NamedSchedule):
    """A named schedule with exactly one stage per rank (not a PipelineScheduleMulti, as in torch)."""

    one_stage_per_rank = True

    def __init__(
        self,
        stage: PipelineStage | Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: LossFn | None = None,
        args_chunk_spec: tuple[Any, ...] | None = None,
        kwargs_chunk_spec: dict[str, Any] | None = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        **options: Any,
    ) -> None:  # torch's positional order for one stage per rank
        super().__init__(
            stage,
            n_microbatches,
            loss_fn,
            args_chunk_spec,
            kwargs_chunk_spec,
            output_merge_spec,
            scale_grads,
            **options,
        )


class _NamedMulti(PipelineScheduleMulti):
    """The base of the concrete multi-stage classes, for torch's positional order of those (torch's
    ``PipelineScheduleMulti`` itself takes ``use_full_backward`` seventh)."""

    __init__ = _NamedSchedule.__init__


class ScheduleGPipe(PipelineScheduleSingle):
    """All forwards, then all backwards: the simplest order, holding every microbatch's activations."""

    schedule_name = "GPipe"


class Schedule1F1B(PipelineScheduleSingle):
    """One forward, one backward after warm-up: GPipe's bubble, at most ``num_stages`` microbatches held."""

    schedule_name = "1F1B"


class ScheduleZBH1(PipelineScheduleSingle):
    """1F1B with the backward split into I and W, the Ws filling the drain: 1F1B's memory, a third of its bubble."""

    schedule_name = "ZBH1"


class ScheduleZBH2(PipelineScheduleSingle):
    """ZB-H1 with more warm-up forwards, so the Ws fill the whole bubble: about twice 1F1B's memory."""

    schedule_name = "ZBH2"


class ScheduleInterleaved1F1B(_NamedMulti):
    """1F1B over several stages per rank placed in a loop: the bubble divided by the stages per rank."""

    schedule_name = "Interleaved1F1B"


ScheduleFlexibleInterleaved1F1B = ScheduleInterleaved1F1B


class ScheduleLoopedBFS(PipelineScheduleMulti):
    """Several stages per rank in a loop, each stage's microbatches run breadth first (all F, then all B)."""

    schedule_name = "LoopedBFS"

    def __init__(
        self,
        stages: PipelineStage | Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: LossFn | None = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
        max_active_stages: int = DEFAULT_MAX_UNSHARDED,
        unshard_lookahead: Any = "full",
        *,
        defer_reduce_grad_wait: bool = False,
        max_outstanding_sends: int | None = None,
        args_chunk_spec: tuple[Any, ...] | None = None,
        kwargs_chunk_spec: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:  # torch's positional order: LoopedBFS takes no chunk specs there
        _NamedSchedule.__init__(
            self,
            stages,
            n_microbatches,
            loss_fn,
            args_chunk_spec,
            kwargs_chunk_spec,
            output_merge_spec,
            scale_grads,
            backward_requires_autograd,
            defer_pp_recv,
            max_active_stages,
            unshard_lookahead,
            defer_reduce_grad_wait=defer_reduce_grad_wait,
            max_outstanding_sends=max_outstanding_sends,
            **options,
        )


class ScheduleInterleavedZeroBubble(_NamedMulti):
    """Interleaved 1F1B with split backwards whose Ws fill the warm-up and drain."""

    schedule_name = "InterleavedZeroBubble"


class ScheduleZBVZeroBubble(_NamedMulti):
    """Two stages per rank placed in a V, with split backwards: near-zero bubble at 1F1B's memory."""

    schedule_name = "ZBVZeroBubble"


class ScheduleDualPipeV(_NamedMulti):
    """DualPipe's V placement: two stages per rank whose forwards and backwards overlap in pairs."""

    schedule_name = "DualPipeV"


class ScheduleForwardOnly(_NamedMulti):
    """Forwards only (inference, validation): each stage runs every microbatch once."""

    schedule_name = "ForwardOnly"


# torch's own names beyond the families' (the base classes, the runtime, older aliases).
_CLASSES: dict[str, type[PipelineScheduleRuntime]] = {
    "pipelineschedulesingle": PipelineScheduleSingle,
    "pipelineschedulemulti": PipelineScheduleMulti,
    "pipelineScheduleRuntime".lower(): PipelineScheduleRuntime,
}


def _class_of(fam: ScheduleFamily) -> type[PipelineScheduleRuntime]:
    """The schedule class of a registered family: the one defined above under its class name,
    else one made here (single-stage when the family runs one stage per rank), so that a new
    schedule needs only its generator module."""
    cls = _CLASSES.get(fam.class_name.lower())
    if cls is not None:
        return cls
    defined = globals().get(fam.class_name)
    if isinstance(defined, type) and issubclass(defined, _NamedSchedule):
        cls = defined
    else:
        base = PipelineScheduleSingle if fam.stages_per_rank == 1 else _NamedMulti
        cls = type(fam.class_name, (base,), {"schedule_name": fam.name, "__module__": __name__})
        globals()[fam.class_name] = cls
    for key in (fam.name, *fam.aliases, fam.class_name, *(f"Schedule{a}" for a in fam.aliases)):
        _CLASSES[key.lower()] = cls
    return cls


for _name in schedule_names():
    _class_of(family(_name))


def __getattr__(name: str) -> Any:
    """``Schedule<Name>`` of a family registered after this module was imported; torch 2.15's
    action kinds pipetrain has no use for are named with the reason."""
    if name in _NOT_HERE:
        raise AttributeError(f"pipetrain has no {name} action (torch 2.15's): {_NOT_HERE[name]}")
    if name.startswith("Schedule"):
        for known in schedule_names():
            fam = family(known)
            if fam.class_name == name:
                return _class_of(fam)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_schedule_class(schedule_name: str) -> type[PipelineScheduleRuntime]:
    """The class for a schedule name, case-insensitively, with torch's names ("1F1B", "ZBVZeroBubble", ...)."""
    if not isinstance(schedule_name, str):
        raise ValueError(f"a schedule name must be a string, not {type(schedule_name).__name__}")
    cls = _CLASSES.get(schedule_name.strip().lower())
    if cls is not None:
        return cls
    try:
        return _class_of(family(schedule_name))  # a family registered since
    except ScheduleError:
        pass
    key = schedule_name.strip().lower()
    for known in schedule_names():
        if family(known).class_name.lower() == key:
            return _class_of(family(known))
    classes = [(family(known).class_name, family(known).class_name) for known in schedule_names()]
    raise ValueError(
        f"unknown schedule {schedule_name!r}{did_you_mean(schedule_name, classes)} "
        f"(known schedules: {', '.join(sorted(schedule_names()))})"
    )
