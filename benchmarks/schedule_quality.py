"""Schedule quality: pipetrain's schedules beside torch 2.13's schedules of the same name.

Both are simulated by the same simulator under the same costs (default F=1, B=2, I=W=1, free
communication), so the ratios compare only the orders of actions. torch's order is taken from
its schedule classes (built on stand-in stages; no process group), loaded as a pipetrain
Schedule and validated first. Run: ``python benchmarks/schedule_quality.py [--sizes 4x8,8x32]``.

Ratios below 1 mean pipetrain's schedule is better (shorter step, less memory).
"""

from __future__ import annotations

import argparse

from _torch_reference import to_pipetrain, torch_schedule_object
from pipetrain.plan import Schedule, ScheduleError, build_schedule
from pipetrain.plan.costs import Costs
from pipetrain.plan.simulate import simulate

NAMES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def torch_order(name: str, num_ranks: int, num_microbatches: int, stages_per_rank: int) -> Schedule | None:
    """torch's compute-only order for ``name`` as a pipetrain Schedule, or None if torch rejects the sizes.

    Taken as torch prints it: 1F1B's off-by-one last rank is not repaired, so the table shows it.
    """
    theirs = torch_schedule_object(name, num_ranks, num_microbatches, stages_per_rank)
    return None if theirs is None else to_pipetrain(theirs, repair_1f1b=False)


def _difference(ours: Schedule, theirs: Schedule | None) -> str:
    """Which compute actions torch's order has that a complete schedule lacks, and vice versa."""
    if theirs is None:
        return ""
    mine = {str(a) for a in ours.iter_actions() if a is not None}
    other = {str(a) for a in theirs.iter_actions() if a is not None}
    extra, missing = sorted(other - mine), sorted(mine - other)
    if not extra and not missing:
        return ""
    return f"runs {', '.join(extra) or 'nothing extra'}; never runs {', '.join(missing) or '-'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4x8,4x16,8x16,8x32", help="ranks x microbatches, comma separated")
    parser.add_argument("--costs", default="f=1,b=2,i=1,w=1,comm=0")
    args = parser.parse_args()
    costs = Costs(**{k: float(v) for k, v in (kv.split("=") for kv in args.costs.split(","))})
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]
    print(f"Simulated under {args.costs}; ratio = pipetrain / torch 2.13 (lower is better).\n")
    print(
        "| schedule | P × M | makespan pipetrain | makespan torch | ratio | bubble pipetrain | bubble torch | peak act. ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in NAMES:
        for p, m in sizes:
            v = 1 if name in ("GPipe", "1F1B") else 2
            row = f"| {name} | {p} × {m} |"
            try:
                ours_schedule = build_schedule(name, p, m, v)
                ours = simulate(ours_schedule, costs)
            except ScheduleError as err:
                print(f"{row} pipetrain: {err} | | | | | |")
                continue
            theirs_schedule = None
            try:
                theirs_schedule = torch_order(name, p, m, v)
                if theirs_schedule is None:
                    print(f"{row} {ours.makespan:g} | torch rejects these sizes | | {ours.bubble:.1%} | | |")
                    continue
                theirs_schedule.validate()
                theirs = simulate(theirs_schedule, costs)
            except (ScheduleError, ValueError, AssertionError, KeyError) as err:
                reason = _difference(ours_schedule, theirs_schedule) or str(err).split(";")[0][:90]
                print(f"{row} {ours.makespan:g} | torch's order is invalid: {reason} | | {ours.bubble:.1%} | | |")
                continue
            print(
                f"{row} {ours.makespan:g} | {theirs.makespan:g} | {ours.makespan / theirs.makespan:.3f} | "
                f"{ours.bubble:.1%} | {theirs.bubble:.1%} | {ours.max_peak_memory / theirs.max_peak_memory:.2f} |"
            )


if __name__ == "__main__":
    main()
