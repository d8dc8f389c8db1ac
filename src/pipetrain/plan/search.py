"""Auto-planning: pick the fastest schedule that fits a memory limit, for measured costs.

Every registered training schedule is built at every number of stages per rank it accepts
(1-4), simulated under the given costs, and ranked: feasible ones (peak memory within the limit)
by makespan, then by peak memory, then by the number of stages (fewer stages, fewer messages).
Without a memory limit the planners prefer less memory over a small simulated gain: of the
schedules within :data:`MEMORY_TOLERANCE` (1 %) of the fastest makespan, the one holding the
least memory (:attr:`Plan.faster` then names the fastest, and what it would cost).

Units: one meaning of :class:`Costs` everywhere. ``Costs(...)`` describes one stage, as in
:func:`~pipetrain.plan.simulate`: every layout is simulated with each of its stages costing that
(so a layout with more stages per rank is a deeper model, and rarely wins). ``Costs.per_rank(...)``
describes one rank's share of one model for one microbatch: cut into ``v`` stages per rank, each
stage takes 1/v of it (and holds 1/v of the activation bytes), which is how layouts with
different stage counts compete on one model (the command line's ``--costs`` means this).
Per-stage cost *sequences* are measurements of an already cut model: they fix the number of
stages (``len(f)`` must be a multiple of ``num_ranks``). Either way ``simulate(best, costs)``
reproduces the planner's makespan and memory. ``memory_limit`` is in bytes when any byte cost
(``activation_bytes``, ``weight_grad_bytes``, ...) is given, as ``simulate`` counts them, else in
units of one microbatch's activations of a stage (plain ``Costs(...)``) or of a rank's whole share
(``per_rank`` or sequences; 1F1B's rank 0 holds ``num_ranks`` of them).

Memory: the construction counts what the order alone sets as ``simulate`` does (an activation,
what W reads from I's end, a received input, static bytes: :mod:`pipetrain.plan.autoplan.layout`)
and a rank's largest transient throughout, which bounds ``simulate``'s count of each action's
transient at that action's own time; message buffers in flight by what simulating the
microbatches one at a time adds. Every schedule returned is simulated, with the caller's costs:
one that ``simulate`` puts over the limit on any rank is never returned (the layout is searched
again with less room on that rank while time is left). The least memory named when nothing fits
is what the microbatches need run one at a time (every order holds one microbatch's activations
when its last forward starts); with that limit a schedule is returned.
"""

from __future__ import annotations

import math
import numbers
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from pipetrain.plan.autoplan import (
    SECONDS_PER_ACTION,
    Orders,
    Problem,
    construct,
    exact,
    polish,
    polish_deadline,
    uses_windows,
    windows_fit,
)
from pipetrain.plan.autoplan.layout import layout_problem, one_at_a_time, raised
from pipetrain.plan.costs import Costs
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.generators import build_schedule, family, schedule_names
from pipetrain.plan.schedule import Schedule
from pipetrain.plan.simulate import SimResult, simulate

__all__ = [
    "MEMORY_TOLERANCE",
    "Alternative",
    "Candidate",
    "Plan",
    "auto_schedule",
    "layout_problem",
    "plan_schedule",
    "rank_schedules",
]

MEMORY_TOLERANCE = 0.01
"""Without a memory limit, a schedule up to this share slower than the fastest (1 %) is preferred
when it holds less memory: a simulated gain that small is within what real step times vary by,
and memory is not free. With a memory limit the fastest that fits is chosen, as asked."""

_MAX_STAGES_PER_RANK = 4
_LIKELY_BEST = ("ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV", "ZBH2", "ZBH1", "Interleaved1F1B", "1F1B")
_NAMED_SHARE = 0.4  # of the time limit, at most, for building and simulating named schedules
_FIRST_LOOK_SHARE = 0.45  # of the search time, for a first look at every layout
_T = TypeVar("_T")
_PRELOAD_WORTH = 3.0  # seconds of time limit, at least, to spend one importing CP-SAT
_RECHECK_SHARE = 0.25  # of the search time, kept to search again where message buffers overflow
_RECHECKS = 3  # searches again at most, each with less room on the ranks that went over


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
    # (Costs refuses per-stage values of different lengths when it is made.)
    names = ("f", "b", "i", "w", "activation_bytes", "weight_grad_bytes", "message_bytes", "static_bytes")
    values = [getattr(costs, name) for name in (*names, "transient_bytes", "b_transient_bytes")]
    lengths = {len(v) for v in values if isinstance(v, Sequence)}
    if not lengths:
        return None
    (n,) = lengths
    if n % num_ranks:
        raise ScheduleError(f"per-stage costs give {n} stages, which {num_ranks} ranks cannot share evenly")
    return n // num_ranks


def _count(label: str, value: object) -> int:
    """``value`` as an int >= 1 (numpy integers too), else a ScheduleError naming ``label``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ScheduleError(f"{label} must be an integer >= 1, got {value!r}")
    return int(value)


def _finite(label: str, value: object, *, positive: bool = False) -> float:
    """``value`` as a finite float >= 0 (> 0 if ``positive``), else a ScheduleError naming ``label``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value < 0
        or (positive and value == 0)
    ):
        raise ScheduleError(f"{label} must be a finite number {'>' if positive else '>='} 0, got {value!r}")
    return float(value)


def _checked_sizes(
    num_ranks: object, num_microbatches: object, costs: object, memory_limit: object, stages_per_rank: object
) -> tuple[int, int, float | None, int | None]:
    """The planners' arguments checked (a bad one named, never a stray IndexError) and normalised."""
    if not isinstance(costs, Costs):
        raise ScheduleError(f"costs must be a pipetrain.plan.Costs, got {type(costs).__name__}: {costs!r}")
    return (
        _count("num_ranks", num_ranks),
        _count("num_microbatches", num_microbatches),
        None if memory_limit is None else _finite("memory_limit", memory_limit),
        None if stages_per_rank is None else _count("stages_per_rank", stages_per_rank),
    )


def _name_list(names: Iterable[str] | str | None) -> list[str] | None:
    """``names`` as a list (one string is one name, not its letters)."""
    if names is None:
        return None
    return [names] if isinstance(names, str) else list(names)


def rank_schedules(
    num_ranks: int,
    num_microbatches: int,
    costs: Costs,
    memory_limit: float | None = None,
    *,
    names: Iterable[str] | None = None,
    stages_per_rank: int | None = None,
    deadline: float | None = None,
) -> list[Candidate]:
    """Every candidate, best first (those that fit the memory limit before those that do not).

    With a ``deadline`` (a ``time.perf_counter()`` value) candidates are built until it passes,
    zero-bubble families and 1 or 2 stages per rank first, so a planner at scale keeps to its
    time limit."""
    num_ranks, num_microbatches, memory_limit, stages_per_rank = _checked_sizes(
        num_ranks, num_microbatches, costs, memory_limit, stages_per_rank
    )
    pairs = _pairs(num_ranks, costs, _name_list(names), stages_per_rank, deadline is not None)
    return _rank(num_ranks, num_microbatches, costs, memory_limit, pairs, deadline)[0]


def _pairs(
    num_ranks: int, costs: Costs, listed: list[str] | None, stages_per_rank: int | None, likely_first: bool
) -> list[tuple[str, int]]:
    """The (schedule name, stages per rank) to try, in the order to try them."""
    fixed = _fixed_stages(costs, num_ranks)
    if stages_per_rank is not None and fixed is not None and stages_per_rank != fixed:
        raise ScheduleError(
            f"stages per rank: {stages_per_rank} asked for, but the {fixed * num_ranks} per-stage costs make "
            f"{fixed} on {num_ranks} ranks"
        )
    choices = [fixed or stages_per_rank] if (fixed or stages_per_rank) else list(range(1, _MAX_STAGES_PER_RANK + 1))
    wanted = [family(n).name for n in listed] if listed is not None else schedule_names()
    pairs = [(n, v) for n in dict.fromkeys(wanted) if n != "ForwardOnly" for v in choices if v is not None]
    if likely_first:
        rank = {name: i for i, name in enumerate(_LIKELY_BEST)}
        pairs.sort(key=lambda nv: (nv[1] > 2, rank.get(nv[0], len(rank))))
    return pairs


def _rank(
    num_ranks: int,
    num_microbatches: int,
    costs: Costs,
    memory_limit: float | None,
    pairs: list[tuple[str, int]],
    deadline: float | None,
    at_least_one: bool = True,
) -> tuple[list[Candidate], list[tuple[str, int]]]:
    """The candidates of ``pairs`` (checked arguments), best first, and the pairs not reached
    before ``deadline`` (past which one candidate is still built if ``at_least_one``)."""
    fixed = _fixed_stages(costs, num_ranks) is not None
    candidates: list[Candidate] = []
    for index, (name, v) in enumerate(pairs):
        if deadline is not None and (candidates or not at_least_one) and time.perf_counter() > deadline:
            return sorted(candidates, key=_rank_key), pairs[index:]
        try:
            schedule = build_schedule(name, num_ranks, num_microbatches, v)
        except ScheduleError:
            continue
        if schedule.num_stages != num_ranks * v:
            continue
        stage_costs = costs if fixed else costs.for_layout(v)
        result = simulate(schedule, stage_costs, check=False)  # a generator's own output
        memory = max(_rank_memory(result, costs, v), default=0.0)
        fits = memory_limit is None or memory <= memory_limit + 1e-9
        candidates.append(Candidate(name, v, schedule, result, memory, fits))
    return sorted(candidates, key=_rank_key), []


def _rank_memory(result: SimResult, costs: Costs, v: int) -> list[float]:
    """Per rank, the simulated peak memory in the units of ``memory_limit``: bytes with any byte
    cost, else a rank's share of a microbatch's activations (or a stage's, for plain costs)."""
    if result.peak_memory_bytes is not None:
        return [result.peak_memory_bytes[r] for r in range(result.num_ranks)]
    return [result.peak_memory[r] / (1 if costs.prices_one_stage else v) for r in range(result.num_ranks)]


def _rank_key(c: Candidate) -> tuple[bool, float, float, int]:
    """Those that fit first, then by makespan, memory and the number of stages."""
    return (not c.fits, c.result.makespan, c.memory, c.stages_per_rank)


@dataclass(frozen=True)
class Alternative:
    """A schedule the planner found but did not choose: its name, stages per rank, simulated
    makespan and peak memory (in the units of ``memory_limit``)."""

    name: str
    stages_per_rank: int
    makespan: float
    memory: float


def _prefer(options: list[tuple[Alternative, _T]], tolerance: float) -> tuple[_T, Alternative | None]:
    """The payload of the option holding the least memory among those within ``tolerance`` of the
    fastest makespan (ties: faster, then named before constructed, then fewer stages), and the
    fastest option when it is not the one chosen."""

    def speed(o: tuple[Alternative, _T]) -> tuple[float, float, bool, int]:
        a = o[0]
        return (a.makespan, a.memory, a.name == "Auto", a.stages_per_rank)

    fastest = min(options, key=speed)
    bound = fastest[0].makespan * (1 + tolerance) + 1e-9
    near = [o for o in options if o[0].makespan <= bound]
    chosen = min(near, key=lambda o: (round(o[0].memory, 9), *speed(o)))
    return chosen[1], (None if chosen is fastest else fastest[0])


def auto_schedule(
    num_ranks: int,
    num_microbatches: int,
    costs: Costs | None = None,
    memory_limit: float | None = None,
    *,
    stages_per_rank: int | None = None,
    placement: str | None = None,
    time_limit: float = 10.0,
    names: Iterable[str] | None = None,
    seed: int = 0,
) -> Schedule:
    """The fastest schedule found within ``time_limit`` seconds whose peak memory fits ``memory_limit``.

    Constructs per-rank orders of F, I, W (or B) for the given costs (see :mod:`pipetrain.plan.autoplan`),
    starting from every named schedule that fits, and returns the best: a named schedule when none
    constructed beats it, else a schedule named "Auto". ``placement`` ("loop" or "v") fixes the layout,
    with two stages per rank unless ``stages_per_rank`` or per-stage costs say otherwise (a V needs
    two); ``names`` restricts the named schedules considered. Raises ScheduleError when nothing
    fits, naming the least memory a layout needs (one microbatch at a time: with that limit a
    schedule is returned). ``simulate(best, costs)`` puts no rank over ``memory_limit``; the
    lowered schedule, whose receives are posted early, can hold a few message buffers more.

    ``Costs(...)`` prices one stage, as ``simulate`` reads it; ``Costs.per_rank(...)`` a rank's
    share of one model, which the search cuts into each layout's stages (as the CLI's
    ``--costs``), so layouts with different stage counts compete on one model. Either way
    ``simulate(best, costs)`` reproduces the search's makespan and memory.

    Time: the named schedules are simulated first (zero-bubble families and 1 or 2 stages per rank
    first) for up to 0.4 of ``time_limit``; those not reached then are simulated after the
    construction, in time kept back for them at the rate of the first ones. A limit too short
    even for that may miss a named schedule that would have won. Where no named schedule fits,
    one construction always runs, which can outlast a very short limit at scale (about 4 s at
    64 ranks x 256 microbatches).

    Memory against speed: with a ``memory_limit`` the result is the fastest found that fits, never
    slower than the best named schedule that fits. Without one, of the schedules found within
    :data:`MEMORY_TOLERANCE` (1 %) of the fastest makespan the one holding the least memory is
    returned (e.g. ZB-V rather than LoopedBFS at 4 stages per rank holding 4x its memory for a
    0.15 % gain), so the result is at most 1 % slower than the best named schedule;
    :func:`plan_schedule`'s ``Plan.faster`` names what was passed over.
    """
    schedule = plan_schedule(
        num_ranks,
        num_microbatches,
        Costs.per_rank() if costs is None else costs,
        memory_limit,
        stages_per_rank=stages_per_rank,
        placement=placement,
        time_limit=time_limit,
        names=names,
        seed=seed,
    ).schedule
    schedule.planned = True
    return schedule


@dataclass(frozen=True)
class Plan:
    """What :func:`plan_schedule` found: the schedule, its simulated makespan and memory, the
    best named schedule that fits (None if none does) for comparison, and ``faster``: the fastest
    schedule found when it was passed over for one within :data:`MEMORY_TOLERANCE` of it that holds
    less memory (only without a memory limit), else None."""

    schedule: Schedule
    makespan: float
    memory: float
    best_named: Candidate | None
    faster: Alternative | None = field(default=None, kw_only=True)


def plan_schedule(
    num_ranks: int,
    num_microbatches: int,
    costs: Costs,
    memory_limit: float | None = None,
    *,
    stages_per_rank: int | None = None,
    placement: str | None = None,
    time_limit: float = 10.0,
    names: Iterable[str] | None = None,
    seed: int = 0,
) -> Plan:
    """:func:`auto_schedule` with what it compared against (and, without a memory limit, the
    faster schedule it passed over for less memory, see :data:`MEMORY_TOLERANCE`)."""
    started = time.perf_counter()
    time_limit = _finite("time_limit (seconds)", time_limit, positive=True)
    if placement is not None and placement not in ("loop", "v"):
        raise ScheduleError(f"placement must be 'loop' or 'v', got {placement!r}")
    num_ranks, num_microbatches, memory_limit, stages_per_rank = _checked_sizes(
        num_ranks, num_microbatches, costs, memory_limit, stages_per_rank
    )
    listed = _name_list(names)
    fixed = _fixed_stages(costs, num_ranks)
    if placement is not None and fixed is None and stages_per_rank is None:
        stages_per_rank = 2  # (a placement is a layout of two stages per rank unless told otherwise)
    # Keep back what writing the result out costs (to_schedule is linear in the actions).
    largest = 3 * num_ranks * (fixed or stages_per_rank or 2) * num_microbatches
    deadline = started + time_limit - min(0.2 * time_limit, SECONDS_PER_ACTION * largest)
    pairs = _pairs(num_ranks, costs, listed, stages_per_rank, True)
    ranked, rest = _rank(num_ranks, num_microbatches, costs, memory_limit, pairs, started + _NAMED_SHARE * time_limit)
    # Time for the named schedules that share did not reach, after the search: at the rate of the
    # first ones, at most half of what is left.
    per_pair = (time.perf_counter() - started) / max(1, len(pairs) - len(rest))
    search_deadline = deadline - min(per_pair * len(rest), 0.5 * max(0.0, deadline - time.perf_counter()))
    choices = [fixed or stages_per_rank] if (fixed or stages_per_rank) else [1, 2]
    layouts: list[tuple[int, str]] = []
    for v in choices:
        assert v is not None
        if placement == "v" and v != 2:
            raise ScheduleError(f"placement 'v' needs 2 stages per rank, got {v}")
        options = [placement] if placement else (["loop", "v"] if v == 2 else ["loop"])
        layouts.extend((v, p) for p in options)
    named = [c for c in ranked if c.fits and (placement is None or family(c.name).placement == placement)]
    best_named = named[0] if named else None

    problems: list[Problem] = []
    least: tuple[float, str] | None = None
    for v, place in layouts:
        problem = layout_problem(num_ranks, num_microbatches, costs, memory_limit, v, place, fixed is not None)
        # The least memory it needs: that of one microbatch alone (as many run one at a time).
        alone = replace(problem, num_microbatches=1)
        orders = one_at_a_time(alone)
        single = _checked(alone, orders, costs, memory_limit)
        if least is None or single.memory < least[0]:
            where = f"{v} stage(s) per rank, {place} placement"
            least = (single.memory, f"one microbatch alone needs {single.memory:.12g} on some rank ({where})")
        if single.fits:
            # What simulate counts there beyond the search's model (message buffers in flight)
            # is room the search keeps on each rank from the start.
            problems.append(raised(problem, _excess(alone, orders, single, costs)))
    for c in ranked:  # (a named schedule of another layout could need less)
        if placement is not None and family(c.name).placement != placement:
            continue
        if least is not None and c.memory < least[0] - 1e-9:
            least = (c.memory, f"{c.name} at {c.stages_per_rank} stage(s) per rank needs {c.memory:.12g} on some rank")
    if not problems and best_named is None:
        if least is None:
            raise ScheduleError(f"no layout accepts {num_ranks} ranks and {num_microbatches} microbatches")
        raise ScheduleError(f"no schedule fits memory_limit={memory_limit:.12g}: {least[1]}")

    rng = random.Random(seed)
    found: list[tuple[float, Problem, Orders]] = []
    if time_limit >= _PRELOAD_WORTH and not exact.ready() and any(windows_fit(p) for p in problems):
        exact.preload()  # within the time limit: the search below gets what is left
    recheck_until = search_deadline
    if memory_limit is not None and costs.message_bytes is not None:
        # The search counts message buffers between ranks only roughly (they depend on timing):
        # keep time to search again, with less room, where simulating what it found says more.
        search_deadline -= _RECHECK_SHARE * max(0.0, search_deadline - time.perf_counter())
    # With two layouts that CP-SAT can take, each gets a first look (list scheduling and local
    # search); the better one then gets what time is left for CP-SAT over windows.
    several = len(problems) > 1 and all(uses_windows(p) for p in problems)
    first_until = time.perf_counter() + (_FIRST_LOOK_SHARE if several else 1.0) * (
        search_deadline - time.perf_counter()
    )
    seeds: dict[int, list[Orders]] = {}
    for index, problem in enumerate(problems):
        share = (first_until - time.perf_counter()) / (len(problems) - index)
        seeds[id(problem)] = [problem.orders_of(c.schedule) for c in named if _same_layout(problem, c.schedule)]
        if best_named is not None and share < 2 * SECONDS_PER_ACTION * 3 * problem.num_stages * num_microbatches:
            continue  # not even one list-scheduling run would end in time: the named schedules stand
        # construct may end a little past its deadline (one evaluation, the last list-scheduling run).
        result = construct(
            problem, seeds[id(problem)], time.perf_counter() + 0.92 * share, rng, 0.0 if several else None
        )
        if result is not None:
            found.append((result[1], problem, result[0]))
    if several:
        # Best first; a polish that ends early (CP-SAT proved a small problem optimal) leaves the
        # rest of the time to the next layout.
        found.sort(key=lambda item: item[0])
        polished: list[tuple[float, Problem, Orders]] = []
        for index, (makespan, problem, orders) in enumerate(found):
            until = polish_deadline(problem, search_deadline, len(found) - index)
            orders, makespan = polish(problem, orders, makespan, until, rng, blocks_first=best_named is None)
            polished.append((makespan, problem, orders))
        found = polished
    # What the search found, simulated as the caller will (searched again with less room where
    # that puts it over the limit, while time is left).
    found.sort(key=lambda item: item[0])  # (the fastest gets the time to search again first)
    checked = [_fitting(p, o, costs, memory_limit, seeds[id(p)], recheck_until, rng) for _, p, o in found]
    autos = [c for c in checked if c is not None]
    if rest and time.perf_counter() < deadline:
        more, _ = _rank(num_ranks, num_microbatches, costs, memory_limit, rest, deadline, at_least_one=False)
        named += [c for c in more if c.fits and (placement is None or family(c.name).placement == placement)]
        named.sort(key=_rank_key)
    tolerance = MEMORY_TOLERANCE if memory_limit is None else 0.0
    offers: list[tuple[Alternative, Candidate]] = [
        (Alternative(c.name, c.stages_per_rank, c.result.makespan, c.memory), c) for c in named
    ]
    best_named = _prefer(offers, tolerance)[0] if offers else None
    if not autos and not offers:  # nothing better found: the microbatches one at a time fit
        autos = [c for c in (_checked(p, one_at_a_time(p), costs, memory_limit) for p in problems) if c.fits]
    if autos:
        auto = min(autos, key=lambda c: (c.result.makespan, c.memory))
        offers.append((Alternative("Auto", auto.stages_per_rank, auto.result.makespan, auto.memory), auto))
    if not offers:
        raise ScheduleError("no schedule found within the time limit; give it more time_limit")
    chosen, faster = _prefer(offers, tolerance)
    return Plan(chosen.schedule, chosen.result.makespan, chosen.memory, best_named, faster=faster)


def _checked(problem: Problem, orders: Orders, costs: Costs, memory_limit: float | None) -> Candidate:
    """``orders`` as a schedule, simulated as the caller will simulate it (``simulate(schedule, costs)``)."""
    schedule = problem.to_schedule(orders)
    v = problem.num_stages // problem.num_ranks
    result = simulate(schedule, costs, check=False)
    memory = max(_rank_memory(result, costs, v), default=0.0)
    return Candidate("Auto", v, schedule, result, memory, memory_limit is None or memory <= memory_limit + 1e-9)


def _excess(problem: Problem, orders: Orders, candidate: Candidate, costs: Costs) -> list[float]:
    """Per rank, what simulating ``orders`` (``candidate``) counts beyond ``problem``'s model of
    them (message buffers in flight), at the rank's peak."""
    peaks = _rank_memory(candidate.result, costs, candidate.stages_per_rank)
    return [
        max(0.0, peak - problem.peak(program, r)) for r, (peak, program) in enumerate(zip(peaks, orders, strict=True))
    ]


def _fitting(
    problem: Problem,
    orders: Orders,
    costs: Costs,
    memory_limit: float | None,
    seeds: list[Orders],
    until: float,
    rng: random.Random,
) -> Candidate | None:
    """``orders`` simulated; where that puts a rank over ``memory_limit`` (message buffers the
    search counts only roughly), orders searched again with that rank's room cut by its excess, up
    to :data:`_RECHECKS` times by ``until``; None if none fits."""
    for attempt in range(_RECHECKS + 1):
        candidate = _checked(problem, orders, costs, memory_limit)
        if candidate.fits or memory_limit is None:
            return candidate
        now = time.perf_counter()
        if attempt == _RECHECKS or now >= until:
            return None
        over = _rank_memory(candidate.result, costs, candidate.stages_per_rank)
        excess = _excess(problem, orders, candidate, costs)
        problem = raised(
            problem, [x if peak > memory_limit + 1e-9 else 0.0 for x, peak in zip(excess, over, strict=True)]
        )
        if problem.least_memory() > memory_limit + 1e-9:
            return None
        fit = [o for o in seeds if problem.fits(o)]
        result = construct(problem, fit, now + (until - now) / (_RECHECKS - attempt), rng, 0.0)
        if result is None:
            return None
        orders = result[0]
    return None  # pragma: no cover - the loop returns


def _same_layout(problem: Problem, schedule: Schedule) -> bool:
    return schedule.num_stages == problem.num_stages and all(
        schedule.stage_to_rank.get(s) == r for s, r in enumerate(problem.stage_to_rank)
    )
