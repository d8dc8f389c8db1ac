"""auto_schedule under tight memory against CP-SAT's proven optimum (issue 37, item 3).

Small problems that CP-SAT solves exactly: mostly 4 ranks x 2 stages each (loop and V layouts),
6 and 8 microbatches, memory limits of 3 to 6 stage activations per rank (``activation_bytes``
per stage), five cost models (uniform F=I=W; B=2F with latency 0.5; a light W; the last or the
first stage heavy), two where W holds memory of its own (``weight_grad_bytes`` half and 1.5x the
activation), and a few with one or three stages per rank. Per-stage cost sequences fix the
number of stages, so auto searches the same layouts the optimum is taken over.

The yardstick is :func:`pipetrain.plan.autoplan.exact.solve` run to a proof on each layout (a
later layout only searched up to the best proven so far): per rank no overlap; the dependency
rules and latencies of ``simulate``; memory as a cumulative resource per rank exactly as
``simulate`` counts it (an activation from its F's start to its I's end, then what W reads until
W's end; where W reads more than the activation, a backward may run as one B, which holds the
activation alone). Every optimum's orders are simulated with ``simulate``: the makespan must be
equal and each rank's peak equal to the model's and within the limit, else the script stops.
Optima are cached in ``tight_memory_optima.json`` beside this file (``--resolve`` recomputes).
Where CP-SAT proves nothing and an auto run finds a shorter schedule (simulated, within the
limit), that is cached as the best known ("auto's" in the table); one shorter than a proven
optimum stops the script (the models would disagree).

Run: ``python benchmarks/tight_memory.py [--time-limit SECONDS] [--only TEXT] [--resolve]``
(auto at its default time limit unless ``--time-limit``; ``--exact-time`` and ``--workers`` for
CP-SAT: 60 s with 2 workers per layout by default).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipetrain.plan import Costs, simulate
from pipetrain.plan.autoplan import exact
from pipetrain.plan.autoplan.layout import layout_problem
from pipetrain.plan.autoplan.problem import Problem
from pipetrain.plan.search import auto_schedule

CACHE = Path(__file__).with_name("tight_memory_optima.json")
_EPS = 1e-6


@dataclass(frozen=True)
class Case:
    ranks: int
    v: int
    microbatches: int
    costs_name: str
    limit: int  # stage activations per rank

    @property
    def key(self) -> str:
        return f"{self.ranks}x{self.v}x{self.microbatches} {self.costs_name} limit {self.limit}"

    @property
    def unit(self) -> int:
        """Bytes of one stage activation (2 where W's bytes are a half or 1.5 of it)."""
        return 2 if self.costs_name.startswith("wgrad") else 1

    def costs(self) -> Costs:
        n = self.ranks * self.v
        ones = [1.0] * n
        act = [float(self.unit)] * n
        name = self.costs_name
        if name == "uniform":
            return Costs(f=ones, i=ones, w=ones, activation_bytes=act)
        if name == "B=2F,lat0.5":
            return Costs(f=ones, i=ones, w=ones, comm=0.5, activation_bytes=act)
        if name == "lightW,lat0.1":
            return Costs(f=ones, i=[1.5] * n, w=[0.5] * n, comm=0.1, activation_bytes=act)
        if name == "last1.6x,lat0.1":
            heavy = [*ones[:-1], 1.6]
            return Costs(f=heavy, i=heavy, w=heavy, comm=0.1, activation_bytes=act)
        if name == "first1.3x,lat0.2":
            heavy = [1.3, *ones[1:]]
            return Costs(f=heavy, i=heavy, w=heavy, comm=0.2, activation_bytes=act)
        if name in ("wgrad0.5,lat0.1", "wgrad1.5,lat0.1"):
            wg = [1.0 if "0.5" in name else 3.0] * n
            return Costs(f=ones, i=ones, w=ones, comm=0.1, activation_bytes=act, weight_grad_bytes=wg)
        raise ValueError(f"unknown cost model {name!r}")

    @property
    def layouts(self) -> tuple[str, ...]:
        return ("loop", "v") if self.v == 2 else ("loop",)


COSTS_MAIN = ("uniform", "B=2F,lat0.5", "lightW,lat0.1", "last1.6x,lat0.1", "first1.3x,lat0.2")


def suite() -> list[Case]:
    cases = [Case(4, 2, 6, c, k) for c in COSTS_MAIN for k in (3, 4, 5, 6)]
    cases += [Case(4, 2, 8, c, k) for c in COSTS_MAIN for k in (4, 6)]
    cases += [Case(4, 2, 6, c, k) for c in ("wgrad0.5,lat0.1", "wgrad1.5,lat0.1") for k in (4, 6)]
    cases += [Case(4, 1, 8, c, k) for c in ("uniform", "lightW,lat0.1") for k in (2, 3)]
    cases += [Case(4, 3, 6, c, 4) for c in ("uniform", "B=2F,lat0.5")]
    return cases


def check_optimum(case: Case, problem: Problem, found: exact.Exact) -> float:
    """The exact model's orders, simulated by ``simulate``: the same makespan (or shorter, where
    CP-SAT stopped at a solution not tight in time: the orders run as soon as possible), peaks
    within the limit and equal to the model's (the prefix sums of the orders), else the script
    stops. Returns the simulated makespan."""
    assert found.orders is not None
    schedule = problem.to_schedule(found.orders, name="Exact")
    result = simulate(schedule, case.costs())
    peaks = result.peak_memory_bytes
    assert peaks is not None
    limit = case.limit * case.unit
    slower = result.makespan > found.makespan + _EPS
    if slower or (found.optimal and result.makespan < found.makespan - _EPS) or max(peaks.values()) > limit + _EPS:
        raise SystemExit(
            f"{case.key}: the exact model disagrees with simulate: makespan {found.makespan} there, "
            f"{result.makespan} simulated; peaks {peaks} against a limit of {limit}"
        )
    for r, program in enumerate(found.orders):
        if abs(problem.peak(program, r) - peaks[r]) > _EPS:
            raise SystemExit(f"{case.key}: rank {r} peaks at {peaks[r]} simulated, {problem.peak(program, r)} modelled")
    return result.makespan


def optimum(case: Case, cache: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The best makespan over the case's layouts, its lower bound and whether it is proven."""
    entry = cache.get(case.key)
    if entry is None or args.resolve:
        entry = {}
        below: float | None = None
        for place in case.layouts:
            problem = layout_problem(
                case.ranks, case.microbatches, case.costs(), case.limit * case.unit, case.v, place, True
            )
            found = exact.solve(problem, time_limit=args.exact_time, workers=args.workers, at_most=below)
            makespan = None if found.orders is None else round(check_optimum(case, problem, found), 9)
            if found.optimal:
                below = found.makespan if below is None else min(below, found.makespan)
            entry[place] = {
                "makespan": makespan,
                "bound": found.lower_bound,
                "optimal": found.optimal,
                "seconds": round(found.seconds, 1),
            }
        cache[case.key] = entry
        CACHE.write_text(json.dumps(cache, indent=1, sort_keys=True) + "\n")
    layouts = [entry[place] for place in case.layouts]
    best = min((e["makespan"] for e in layouts if e["makespan"] is not None), default=math.inf)
    bound = min(
        (e["bound"] if e["makespan"] is None else e["makespan"]) if e["optimal"] else e["bound"] for e in layouts
    )
    by_auto = entry.get("by_auto", math.inf)  # a shorter schedule an auto run found (never a proven optimum)
    return {"makespan": min(best, by_auto), "bound": bound, "optimal": bound >= best - _EPS, "by_auto": by_auto < best}


def record_auto(case: Case, cache: dict[str, Any], opt: dict[str, Any], makespan: float) -> dict[str, Any]:
    """``opt`` with auto's simulated ``makespan`` as the best known where it is shorter (and the
    cache so updated); shorter than a proven optimum stops the script: the models disagree."""
    if makespan >= opt["makespan"] - _EPS:
        return opt
    if opt["optimal"]:
        raise SystemExit(f"{case.key}: auto's {makespan} beats the proven optimum {opt['makespan']}")
    cache[case.key]["by_auto"] = makespan
    CACHE.write_text(json.dumps(cache, indent=1, sort_keys=True) + "\n")
    return {**opt, "makespan": makespan, "by_auto": True}


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in values) / len(values)) if values else math.nan


def main() -> None:
    default = inspect.signature(auto_schedule).parameters["time_limit"].default
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=default, help=f"auto's (default: its own, {default:g} s)")
    parser.add_argument("--exact-time", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--resolve", action="store_true", help="solve the optima again, not from the cache")
    parser.add_argument("--only", default="", help="cases whose name contains this text")
    parser.add_argument("--optima-only", action="store_true", help="solve and cache the optima, no auto")
    parser.add_argument("--cached-only", action="store_true", help="only the cases whose optima are cached")
    args = parser.parse_args()
    exact.preload()  # once, before any case's clock starts
    cache: dict[str, Any] = json.loads(CACHE.read_text()) if CACHE.exists() else {}
    print(
        f"auto_schedule at time_limit={args.time_limit:g} s; optimum: CP-SAT, {args.exact_time:g} s x {args.workers} workers per layout"
    )
    print(f"load average at the start: {' '.join(format(x, '.2f') for x in os.getloadavg())}")
    print()
    print("| case | optimum | auto | layout | auto / optimum | auto s |")
    print("|---|---:|---:|---|---:|---:|")
    ratios: list[float] = []
    worst: tuple[float, str] = (0.0, "")
    for case in suite():
        if args.only not in case.key or (args.cached_only and case.key not in cache):
            continue
        opt = optimum(case, cache, args)
        if args.optima_only:
            print(
                f"| {case.key} | {opt['makespan']:g}{'' if opt['optimal'] else ' (bound ' + format(opt['bound'], 'g') + ')'} |",
                flush=True,
            )
            continue
        costs, limit = case.costs(), case.limit * case.unit
        started = time.perf_counter()
        schedule = auto_schedule(case.ranks, case.microbatches, costs, limit, time_limit=args.time_limit)
        wall = time.perf_counter() - started
        result = simulate(schedule, costs)
        assert result.peak_memory_bytes is not None
        peak = max(result.peak_memory_bytes.values())
        if peak > limit + _EPS:
            raise SystemExit(f"{case.key}: auto's schedule peaks at {peak} > {limit}")
        opt = record_auto(case, cache, opt, result.makespan)
        ratio = result.makespan / opt["makespan"]
        ratios.append(ratio)
        worst = max(worst, (ratio, case.key))
        place = "v" if schedule.stage_to_rank.get(2 * case.ranks - 1) == 0 and case.v == 2 else "loop"
        shown = f"{opt['makespan']:g}" + ("" if opt["optimal"] else f" (bound {opt['bound']:g})")
        shown += " (auto's)" if opt["by_auto"] else ""
        print(
            f"| {case.key} | {shown} | {result.makespan:g} | {schedule.name} ({place}) | {ratio:.3f} | {wall:.1f} |",
            flush=True,
        )
    if ratios:
        print()
        print(f"load average at the end: {' '.join(format(x, '.2f') for x in os.getloadavg())}")
        print(
            f"{len(ratios)} cases: auto / optimum geometric mean {geomean(ratios):.4f}, worst {worst[0]:.4f} ({worst[1]})"
        )


if __name__ == "__main__":
    main()
