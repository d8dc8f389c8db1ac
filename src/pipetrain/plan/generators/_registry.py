"""The registry behind ``build_schedule`` and ``schedule_names``."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pipetrain.plan._graph import gc_paused
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.schedule import Schedule

Builder = Callable[[int, int, int | None], Schedule]
"""``builder(num_ranks, num_microbatches, stages_per_rank)`` -> compute-only Schedule."""


@dataclass(frozen=True)
class ScheduleFamily:
    """A named generator. ``placement`` is "loop" or "v"; ``split_backward`` means it emits I and W.

    What the runtime derives its schedule class from (``pipetrain.schedules``): ``stages_per_rank``
    (1: exactly one stage per rank, torch's ``PipelineScheduleSingle``; None: any number) and
    ``torch_class`` (the class name; ``"Schedule" + name`` when empty). ``several`` names the
    family to use for several stages per rank, in the error a single-stage family gives.
    """

    name: str
    build: Builder
    placement: str
    split_backward: bool
    aliases: tuple[str, ...] = ()
    summary: str = ""
    stages_per_rank: int | None = None
    torch_class: str = ""
    several: str = ""

    @property
    def class_name(self) -> str:
        """The name of the runtime's schedule class for this family."""
        return self.torch_class or f"Schedule{self.name}"


_FAMILIES: dict[str, ScheduleFamily] = {}
_LOOKUP: dict[str, str] = {}


def register(family: ScheduleFamily) -> ScheduleFamily:
    for key in (family.name, *family.aliases):
        folded = key.lower()
        if folded in _LOOKUP and _LOOKUP[folded] != family.name:
            raise ValueError(f"schedule name {key!r} registered twice")
        _LOOKUP[folded] = family.name
    _FAMILIES[family.name] = family
    return family


def generator(
    name: str,
    *,
    placement: str,
    split_backward: bool,
    aliases: tuple[str, ...] = (),
    stages_per_rank: int | None = None,
    torch_class: str = "",
    several: str = "",
) -> Callable[[Builder], Builder]:
    """Register the decorated builder as the schedule family ``name``; the first line of its
    docstring is the family's summary. A new schedule is one module with one decorated function."""

    def decorate(build: Builder) -> Builder:
        doc = (build.__doc__ or "").strip()
        summary = doc.splitlines()[0].rstrip(".") if doc else ""
        register(
            ScheduleFamily(
                name,
                build,
                placement=placement,
                split_backward=split_backward,
                aliases=aliases,
                summary=summary,
                stages_per_rank=stages_per_rank,
                torch_class=torch_class,
                several=several,
            )
        )
        return build

    return decorate


def family(name: str) -> ScheduleFamily:
    """Look a schedule family up by name or alias, case-insensitively."""
    if not isinstance(name, str):
        raise ScheduleError(f"a schedule name must be a string, not {type(name).__name__}")
    canonical = _LOOKUP.get(name.strip().lower())
    if canonical is None:
        raise ScheduleError(f"unknown schedule {name!r}{did_you_mean(name)} (known schedules: {', '.join(_FAMILIES)})")
    return _FAMILIES[canonical]


def did_you_mean(name: str, extra: Iterable[tuple[str, str]] = ()) -> str:
    """``"; did you mean 'ZBVZeroBubble'?"`` for a mistyped schedule name, or "" when nothing is close.

    Compares case-insensitively with every name and alias (an alias suggests its family's name) and
    with ``extra`` (spelling, what to suggest) pairs, e.g. the runtime's class names."""
    targets = {key: _LOOKUP[key] for key in _LOOKUP}
    targets.update((spelling.lower(), suggestion) for spelling, suggestion in extra)
    close = difflib.get_close_matches(name.strip().lower(), list(targets), n=3, cutoff=0.75)
    suggestions = list(dict.fromkeys(targets[key] for key in close))
    if not suggestions:
        return ""
    return "; did you mean " + " or ".join(repr(s) for s in suggestions) + "?"


def schedule_names() -> list[str]:
    """Canonical names of every registered schedule, in registration order."""
    return list(_FAMILIES)


def build_schedule(name: str, num_ranks: int, num_microbatches: int, stages_per_rank: int | None = None) -> Schedule:
    """Build the compute-only schedule ``name`` for the given sizes.

    ``stages_per_rank`` defaults to what the schedule needs (1 for single-stage schedules,
    2 for interleaved and V-shaped ones). Raises :class:`ScheduleError` naming the constraint
    when the sizes make no sense for the schedule.
    """
    fam = family(name)
    for label, value in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{fam.name}: {label} must be an integer >= 1, got {value!r}")
    if stages_per_rank is not None and (
        isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int) or stages_per_rank < 1
    ):
        raise ScheduleError(f"{fam.name}: stages_per_rank must be an integer >= 1, got {stages_per_rank!r}")
    _check_stages_per_rank(fam, stages_per_rank)
    with gc_paused():  # hundreds of thousands of small acyclic objects at scale
        schedule = fam.build(num_ranks, num_microbatches, stages_per_rank)
    schedule.name = fam.name
    return schedule


def _check_stages_per_rank(fam: ScheduleFamily, stages_per_rank: int | None) -> None:
    """What the family declares: one stage per rank, or two in a V."""
    if stages_per_rank is None:
        return
    if fam.stages_per_rank == 1 and stages_per_rank != 1:
        hint = f"; use {fam.several} for several" if fam.several else ""
        raise ScheduleError(f"{fam.name}: one stage per rank (got stages_per_rank={stages_per_rank}){hint}")
    if fam.placement == "v" and stages_per_rank != 2:
        raise ScheduleError(f"{fam.name}: exactly 2 stages per rank in a V (got stages_per_rank={stages_per_rank})")
