"""Each generator against torch 2.13's schedule of the same name: never longer, never more memory.

torch builds its compute-only pipeline order in the schedule constructor; lightweight stand-ins
for its stage objects (the attributes the constructors read) are enough to get it. Both orders
are simulated under F=1, B=2, I=W=1 with free communication and with a latency of half a
forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from pipetrain.plan.actions import Action, ActionKind
from pipetrain.plan.costs import Costs
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.generators import build_schedule
from pipetrain.plan.schedule import Schedule
from pipetrain.plan.simulate import simulate

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")


@dataclass
class FakeStage:
    """What torch's schedule constructors read from a stage, and nothing more."""

    stage_index: int
    num_stages: int
    group_size: int
    group_rank: int = 0
    submod: Any = None
    stage_index_to_group_rank: dict[int, int] = field(default_factory=dict)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1


def _loss(out: Any, target: Any) -> Any:
    return out


# name -> (torch class, placement); "single" is one stage per rank
TORCH: dict[str, tuple[Callable[..., Any], str]] = {
    "GPipe": (schedules.ScheduleGPipe, "single"),
    "1F1B": (schedules.Schedule1F1B, "single"),
    "Interleaved1F1B": (schedules.ScheduleInterleaved1F1B, "loop"),
    "LoopedBFS": (schedules.ScheduleLoopedBFS, "loop"),
    "InterleavedZeroBubble": (schedules.ScheduleInterleavedZeroBubble, "loop"),
    "ZBVZeroBubble": (schedules.ScheduleZBVZeroBubble, "v"),
    "DualPipeV": (schedules.ScheduleDualPipeV, "v"),
}
RANKS = (2, 3, 4, 5, 8)
COSTS = (Costs(f=1, b=2, i=1, w=1, comm=0.0), Costs(f=1, b=2, i=1, w=1, comm=0.5))


def _repair_1f1b_last_rank(rows: dict[int, list[Action]], m: int) -> None:
    """torch 2.13's 1F1B order runs F of microbatches 1..m on the last rank (its runtime does
    0..m-1): shift them back so the order is the one torch actually executes."""
    last = max(rows)
    fwd = sorted(a.microbatch for a in rows[last] if a.kind is ActionKind.F and a.microbatch is not None)
    if fwd == list(range(1, m + 1)):
        rows[last] = [
            Action(a.stage, a.kind, a.microbatch - 1) if a.kind is ActionKind.F and a.microbatch is not None else a
            for a in rows[last]
        ]


def torch_schedule(name: str, p: int, m: int, v: int) -> Schedule | None:
    """torch's compute-only order for these sizes as our Schedule, or None if torch rejects them."""
    cls, style = TORCH[name]
    n = p * v
    try:
        if style == "single":
            sched = cls(FakeStage(0, p, p), m, loss_fn=_loss)
        elif style == "loop":
            sched = cls([FakeStage(k * p, n, p) for k in range(v)], m, loss_fn=_loss)
        else:
            sched = cls([FakeStage(0, n, p), FakeStage(n - 1, n, p)], m, loss_fn=_loss)
    except (ValueError, AssertionError, RuntimeError):
        return None
    rows: dict[int, list[Action]] = {}
    for rank, order in sched.pipeline_order.items():
        parsed = (Action.parse(str(a)) for a in order if a is not None)
        rows[rank] = [a for a in parsed if a is not None and a.kind.is_compute]
    if name == "1F1B":
        _repair_1f1b_last_rank(rows, m)
    return Schedule(rows, num_microbatches=m, name=f"torch {name}")


def _grid(name: str) -> list[tuple[int, int, int]]:
    style = TORCH[name][1]
    out = []
    for p in RANKS:
        for v in (1,) if style == "single" else (2,) if style == "v" else (2, 3):
            for m in sorted({1, 2, p - 1, p, p + 1, 2 * p, 2 * p + 1, 3 * p, 4 * p} - {0}):
                out.append((p, m, v))
    return out


@pytest.mark.parametrize("name", list(TORCH))
def test_no_worse_than_torch(name: str) -> None:
    compared = 0
    worse: list[str] = []
    for p, m, v in _grid(name):
        theirs = torch_schedule(name, p, m, v)
        if theirs is None:
            continue
        try:
            ours = build_schedule(name, p, m, v)
        except ScheduleError as err:
            worse.append(f"p={p} m={m} v={v}: torch accepts the sizes, we reject them: {err}")
            continue
        for costs in COSTS:
            mine = simulate(ours, costs)
            ref = simulate(theirs, costs)
            compared += 1
            if mine.makespan > ref.makespan + 1e-9:
                worse.append(f"p={p} m={m} v={v} comm={costs.comm}: makespan {mine.makespan} > torch {ref.makespan}")
            for rank in range(p):
                if mine.peak_memory[rank] > ref.peak_memory[rank]:
                    worse.append(
                        f"p={p} m={m} v={v} comm={costs.comm}: rank {rank} holds {mine.peak_memory[rank]} "
                        f"activations > torch {ref.peak_memory[rank]}"
                    )
    assert compared >= 10, f"only {compared} configurations of {name} compared; is the torch conversion broken?"
    assert not worse, f"{name} is worse than torch 2.13 in:\n" + "\n".join(worse)


def test_torch_conversion_is_faithful() -> None:
    # the converted 1F1B order is torch's intended one and it simulates to the textbook answer
    theirs = torch_schedule("1F1B", 4, 8, 1)
    assert theirs is not None and theirs.num_microbatches == 8
    assert simulate(theirs, COSTS[0]).makespan == (8 + 4 - 1) * 3
    zbv = torch_schedule("ZBVZeroBubble", 4, 8, 2)
    assert zbv is not None and zbv.stage_to_rank == {0: 0, 1: 1, 2: 2, 3: 3, 4: 3, 5: 2, 6: 1, 7: 0}
    assert sum(1 for a in zbv.iter_actions() if a is not None and a.kind is ActionKind.W) == 8 * 8


@pytest.mark.parametrize("name", ["Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
def test_torch_lowered_orders_simulate_like_their_compute_orders(name: str) -> None:
    # torch's own lowering (SEND/RECV, UNSHARD/RESHARD, REDUCE_GRAD) reads and simulates here
    cls, style = TORCH[name]
    p, m, n = 4, 8, 8
    stages = (
        [FakeStage(0, n, p), FakeStage(4, n, p)] if style == "loop" else [FakeStage(0, n, p), FakeStage(n - 1, n, p)]
    )
    sched = cls(stages, m, loss_fn=_loss)
    rows: dict[int, list[Action]] = {}
    for rank, order in sched.pipeline_order_with_comms.items():
        rows[rank] = [a for a in (Action.parse(str(x)) for x in order if x is not None) if a is not None]
    lowered = Schedule(rows)
    compute = Schedule({r: [a for a in acts if a.kind.is_compute] for r, acts in rows.items()})
    assert lowered.is_lowered
    for costs in COSTS:
        low = simulate(lowered, costs)
        assert low.lowered and low.num_sends > 0
        assert low.makespan == simulate(compute, costs).makespan
