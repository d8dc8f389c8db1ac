"""torch's way of writing a schedule class: subclass PipelineScheduleMulti and assign a compute-only
``pipeline_order`` in ``__init__``. It runs (validated and lowered as a CSV file is) and trains like
plain training; an order that places this rank's stages elsewhere is refused by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from support.dist import run_ranks

pytestmark = pytest.mark.slow


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])


def _worker(rank: int, world: int) -> dict[str, Any]:
    from pipetrain import PipelineStage
    from pipetrain.schedules import PipelineScheduleMulti, _Action

    torch.set_num_threads(1)

    class MyLooped(PipelineScheduleMulti):
        """Two stages per rank, all forwards then all backwards, written by hand."""

        def __init__(self, stages: list[Any], n_microbatches: int, loss_fn: Any = None) -> None:
            super().__init__(stages, n_microbatches, loss_fn)
            n = n_microbatches
            fwd = {0: [0, 2], 1: [1, 3]}
            self.pipeline_order = {
                r: [_Action(s, _Action.from_str("0F0").computation_type, m) for s in fwd[r] for m in range(n)]
                + [_Action.from_str(f"{s}B{m}") for s in reversed(fwd[r]) for m in range(n)]
                for r in range(world)
            }

    model = _model()
    held = {0: [0, 2], 1: [1, 3]}[rank]
    stages = [PipelineStage(model[s], s, 4, "cpu") for s in held]
    schedule = MyLooped(stages, 4, loss_fn=nn.functional.mse_loss)
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 8, generator=torch.Generator().manual_seed(2))
    schedule.step(x, target=y)
    ref = _model()
    loss = sum(nn.functional.mse_loss(ref(a), b) for a, b in zip(x.chunk(4), y.chunk(4), strict=True))
    (loss / 4).backward()
    for s in held:
        for p, q in zip(model[s].parameters(), ref[s].parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)
    refused = ""
    try:
        wrong = PipelineScheduleMulti([PipelineStage(_model()[s], s, 4, "cpu") for s in held], 4)
        swapped = {0: [1, 3], 1: [0, 2]}  # a whole order, but rank 0's stages on rank 1 and back
        wrong.pipeline_order = {
            r: [_Action.from_str(f"{s}F{m}") for s in swapped[r] for m in range(4)]
            + [_Action.from_str(f"{s}B{m}") for s in reversed(swapped[r]) for m in range(4)]
            for r in range(world)
        }
    except Exception as err:
        refused = f"{type(err).__name__}: {err}"
    return {"order": [str(a) for a in schedule.pipeline_order[rank]], "refused": refused}


def test_a_class_that_assigns_pipeline_order_trains_like_plain_training() -> None:
    results = run_ranks(_worker, 2, timeout=120)
    assert results[0]["order"][:2] == ["0F0", "0F1"]
    for rank, res in enumerate(results):
        assert f"rank {rank}: pipeline_order places stages" in res["refused"], (rank, res["refused"])


def _prepared(rank: int, world: int, fmt: str) -> dict[str, Any]:
    """torch's ``_prepare_schedule_with_comms``: a ``{rank: actions}`` order given directly, split
    backward (I then W) on rank 0's two stages, the order lowered here (compute_only) or given
    with its SEND/RECV (compute_comms)."""
    from pipetrain import PipelineStage
    from pipetrain.plan import Schedule
    from pipetrain.schedules import _Action, _PipelineScheduleRuntime

    torch.set_num_threads(1)
    compute = {
        0: ["0F0", "0F1", "2F0", "2F1", "2I0", "2W0", "2I1", "2W1", "0I0", "0I1", "0W0", "0W1"],
        1: ["1F0", "1F1", "3F0", "3F1", "3B0", "3B1", "1B0", "1B1"],
    }
    text = {r: row for r, row in compute.items()}
    if fmt == "compute_comms":
        lowered = Schedule(
            {r: [_Action.from_str(a) for a in row] for r, row in compute.items()}, num_microbatches=2
        ).lower()
        text = {r: [str(a) for a in lowered.actions[r]] for r in range(world)}
    model = _model()
    held = {0: [0, 2], 1: [1, 3]}[rank]
    stages = [PipelineStage(model[s], s, 4, "cpu") for s in held]
    schedule = _PipelineScheduleRuntime(stages, 2, loss_fn=nn.functional.mse_loss)
    schedule._prepare_schedule_with_comms({r: [_Action.from_str(a) for a in row] for r, row in text.items()}, fmt)
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 8, generator=torch.Generator().manual_seed(2))
    schedule.step(x if rank == 0 else None, target=y if rank == 1 else None)
    ref = _model()
    loss = sum(nn.functional.mse_loss(ref(a), b) for a, b in zip(x.chunk(2), y.chunk(2), strict=True))
    (loss / 2).backward()
    for s in held:
        for p, q in zip(model[s].parameters(), ref[s].parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)
    refused = ""
    try:  # the same compute-only order named lowered: refused, saying which format it is
        other = _PipelineScheduleRuntime([PipelineStage(_model()[s], s, 4, "cpu") for s in held], 2)
        other._prepare_schedule_with_comms(
            {r: [_Action.from_str(a) for a in row] for r, row in compute.items()}, "compute_comms"
        )
    except Exception as err:
        refused = f"{type(err).__name__}: {err}"
    return {"refused": refused}


@pytest.mark.parametrize("fmt", ["compute_only", "compute_comms"])
def test_prepare_schedule_with_comms_runs_a_given_order_like_plain_training(fmt: str) -> None:
    for res in run_ranks(_prepared, 2, fmt, timeout=120):
        assert "hold no SEND/RECV" in res["refused"] and "compute_only" in res["refused"], res["refused"]
