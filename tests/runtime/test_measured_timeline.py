"""The measured timeline times compute from the moment its inputs are there: a wait shows as a gap,
not inside the waiting action's box (so measured costs are not inflated by the peer's slowness)."""

from __future__ import annotations

import time

import pytest
import torch

from support.dist import run_ranks

pytestmark = pytest.mark.slow

_SLEEP = 0.3


class _Slow(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(_SLEEP)
        return self.lin(x)


def _run(rank: int, world: int) -> list[tuple[str, float, float]]:
    from pipetrain import PipelineStage, Schedule1F1B

    torch.manual_seed(0)
    module = _Slow() if rank == 0 else torch.nn.Linear(4, 4)
    stage = PipelineStage(module, rank, world, "cpu")
    sched = Schedule1F1B(stage, 1, loss_fn=torch.nn.functional.mse_loss)
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    sched.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None)
    timeline = sched.gather_timeline()
    assert timeline is not None
    return [(e.action, e.start, e.end) for e in timeline.events if e.rank == 1]


def test_a_wait_for_the_peer_is_not_counted_as_compute() -> None:
    events = run_ranks(_run, 2)[1]
    forward = next((start, end) for label, start, end in events if label == "1F0")
    assert forward[1] - forward[0] < _SLEEP / 2, events  # rank 0's 0.3 s forward is a gap on rank 1
