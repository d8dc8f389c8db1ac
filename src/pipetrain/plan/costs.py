"""Cost model for the simulator: how long each kind of action takes and what it holds, per stage.

Durations are in any unit (the papers use "one forward = 1"). Each of ``f``, ``b``, ``i``, ``w``
and the byte sizes is a number or one number per stage, because first and last stages are often
heavier (embedding, loss head). A :class:`Costs` describes stages; :meth:`Costs.per_rank` makes
one that describes a rank's share of the model instead, which :func:`~pipetrain.plan.simulate`
and the planners cut into the stages each schedule puts on a rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from pipetrain.plan.actions import Action, ActionKind
from pipetrain.plan.errors import ScheduleError

if TYPE_CHECKING:
    from pipetrain.plan.schedule import Schedule

__all__ = ["Costs", "PerStage", "held_per_rank"]


def held_per_rank(schedule: Schedule) -> int:
    """V when every rank holds V stages (a rank's share is then cut into V), else 1: stages spread
    unevenly, or a rank holding none, take a rank's share per stage. One rule for ``simulate`` and
    every command that reads ``--costs``."""
    held = [len(schedule.stages_of(r)) for r in range(schedule.num_ranks)]
    return held[0] if held and min(held) == max(held) > 0 else 1


PerStage = float | Sequence[float]
"""A number used for every stage, or one number per stage."""

_DEFAULT = 1.0
_BYTES = (
    "activation_bytes",
    "weight_grad_bytes",
    "message_bytes",
    "static_bytes",
    "transient_bytes",
    "b_transient_bytes",
)
_PER_STAGE = ("f", "b", "i", "w", *_BYTES)
_SHARES = ("stage", "rank")
_SCALARS = ("comm", "overlap", "send", "recv", "unshard", "reshard", "reduce_grad", "action_overhead")
_DURATIONS = ("f", "b", "i", "w")


def _check(name: str, value: PerStage | None) -> PerStage | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise ScheduleError(f"cost {name} must be a number or a sequence of numbers, not {value!r}")
    if isinstance(value, int | float):
        if not math.isfinite(value) or value < 0:
            raise ScheduleError(f"cost {name} must be a finite number >= 0, got {value!r}")
        return float(value)
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ScheduleError(f"cost {name} must be a number or a sequence of numbers, not {value!r}")
    if not value:
        raise ScheduleError(f"cost {name}: an empty sequence gives no duration")
    out: list[float] = []
    for k, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int | float) or not math.isfinite(item) or item < 0:
            raise ScheduleError(f"cost {name}[{k}] must be a finite number >= 0, got {item!r}")
        out.append(float(item))
    return tuple(out)


def _check_stage_counts(costs: Costs) -> None:
    """Per-stage values given for several costs must agree on the number of stages."""
    counts = {
        ("bytes" if name == "activation_bytes" else name): len(v)
        for name in _PER_STAGE
        if isinstance(v := getattr(costs, name), tuple)
    }
    if len(set(counts.values())) > 1:
        each = ", ".join(f"{name} {count}" for name, count in counts.items())
        raise ScheduleError(f"per-stage costs disagree on the number of stages: {each} values")


def _check_share(share: str) -> None:
    if share not in _SHARES:
        raise ScheduleError(f"Costs share must be 'stage' (per-stage costs) or 'rank' (a rank's share), got {share!r}")


def _combine(a: PerStage, b: PerStage, op: str) -> PerStage:
    """Element-wise a + b, a - b or a / 2 (``b`` ignored) over numbers and per-stage tuples."""
    if isinstance(a, float) and isinstance(b, float):
        return {"+": a + b, "-": a - b, "/2": a / 2}[op]
    left = [a] if isinstance(a, float) else list(a)
    right = [b] if isinstance(b, float) else list(b)
    n = max(len(left), len(right))
    if len(left) not in (1, n) or len(right) not in (1, n):
        raise ScheduleError(f"per-stage costs have different lengths ({len(left)} and {len(right)})")
    left = left * n if len(left) == 1 else left
    right = right * n if len(right) == 1 else right
    return tuple({"+": x + y, "-": x - y, "/2": x / 2}[op] for x, y in zip(left, right, strict=True))


@dataclass(frozen=True)
class Costs:
    """Durations of actions and the latency of a message between ranks.

    ``f``, ``b`` (full backward), ``i`` (input-gradient backward) and ``w`` (weight-gradient
    backward) are numbers or per-stage sequences. Defaults follow the Zero Bubble paper's simple
    model: ``i`` and ``w`` default to half of ``b`` when ``b`` is given, else to ``f``; ``b``
    defaults to ``i + w``. ``comm`` is the time from the end of an action (or the post of its
    SEND) until its output is usable on another rank; stages on the same rank pass data for free.

    ``overlap`` (0..1) says how much of an ``OVERLAP_F_B`` pair runs concurrently: the pair takes
    ``sum - overlap * (sum - longest part)`` (0: one after the other, 1: as long as its longest
    part, DualPipe's ideal F&B). ``send``, ``recv``, ``unshard``, ``reshard`` and ``reduce_grad``
    are rank time spent on those actions (0: they are posted and run in the background).
    ``action_overhead`` is rank time a runtime spends on each compute action beyond the action
    itself (taking its inputs, bookkeeping): :meth:`per_stage` and :meth:`duration` add it to
    every F, B, I and W, so a simulation prices it as the runtime pays it (once per action, not
    per layer).
    Memory (bytes, per stage and microbatch unless said; docs/semantics.md, "Memory"):
    ``activation_bytes`` what a forward keeps for its backward (its output included), held from
    the start of F until its last backward ends; ``weight_grad_bytes`` what a split backward
    holds from the end of its I until its W ends instead (W's inputs and output gradients;
    default: the activation bytes); ``message_bytes`` the size of the stage's output
    (and of its gradient), which the simulator counts as message buffers from a RECV's post until
    its consumer is done and from a SEND's post until delivery; ``static_bytes`` what the stage
    holds for the whole step (parameters, gradients, optimizer state); ``transient_bytes`` what a
    compute action of the stage (F, I, W; B without ``b_transient_bytes``) allocates beyond that
    (a recomputed stage rebuilding its activations, a layer's workspace), counted while one of
    the stage's actions runs, on what the rank holds then; ``b_transient_bytes`` the same for a
    backward in one pass (B, and the B of an overlapped pair; default: ``transient_bytes``), whose
    temporaries can exceed its I's or its W's. With any of them the simulator reports peaks in
    bytes.

    ``share``: ``"stage"`` (the default) when plain numbers describe one stage, ``"rank"`` when
    they describe one rank's share of the model (:meth:`per_rank`); :meth:`for_schedule` turns
    the latter into per-stage costs for a given schedule. Per-stage sequences always describe
    stages as they are. Every function reads them alike (``simulate``, ``auto_schedule``,
    ``plan_schedule``); the command line's ``--costs`` is a rank's share.
    """

    f: PerStage = _DEFAULT
    b: PerStage | None = None
    i: PerStage | None = None
    w: PerStage | None = None
    comm: float = 0.0
    overlap: float = 0.0
    send: float = 0.0
    recv: float = 0.0
    unshard: float = 0.0
    reshard: float = 0.0
    reduce_grad: float = 0.0
    action_overhead: float = 0.0
    activation_bytes: PerStage | None = None
    weight_grad_bytes: PerStage | None = None
    message_bytes: PerStage | None = None
    static_bytes: PerStage | None = None
    transient_bytes: PerStage | None = None
    b_transient_bytes: PerStage | None = None
    share: str = "stage"

    def __post_init__(self) -> None:
        _check_share(self.share)
        for name in _PER_STAGE:
            object.__setattr__(self, name, _check(name, getattr(self, name)))
        if self.f is None:
            raise ScheduleError("cost f is required")
        _check_stage_counts(self)
        for name in _SCALARS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ScheduleError(f"cost {name} must be a finite number >= 0, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.overlap > 1:
            raise ScheduleError(
                f"cost overlap must lie in 0..1 (fraction of an F&B pair that overlaps), got {self.overlap}"
            )
        b, i, w = self.b, self.i, self.w
        if b is not None:
            if i is None and w is None:
                i = w = _combine(b, 0.0, "/2")
            elif i is None:
                assert w is not None
                i = _combine(b, w, "-")
            elif w is None:
                w = _combine(b, i, "-")
        else:
            i = self.f if i is None else i
            w = self.f if w is None else w
            b = _combine(i, w, "+")
        for name, value in (("i", i), ("w", w)):
            values = [value] if isinstance(value, float) else list(value)
            if min(values) < 0:
                raise ScheduleError(f"cost {name} comes out negative ({value}); give i and w that fit inside b")
        object.__setattr__(self, "b", b)
        object.__setattr__(self, "i", i)
        object.__setattr__(self, "w", w)

    # ------------------------------------------------------------ shares
    @classmethod
    def per_rank(cls, **values: Any) -> Costs:
        """Costs whose plain numbers are one rank's share of the model (``Costs(..., share="rank")``).

        A schedule with V stages per rank runs each stage in 1/V of them (durations, activation,
        static and transient bytes; a message between stages keeps its size). This is what the
        command line's ``--costs`` means, and what lets schedules with different stage counts be
        compared on one model.
        """
        return cls(**values, share="rank")

    @property
    def fixes_stages(self) -> bool:
        """Whether a per-stage sequence among the costs fixes the number of stages."""
        return any(isinstance(getattr(self, name), tuple) for name in _PER_STAGE)

    def cut_into(self, stages_per_rank: float) -> Costs:
        """Per-stage costs when a rank's share of the model is cut into ``stages_per_rank`` stages:
        plain f, b, i, w, activation, static and transient bytes divide by it (message sizes stay).

        Costs holding any per-stage sequence measure stages as they are: they are only marked
        per stage. The result always has ``share="stage"``.
        """
        if stages_per_rank == 1 or self.fixes_stages:
            return self if self.share == "stage" else replace(self, share="stage")

        def part(value: PerStage | None) -> PerStage | None:
            return value / stages_per_rank if isinstance(value, float) else value

        return replace(
            self,
            f=part(self.f) or 0.0,
            b=part(self.b),
            i=part(self.i),
            w=part(self.w),
            activation_bytes=part(self.activation_bytes),
            weight_grad_bytes=part(self.weight_grad_bytes),
            static_bytes=part(self.static_bytes),
            transient_bytes=part(self.transient_bytes),
            b_transient_bytes=part(self.b_transient_bytes),
            share="stage",
        )

    def for_layout(self, stages_per_rank: float) -> Costs:
        """These costs per stage of a layout with ``stages_per_rank`` stages on every rank:
        unchanged for per-stage costs, a rank's share cut into them (:meth:`cut_into`)."""
        return self if self.share == "stage" else self.cut_into(stages_per_rank)

    @property
    def in_bytes(self) -> bool:
        """Whether any byte cost is given: memory (and a memory limit) is then counted in bytes,
        else in stage activations."""
        return any(getattr(self, name) is not None for name in _BYTES)

    @property
    def prices_one_stage(self) -> bool:
        """Whether these are plain numbers for one stage (not a rank's share, not a sequence): the
        planners then count memory in one stage's activations, not a rank's share's."""
        return self.share == "stage" and not self.fixes_stages

    def for_schedule(self, schedule: Schedule) -> Costs:
        """These costs per stage of ``schedule``: unchanged for per-stage costs; a rank's share is
        cut into the stages each rank holds (V when every rank holds V, else one: stages spread
        unevenly take a rank's share each)."""
        return self if self.share == "stage" else self.cut_into(held_per_rank(schedule))

    # ------------------------------------------------------------ lookups

    def per_stage(self, name: str, num_stages: int) -> list[float]:
        """The cost ``name`` ("f", "b", "i", "w" or one of the byte sizes) as one value per stage;
        a duration includes ``action_overhead`` (what a runtime spends on the action beyond it)."""
        value = getattr(self, name)
        if value is None:
            raise ScheduleError(f"cost {name} is not set")
        extra = self.action_overhead if name in _DURATIONS else 0.0
        if isinstance(value, float):
            return [value + extra] * num_stages
        if len(value) != num_stages:
            raise ScheduleError(
                f"cost {name} gives {len(value)} per-stage values, but the schedule has {num_stages} stages"
            )
        return [v + extra for v in value]

    def transients(self, num_stages: int) -> tuple[list[float], list[float]] | None:
        """(F, I and W's, B's) transient bytes per stage: ``transient_bytes`` (0 when only
        ``b_transient_bytes`` is set) and ``b_transient_bytes`` (default: ``transient_bytes``);
        None when neither is set."""
        if self.transient_bytes is None and self.b_transient_bytes is None:
            return None
        plain = self.per_stage("transient_bytes", num_stages) if self.transient_bytes is not None else None
        b = self.per_stage("b_transient_bytes", num_stages) if self.b_transient_bytes is not None else plain
        assert b is not None
        return (plain if plain is not None else [0.0] * num_stages), b

    def duration(self, action: Action, num_stages: int) -> float:
        """Rank time of one action (OVERLAP_F_B per ``overlap``). Convenient, not fast."""
        kind = action.kind
        if kind is ActionKind.OVERLAP_F_B:
            parts = [self.duration(p, num_stages) for p in action.parts]
            return self.overlapped(parts)
        if kind.is_compute:
            return self.per_stage(kind.value.lower(), num_stages)[action.stage]
        if kind in (ActionKind.SEND_F, ActionKind.SEND_B):
            return self.send
        if kind in (ActionKind.RECV_F, ActionKind.RECV_B):
            return self.recv
        return float(getattr(self, kind.value.lower()))

    def overlapped(self, parts: Sequence[float]) -> float:
        """Duration of an OVERLAP_F_B whose parts alone take ``parts``."""
        total = sum(parts)
        return total - self.overlap * (total - max(parts, default=0.0))

    # ---------------------------------------------------------- text form
    @classmethod
    def parse(cls, text: str, share: str = "stage") -> Costs:
        """Read ``f=1,b=2,i=1,w=1,comm=0``; per-stage values separate with ``:`` (``f=2:1:1:2``).
        ``share``: what plain numbers describe (the command line's are a rank's share)."""
        known = {f.name for f in fields(cls)} - {"share"}
        aliases = {
            "bytes": "activation_bytes",
            "wbytes": "weight_grad_bytes",
            "msg": "message_bytes",
            "static": "static_bytes",
        }
        kwargs: dict[str, PerStage] = {}
        for item in text.split(","):
            item = item.strip()
            if not item:
                continue
            key, sep, raw = item.partition("=")
            key = aliases.get(key.strip().lower(), key.strip().lower())
            if not sep or key not in known:
                raise ScheduleError(
                    f"cannot read cost {item!r}: expected name=value with name one of {', '.join(sorted(known | set(aliases)))}"
                )
            try:
                values = [float(v) for v in raw.split(":")]
            except ValueError:
                raise ScheduleError(
                    f"cannot read cost {item!r}: {raw!r} is not a number (per-stage: 1:2:2:1)"
                ) from None
            if len(values) > 1 and key not in _PER_STAGE:
                raise ScheduleError(f"cost {key} takes one number, not per-stage values")
            kwargs[key] = values[0] if len(values) == 1 else tuple(values)
        return cls(**kwargs, share=share)  # type: ignore[arg-type]

    def __str__(self) -> str:
        def show(v: PerStage | None) -> str:
            if v is None:
                return ""
            if isinstance(v, float):
                return f"{v:g}"
            return ":".join(f"{x:g}" for x in v)

        parts = [
            f"f={show(self.f)}",
            f"b={show(self.b)}",
            f"i={show(self.i)}",
            f"w={show(self.w)}",
            f"comm={self.comm:g}",
        ]
        for name in _SCALARS[1:]:
            if getattr(self, name):
                parts.append(f"{name}={getattr(self, name):g}")
        for name, label in (
            ("activation_bytes", "bytes"),
            ("weight_grad_bytes", "wbytes"),
            ("message_bytes", "msg"),
            ("static_bytes", "static"),
            ("transient_bytes", "transient_bytes"),
            ("b_transient_bytes", "b_transient_bytes"),
        ):
            if getattr(self, name) is not None:
                parts.append(f"{label}={show(getattr(self, name))}")
        return ",".join(parts)
