"""Schedule quality: pipetrain's schedules beside torch 2.13's schedules of the same name.

Both are simulated by the same simulator under the same costs (default F=1, B=2, I=W=1, free
communication), so the ratios compare only the orders of actions. torch's order is taken from
its schedule classes (built on stand-in stages; no process group), loaded as a pipetrain
Schedule and validated first. Run: ``python benchmarks/schedule_quality.py [--sizes 4x8,8x32]``.

Ratios below 1 mean pipetrain's schedule is better (shorter step, less memory).
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

import torch.distributed.pipelining.schedules as torch_schedules

from pipetrain.plan import Schedule, ScheduleError, build_schedule
from pipetrain.plan.costs import Costs
from pipetrain.plan.simulate import simulate

NAMES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
V_PLACED = ("zbvzerobubble", "dualpipev")
NON_COMPUTE = ("REDUCE_GRAD", "UNSHARD", "RESHARD", "SEND_F", "RECV_F", "SEND_B", "RECV_B")


def _stand_in(stage: int, num_stages: int, num_ranks: int) -> SimpleNamespace:
    # What torch's schedule constructors read from a stage to compute their order (rank 0's view;
    # every rank computes the whole pipeline_order).
    return SimpleNamespace(
        stage_index=stage,
        num_stages=num_stages,
        group_rank=0,
        group_size=num_ranks,
        is_first=stage == 0,
        is_last=stage == num_stages - 1,
        submod=None,
        stage_index_to_group_rank={},
    )


def _compute_only(action: Any) -> str:
    text = "" if action is None else str(action)
    return "" if any(text.endswith(kind) for kind in NON_COMPUTE) else text


def torch_order(name: str, num_ranks: int, num_microbatches: int, stages_per_rank: int) -> Schedule:
    """torch's compute-only order for ``name`` as a pipetrain Schedule."""
    cls = torch_schedules.get_schedule_class(name)
    n = num_ranks * stages_per_rank
    if issubclass(cls, torch_schedules.PipelineScheduleSingle):
        sched: Any = cls(_stand_in(0, num_ranks, num_ranks), num_microbatches)
    elif name.lower() in V_PLACED:
        sched = cls([_stand_in(0, n, num_ranks), _stand_in(n - 1, n, num_ranks)], num_microbatches)
    else:
        stages = [_stand_in(v * num_ranks, n, num_ranks) for v in range(stages_per_rank)]
        sched = cls(stages, num_microbatches)
    rows = []
    for rank in range(num_ranks):
        cells = [_compute_only(a) for a in sched.pipeline_order[rank]]
        # REDUCE_GRAD (single-stage schedules) is not compute: drop it, keep idle steps.
        while cells and cells[-1] == "":
            cells.pop()
        rows.append(",".join(cells))
    return Schedule.from_csv_text("\n".join(rows) + "\n", name=f"torch {name}")


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
