"""benchmarks/run_all.py (the `make bench` runner) and schedule_quality's reading of torch's orders."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

import run_all  # benchmarks/ is on the import path (tests/conftest.py)

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_runner_finds_every_benchmark_but_itself() -> None:
    names = [p.name for p in run_all.benchmark_scripts()]
    assert "run_all.py" not in names
    assert "_torch_reference.py" not in names
    assert "schedule_quality.py" in names
    assert names == sorted(names)
    assert [p.stem for p in run_all.benchmark_scripts(["schedule_quality"])] == ["schedule_quality"]


def test_report_has_date_machine_status_and_outputs() -> None:
    when = datetime.datetime(2026, 12, 2, 10, 0, tzinfo=datetime.timezone.utc)
    table = "intro\n\n| a | b |\n|---|---|\n| 1 | 2 |"
    results = [
        (BENCH / "schedule_quality.py", 0, 1.5, table),
        (BENCH / "split_backward.py", "timeout", 9.0, "B 1 ms"),
    ]
    text = run_all.report(results, when, "test machine")
    assert "2026-12-02 10:00 UTC on test machine" in text
    assert "| [schedule_quality](#schedule_quality) | ok | 1.5 s |" in text
    assert "| [split_backward](#split_backward) | timeout | 9.0 s |" in text
    assert table in text  # a markdown table is kept as markdown
    assert "```\nB 1 ms\n```" in text  # plain output goes into a code block
    assert "torch" in run_all.machine()


@pytest.mark.torch_interop
def test_torch_orders_load_as_pipetrain_schedules() -> None:
    import schedule_quality
    from pipetrain.plan import build_schedule

    theirs = schedule_quality.torch_order("GPipe", 4, 8, 1)
    assert theirs is not None
    theirs.validate()
    ours = build_schedule("GPipe", 4, 8)
    for rank in range(4):
        assert [str(a) for a in theirs.actions[rank] if a] == [str(a) for a in ours.actions[rank] if a]
    zbv = schedule_quality.torch_order("ZBVZeroBubble", 2, 4, 2)
    assert zbv is not None and zbv.stage_to_rank == {0: 0, 1: 1, 2: 1, 3: 0}
    assert {a.kind.value for a in zbv.iter_actions() if a} == {"F", "I", "W"}


@pytest.mark.torch_interop
@pytest.mark.slow
def test_runtime_vs_torch_on_one_rank_holding_every_stage() -> None:
    """What gpu_check runs with one GPU (``--ranks 1``), here on the CPU: both runtimes, a row each.
    (Before torch 2.13, torch's multi-stage schedules fail on one gloo rank: its first step sends
    between neighbouring stages, and gloo cannot send to its own rank. NCCL can.)"""
    import subprocess
    import sys

    import torch

    names = ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"] if torch.__version__ >= (2, 13) else ["1F1B"]
    args = ["--ranks", "1", "--models", "small", "--steps", "2", "--warmup", "1", "--schedules", ",".join(names)]
    done = subprocess.run(
        [sys.executable, str(BENCH / "runtime_vs_torch.py"), *args],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "max over the 1 rank(s) (gloo, 1 CPU process)" in done.stdout
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("small")]
    assert [row[2] for row in rows] == names, done.stdout
    assert all(float(row[-2]) > 0 for row in rows)  # a ratio of two measured times


def test_plan_speed_floor_runs_and_its_loops_do_the_work(capsys: pytest.CaptureFixture[str]) -> None:
    """The floor script (issue 14's speed bar beside the least pure Python can spend) at a small size."""
    import sys

    import plan_speed_floor

    argv = sys.argv
    sys.argv = ["plan_speed_floor.py", "--no-torch", "--repeat", "1", "--ranks", "4", "--microbatches", "8"]
    try:
        plan_speed_floor.main()
    finally:
        sys.argv = argv
    out = capsys.readouterr().out
    assert "4 × 2 × 8: 192 actions" in out
    assert "| **all four** |" in out
    for step in ("build", "validate", "lower", "validate lowered"):
        assert f"| {step} |" in out


def test_plan_speed_floor_loops_rebuild_what_pipetrain_builds() -> None:
    """The floor's message loop makes the lowered programs' SEND/RECV; its run reaches every part."""
    import plan_speed_floor
    from pipetrain.plan import build_schedule
    from pipetrain.plan.dependencies import C_F, C_I, C_W, Dependencies

    s = build_schedule("ZBVZeroBubble", 4, 8, 2)
    low = s.lower()
    M = s.num_microbatches
    SM = s.num_stages * M
    rank_of = [s.stage_to_rank[t] for t in range(s.num_stages)]
    base = {"F": 0, "I": SM, "W": 2 * SM}
    programs = [
        [base[a.kind.value] + a.stage * M + a.microbatch for a in s.actions[r] if a and a.kind.value != "W"]
        for r in range(4)
    ]  # type: ignore[operator]
    need1, need2 = Dependencies(s.num_stages, M, rank_of, lowered=False).flat_needs((C_F, C_I, C_W))
    end = plan_speed_floor.run(programs, need1, need2)
    assert all(end[x] > 0 for row in programs for x in row)
    lowered_rows = [list(low.actions[r]) for r in range(4)]
    computes = [[a for a in s.actions[r] if a] for r in range(4)]
    assert plan_speed_floor.messages(*plan_speed_floor.message_plan(lowered_rows), computes) == lowered_rows
