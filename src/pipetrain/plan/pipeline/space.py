"""The search space of :mod:`pipetrain.plan.pipeline.search`: layouts (stages per rank and
placement, with the named schedules that build for them), hand-split rows and candidates."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from pipetrain.plan.autoplan.problem import Orders, Problem
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.generators import build_schedule, family, schedule_names
from pipetrain.plan.generators._common import v_placement
from pipetrain.plan.pipeline.cuts import Cut
from pipetrain.plan.pipeline.model import Vectors, count_vectors
from pipetrain.plan.schedule import Schedule
from pipetrain.plan.simulate import SimResult

__all__ = ["Candidate", "HandSplit", "Layout", "Named", "layouts_for"]

_SEED_EXTRA_V = (3, 4)  # stages per rank tried as hand splits only (loop placement)


# ------------------------------------------------------------------ layouts


@dataclass(frozen=True, eq=False)
class Named:
    """A named schedule's orders on a layout."""

    name: str
    orders: Orders
    vectors: list[Vectors]
    paired: bool  # holds OVERLAP_F_B pairs, which simulate times as one action


@dataclass(frozen=True, eq=False)
class Layout:
    """Stages per rank and placement, with the named schedules that build for them."""

    num_ranks: int
    num_microbatches: int
    v: int
    placement: str
    rank_of: tuple[int, ...]
    rank_stages: tuple[tuple[int, ...], ...]
    named: tuple[Named, ...]
    base: Problem

    @property
    def num_stages(self) -> int:
        return len(self.rank_of)

    @property
    def label(self) -> str:
        if self.v == 1:
            return "1 stage per rank"
        return f"{self.v} stages per rank, {'V' if self.placement == 'v' else 'loop'}"

    def cross_in(self, s: int) -> bool:
        return s > 0 and self.rank_of[s - 1] != self.rank_of[s]

    def cross_out(self, s: int) -> bool:
        return s + 1 < len(self.rank_of) and self.rank_of[s + 1] != self.rank_of[s]

    def schedule_of(self, name: str) -> Schedule:
        return build_schedule(name, self.num_ranks, self.num_microbatches, self.v)


@functools.lru_cache(maxsize=32)
def _layout(num_ranks: int, num_microbatches: int, v: int, placement: str, comm: float) -> Layout | None:
    if placement == "v":
        if v != 2:
            return None
        rank_of = tuple(v_placement(num_ranks)[s] for s in range(2 * num_ranks))
    else:
        rank_of = tuple(s % num_ranks for s in range(num_ranks * v))
    n = len(rank_of)
    rank_stages = tuple(tuple(s for s in range(n) if rank_of[s] == r) for r in range(num_ranks))
    one = (1.0,) * n
    base = Problem(num_ranks, num_microbatches, rank_of, one, one, one, (2.0,) * n, comm, one, None, placement)
    named: list[Named] = []
    seen: dict[tuple[tuple[int, ...], ...], int] = {}
    for name in schedule_names():
        fam = family(name)
        if name == "ForwardOnly" or fam.placement != placement:
            continue
        try:
            schedule = build_schedule(name, num_ranks, num_microbatches, v)
        except ScheduleError:
            continue
        if schedule.num_stages != n or any(schedule.stage_to_rank.get(s) != r for s, r in enumerate(rank_of)):
            continue
        orders = base.orders_of(schedule)
        key = tuple(tuple(o) for o in orders)
        paired = any(a is not None and a.sub_actions is not None for row in schedule.actions.values() for a in row)
        entry = Named(name, orders, count_vectors(base, orders, rank_stages), paired)
        if key in seen:
            # The same orders under two names: keep the single-stage family's (1F1B over Interleaved1F1B at v=1).
            k = seen[key]
            if fam.stages_per_rank == 1 and family(named[k].name).stages_per_rank != 1 and not paired:
                named[k] = entry
            continue
        seen[key] = len(named)
        named.append(entry)
    return Layout(num_ranks, num_microbatches, v, placement, rank_of, rank_stages, tuple(named), base)


def layouts_for(
    num_ranks: int,
    num_microbatches: int,
    num_layers: int,
    stages_per_rank: int | None,
    placement: str | None,
    comm: float,
) -> tuple[list[Layout], list[Layout]]:
    """(layouts searched, layouts tried only as hand splits) for these arguments."""
    if stages_per_rank is not None:
        choices = [stages_per_rank]
    elif placement == "v":
        choices = [2]
    else:
        choices = [1, 2]
    searched: list[Layout] = []
    for v in choices:
        places = [placement] if placement else (["loop", "v"] if v == 2 else ["loop"])
        for place in places:
            if place == "v" and v != 2:
                raise ScheduleError(f"placement 'v' needs 2 stages per rank, got stages_per_rank={v}")
            if num_layers < num_ranks * v:
                continue
            found = _layout(num_ranks, num_microbatches, v, place, comm)
            if found is not None:
                searched.append(found)
    extra: list[Layout] = []
    if stages_per_rank is None and placement in (None, "loop"):
        for v in _SEED_EXTRA_V:
            if num_layers >= num_ranks * v:
                found = _layout(num_ranks, num_microbatches, v, "loop", comm)
                if found is not None and found.named:
                    extra.append(found)
    return searched, extra


# ------------------------------------------------------------------ results


@dataclass(frozen=True)
class HandSplit:
    """A hand split (a peer's rule) on one layout, with its best named schedule that fits.

    ``schedule_name`` is None when no named schedule fits; ``makespan``, ``bubble`` and
    ``peak_memory_bytes`` then describe the named schedule that needs the least memory."""

    rule: str
    stages_per_rank: int
    placement: str
    sizes: tuple[int, ...]
    schedule_name: str | None
    makespan: float
    bubble: float
    peak_memory_bytes: dict[int, float]
    fits: bool
    closest: str = ""  # the named schedule needing least memory, when none fits

    @property
    def label(self) -> str:
        if self.stages_per_rank == 1:
            return "1 stage per rank"
        return f"{self.stages_per_rank} stages per rank, {'V' if self.placement == 'v' else 'loop'}"


@dataclass
class Candidate:
    """A plan the search found: its layout, cut, recompute set and orders (or named schedule)."""

    makespan: float  # by the fast evaluation (simulate's for named, unpaired orders)
    layout: Layout
    cut: Cut
    recompute: frozenset[int]
    named: str | None = None  # run this named schedule as built (else ``orders``)
    orders: Orders | None = None
    how: str = ""
    vectors: list[Vectors] | None = field(default=None, repr=False)  # of the named order used
    result: SimResult | None = field(default=None, repr=False)
    schedule: Schedule | None = field(default=None, repr=False)
