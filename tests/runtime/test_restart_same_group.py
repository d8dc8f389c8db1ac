"""A failure before any message was exchanged does not poison the group; a real one leaves a new group usable.

Failure stories are kept per *round* (a schedule's first step, or a schedule refused while being
built), which every rank counts alike: a refusal stops its round on every rank and no later one.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import torch
from torch import nn

from support.dist import run_ranks

pytestmark = pytest.mark.slow


class _Explodes(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("bug in the module")


def _trains(sched: Any, rank: int, world: int) -> float:
    """One training step; the mean loss on the last rank (nan elsewhere), which must be finite there."""
    torch.manual_seed(1)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    losses: list[torch.Tensor] = []
    last = rank == world - 1
    sched.step(*((x,) if rank == 0 else ()), **({"target": y, "losses": losses} if last else {}))
    return float(torch.stack(losses).mean()) if last else math.nan


def _error(fn: Any) -> tuple[str, float]:
    t0 = time.monotonic()
    try:
        fn()
    except Exception as err:
        return f"{type(err).__name__}: {err}", time.monotonic() - t0
    return "no error", time.monotonic() - t0


def _scenarios(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from pipetrain import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleZBVZeroBubble

    loss = nn.functional.mse_loss
    out: dict[str, Any] = {}

    def stage(index: int, num_stages: int = world, group: Any = None, module: nn.Module | None = None) -> Any:
        torch.manual_seed(index)
        return PipelineStage(module or nn.Linear(4, 4), index, num_stages, "cpu", group=group)

    # 1. Every rank makes the same mistake (ZBV needs two stages per rank), then the right call on
    #    the same (default) group trains.
    out["bad everywhere"] = _error(lambda: ScheduleZBVZeroBubble([stage(rank)], 4, loss_fn=loss))
    out["then trains"] = _trains(Schedule1F1B(stage(rank), 4, loss_fn=loss, timeout=60), rank, world)

    # 2. Only rank 1 makes it: rank 0's first step stops at once, naming rank 1's error; then both
    #    build the right schedule on the same group, and it trains.
    def one_rank_wrong() -> None:
        if rank == 1:
            ScheduleZBVZeroBubble([stage(rank)], 4, loss_fn=loss)
        else:
            _trains(Schedule1F1B(stage(rank), 4, loss_fn=loss, timeout=60), rank, world)

    out["bad on rank 1"] = _error(one_rank_wrong)
    out["then trains too"] = _trains(Schedule1F1B(stage(rank), 4, loss_fn=loss, timeout=60), rank, world)

    # 3. Ranks that disagree (4 against 8 microbatches) stop before any message: the group stays usable.
    out["disagree"] = _error(
        lambda: ScheduleGPipe(stage(rank), 8 if rank == 1 else 4, loss_fn=loss, timeout=60).step(
            *((torch.randn(8, 4),) if rank == 0 else ()), target=torch.randn(8, 4) if rank == world - 1 else None
        )
    )
    out["agreed after"] = _trains(ScheduleGPipe(stage(rank), 4, loss_fn=loss, timeout=60), rank, world)

    # 4. A real failure mid-step: that group is done (messages may be in flight), a new one trains.
    group = dist.new_group(backend="gloo")
    module = _Explodes(4, 4) if rank == 1 else None
    out["mid-step failure"] = _error(
        lambda: _trains(Schedule1F1B(stage(rank, group=group, module=module), 4, loss_fn=loss, timeout=60), rank, world)
    )
    out["same group refused"] = _error(lambda: Schedule1F1B(stage(rank, group=group), 4, loss_fn=loss))
    fresh = dist.new_group(backend="gloo")
    out["new group trains"] = _trains(Schedule1F1B(stage(rank, group=fresh), 4, loss_fn=loss, timeout=60), rank, world)
    return out


def test_a_refused_schedule_leaves_the_group_usable_and_a_new_group_follows_a_real_failure() -> None:
    results = run_ranks(_scenarios, 2, timeout=150)
    for rank, res in enumerate(results):
        msg, _ = res["bad everywhere"]
        # a ScheduleError (a PipelineError, and a ValueError as torch raises for a bad layout)
        assert "ScheduleError" in msg and "2 stages per rank" in msg, (rank, msg)
        msg, elapsed = res["bad on rank 1"]
        assert "rank 1: ScheduleZBVZeroBubble" in msg and elapsed < 10, (rank, msg)
        msg, _ = res["disagree"]
        assert "different schedules" in msg, (rank, msg)
        msg, _ = res["mid-step failure"]
        assert "ValueError: bug in the module" in msg, (rank, msg)
        msg, _ = res["same group refused"]
        assert "already failed" in msg and "dist.new_group" in msg, (rank, msg)
    for case in ("then trains", "then trains too", "agreed after", "new group trains"):
        assert math.isfinite(results[1][case]), (case, results[1])
    assert results[1]["then trains"] == results[1]["then trains too"] == results[1]["new group trains"]
