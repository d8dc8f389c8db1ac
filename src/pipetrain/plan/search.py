"""Auto-planning: pick the fastest schedule that fits a memory limit, for measured costs.

Every registered training schedule is built at every number of stages per rank it accepts
(1-4), simulated under the given costs, and ranked: feasible ones (peak memory within the limit)
by makespan, then by peak memory, then by the number of stages (fewer stages, fewer messages).

Units. Per-stage cost *sequences* are measurements of an already cut model: they fix the number
of stages (``len(f)`` must be a multiple of ``num_ranks``). A *scalar* cost is the time of one
rank's share of the model for one microbatch; cut into ``v`` stages per rank, each stage takes
1/v of it (and holds 1/v of the activation bytes). ``memory_limit`` is in bytes when
``costs.activation_bytes`` is given, else in units of one microbatch's activations of one rank's
whole share (1F1B's rank 0 holds ``num_ranks`` of them).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pipetrain.plan.costs import Costs
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.generators import build_schedule, family, schedule_names
from pipetrain.plan.schedule import Schedule
from pipetrain.plan.simulate import SimResult, simulate

__all__ = ["Candidate", "auto_schedule", "rank_schedules"]

_MAX_STAGES_PER_RANK = 4


@dataclass(frozen=True)
class Candidate:
    """One schedule tried by the planner, with its simulated result."""

    name: str
    stages_per_rank: int
    schedule: Schedule
    result: SimResult
    memory: float
    """Peak memory of the busiest rank, in the units of ``memory_limit``."""
    fits: bool


def _fixed_stages(costs: Costs, num_ranks: int) -> int | None:
    lengths = {len(v) for v in (costs.f, costs.b, costs.i, costs.w, costs.activation_bytes) if isinstance(v, Sequence)}
    if not lengths:
        return None
    if len(lengths) > 1:
        raise ScheduleError(f"per-stage costs disagree on the number of stages: {sorted(lengths)}")
    (n,) = lengths
    if n % num_ranks:
        raise ScheduleError(f"per-stage costs give {n} stages, not a multiple of num_ranks={num_ranks}")
    return n // num_ranks


def rank_schedules(
    num_ranks: int,
    num_microbatches: int,
    costs: Costs,
    memory_limit: float | None = None,
    *,
    names: Iterable[str] | None = None,
    stages_per_rank: int | None = None,
) -> list[Candidate]:
    """Every candidate, best first (those that fit the memory limit before those that do not)."""
    # Checked here, not left to the generators: 0 would read as "any" and NaN fits nothing silently.
    if stages_per_rank is not None and (type(stages_per_rank) is not int or stages_per_rank < 1):
        raise ScheduleError(f"stages_per_rank must be an integer >= 1, got {stages_per_rank!r}")
    if memory_limit is not None and (
        isinstance(memory_limit, bool)
        or not isinstance(memory_limit, int | float)
        or not math.isfinite(memory_limit)
        or memory_limit < 0
    ):
        raise ScheduleError(f"memory_limit must be a finite number >= 0, got {memory_limit!r}")
    fixed = _fixed_stages(costs, num_ranks)
    if stages_per_rank is not None and fixed is not None and stages_per_rank != fixed:
        raise ScheduleError(f"stages_per_rank={stages_per_rank} contradicts the {fixed * num_ranks} per-stage costs")
    choices = [fixed or stages_per_rank] if (fixed or stages_per_rank) else list(range(1, _MAX_STAGES_PER_RANK + 1))
    wanted = [family(n).name for n in names] if names is not None else schedule_names()
    candidates: list[Candidate] = []
    for name in wanted:
        if name == "ForwardOnly":
            continue
        for v in choices:
            assert v is not None
            try:
                schedule = build_schedule(name, num_ranks, num_microbatches, v)
            except ScheduleError:
                continue
            if schedule.num_stages != num_ranks * v:
                continue
            stage_costs = costs if fixed else costs.cut_into(v)
            result = simulate(schedule, stage_costs, check=False)  # a generator's own output
            if result.peak_memory_bytes is not None:
                memory = max(result.peak_memory_bytes.values(), default=0.0)
            else:
                memory = result.max_peak_memory / v
            fits = memory_limit is None or memory <= memory_limit + 1e-9
            candidates.append(Candidate(name, v, schedule, result, memory, fits))
    candidates.sort(key=lambda c: (not c.fits, c.result.makespan, c.memory, c.stages_per_rank))
    return candidates


def auto_schedule(
    num_ranks: int,
    num_microbatches: int,
    costs: Costs | None = None,
    memory_limit: float | None = None,
    *,
    names: Iterable[str] | None = None,
    stages_per_rank: int | None = None,
) -> Schedule:
    """The fastest schedule (under ``costs``) whose peak memory fits ``memory_limit``.

    Raises ScheduleError when nothing fits, naming the least memory any candidate needs.
    """
    ranked = rank_schedules(
        num_ranks,
        num_microbatches,
        Costs() if costs is None else costs,
        memory_limit,
        names=names,
        stages_per_rank=stages_per_rank,
    )
    if not ranked:
        raise ScheduleError(f"no schedule accepts {num_ranks} ranks and {num_microbatches} microbatches")
    best = ranked[0]
    if not best.fits:
        least = min(ranked, key=lambda c: c.memory)
        raise ScheduleError(
            f"no schedule fits memory_limit={memory_limit:g}; the least memory is {least.memory:g} "
            f"({least.name} with {least.stages_per_rank} stages per rank)"
        )
    return best.schedule
