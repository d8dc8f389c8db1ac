"""`pipetrain train --schedule auto`: measure a few steps, plan for what was measured, train on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipetrain.plan import Costs, Schedule, build_schedule, simulate
from pipetrain.train.auto import plan_from_profile, profiled_schedule


def test_plan_from_profile_beats_the_profiled_schedule_where_costs_break_its_assumptions() -> None:
    """Measured (here: simulated) steps of ZB-V with message latency and a heavy last stage: the plan
    keeps ZB-V's layout and memory and is faster on the measured costs."""
    profiled = profiled_schedule(4, 4, None)
    assert profiled.name == "ZBVZeroBubble"
    n = profiled.num_stages
    f = [1.0] * (n - 1) + [1.6]
    truth = Costs(f=f, i=f, w=f, comm=0.5, activation_bytes=[1.0] * n)
    timelines = [simulate(profiled, truth).timeline] * 3
    plan = plan_from_profile(profiled, timelines, time_limit=2.0)
    assert plan.schedule.stage_to_rank == profiled.stage_to_rank
    mine, theirs = simulate(plan.schedule, truth), simulate(profiled, truth)
    assert mine.makespan < theirs.makespan
    assert mine.peak_memory_bytes is not None and theirs.peak_memory_bytes is not None
    assert max(mine.peak_memory_bytes.values()) <= max(theirs.peak_memory_bytes.values())
    assert "auto: measured 3 steps of ZBVZeroBubble; planned Auto" in plan.summary


def test_the_profiled_schedule_follows_the_stages_per_rank() -> None:
    assert profiled_schedule(2, 4, 1).name == "ZBH1"
    assert profiled_schedule(2, 4, 3).name == "InterleavedZeroBubble"
    assert isinstance(profiled_schedule(2, 4, 2), Schedule)
    assert build_schedule("ZBVZeroBubble", 2, 4).actions == profiled_schedule(2, 4, None).actions


@pytest.mark.slow
def test_train_schedule_auto_trains_with_the_plan(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    run = subprocess.run(
        [sys.executable, "-m", "pipetrain", "train", "--schedule", "auto", "--model", "tiny", "--steps", "5",
         "--microbatches", "4", "--batch-size", "8", "--out", str(tmp_path / "out")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "auto: measured 3 steps of ZBVZeroBubble; planned" in run.stdout
    assert "final loss" in run.stdout
    assert (tmp_path / "out" / "costs.txt").exists()
    # The plan is kept: its line in the summary, the schedule the last step ran in schedule.csv.
    planned = next(line for line in run.stdout.splitlines() if line.startswith("auto: "))
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["auto"] == planned and planned in (tmp_path / "out" / "summary.md").read_text()
    kept = Schedule.load(summary["schedule_file"])
    kept.validate()
    assert kept.num_ranks == 2 and kept.num_microbatches == 4
    assert kept.name == summary["schedule"]  # the plan's name kept (Auto, or ZBVZeroBubble if it stayed)
    if kept.name == "ZBVZeroBubble":
        assert kept.actions == build_schedule("ZBVZeroBubble", 2, 4).actions
    else:
        assert kept.name == "Auto"


@pytest.mark.slow
def test_profile_writes_costs_that_plan_reads(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    costs = tmp_path / "measured.txt"
    run = subprocess.run(
        [sys.executable, "-m", "pipetrain", "profile", "--model", "tiny", "--microbatches", "4", "--batch-size", "8",
         "--costs-out", str(costs), "--out", str(tmp_path / "out")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"measured 3 steps of ZBVZeroBubble: wrote {costs}" in run.stdout
    measured = Costs.parse(costs.read_text())
    assert isinstance(measured.f, tuple) and len(measured.f) == 4 and min(measured.f) > 0
    assert measured.comm >= 0
    from pipetrain.cli import main

    assert main(["plan", "-p", "2", "-m", "4", "--from-profile", str(costs), "--time-limit", "1"]) == 0
