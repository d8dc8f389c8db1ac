"""A constructed schedule runs on real gloo ranks with the gradients of plain training.

The plan is made below every named schedule's memory (so it equals none of them), on rank 0 of
each process alike (the search is deterministic for a seed), and run by PipelineScheduleRuntime.
"""

from __future__ import annotations

import pytest
import torch

from support.dist import run_ranks
from support.models import make_batch, make_layers, reference

pytestmark = pytest.mark.slow


def _plan(world: int, m: int, placement: str) -> object:
    from pipetrain.plan import Costs, auto_schedule

    n = 2 * world
    f = [1.0] * (n - 1) + [1.6]
    costs = Costs(f=f, i=f, w=f, comm=0.1, activation_bytes=[1.0] * n)
    return auto_schedule(world, m, costs, memory_limit=float(world), placement=placement, time_limit=0.5, seed=0)


def _train(rank: int, world: int, m: int, csv: str) -> list[str]:
    from torch import nn

    from pipetrain import PipelineScheduleRuntime, PipelineStage
    from pipetrain.plan import Schedule

    schedule = Schedule.from_csv(csv)
    num_stages = schedule.num_stages
    layers = make_layers("mlp", num_stages)
    x, y = make_batch("mlp", 2 * m)
    ref_layers, ref_losses, _ = reference(layers, x, y, m)
    mine = [s for s, r in schedule.stage_to_rank.items() if r == rank]
    stages = [PipelineStage(layers[s], s, num_stages, "cpu") for s in mine]
    runtime = PipelineScheduleRuntime(stages, schedule, loss_fn=nn.functional.mse_loss)
    losses: list[torch.Tensor] = []
    runtime.step(*((x,) if 0 in mine else ()), target=y if num_stages - 1 in mine else None, losses=losses)
    for s in mine:
        for p, q in zip(layers[s].parameters(), ref_layers[s].parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda e, s=s: f"rank {rank} stage {s}: {e}")
    if num_stages - 1 in mine:
        torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
    return [f"rank {rank}: stages {mine}"]


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
