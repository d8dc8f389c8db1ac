"""The examples run as documented (examples/*.py)."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from pipetrain.plan import Schedule

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TORCHRUN = Path(sys.executable).parent / "torchrun"


def _torchrun(script: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", str(EXAMPLES / script), *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_the_hand_written_csv_is_a_valid_schedule() -> None:
    namespace = runpy.run_path(str(EXAMPLES / "custom_csv_schedule.py"))
    plan = Schedule.from_csv_text(namespace["CSV"])
    plan.validate()
    assert (plan.num_ranks, plan.num_stages, plan.num_microbatches) == (2, 2, 4)


def test_local_debug_matches_plain_training(capsys: pytest.CaptureFixture[str]) -> None:
    runpy.run_path(str(EXAMPLES / "local_debug.py"), run_name="__main__")
    assert "gradients match plain training for every parameter" in capsys.readouterr().out


@pytest.mark.slow
def test_gpt_pipeline_under_torchrun(tmp_path: Path) -> None:
    proc = _torchrun("gpt_pipeline.py", ["--steps", "2"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step 2: loss" in proc.stdout and ", grad norm " in proc.stdout
    assert sorted(p.name for p in tmp_path.glob("gpt_rank*.pt")) == ["gpt_rank0.pt", "gpt_rank1.pt"]


@pytest.mark.slow
def test_custom_csv_schedule_under_torchrun(tmp_path: Path) -> None:
    proc = _torchrun("custom_csv_schedule.py", [], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step 5: loss" in proc.stdout
    assert "simulated: makespan" in proc.stdout
