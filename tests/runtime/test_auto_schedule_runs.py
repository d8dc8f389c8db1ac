"""A constructed schedule runs on real gloo ranks with the gradients of plain training.

The plan is made below every named schedule's memory (so it equals none of them), on rank 0 of
each process alike (the search is deterministic for a seed), and run by PipelineScheduleRuntime.
"""

from __future__ import annotations

import pytest

from support.dist import run_ranks
from support.models import train_csv_schedule

pytestmark = pytest.mark.slow


def _plan(world: int, m: int, placement: str) -> object:
    from pipetrain.plan import Costs, auto_schedule

    n = 2 * world
    f = [1.0] * (n - 1) + [1.6]
    costs = Costs(f=f, i=f, w=f, comm=0.1, activation_bytes=[1.0] * n)
    return auto_schedule(world, m, costs, memory_limit=float(world), placement=placement, time_limit=0.5, seed=0)


def _train(rank: int, world: int, m: int, csv: str) -> list[str]:
    return [f"rank {rank}: stages {train_csv_schedule(rank, csv)}"]


@pytest.mark.parametrize(("world", "placement"), [(2, "v"), (4, "loop")])
def test_a_constructed_schedule_trains_like_plain_training(world: int, placement: str, tmp_path: object) -> None:
    from pipetrain.plan import Schedule, build_schedule, schedule_names

    m = 2 * world
    schedule = _plan(world, m, placement)
    assert isinstance(schedule, Schedule) and schedule.name == "Auto"
    for name in schedule_names():  # no named schedule is this order
        try:
            named = build_schedule(name, world, m, 2)
        except Exception:
            continue
        assert named.actions != schedule.actions, name
    path = f"{tmp_path}/auto.csv"
    schedule.to_csv(path)
    done = run_ranks(_train, world, m, path)
    assert len(done) == world
