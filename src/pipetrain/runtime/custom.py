"""torch 2.13's ``register_custom_function``: what a registered function receives.

Its own module because it is an API, not interpretation: the action under torch's field names
(:class:`CustomAction`) and the context (:class:`PipelineContext`) through which a function can
run a stage's computation while the executor still routes the data. The executor only calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pipetrain.errors import PipelineError
from pipetrain.plan import Action, ActionKind
from pipetrain.stage import PipelineStage

if TYPE_CHECKING:
    from pipetrain.runtime.executor import RankExecutor

__all__ = ["CUSTOM_KINDS", "CustomAction", "CustomFunction", "PipelineContext"]

_K = ActionKind


class CustomAction(Action):
    """An :class:`~pipetrain.plan.Action` also readable by torch's field names, as torch's
    ``_Action`` (``stage_index``, ``computation_type``, ``microbatch_index``): what a function
    registered with ``register_custom_function`` receives, written for torch or for pipetrain."""

    __slots__ = ()

    def __new__(
        cls,
        stage_index: int,
        computation_type: ActionKind,
        microbatch_index: int | None = None,
        sub_actions: tuple[Action, ...] | None = None,
    ) -> CustomAction:
        # torch's field names as keywords too: ``_Action(stage_index=0, computation_type=F, ...)``.
        return super().__new__(cls, stage_index, computation_type, microbatch_index, sub_actions)  # type: ignore[return-value]

    def __repr__(self) -> str:
        return str(self)  # torch's repr is the action string: ``2F0``

    @property
    def stage_index(self) -> int:
        return self.stage

    @property
    def computation_type(self) -> ActionKind:
        return self.kind

    @property
    def microbatch_index(self) -> int | None:
        return self.microbatch

    @staticmethod
    def from_str(text: str) -> CustomAction | None:
        """torch's ``_Action.from_str``: one action string, e.g. ``"2F0"``; a blank one is None
        (no action), as in torch's CSV reader."""
        action = Action.parse(text)
        return None if action is None else CustomAction.of(action)

    @staticmethod
    def of(action: Action) -> CustomAction:
        """``action`` (and its sub-actions) under torch's field names as well."""
        if isinstance(action, CustomAction):
            return action
        subs = None if action.sub_actions is None else tuple(CustomAction.of(a) for a in action.sub_actions)
        return CustomAction(action.stage, action.kind, action.microbatch, subs)


@dataclass
class PipelineContext:
    """What a custom function gets with its action (torch 2.13's ``_PipelineContext`` fields first).

    ``schedule_ref`` is the schedule running the step; ``arg_mbs``/``kwarg_mbs`` the step's
    inputs per microbatch (``arg_mbs`` where stage 0 is held), ``target_mbs`` its targets where
    the last stage is, ``losses`` the list ``step`` fills at its end. Beyond torch, ``stages``
    (this rank's, by index) and the executor's own plumbing, so a function can run a stage's
    computation itself through the stage's public methods: :meth:`forward_inputs` then
    ``stage.forward_one_chunk`` then :meth:`forward_done`; :meth:`backward_inputs` then
    ``stage.backward_one_chunk`` then :meth:`backward_done`; or :meth:`run` for pipetrain's own
    implementation of an action.
    """

    schedule_ref: Any
    arg_mbs: list[tuple[Any, ...]] | None = None
    kwarg_mbs: list[dict[str, Any]] | None = None
    target_mbs: list[Any] | None = None
    losses: list[Any] | None = None
    stages: dict[int, PipelineStage] = field(default_factory=dict)
    executor: RankExecutor | None = field(default=None, repr=False)

    def _ex(self) -> RankExecutor:
        if self.executor is None:
            raise PipelineError("this PipelineContext belongs to no running step")
        return self.executor

    def run(self, action: Action) -> None:
        """Perform ``action`` as pipetrain does (an OVERLAP_F_B's parts one after the other)."""
        self._ex()._perform(action)

    def forward_inputs(self, stage: int, mb: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The positional and keyword inputs of ``stage``'s forward of microbatch ``mb`` (taken: once)."""
        return self._ex()._forward_inputs(stage, mb)

    def forward_done(self, stage: int, mb: int, output: Any) -> None:
        """Hand ``stage``'s forward output of ``mb`` on (the next stage, a send, or the loss)."""
        self._ex()._forward_output(stage, mb, output)

    def backward_inputs(self, stage: int, mb: int) -> dict[str, Any]:
        """Keywords for ``stage.backward_one_chunk(mb, **kw, full=...)``: the loss or the output grads."""
        return self._ex()._backward_inputs(stage, mb)

    def backward_done(self, stage: int, mb: int, input_grads: list[torch.Tensor | None]) -> None:
        """Hand ``stage``'s input gradients of ``mb`` on to the previous stage."""
        self._ex()._backward_output(stage, mb, input_grads)


CustomFunction = Callable[[CustomAction, PipelineContext], None]
# The kinds torch 2.13 lets a function replace (communication stays the executor's).
CUSTOM_KINDS = frozenset({_K.F, _K.B, _K.I, _K.W, _K.OVERLAP_F_B, _K.UNSHARD, _K.RESHARD, _K.REDUCE_GRAD})
