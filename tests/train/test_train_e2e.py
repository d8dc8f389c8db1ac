"""`pipetrain train` end to end: spawned ranks, --check, a CSV schedule, and two torchrun "nodes"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipetrain.plan import build_schedule
from pipetrain.plan.timeline import Timeline
from pipetrain.train.launch import free_port

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
TIMEOUT = 300


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _pipetrain(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipetrain", "train", *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


def test_check_agrees_and_writes_timelines(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _pipetrain(["--check", "--steps", "3", "--model", "tiny", "--out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["1/3", "2/3", "3/3"]
    assert any(line.startswith("final loss ") and "held-out loss" in line for line in lines)
    assert any(line.startswith("last step: measured ") and "simulated" in line for line in lines)
    check = [line for line in lines if line.startswith("check: ")]
    assert len(check) == 1 and check[0].endswith(": agree"), proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["schedule"] == "ZBVZeroBubble" and summary["ranks"] == 2 and len(summary["losses"]) == 3
    measured = Timeline.from_json(out / "measured_timeline.json")
    assert measured.source == "measured" and measured.num_ranks == 2
    # The last step ran every compute action of the schedule once, on the rank it names.
    plan = build_schedule("ZBVZeroBubble", 2, 8)
    expected = sorted((r, str(a)) for r in range(2) for a in plan.actions[r] if a is not None)
    got = sorted((e.rank, e.action) for e in measured.events if e.kind in ("F", "B", "I", "W", "OVERLAP_F_B"))
    assert got == expected
    # Ranks on one machine keep their true offsets: no forward starts before the forward it takes
    # its input from, on the other rank, has ended (each rank's own barrier exit used to be its zero).
    ends = {(e.stage, e.microbatch): e.end for e in measured.events if e.kind == "F"}
    for e in measured.events:
        if e.kind == "F" and e.stage > 0 and plan.stage_to_rank[e.stage] != plan.stage_to_rank[e.stage - 1]:
            assert e.start >= ends[(e.stage - 1, e.microbatch)], e
    simulated = Timeline.from_json(out / "simulated_timeline.json")
    assert simulated.makespan > 0 and summary["simulated_step_s"] > 0
    for name in ("measured_timeline.png", "simulated_timeline.png", "measured_trace.json", "summary.md"):
        assert (out / name).stat().st_size > 0, name


def test_a_csv_schedule_runs_with_the_runtime(tmp_path: Path) -> None:
    """With clipping on, the check also compares each step's gradient norm with plain training's."""
    path = tmp_path / "mine.csv"
    build_schedule("1F1B", 2, 4).to_csv(path)
    proc = _pipetrain(["--schedule", str(path), "--batch-size", "8", "--steps", "3", "--model", "tiny", "--check",
                       "--clip-grad-norm", "0.05", "--out", str(tmp_path / "o")], tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "losses and gradient norms" in proc.stdout and ": agree" in proc.stdout, proc.stdout
    # The file sets the ranks: said before anything is spawned.
    assert f"{path}: 2 ranks, 2 stages, 4 microbatches: spawning 2 processes" in proc.stdout.splitlines()[0]


def test_two_torchrun_nodes_on_localhost(tmp_path: Path) -> None:
    """Exactly the multi-node command of the README, with both "nodes" on 127.0.0.1."""
    port = free_port()
    procs = []
    for node in range(2):
        cwd = tmp_path / f"node{node}"
        cwd.mkdir()
        cmd = [str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "-m", "pipetrain", "train", "--steps", "3"]  # fmt: skip
        procs.append(
            subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=TIMEOUT)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)
    text = "\n".join(outputs)
    assert "step 3/3" in text and "final loss" in text
    # One rank reported and wrote the run's files (ZBV puts the last stage on rank 0).
    summaries = list(tmp_path.glob("node*/runs/*/summary.json"))
    assert len(summaries) == 1
    assert json.loads(summaries[0].read_text())["ranks"] == 2
