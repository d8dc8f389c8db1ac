"""A failure on one rank becomes a clear error on every rank, quickly; bad input is named."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from _dist import run_ranks
from torch import nn

pytestmark = pytest.mark.slow


class Explodes(nn.Module):
    """A module with a bug: its forward raises on call number ``fail_on`` (counting from 0)."""

    def __init__(self, fail_on: int) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0
        self.fail_on = fail_on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls - 1 == self.fail_on:
            raise ValueError("bug in the module")
        return self.lin(x)


class Unsendable(nn.Module):
    """Returns its activation with a lock beside it: a plain value that cannot be pickled."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        import threading

        return {"x": self.lin(x), "lock": threading.Lock()}


def _expect_error(fn: Any) -> tuple[str, float]:
    from pipetrain.errors import PipelineError

    t0 = time.monotonic()
    try:
        fn()
    except PipelineError as err:
        return str(err), time.monotonic() - t0
    raise AssertionError("no PipelineError was raised")


def _scenarios(rank: int, world: int) -> dict[str, tuple[str, float]]:
    import torch.distributed as dist

    from pipetrain import PipelineScheduleRuntime, PipelineStage, Schedule1F1B, ScheduleGPipe
    from pipetrain.plan import Schedule

    out: dict[str, tuple[str, float]] = {}
    loss = nn.functional.mse_loss
    x = torch.randn(8, 4)
    y = torch.randn(8, 4)

    def stage(group: Any, module: nn.Module | None = None, index: int | None = None) -> PipelineStage:
        torch.manual_seed(0)
        return PipelineStage(module or nn.Linear(4, 4), rank if index is None else index, world, "cpu", group=group)

    def inputs(first: Any = x, last: Any = y) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return ((first,) if rank == 0 else ()), {"target": last if rank == world - 1 else None}

    # 1. A module raises mid-step on the middle rank (microbatch 2 of 4 in step 1): everybody stops.
    group = dist.new_group(backend="gloo")
    sched = Schedule1F1B(stage(group, Explodes(fail_on=6 if rank == 1 else -1)), 4, loss_fn=loss, timeout=60)
    args, kw = inputs()
    sched.step(*args, **kw)
    out["module raises"] = _expect_error(lambda: sched.step(*args, **kw))

    # 2. Batch smaller than the number of microbatches (detected on the first rank only).
    group = dist.new_group(backend="gloo")
    sched = ScheduleGPipe(stage(group), 4, loss_fn=loss, timeout=60)
    args, kw = inputs(first=torch.randn(3, 4))
    out["small batch"] = _expect_error(lambda: sched.step(*args, **kw))

    # 3. Target missing on the last stage's rank.
    group = dist.new_group(backend="gloo")
    sched = ScheduleGPipe(stage(group), 4, loss_fn=loss, timeout=60)
    args, _ = inputs()
    out["no target"] = _expect_error(lambda: sched.step(*args, target=None))

    # 4. Stages that do not match the schedule's placement (rank 1 passes stage 0).
    group = dist.new_group(backend="gloo")

    def wrong_stage() -> None:
        st = stage(group, index=0 if rank == 1 else rank)
        s = ScheduleGPipe(st, 4, loss_fn=loss, timeout=60)
        a, k = inputs()
        s.step(*a, **k)

    out["wrong stage"] = _expect_error(wrong_stage)

    # 5. A schedule that fails validation is refused on every rank before any communication.
    group = dist.new_group(backend="gloo")
    broken = Schedule.from_csv_text("\n".join(f"{r}B0,{r}F0" for r in range(world)) + "\n")

    def invalid() -> None:
        PipelineScheduleRuntime(stage(group), broken, loss_fn=loss, timeout=60)

    out["invalid schedule"] = _expect_error(invalid)

    # 6. A stage output that cannot be sent (a value pickle refuses) fails on the sending rank, and
    #    the ranks waiting for it hear why.
    group = dist.new_group(backend="gloo")
    sched = ScheduleGPipe(stage(group, Unsendable() if rank == 0 else None), 4, loss_fn=loss, timeout=60)
    args, kw = inputs()
    out["unsendable output"] = _expect_error(lambda: sched.step(*args, **kw))
    return out


def test_every_rank_fails_fast_and_names_the_failure() -> None:
    results = run_ranks(_scenarios, 3, timeout=240)
    for rank, res in enumerate(results):
        msg, elapsed = res["module raises"]
        assert elapsed < 30, (rank, elapsed, msg)
        # the failing rank, its action, the step and the cause are named on every rank
        assert "rank 1, step 1, action 1F2: ValueError: bug in the module" in msg, (rank, msg)
        msg, elapsed = res["small batch"]
        assert elapsed < 30 and "args[0]" in msg and "rank 0" in msg, (rank, msg)
        msg, elapsed = res["no target"]
        assert elapsed < 30 and "target" in msg and f"rank {2}" in msg, (rank, msg)
        msg, elapsed = res["wrong stage"]
        assert elapsed < 30 and "rank 1" in msg and "stages [0]" in msg, (rank, msg)
        msg, _ = res["invalid schedule"]
        assert "cannot run" in msg and "B0" in msg and "needs" in msg, (rank, msg)
        msg, elapsed = res["unsendable output"]
        assert elapsed < 30 and "rank 0, step 0, action 0SEND_F0" in msg and "pickle" in msg, (rank, msg)


class Slow(nn.Module):
    """A stage that takes its time: its peer fails while a send to it is still pending."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.3)
        return self.lin(x)


def _fails_with_a_send_pending(rank: int, world: int) -> tuple[str, float]:
    from pipetrain import ScheduleGPipe
    from pipetrain.stage import PipelineStage

    torch.manual_seed(0)
    module = Explodes(fail_on=2) if rank == 0 else Slow()
    sched = ScheduleGPipe(PipelineStage(module, rank, world, "cpu"), 4, loss_fn=nn.functional.mse_loss, timeout=60)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    result = _expect_error(lambda: sched.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None))
    if rank == 0:
        time.sleep(8)  # a failed rank lives on for a while (logging, cleanup): its connections stay open
    return result


def test_a_rank_failing_with_a_send_still_pending_does_not_stall_its_peer() -> None:
    """Rank 0 fails at microbatch 2 while its send of microbatch 1 waits for the slow rank 1 to post
    the receive. That send must stay alive: gloo would otherwise leave the connection stuck, and
    rank 1 would wait its whole timeout for data and for the failure notice queued behind it."""
    results = run_ranks(_fails_with_a_send_pending, 2, timeout=120)
    msg, elapsed = results[1]
    # without the fix rank 1 waits until rank 0's process ends (8 s here), its I/O thread spinning
    assert elapsed < 5 and "rank 0, step 0, action 0F2: ValueError: bug in the module" in msg, (elapsed, msg)
