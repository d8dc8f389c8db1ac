"""CSV interop with torch 2.13: its dumps load and validate here; our files load in its ``_load_csv``.

torch's schedule objects come from benchmarks/_torch_reference.py (built on stand-in stages,
without a process group).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import _torch_reference
from pipetrain.plan import Schedule, ScheduleError, build_schedule, schedule_names

pytestmark = pytest.mark.torch_interop


def torch_multi(name: str, p: int, m: int, v: int) -> Any:
    """torch's schedule object ``name`` with ``v`` stages per rank (its own placement for the name)."""
    theirs = _torch_reference.torch_schedule_object(name, p, m, v)
    assert theirs is not None, f"torch rejects {name} with p={p} m={m} v={v}"
    return theirs


TORCH_NAMES = ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
SIZES = [(2, 4), (3, 6), (4, 8), (4, 16)]


def cells(program: list[Any]) -> list[str]:
    return [str(a) for a in program if a is not None]


@pytest.mark.parametrize(("p", "m"), SIZES)
@pytest.mark.parametrize("name", TORCH_NAMES)
def test_torch_dumps_load_and_validate(name: str, p: int, m: int, tmp_path: Path) -> None:
    theirs = torch_multi(name, p, m, 2)
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
    return torch_multi("ZBVZeroBubble" if v_shape else "LoopedBFS", p, s.num_microbatches, v)


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
