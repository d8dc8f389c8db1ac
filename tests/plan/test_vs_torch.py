"""Each generator against torch 2.13's schedule of the same name: never longer, never more memory.

torch's orders come from benchmarks/_torch_reference.py (built on stand-in stages, no process
group; 1F1B's off-by-one last rank repaired to the order torch's runtime executes). Both orders
are simulated under F=1, B=2, I=W=1 with free communication and with a latency of half a
forward.
"""

from __future__ import annotations

import pytest

import _torch_reference
from pipetrain.plan.actions import ActionKind, parse_torch_wait
from pipetrain.plan.costs import Costs
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.generators import build_schedule
from pipetrain.plan.schedule import Schedule
from pipetrain.plan.simulate import simulate

# name -> placement: "single" is one stage per rank, "loop" k*p + r on rank r, "v" two stages in a V
TORCH: dict[str, str] = {
    "GPipe": "single",
    "1F1B": "single",
    "Interleaved1F1B": "loop",
    "LoopedBFS": "loop",
    "InterleavedZeroBubble": "loop",
    "ZBVZeroBubble": "v",
    "DualPipeV": "v",
}
RANKS = (2, 3, 4, 5, 8)
COSTS = (Costs(f=1, b=2, i=1, w=1, comm=0.0), Costs(f=1, b=2, i=1, w=1, comm=0.5))


def torch_schedule(name: str, p: int, m: int, v: int) -> Schedule | None:
    """torch's compute-only order for these sizes as our Schedule, or None if torch rejects them.

    1F1B's last rank is repaired: we compare with the order torch runs, not the one it prints.
    """
    theirs = _torch_reference.torch_schedule_object(name, p, m, v)
    return None if theirs is None else _torch_reference.to_pipetrain(theirs, repair_1f1b=True)


def _grid(name: str) -> list[tuple[int, int, int]]:
    style = TORCH[name]
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
    # torch's own lowering (SEND/RECV, UNSHARD/RESHARD, REDUCE_GRAD; torch 2.15's waits dropped)
    # reads and simulates here
    theirs = _torch_reference.torch_schedule_object(name, 4, 8, 2)
    assert theirs is not None
    lowered = _torch_reference.to_pipetrain(theirs, with_comms=True)
    for rank, program in theirs.pipeline_order_with_comms.items():  # all of it but torch 2.15's waits, in order
        kept = [str(a) for a in program if a is not None and parse_torch_wait(str(a)) is None]
        assert [str(a) for a in lowered.actions[rank]] == kept
    compute = Schedule(
        {r: [a for a in acts if a is not None and a.kind.is_compute] for r, acts in lowered.actions.items()}
    )
    assert lowered.is_lowered
    for costs in COSTS:
        low = simulate(lowered, costs)
        assert low.lowered and low.num_sends > 0
        assert low.makespan == simulate(compute, costs).makespan


def test_1f1b_repair_touches_only_torchs_off_by_one_last_rank() -> None:
    theirs = _torch_reference.torch_schedule_object("1F1B", 4, 8, 1)
    assert theirs is not None
    printed = _torch_reference.to_pipetrain(theirs)
    repaired = _torch_reference.to_pipetrain(theirs, repair_1f1b=True)
    # as printed, the last rank runs F of microbatches 1..8: microbatch 0 never reaches the loss
    assert printed.num_microbatches == 9
    with pytest.raises(ScheduleError):
        printed.validate()
    repaired.validate()
    assert repaired.num_microbatches == 8
    assert all(printed.actions[r] == repaired.actions[r] for r in range(3))
    # an order without the off-by-one is left alone
    interleaved = _torch_reference.torch_schedule_object("Interleaved1F1B", 4, 8, 2)
    assert interleaved is not None
    assert _torch_reference.to_pipetrain(interleaved, repair_1f1b=True) == _torch_reference.to_pipetrain(interleaved)


def test_sizes_torch_rejects_give_none() -> None:
    assert _torch_reference.torch_schedule_object("1F1B", 4, 2, 1) is None  # needs m >= stages
    assert _torch_reference.torch_schedule_object("GPipe", 4, 8, 2) is None  # one stage per rank only
    assert _torch_reference.torch_schedule_object("DualPipeV", 4, 4, 2) is None  # needs m >= 2p
    assert _torch_reference.torch_schedule_object("GPipe", 4, 8, 1) is not None
