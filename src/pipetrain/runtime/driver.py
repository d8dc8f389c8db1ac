"""The step driver shared by the distributed runtime and :class:`~pipetrain.runtime.local.LocalPipeline`.

``step`` and ``eval``, splitting inputs, targets and keyword arguments into microbatches,
finishing (losses, merged output) and the timeline are written once, here, for "the stages this
caller holds": one rank's on ``torch.distributed``, every stage in one process. A subclass only
says how a step executes (``_execute``) and what guards it (``_guard``), so a script debugged in
one process sees exactly what the ranks do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from pipetrain.errors import PipelineError
from pipetrain.microbatch import merge_chunks, requires_grad, split_args_kwargs_into_chunks, split_into_chunks
from pipetrain.microbatch import split_stage_kwargs as split_extra_kwargs
from pipetrain.plan import Action, ActionKind, Schedule
from pipetrain.plan.timeline import Timeline, TimelineEvent
from pipetrain.runtime.custom import CUSTOM_KINDS, CustomFunction
from pipetrain.runtime.executor import LossFn, RankExecutor, StepData
from pipetrain.runtime.prepare import Prepared, require_autograd

__all__ = ["StepDriver", "events_timeline"]

Events = list[tuple[int, Action, int, int]]  # (rank, action, start ns, end ns)


def events_timeline(events: Events, schedule: Schedule, title: str, origin_ns: int = 0) -> Timeline:
    """A measured timeline of ``events``, in seconds from ``origin_ns``."""
    return Timeline(
        schedule.num_ranks,
        [
            TimelineEvent(
                rank=r,
                action=str(a),
                kind=a.kind.value,
                stage=a.stage,
                microbatch=a.microbatch,
                start=(t0 - origin_ns) / 1e9,
                end=(t1 - origin_ns) / 1e9,
            )
            for r, a, t0, t1 in events
        ],
        title=title,
        source="measured",
        unit="s",
    )


def _first_tensor(values: Any) -> torch.Tensor | None:
    from torch.utils._pytree import tree_leaves

    return next((v for v in tree_leaves(values) if isinstance(v, torch.Tensor) and v.dim() > 0), None)


class StepDriver:
    """``step``/``eval`` over the stages a caller holds (``held``), for any way of executing them.

    Subclasses set the attributes of ``__init__``'s body (via :meth:`_setup`) and implement
    :meth:`_execute`; :meth:`_guard` wraps every step (failure reporting, agreement).
    """

    _loss_fn: LossFn | None
    scale_grads: bool
    backward_requires_autograd: bool
    n_microbatches: int
    _prepared: Prepared

    def _setup(
        self,
        loss_fn: LossFn | None,
        scale_grads: bool,
        args_chunk_spec: tuple[Any, ...] | None,
        kwargs_chunk_spec: dict[str, Any] | None,
        output_merge_spec: Any,
        backward_requires_autograd: bool,
    ) -> None:
        self._loss_fn = loss_fn
        self.scale_grads = scale_grads
        self._args_chunk_spec = args_chunk_spec
        self._kwargs_chunk_spec = kwargs_chunk_spec
        self._output_merge_spec = output_merge_spec
        # As in torch: False lets step() run under torch.no_grad() (a backward that needs no autograd).
        self.backward_requires_autograd = backward_requires_autograd
        self._eval_prepared: Prepared | None = None
        self._step_count = 0
        self._lower_options: dict[str, Any] = {}
        # Kept across a re-setup: torch's CSV route registers functions before _load_csv builds the runtime.
        self._custom: dict[ActionKind, CustomFunction] = self.__dict__.get("_custom", {})

    # ------------------------------------------------------------ to implement
    @property
    def _held(self) -> list[int]:
        """The stages this caller holds, sorted."""
        raise AttributeError("a StepDriver subclass says which stages it holds")

    def _where(self) -> str:
        """Where an error before or between actions happened (``rank r, step s``)."""
        return "pipeline"

    def _execute(self, prepared: Prepared, data: StepData) -> RankExecutor | None:
        """Run one step of ``prepared``; the executor holding the last stage (None if not held here)."""
        raise AttributeError("a StepDriver subclass says how a step executes")

    @contextlib.contextmanager
    def _guard(self, prepared: Prepared, step_index: int) -> Iterator[None]:
        yield

    def _settle_order(self, prepared: Prepared) -> Prepared:
        """The schedule to run, once the ranks settled on one order (runtime.sharing); ``prepared`` here."""
        return prepared

    # ------------------------------------------------------------ the schedule
    @property
    def schedule(self) -> Schedule:
        """The lowered schedule this driver runs, exactly (early receives included)."""
        return self._prepared.schedule

    @property
    def num_stages(self) -> int:
        return self._prepared.schedule.num_stages

    @property
    def has_first_stage(self) -> bool:
        return 0 in self._held

    @property
    def has_last_stage(self) -> bool:
        return self.num_stages - 1 in self._held

    def _forward_prepared(self) -> Prepared:
        if self._eval_prepared is None:
            self._eval_prepared = self._prepared.forwards(self._lower_options)
        return self._eval_prepared

    # ------------------------------------------------------------ running
    def register_custom_function(self, computation_type: Any, custom_function: CustomFunction) -> None:
        """Run ``custom_function(action, ctx)`` instead of pipetrain's own code for every action of
        ``computation_type`` (torch 2.13's hook and kinds: F, B, I, W, OVERLAP_F_B, UNSHARD,
        RESHARD, REDUCE_GRAD, as pipetrain's ``ActionKind``, torch's constants or their strings).

        ``ctx`` is a :class:`~pipetrain.runtime.custom.PipelineContext`: torch's fields
        (``schedule_ref``, ``arg_mbs``, ``kwarg_mbs``, ``target_mbs``, ``losses``), this rank's
        ``stages``, and the executor's hand-over of inputs and outputs, so the function computes
        while the executor still routes the data. As in torch, a later registration replaces an
        earlier one, and only top-level actions are replaced (an OVERLAP_F_B's parts are not).
        """
        try:
            kind = ActionKind(getattr(computation_type, "value", computation_type))
        except ValueError:
            kind = None
        if kind not in CUSTOM_KINDS:
            allowed = ", ".join(sorted(k.value for k in CUSTOM_KINDS))
            raise ValueError(f"register_custom_function: {computation_type!r} is not one of {allowed}")
        assert kind is not None
        if not callable(custom_function):
            raise TypeError(f"register_custom_function: {custom_function!r} is not callable")
        self.__dict__.setdefault("_custom", {})[kind] = custom_function

    def step(
        self,
        *args: Any,
        target: Any = None,
        losses: list[Any] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        stage_kwargs: dict[int, dict[str, Any]] | None = None,
        stage_kwargs_chunk_spec: dict[int, dict[str, Any]] | None = None,
        arg_mbs: Sequence[Any] | None = None,
        kwarg_mbs: Sequence[dict[str, Any]] | None = None,
        target_mbs: Sequence[Any] | None = None,
        finalize_gradients: bool = True,
        **kwargs: Any,
    ) -> Any:
        """One training step (forward only when there is no ``loss_fn``).

        Positional inputs go to stage 0; keyword arguments to every stage held here, split into
        microbatches (torch's rule: each rank passes, say, the attention mask its blocks take).
        ``target`` is given where the last stage is held, and only there. ``loss_kwargs`` go to
        every call of ``loss_fn``, as in torch. ``stage_kwargs`` (``{stage index: {name: value}}``,
        beyond torch) gives any held stage extra keyword inputs, split into microbatches like the
        first stage's (dim 0 unless ``stage_kwargs_chunk_spec`` says otherwise).

        Pre-split form (torchtitan's trainer): instead of the whole batch, ``arg_mbs`` (one tuple
        of positional inputs per microbatch, where stage 0 is held), ``kwarg_mbs`` (one dict per
        microbatch, for every held stage) and ``target_mbs`` (one target per microbatch, where the
        last stage is). Microbatches may differ in shape (packed documents of different lengths);
        the output, where asked for, is then the list of the microbatches' outputs.

        ``finalize_gradients`` (torch 2.15) is accepted either way: torch defers FSDP's reduction
        and resharding to the call that passes True; here every step reduces what it adds, so
        ``.grad`` after that call is the same, and readable after each call too.
        """
        del finalize_gradients
        batch = _Batch(args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs)
        extra = (stage_kwargs, stage_kwargs_chunk_spec)
        if self._loss_fn is None:
            return self._run(self._forward_prepared(), batch, None, return_outputs, False, None, extra)
        train = self._prepared.schedule.has_backward
        if train and self.backward_requires_autograd:
            require_autograd(f"{self._where()}: step()")
        # A forward-only schedule with a loss_fn computes losses (e.g. validation) without autograd.
        return self._run(self._prepared, batch, losses, return_outputs, train, loss_kwargs, extra)

    def eval(
        self,
        *args: Any,
        target: Any = None,
        losses: list[Any] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        stage_kwargs: dict[int, dict[str, Any]] | None = None,
        stage_kwargs_chunk_spec: dict[int, dict[str, Any]] | None = None,
        arg_mbs: Sequence[Any] | None = None,
        kwarg_mbs: Sequence[dict[str, Any]] | None = None,
        target_mbs: Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Forward only, without autograd, on any schedule; the merged output where the last stage is.

        With a ``target`` (where the last stage is held) and a ``loss_fn``, ``losses`` gets each
        microbatch's loss, as in torch. Keywords, ``stage_kwargs`` and the pre-split form
        (``arg_mbs``, ``kwarg_mbs``, ``target_mbs``) as in :meth:`step`.
        """
        batch = _Batch(args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs)
        extra = (stage_kwargs, stage_kwargs_chunk_spec)
        return self._run(self._forward_prepared(), batch, losses, return_outputs, False, loss_kwargs, extra)

    def _run(
        self,
        prepared: Prepared,
        batch: _Batch,
        losses: list[Any] | None,
        return_outputs: bool,
        train: bool,
        loss_kwargs: dict[str, Any] | None,
        extra: tuple[Any, Any],
    ) -> Any:
        prepared = self._settle_order(prepared)
        step_index = self._step_count
        self._step_count += 1
        with self._guard(prepared, step_index):
            if losses is not None and not isinstance(losses, list):
                raise PipelineError(
                    f"{self._where()}: losses must be a list (step fills it in place), got {type(losses).__name__}"
                )
            if batch.presplit:
                inputs, chunks, targets = self._presplit(batch, train)
                # Every microbatch's value of a keyword, for the checks of _stage_keywords.
                keywords: dict[str, Any] = {}
                for chunk in chunks or ():
                    for k, v in chunk.items():
                        keywords.setdefault(k, []).append(v)
            else:
                inputs = self._split_inputs(batch.args, batch.kwargs)
                targets = self._split_target(batch.target, train, batch.args, batch.kwargs)
                keywords, chunks = batch.kwargs, None
            data = StepData(
                step_index,
                train,
                return_outputs,
                inputs=inputs,
                targets=targets,
                loss_fn=self._loss_fn if targets is not None else None,
                loss_scale=1.0 / self.n_microbatches if self.scale_grads else 1.0,
                loss_kwargs=loss_kwargs or {},
                stage_kwargs=self._stage_keywords(keywords, inputs, extra, chunks),
                custom=self._custom,
                schedule_ref=self,
                kwarg_mbs=chunks if batch.presplit else ([k for _, k in inputs] if inputs is not None else None),
                user_losses=losses,
            )
            return self._finish(self._execute(prepared, data), losses, return_outputs, batch.presplit)

    def _presplit(
        self, batch: _Batch, train: bool
    ) -> tuple[list[tuple[tuple[Any, ...], dict[str, Any]]] | None, list[dict[str, Any]] | None, list[Any] | None]:
        """Check the pre-split form and give it as the executor takes it: (inputs, keywords, targets)."""
        where, n = self._where(), self.n_microbatches
        if batch.args or batch.kwargs or batch.target is not None:
            given = [
                w
                for w, v in (
                    ("positional inputs", batch.args),
                    ("keyword inputs", batch.kwargs),
                    ("target", batch.target),
                )
                if (v is not None if w == "target" else v)
            ]
            raise PipelineError(
                f"{where}: step() got both the pre-split form (arg_mbs/kwarg_mbs/target_mbs) and whole-batch "
                f"{' and '.join(given)}: give one or the other"
            )
        arg_mbs = _mb_list(batch.arg_mbs, "arg_mbs", n, where)
        kwarg_mbs = _mb_list(batch.kwarg_mbs, "kwarg_mbs", n, where)
        target_mbs = _mb_list(batch.target_mbs, "target_mbs", n, where)
        args_per_mb: list[tuple[Any, ...]] | None = None
        if arg_mbs is not None:
            args_per_mb = []
            for i, a in enumerate(arg_mbs):
                if isinstance(a, list):
                    a = tuple(a)
                elif not isinstance(a, tuple):
                    raise PipelineError(
                        f"{where}: arg_mbs[{i}] is a {type(a).__name__}; each item of arg_mbs is the tuple of one "
                        "microbatch's positional inputs, e.g. (tokens,)"
                    )
                args_per_mb.append(a)
        if kwarg_mbs is not None:
            for i, k in enumerate(kwarg_mbs):
                if not isinstance(k, dict):
                    raise PipelineError(
                        f"{where}: kwarg_mbs[{i}] is a {type(k).__name__}; each item of kwarg_mbs is the dict of "
                        "one microbatch's keyword inputs"
                    )
        chunks = list(kwarg_mbs) if kwarg_mbs is not None else None
        inputs = None
        if self.has_first_stage:
            if args_per_mb is None and chunks is None:
                raise PipelineError(f"{where}: holds stage 0 but step() was given no inputs (arg_mbs is None)")
            a_list = args_per_mb if args_per_mb is not None else [() for _ in range(n)]
            k_list = chunks if chunks is not None else [{} for _ in range(n)]
            inputs = list(zip(a_list, k_list, strict=True))
        targets = target_mbs if self._takes_target(target_mbs, train, "target_mbs") else None
        return inputs, chunks, targets

    def _takes_target(self, given: Any, train: bool, name: str) -> bool:
        """Whether this caller computes losses against ``given`` (``target`` or ``target_mbs``, the
        argument ``name``); an error where it is needed and missing. Off the last stage's rank a
        target is ignored, as torch does (and as inputs are off the first stage's): a script that
        passes it on every rank runs unchanged."""
        last = self.num_stages - 1
        if not self.has_last_stage:
            return False
        if self._loss_fn is None or (not train and given is None):
            return False
        if given is None:
            raise PipelineError(
                f"{self._where()}: holds the last stage ({last}) and loss_fn is set, but step() got no {name}"
            )
        return True

    def _split_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> list[tuple[tuple[Any, ...], dict[str, Any]]] | None:
        if not self.has_first_stage:
            return None
        if not args and not kwargs:
            raise PipelineError(f"{self._where()}: holds stage 0 but step() was given no inputs")
        a, k = split_args_kwargs_into_chunks(
            args, kwargs, self.n_microbatches, self._args_chunk_spec, self._kwargs_chunk_spec
        )
        return list(zip(a, k, strict=True))

    def _stage_keywords(
        self,
        kwargs: dict[str, Any],
        inputs: list[tuple[tuple[Any, ...], dict[str, Any]]] | None,
        extra: tuple[Any, Any],
        presplit: list[dict[str, Any]] | None = None,
    ) -> dict[int, list[dict[str, Any]]]:
        """Per stage held here (but stage 0, whose inputs carry them), the keyword inputs of each
        microbatch: ``step()``'s keyword arguments (or ``kwarg_mbs``, ``presplit``) go to every
        held stage, as in torch (an attention mask each block needs), and ``stage_kwargs`` to the
        stage it names."""
        n = self.n_microbatches
        per_stage = split_extra_kwargs(extra[0], n, self.num_stages, self._held, extra[1])
        later = [s for s in self._held if s != 0]
        if not kwargs or not later:
            return per_stage
        for name, value in kwargs.items():
            if requires_grad(value):
                raise PipelineError(
                    f"{self._where()}: keyword argument {name!r} requires grad, but step() also gives it to "
                    f"stage{'s' if len(later) > 1 else ''} {', '.join(map(str, later))}, whose keyword inputs get no "
                    "gradient (only the first stage's inputs do); detach it, or give it to stage 0 alone with "
                    "stage_kwargs={0: {...}}"
                )
        if presplit is not None:
            chunks = presplit
        elif inputs is not None:  # split once: the first stage's split has them
            chunks = [k for _, k in inputs]
        else:
            chunks = split_args_kwargs_into_chunks((), kwargs, n, None, self._kwargs_chunk_spec)[1]
        for s in later:
            own = per_stage.get(s)
            if own is None:
                per_stage[s] = chunks
                continue
            clash = sorted(own[0].keys() & kwargs.keys())
            if clash:
                raise PipelineError(
                    f"{self._where()}: stage {s} gets {clash} both from step()'s keyword arguments and from stage_kwargs"
                )
            per_stage[s] = [{**chunk, **mine} for chunk, mine in zip(chunks, own, strict=True)]
        return per_stage

    def _split_target(
        self, target: Any, train: bool, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> list[Any] | None:
        if not self._takes_target(target, train, "target"):
            return None
        self._check_batch(target, args, kwargs, self.num_stages - 1)
        return split_into_chunks(target, self.n_microbatches, None, "target")

    def _check_batch(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], last: int) -> None:
        """Where the input is here too and split by dim 0, the target's batch size must be the input's."""
        if not self.has_first_stage or self._args_chunk_spec is not None or self._kwargs_chunk_spec is not None:
            return
        x = _first_tensor((args, kwargs))
        if x is None or not isinstance(target, torch.Tensor) or target.dim() == 0 or target.shape[0] == x.shape[0]:
            return
        raise PipelineError(
            f"{self._where()}: the target has shape {list(target.shape)} but the input has shape {list(x.shape)}: "
            f"their batch sizes (dim 0) differ, and stage {last} computes each microbatch's loss against the "
            "matching slice of the target"
        )

    def _finish(
        self, last: RankExecutor | None, losses: list[Any] | None, want_output: bool, presplit: bool = False
    ) -> Any:
        if last is None:
            return None
        if losses is not None and last.losses:
            losses.clear()
            losses.extend(last.losses[m] for m in sorted(last.losses))
        if want_output and last.outputs:
            outputs = [last.outputs[m] for m in sorted(last.outputs)]
            # Pre-split microbatches may differ in shape: their outputs stay the caller's split.
            return outputs if presplit else merge_chunks(outputs, self._output_merge_spec)
        return None


class _Batch:
    """What one step()/eval() call was given: the whole batch, or the pre-split form."""

    __slots__ = ("arg_mbs", "args", "kwarg_mbs", "kwargs", "presplit", "target", "target_mbs")

    def __init__(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        target: Any,
        arg_mbs: Sequence[Any] | None,
        kwarg_mbs: Sequence[dict[str, Any]] | None,
        target_mbs: Sequence[Any] | None,
    ) -> None:
        self.args, self.kwargs, self.target = args, kwargs, target
        self.arg_mbs, self.kwarg_mbs, self.target_mbs = arg_mbs, kwarg_mbs, target_mbs
        self.presplit = arg_mbs is not None or kwarg_mbs is not None or target_mbs is not None


def _mb_list(value: Sequence[Any] | None, name: str, n: int, where: str) -> list[Any] | None:
    """``value`` as a list of one item per microbatch, or a clear error."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise PipelineError(f"{where}: {name} must be a list with one item per microbatch, got {type(value).__name__}")
    if len(value) != n:
        raise PipelineError(
            f"{where}: {name} has {len(value)} microbatch{'es' if len(value) != 1 else ''}, but this schedule "
            f"was built with n_microbatches={n}"
        )
    return list(value)
