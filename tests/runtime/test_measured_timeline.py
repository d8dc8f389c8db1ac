"""The measured timeline times compute from the moment its inputs are there: a wait shows as a gap,
not inside the waiting action's box (so measured costs are not inflated by the peer's slowness)."""

from __future__ import annotations

import time
from typing import ClassVar

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


class _StandInClock:
    """A device clock for the CPU: each mark reads as -1 s plus a millisecond per mark made (the
    host's perf_counter is never negative, and may be small on a machine just booted)."""

    made: ClassVar[list[_StandInClock]] = []

    def __init__(self, device: torch.device) -> None:
        self.starts = 0
        self.reads = 0
        self.marks = 0
        _StandInClock.made.append(self)

    def start(self) -> None:
        self.starts += 1

    def mark(self) -> int:
        self.marks += 1
        return self.marks

    def read(self, marks: list[int]) -> list[int]:
        self.reads += 1
        return [-(10**9) + k * 10**6 for k in marks]


def _device_timed(rank: int, world: int) -> dict[str, object]:
    from pipetrain import PipelineStage, ScheduleZBVZeroBubble
    from pipetrain.runtime import device_timing

    device_timing._CLOCKS["cpu"] = _StandInClock
    torch.manual_seed(0)
    mine = [rank, 2 * world - 1 - rank]
    stages = [PipelineStage(torch.nn.Linear(4, 4), s, 2 * world, "cpu") for s in mine]
    sched = ScheduleZBVZeroBubble(stages, 4, loss_fn=torch.nn.functional.mse_loss)
    x, y = torch.randn(8, 4), torch.randn(8, 4)

    def step() -> None:
        sched.step(*((x,) if rank == 0 else ()), target=y if rank == 0 else None)

    step()
    host = sched.last_timeline
    assert host is not None and not _StandInClock.made  # off by default: no clock, host times
    sched.device_timing = True
    step()
    clock = _StandInClock.made[-1]
    first = sched.last_timeline
    again = sched.last_timeline
    assert first is not None and again is not None
    compute = [e for e in first.events if e.kind in ("F", "I", "W", "B")]
    comm = [e for e in first.events if e.kind not in ("F", "I", "W", "B")]
    sched.device_timing = False
    step()
    clocks_made = len(_StandInClock.made)
    # A step that fails midway keeps host times: its marks are never read (on a GPU, the stream
    # may wait forever for a dead peer's data).
    sched.device_timing = True
    stages[0].submodule.register_forward_hook(lambda *_: 1 / 0 if rank == 1 else None)
    from pipetrain.errors import PipelineError

    with pytest.raises(PipelineError):
        step()
    failed = sched.last_timeline
    assert failed is not None
    return {
        "compute": [(e.start, e.end) for e in compute],
        "comm_starts": [e.start for e in comm],
        "again": [(e.start, e.end) for e in again.events] == [(e.start, e.end) for e in first.events],
        "starts_reads_marks": (clock.starts, clock.reads, clock.marks),
        "clocks_made": clocks_made,
        "failed_step": (_StandInClock.made[-1].reads, min((e.start for e in failed.events), default=0.0) >= 0),
    }


def test_device_timing_times_compute_with_the_device_clock_only_when_asked() -> None:
    """With ``device_timing`` on, each compute action's box is read from its two marks on the device
    (here a stand-in clock on the CPU); SEND/RECV keep the host's times; the marks are read once,
    when the timeline is first built; the next step without it makes no clock; a failed step's
    marks are never read."""
    for out in run_ranks(_device_timed, 2):
        compute = out["compute"]
        # 2 stages × 4 microbatches × F, I, W on each rank: marks 1..24, two per action, in order.
        assert compute == [(-1 + (2 * k + 1) / 1000, -1 + (2 * k + 2) / 1000) for k in range(24)], compute
        assert all(start >= 0 for start in out["comm_starts"])  # the host's perf_counter
        assert out["again"] is True
        assert out["starts_reads_marks"] == (1, 1, 48)
        assert out["clocks_made"] == 1
        assert out["failed_step"] == (0, True)
