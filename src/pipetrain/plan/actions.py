"""Actions: the atoms of a schedule, written in torch.distributed.pipelining's grammar.

``2F0`` is stage 2's forward of microbatch 0, ``1SEND_F3`` sends stage 1's forward output of
microbatch 3, ``0UNSHARD`` gathers stage 0's parameters, ``(0F7;7B3)OVERLAP_F_B`` issues two
compute actions together (DualPipe's overlapped forward and backward).

torch 2.15's lowered CSV files also hold waits (``0WAIT_SEND_F3``, ``1WAIT_REDUCE_GRAD``): the
point where a rank completes an earlier send or gradient reduction. They are not actions here
(pipetrain's runtime completes its sends and reductions itself): :func:`parse_torch_wait` and
:func:`torch_wait` read and write them for the CSV files, which drop and place them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from enum import Enum
from typing import NamedTuple

from pipetrain.plan.errors import ScheduleError

__all__ = ["Action", "ActionKind"]


class ActionKind(str, Enum):
    """What an action does. The value is the token used in action strings."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the name is the token torch and the papers use
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"
    REDUCE_GRAD = "REDUCE_GRAD"
    OVERLAP_F_B = "OVERLAP_F_B"

    def __str__(self) -> str:
        return self.value

    @property
    def is_compute(self) -> bool:
        """F, B, I, W and OVERLAP_F_B: the actions that run the model."""
        return self in _COMPUTE

    @property
    def is_comm(self) -> bool:
        """Point-to-point sends and receives between ranks."""
        return self in _COMM

    @property
    def is_backward(self) -> bool:
        """B or I: the actions that produce the gradient sent to the previous stage."""
        return self is ActionKind.B or self is ActionKind.I

    @property
    def needs_microbatch(self) -> bool:
        return self in _WITH_MICROBATCH


_COMPUTE = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W, ActionKind.OVERLAP_F_B})
_COMM = frozenset({ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B})
_WITH_MICROBATCH = (_COMPUTE | _COMM) - {ActionKind.OVERLAP_F_B}

# Longest tokens first so that e.g. "SEND_F" is not read as "S" + junk.
_KIND_PATTERN = "|".join(
    sorted((k.value for k in ActionKind if k is not ActionKind.OVERLAP_F_B), key=len, reverse=True)
)
_SIMPLE_RE = re.compile(rf"([0-9]+)({_KIND_PATTERN})([0-9]*)")
_OVERLAP_SUFFIX = ")" + ActionKind.OVERLAP_F_B.value
_tuple_new: Callable[..., Action] = tuple.__new__


class _ActionFields(NamedTuple):
    stage: int
    kind: ActionKind
    microbatch: int | None = None
    sub_actions: tuple[Action, ...] | None = None


class Action(_ActionFields):
    """One step of one rank's program.

    ``microbatch`` is None for UNSHARD, RESHARD, REDUCE_GRAD and OVERLAP_F_B. An OVERLAP_F_B
    action carries its parts in ``sub_actions`` and takes the stage of its first part.

    An immutable tuple underneath: schedules hold hundreds of thousands of actions, and a tuple
    is built, hashed and compared in one C call each.
    """

    __slots__ = ()

    def __new__(
        cls,
        stage: int,
        kind: ActionKind,
        microbatch: int | None = None,
        sub_actions: tuple[Action, ...] | None = None,
    ) -> Action:
        self = _tuple_new(cls, (stage, kind, microbatch, sub_actions))
        # The full checks only off the common path (a plain action with a microbatch).
        if not (
            sub_actions is None
            and type(stage) is int
            and type(microbatch) is int
            and stage >= 0
            and microbatch >= 0
            and getattr(kind, "_takes_microbatch", False)
        ):
            self._check()
        return self

    def _check(self) -> None:
        if not isinstance(self.kind, ActionKind):
            raise ScheduleError(f"action kind must be an ActionKind, not {self.kind!r}")
        for label, value in (("stage", self.stage), ("microbatch", self.microbatch)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ScheduleError(f"action {label} must be an integer, not {value!r}")
        if self.stage < 0:
            raise ScheduleError(f"action {self._raw()}: stage must be >= 0")
        if self.kind is ActionKind.OVERLAP_F_B:
            subs = self.sub_actions
            if not subs or len(subs) < 2:
                raise ScheduleError("OVERLAP_F_B needs at least two sub-actions, e.g. (0F7;7B3)OVERLAP_F_B")
            for sub in subs:
                if not isinstance(sub, Action) or not sub.kind.is_compute or sub.kind is ActionKind.OVERLAP_F_B:
                    raise ScheduleError(f"OVERLAP_F_B may only hold F, B, I or W actions, not {sub}")
            if self.microbatch is not None:
                raise ScheduleError("OVERLAP_F_B takes no microbatch of its own")
            return
        if self.sub_actions is not None:
            raise ScheduleError(f"only OVERLAP_F_B carries sub-actions, not {self.kind.value}")
        if self.kind.needs_microbatch:
            if self.microbatch is None:
                raise ScheduleError(
                    f"action {self._raw()}: {self.kind.value} needs a microbatch, e.g. {self.stage}{self.kind.value}0"
                )
            if self.microbatch < 0:
                raise ScheduleError(f"action {self._raw()}: microbatch must be >= 0")
        elif self.microbatch is not None:
            raise ScheduleError(
                f"action {self._raw()}: {self.kind.value} takes no microbatch, write {self.stage}{self.kind.value}"
            )

    def _raw(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        return f"{self.stage}{self.kind.value}{mb}"

    def __str__(self) -> str:
        if self.sub_actions is not None:
            return "(" + ";".join(str(a) for a in self.sub_actions) + ")" + self.kind.value
        return self._raw()

    def __repr__(self) -> str:
        return f"Action({str(self)!r})"

    @property
    def parts(self) -> tuple[Action, ...]:
        """The compute actions this action performs: its sub-actions, or itself."""
        return self.sub_actions if self.sub_actions is not None else (self,)

    @staticmethod
    def overlap(*parts: Action) -> Action:
        """Build ``(a;b)OVERLAP_F_B`` from its compute parts."""
        if not parts:
            raise ScheduleError("OVERLAP_F_B needs at least two sub-actions")
        return Action(parts[0].stage, ActionKind.OVERLAP_F_B, None, tuple(parts))

    @staticmethod
    def parse(text: str) -> Action | None:
        """Read one action string strictly; an empty (or blank) cell is None.

        Unlike torch 2.13, trailing junk is an error: the whole string must match.
        """
        if not isinstance(text, str):
            raise ScheduleError(f"an action must be given as a string, not {type(text).__name__}")
        s = text.strip()
        if not s:
            return None
        if s.startswith("("):
            if not s.endswith(_OVERLAP_SUFFIX):
                raise ScheduleError(
                    f"cannot parse action {text!r}: expected '(<action>;<action>)OVERLAP_F_B', e.g. (0F7;7B3)OVERLAP_F_B"
                )
            inner = s[1 : -len(_OVERLAP_SUFFIX)]
            if "(" in inner or ")" in inner:
                raise ScheduleError(f"cannot parse action {text!r}: OVERLAP_F_B cannot be nested")
            parts: list[Action] = []
            for piece in inner.split(";"):
                sub = Action.parse(piece)
                if sub is None:
                    raise ScheduleError(f"cannot parse action {text!r}: empty sub-action in OVERLAP_F_B")
                parts.append(sub)
            if len(parts) < 2:
                raise ScheduleError(f"cannot parse action {text!r}: OVERLAP_F_B needs at least two sub-actions")
            return Action.overlap(*parts)
        match = _SIMPLE_RE.fullmatch(s)
        if match is None:
            if _WAIT in s and _WAIT_RE.fullmatch(s):
                raise ScheduleError(
                    f"cannot parse action {s!r}: torch 2.15's waits are not pipetrain actions; "
                    "a lowered CSV file may hold them (Schedule.from_csv drops them)"
                )
            raise ScheduleError(
                f"cannot parse action {_abridged(text)}: expected <stage><kind><microbatch> such as 2F0, 3I5, 1SEND_F3 "
                f"or 0UNSHARD, with kind one of {', '.join(k.value for k in ActionKind)}"
            )
        stage_text, kind_text, mb_text = match.groups()
        kind = ActionKind(kind_text)
        try:
            return Action(int(stage_text), kind, int(mb_text) if mb_text else None)
        except ScheduleError as err:
            raise ScheduleError(f"cannot parse action {text!r}: {err}") from None
        except ValueError:
            # int() refuses numbers of thousands of digits; no schedule has that many stages or microbatches.
            raise ScheduleError(
                f"cannot parse action {_abridged(s)}: its stage or microbatch number is too long"
            ) from None


_WAIT = "WAIT_"
_WAIT_RE = re.compile(r"([0-9]+)WAIT_(SEND_F|SEND_B|REDUCE_GRAD)([0-9]*)")
_WAIT_FORMS = "<stage>WAIT_SEND_F<microbatch>, <stage>WAIT_SEND_B<microbatch> or <stage>WAIT_REDUCE_GRAD"
_AWAITED = frozenset({ActionKind.SEND_F, ActionKind.SEND_B, ActionKind.REDUCE_GRAD})


def parse_torch_wait(text: str) -> Action | None:
    """The action that a torch 2.15 wait cell waits for (``0WAIT_SEND_F3``: ``0SEND_F3``,
    ``1WAIT_REDUCE_GRAD``: ``1REDUCE_GRAD``); None for a cell that is no wait (holds no "WAIT_").

    Strict like :meth:`Action.parse`: a malformed wait (``0WAIT_F3``, ``0WAIT_SEND_F``,
    ``1WAIT_REDUCE_GRAD2``) raises :class:`ScheduleError`.
    """
    if _WAIT not in text:
        return None
    s = text.strip()
    match = _WAIT_RE.fullmatch(s)
    if match is None:
        raise ScheduleError(f"cannot parse action {_abridged(text)}: torch's waits are written {_WAIT_FORMS}")
    stage_text, kind_text, mb_text = match.groups()
    kind = ActionKind(kind_text)
    if kind.needs_microbatch != bool(mb_text):
        needs = "needs a microbatch" if kind.needs_microbatch else "takes no microbatch"
        raise ScheduleError(f"cannot parse action {s!r}: {_WAIT}{kind.value} {needs}; torch's waits are {_WAIT_FORMS}")
    try:
        return Action(int(stage_text), kind, int(mb_text) if mb_text else None)
    except ValueError:  # a number of thousands of digits (see Action.parse)
        raise ScheduleError(f"cannot parse action {_abridged(s)}: its stage or microbatch number is too long") from None


def torch_wait(action: Action) -> str:
    """torch 2.15's wait cell for a SEND_F, SEND_B or REDUCE_GRAD action (``0SEND_F3``: ``0WAIT_SEND_F3``)."""
    if action.kind not in _AWAITED:
        raise ScheduleError(f"torch has no wait for {action}: only SEND_F, SEND_B and REDUCE_GRAD are awaited")
    return f"{action.stage}{_WAIT}{action.kind.value}{'' if action.microbatch is None else action.microbatch}"


def _abridged(text: str, limit: int = 40) -> str:
    """``repr`` of ``text``, cut in the middle when long, so an error message stays one short line."""
    if len(text) <= limit:
        return repr(text)
    return repr(text[: limit // 2]) + f"...({len(text)} characters)..." + repr(text[-8:])


for _kind in ActionKind:
    # A plain attribute read is much cheaper than hashing an enum member in the hot path.
    object.__setattr__(_kind, "_takes_microbatch", _kind in _WITH_MICROBATCH)


def make_action(stage: int, kind: ActionKind, microbatch: int | None = None) -> Action:
    """Build a plain action without checks: for passes that derive actions from checked ones.

    Hot loops bind :data:`new_action` and call ``new_action(Action, (stage, kind, mb, None))``
    directly, which saves this call.
    """
    return _tuple_new(Action, (stage, kind, microbatch, None))


new_action: Callable[[type[Action], tuple[int, ActionKind, int | None, None]], Action] = tuple.__new__
"""``new_action(Action, (stage, kind, microbatch, None))``: an unchecked plain action, one C call."""
