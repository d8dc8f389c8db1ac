"""CSV interop with torch 2.13: its dumps load and validate here; our files load in its ``_load_csv``.

torch builds its pipeline order in the schedule constructor; light stand-ins for its stage
objects (the attributes the constructors read) are enough to build one without a process group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pipetrain.plan import Schedule, ScheduleError, build_schedule, schedule_names

pytestmark = pytest.mark.torch_interop
ts = pytest.importorskip("torch.distributed.pipelining.schedules")


@dataclass
class FakeStage:
    stage_index: int
    num_stages: int
    group_size: int
    group_rank: int = 0
    submod: Any = None
    stage_index_to_group_rank: dict[int, int] = field(default_factory=dict)


def torch_multi(cls: Any, p: int, m: int, v: int, *, v_shape: bool = False) -> Any:
    n = p * v
    indices = [0, n - 1] if v_shape else [k * p for k in range(v)]
    return cls([FakeStage(i, n, p) for i in indices], m)


TORCH_CLASSES = [
    ("Interleaved1F1B", "ScheduleInterleaved1F1B", False),
    ("LoopedBFS", "ScheduleLoopedBFS", False),
    ("InterleavedZeroBubble", "ScheduleInterleavedZeroBubble", False),
    ("ZBVZeroBubble", "ScheduleZBVZeroBubble", True),
    ("DualPipeV", "ScheduleDualPipeV", True),
]
SIZES = [(2, 4), (3, 6), (4, 8), (4, 16)]


def cells(program: list[Any]) -> list[str]:
    return [str(a) for a in program if a is not None]


@pytest.mark.parametrize(("p", "m"), SIZES)
@pytest.mark.parametrize(("name", "cls_name", "v_shape"), TORCH_CLASSES)
def test_torch_dumps_load_and_validate(name: str, cls_name: str, v_shape: bool, p: int, m: int, tmp_path: Path) -> None:
    theirs = torch_multi(getattr(ts, cls_name), p, m, 2, v_shape=v_shape)
    compute_csv, comms_csv = tmp_path / "compute.csv", tmp_path / "comms.csv"
    theirs._dump_csv(str(compute_csv), format="compute_only")
    theirs._dump_csv(str(comms_csv), format="compute_comms")

    compute = Schedule.from_csv(compute_csv)
    compute.validate()
    assert not compute.is_lowered
    assert compute.num_ranks == p and compute.num_stages == 2 * p and compute.num_microbatches == m
    for r in range(p):
        assert cells(compute.actions[r]) == cells(theirs.pipeline_order[r])

    lowered = Schedule.from_csv(comms_csv)
    lowered.validate()  # their SEND/RECV, UNSHARD/RESHARD and REDUCE_GRAD, under our strict model
    assert lowered.is_lowered
    for r in range(p):
        assert cells(lowered.actions[r]) == cells(theirs.pipeline_order_with_comms[r])
    # And our own lowering of their compute order validates too.
    compute.lower(fsdp=True, grad_reduce=True).validate()


def torch_loader(s: Schedule) -> Any:
    """A torch runtime schedule with the sizes and placement style of ``s``, ready for ``_load_csv``."""
    p = s.num_ranks
    v = s.num_stages // p
    v_shape = v == 2 and s.stage_to_rank.get(p) == p - 1
    cls = ts.ScheduleZBVZeroBubble if v_shape else ts.ScheduleLoopedBFS
    return torch_multi(cls, p, s.num_microbatches, v, v_shape=v_shape)


def ours() -> list[tuple[str, int, int, int | None]]:
    out = []
    for name in schedule_names():
        if name == "ForwardOnly":  # torch's loader insists on a backward for every microbatch
            continue
        for p, m, v in [(2, 4, None), (4, 8, None), (3, 6, 2)]:
            try:
                build_schedule(name, p, m, v)
            except ScheduleError:
                continue
            out.append((name, p, m, v))
    return out


@pytest.mark.parametrize(("name", "p", "m", "v"), ours())
def test_our_csv_loads_in_torch(name: str, p: int, m: int, v: int | None, tmp_path: Path) -> None:
    s = build_schedule(name, p, m, v)
    path = tmp_path / "ours.csv"
    s.to_csv(path)
    loader = torch_loader(s)
    loader._load_csv(str(path), format="compute_only")  # torch validates and lowers it with its passes
    for r in range(p):
        assert cells(loader.pipeline_order[r]) == cells(s.actions[r])

    low = s.lower(fsdp=True, grad_reduce=True)
    low_path = tmp_path / "ours_lowered.csv"
    low.to_csv(low_path)
    loader = torch_loader(s)
    loader._load_csv(str(low_path), format="compute_comms")
    for r in range(p):
        assert cells(loader.pipeline_order_with_comms[r]) == cells(low.actions[r])
