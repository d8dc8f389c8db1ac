"""CSV interop with the installed torch (2.13, 2.15): its dumps load and validate here; our files
load in its ``_load_csv``.

torch 2.15's lowered ("compute_comms") files hold waits (WAIT_SEND_F, WAIT_SEND_B,
WAIT_REDUCE_GRAD) and it refuses lowered files without them; torch 2.13 cannot read them. So
lowered files are written here in the installed torch's form (``torch_waits``), and read in either.
torch's schedule objects come from benchmarks/_torch_reference.py (built on stand-in stages,
without a process group).
"""

from __future__ import annotations

import csv
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import _torch_reference
from pipetrain.errors import PipelineError
from pipetrain.plan import Schedule, ScheduleError, build_schedule, schedule_names
from pipetrain.plan.actions import parse_torch_wait
from pipetrain.runtime.distributed import PipelineScheduleRuntime
from pipetrain.runtime.prepare import torch_csv_has_waits

pytestmark = pytest.mark.torch_interop

WAITS = torch_csv_has_waits()
"""Whether the installed torch writes and requires waits in its lowered files."""


def torch_multi(name: str, p: int, m: int, v: int) -> Any:
    """torch's schedule object ``name`` with ``v`` stages per rank (its own placement for the name)."""
    theirs = _torch_reference.torch_schedule_object(name, p, m, v)
    assert theirs is not None, f"torch rejects {name} with p={p} m={m} v={v}"
    return theirs


TORCH_NAMES = ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
SIZES = [(2, 4), (3, 6), (4, 8), (4, 16)]


def cells(program: list[Any]) -> list[str]:
    return [str(a) for a in program if a is not None]


def without_waits(row: list[str]) -> list[str]:
    return [cell for cell in row if parse_torch_wait(cell) is None]


def csv_rows(path: Path) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.reader(fh))


def reduction_waits_first(row: list[str]) -> list[str]:
    """torch's lowered row with each WAIT_REDUCE_GRAD moved back to right after its REDUCE_GRAD,
    over the receives (only those) that torch's send/recv pass added between them: torch puts the
    wait right after the reduction in the compute order, before receives are added; a pipetrain
    lowered order has no such later pass, so its wait goes right after the reduction."""
    out: list[str] = []
    for cell in row:
        if cell.endswith("WAIT_REDUCE_GRAD"):
            at = len(out)
            while out[at - 1] != cell.replace("WAIT_", ""):
                assert "RECV_" in out[at - 1], f"{cell} is separated from its reduction by {out[at - 1]}"
                at -= 1
            out.insert(at, cell)
        else:
            out.append(cell)
    return out


def test_the_version_rule_matches_the_installed_torch() -> None:
    assert WAITS == hasattr(_torch_reference.ts._ComputationType, "WAIT_SEND_F")


@pytest.mark.parametrize(
    ("version", "waits"),
    [
        ("2.13.0+cpu", False),
        ("2.9.1", False),
        ("2.15.0", True),
        ("2.15.0a0+git1234", True),
        ("2.16.1", True),
        ("3.0", True),
    ],
)
def test_torch_versions_with_waits(version: str, waits: bool) -> None:
    assert torch_csv_has_waits(version) is waits


def test_an_unreadable_torch_version_is_an_error() -> None:
    with pytest.raises(PipelineError, match="cannot read the torch version 'nightly'"):
        torch_csv_has_waits("nightly")


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
    theirs_rows = csv_rows(comms_csv)
    assert any("WAIT_" in cell for row in theirs_rows for cell in row) == WAITS
    for r in range(p):
        assert theirs_rows[r] == cells(theirs.pipeline_order_with_comms[r])
        assert cells(lowered.actions[r]) == without_waits(theirs_rows[r])  # waits dropped, order kept
    # Written back in the installed torch's form: torch's file, up to where its passes put a
    # reduction's wait among receives (the sends' waits exactly where torch puts them).
    back = tmp_path / "back.csv"
    lowered.to_csv(back, torch_waits=WAITS)
    assert csv_rows(back) == [reduction_waits_first(row) for row in theirs_rows]
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
    low.to_csv(low_path, torch_waits=WAITS)
    loader = torch_loader(s)
    loader._load_csv(str(low_path), format="compute_comms")  # torch 2.15 checks every send's wait
    written = csv_rows(low_path)
    for r in range(p):
        assert cells(loader.pipeline_order_with_comms[r]) == written[r]
        assert without_waits(written[r]) == cells(low.actions[r])
    assert Schedule.from_csv(low_path) == low


def test_each_torch_refuses_the_other_form(tmp_path: Path) -> None:
    """Why torch_waits follows the installed torch: torch 2.15 refuses a lowered file without
    waits; torch 2.13 reads each wait as a W without microbatch (its parser takes the longest
    known prefix: 0WAIT_SEND_F0 is 0W) and refuses the order."""
    low = build_schedule("ZBVZeroBubble", 2, 4).lower(fsdp=True)
    path = tmp_path / "other_form.csv"
    low.to_csv(path, torch_waits=not WAITS)
    loader = torch_loader(low)
    if WAITS:
        with pytest.raises(ValueError, match="Pipeline sends at rank 0 have no matching wait"):
            loader._load_csv(str(path), format="compute_comms")
    else:
        with pytest.raises(AssertionError, match="Running Backward Weight for stage 0, microbatch None"):
            loader._load_csv(str(path), format="compute_comms")


@pytest.mark.parametrize("name", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"])
def test_runtime_dump_csv_writes_what_the_installed_torch_loads(name: str, tmp_path: Path) -> None:
    # PipelineScheduleRuntime._dump_csv reads only the schedules it holds: no process group needed.
    planned = build_schedule(name, 2, 4, None if name == "1F1B" else 2)
    held = SimpleNamespace(_planned=planned, _prepared=SimpleNamespace(base=planned.lower(grad_reduce=True)))
    comms, compute = tmp_path / "comms.csv", tmp_path / "compute.csv"
    PipelineScheduleRuntime._dump_csv(held, str(comms), "compute_comms")  # type: ignore[arg-type]
    PipelineScheduleRuntime._dump_csv(held, str(compute), "compute_only")  # type: ignore[arg-type]
    assert ("WAIT_" in comms.read_text()) == WAITS
    assert Schedule.from_csv(comms) == held._prepared.base
    assert Schedule.from_csv(compute) == planned
    loader = torch_loader(planned)
    loader._load_csv(str(comms), format="compute_comms")
    assert [cells(loader.pipeline_order_with_comms[r]) for r in range(2)] == csv_rows(comms)
