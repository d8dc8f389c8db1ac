"""auto_schedule against the named schedules (pipetrain's and torch 2.13's) and the exact optimum.

The suite of issue 14: five cost models with one duration per stage (uniform F=I=W=1; B=2F with
latency 0.5; a light W: I=1.5, W=0.5, latency 0.1; the last stage 1.6x heavier, latency 0.1; the
first stage 1.3x heavier, latency 0.2), 4 and 8 ranks, 1 and 2 stages per rank, p, 2p and 4p
microbatches, and memory limits of p and 2p stage activations per rank (activation_bytes 1 per
stage). Every schedule is simulated by the same simulator. ``--exact`` adds the CP-SAT optimum
(ortools) for 4 ranks and 4 or 8 microbatches.

Run: ``python benchmarks/auto_schedule.py [--time-limit 10] [--exact --exact-time 60] [--scale]``.
Ratios above 1 mean auto_schedule's makespan is shorter. With ortools installed (the ``solver``
extra, imported here before any case's clock starts) the planner's last step is CP-SAT over windows
of time (problems up to 1000 actions), so the tables depend on it; without it, local search takes
that time. The search is time-bound: on a loaded machine it finds less.
"""

from __future__ import annotations

import argparse
import math
import random
import time

from _torch_reference import to_pipetrain, torch_schedule_object
from pipetrain.plan import Costs, simulate
from pipetrain.plan.autoplan import exact
from pipetrain.plan.search import layout_problem, plan_schedule

TORCH_NAMES = {
    1: ("GPipe", "1F1B"),
    2: ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"),
}


def suite_costs(name: str, num_stages: int) -> Costs:
    ones = [1.0] * num_stages
    if name == "uniform":
        return Costs(f=ones, i=ones, w=ones, activation_bytes=ones)
    if name == "B=2F,lat0.5":
        return Costs(f=ones, i=ones, w=ones, comm=0.5, activation_bytes=ones)
    if name == "lightW,lat0.1":
        return Costs(f=ones, i=[1.5] * num_stages, w=[0.5] * num_stages, comm=0.1, activation_bytes=ones)
    heavy = list(ones)
    if name == "last1.6x,lat0.1":
        heavy[-1] = 1.6
        return Costs(f=heavy, i=heavy, w=heavy, comm=0.1, activation_bytes=ones)
    if name == "first1.3x,lat0.2":
        heavy[0] = 1.3
        return Costs(f=heavy, i=heavy, w=heavy, comm=0.2, activation_bytes=ones)
    raise ValueError(name)


COST_NAMES = ("uniform", "B=2F,lat0.5", "lightW,lat0.1", "last1.6x,lat0.1", "first1.3x,lat0.2")


def torch_best(p: int, m: int, v: int, costs: Costs, limit: float) -> tuple[str, float] | None:
    """torch 2.13's fastest named schedule for these sizes that fits the limit, simulated here."""
    best: tuple[str, float] | None = None
    for name in TORCH_NAMES[v]:
        theirs = torch_schedule_object(name, p, m, v)
        if theirs is None:
            continue
        schedule = to_pipetrain(theirs, repair_1f1b=True)
        result = simulate(schedule, costs)
        assert result.peak_memory_bytes is not None
        if max(result.peak_memory_bytes.values()) <= limit + 1e-9 and (best is None or result.makespan < best[1]):
            best = (name, result.makespan)
    return best


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in values) / len(values)) if values else float("nan")


def run_suite(args: argparse.Namespace) -> None:
    print(
        "| ranks | v | mb | costs | limit | auto | layout | best named (pipetrain) | best named (torch) | vs pipetrain | vs torch | optimum | auto/opt |"
    )
    print("|---:|---:|---:|---|---:|---:|---|---|---|---:|---:|---:|---:|")
    vs_ours: list[float] = []
    vs_torch: list[float] = []
    vs_opt: list[float] = []
    worst_opt = 0.0
    ranks = [int(x) for x in args.ranks.split(",")]
    for p in ranks:
        for v in (1, 2):
            for m in (p, 2 * p, 4 * p):
                for cost_name in COST_NAMES:
                    costs = suite_costs(cost_name, p * v)
                    for limit in (float(p), float(2 * p)):
                        plan = plan_schedule(p, m, costs, limit, time_limit=args.time_limit)
                        check = simulate(plan.schedule, costs)
                        assert check.makespan == plan.makespan and check.peak_memory_bytes is not None
                        assert max(check.peak_memory_bytes.values()) <= limit + 1e-9
                        named = plan.best_named
                        ours = f"{named.name} {named.result.makespan:g}" if named else "none fits"
                        theirs = torch_best(p, m, v, costs, limit)
                        tname = f"{theirs[0]} {theirs[1]:g}" if theirs else "none fits"
                        r_ours = named.result.makespan / plan.makespan if named else None
                        r_torch = theirs[1] / plan.makespan if theirs else None
                        if r_ours is not None:
                            vs_ours.append(r_ours)
                        if r_torch is not None:
                            vs_torch.append(r_torch)
                        opt = ratio = ""
                        if args.exact and p == 4 and m in (4, 8):
                            problem = layout_problem(
                                p,
                                m,
                                costs,
                                limit,
                                v,
                                "v" if plan.schedule.stage_to_rank.get(2 * p - 1) == 0 and v == 2 else "loop",
                                True,
                            )
                            solved = exact.solve(
                                problem, hint=problem.orders_of(plan.schedule), time_limit=args.exact_time
                            )
                            opt = f"{solved.makespan:g}{'' if solved.optimal else ' (bound ' + format(solved.lower_bound, 'g') + ')'}"
                            ratio_value = plan.makespan / solved.makespan
                            vs_opt.append(ratio_value)
                            worst_opt = max(worst_opt, ratio_value)
                            ratio = f"{ratio_value:.3f}"
                        layout = f"{plan.schedule.name}"
                        print(
                            f"| {p} | {v} | {m} | {cost_name} | {limit:g} | {plan.makespan:g} | {layout} | {ours} | {tname} | "
                            f"{'' if r_ours is None else format(r_ours, '.3f')} | {'' if r_torch is None else format(r_torch, '.3f')} | {opt} | {ratio} |",
                            flush=True,
                        )
    print()
    print(
        f"geometric mean speed-up over the best fitting named schedule: pipetrain's {geomean(vs_ours):.4f} ({len(vs_ours)} cases), torch's {geomean(vs_torch):.4f} ({len(vs_torch)} cases)"
    )
    print(
        f"never slower than pipetrain's named: {all(r >= 1 - 1e-9 for r in vs_ours)}; than torch's: {all(r >= 1 - 1e-9 for r in vs_torch)}"
    )
    if vs_opt:
        print(
            f"auto / optimum (best found by CP-SAT in {args.exact_time:g} s): geometric mean {geomean(vs_opt):.4f}, worst {worst_opt:.4f}"
        )


def run_scale(args: argparse.Namespace) -> None:
    print("| ranks x stages x microbatches | time limit (s) | wall (s) | auto makespan | best named | ratio |")
    print("|---|---:|---:|---:|---|---:|")
    for p, v, m, limit_s in ((16, 2, 128, 10.0), (64, 2, 512, 10.0)):
        costs = suite_costs("B=2F,lat0.5", p * v)
        started = time.perf_counter()
        plan = plan_schedule(p, m, costs, float(2 * p), time_limit=limit_s)
        wall = time.perf_counter() - started
        named = plan.best_named
        print(
            f"| {p} x {v} x {m} | {limit_s:g} | {wall:.1f} | {plan.makespan:g} | {named.name + ' ' + format(named.result.makespan, 'g') if named else 'none fits'} | {named.result.makespan / plan.makespan if named else float('nan'):.4f} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--ranks", default="4,8")
    parser.add_argument(
        "--exact", action="store_true", help="also the CP-SAT optimum for 4 ranks, 4 and 8 microbatches"
    )
    parser.add_argument("--exact-time", type=float, default=60.0)
    parser.add_argument("--scale", action="store_true", help="only the search-time table at 16x2x128 and 64x2x512")
    args = parser.parse_args()
    random.seed(0)
    if exact.available():
        exact.preload()  # once, before the clock of any case starts (the planner then uses CP-SAT)
    if args.scale:
        run_scale(args)
    else:
        run_suite(args)


if __name__ == "__main__":
    main()
