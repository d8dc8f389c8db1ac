"""A rank killed mid-training under ``torchrun --max-restarts 1``: the job resumes and loses nothing.

Rank 1 SIGKILLs itself before step 3 on torchrun's first attempt (``PIPETRAIN_TEST_KILL_AT``,
read only while ``TORCHELASTIC_RESTART_COUNT`` is 0). torchrun restarts the group, which resumes
from the checkpoint after step 2 and finishes by itself. Its final parameters, optimizer state
and per-step losses equal, bit for bit, those of the same job run without interruption: the
batches are a pure function of (seed, step) and CPU gloo runs are deterministic.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

STEPS = 5
COMMON = [
    "--model",
    "tiny",
    "--steps",
    str(STEPS),
    "--microbatches",
    "4",
    "--batch-size",
    "8",
    "--checkpoint-every",
    "2",
]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "PIPETRAIN_TEST_"))}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", **extra)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(name, None)
    return env


def _run(cmd: list[str], env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=240)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    return log


def _final(directory: Path, schedule_stages: int) -> tuple[dict[str, torch.Tensor], dict[str, object], list[float]]:
    """The final checkpoint loaded in one process: parameters, optimizer state, losses."""
    from pipetrain import Checkpointer
    from pipetrain.train.loop import TrainConfig
    from pipetrain.train.model import GPT

    model = GPT(TrainConfig(model="tiny").model_config_for(schedule_stages))
    optimizer = torch.optim.Adam(model.parameters())
    resumed = Checkpointer(directory).load(model, optimizer)
    assert resumed.step == STEPS
    return dict(model.state_dict()), optimizer.state_dict()["state"], list(resumed.extra["losses"])


@pytest.mark.parametrize(("ranks", "schedule", "stages"), [(2, "ZBVZeroBubble", 4), (4, "1F1B", 4)])
def test_a_killed_rank_is_restarted_by_torchrun_and_the_run_equals_an_uninterrupted_one(
    tmp_path: Path, ranks: int, schedule: str, stages: int
) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    train = ["-m", "pipetrain", "train", "--schedule", schedule, *COMMON]
    log = _run(
        [*torchrun, "--max-restarts=1", *train, "--checkpoint-dir", "killed", "--out", "out_killed"],
        _env(PIPETRAIN_TEST_KILL_AT="1:3"),
        tmp_path,
    )
    assert "exitcode: -9" in log, log[-4000:]  # rank 1 did die, by SIGKILL
    assert "resumed from killed/step_000000002 after 2 of 5 steps" in log, log[-4000:]
    # The same job uninterrupted, on spawned ranks (no outputs: only its final checkpoint is compared).
    from pipetrain.train.launch import spawn
    from pipetrain.train.loop import TrainConfig, run_rank

    whole = TrainConfig(
        ranks=ranks,
        schedule=schedule,
        model="tiny",
        steps=STEPS,
        microbatches=4,
        batch_size=8,
        lr=3e-3,
        checkpoint_dir=str(tmp_path / "whole"),
        checkpoint_every=2,
    )
    spawn(run_rank, ranks, whole)
    params, optim, losses = _final(tmp_path / "killed", stages)
    ref_params, ref_optim, ref_losses = _final(tmp_path / "whole", stages)
    assert len(losses) == STEPS and losses == ref_losses
    assert params.keys() == ref_params.keys()
    assert all(torch.equal(params[k], ref_params[k]) for k in params), [
        k for k in params if not torch.equal(params[k], ref_params[k])
    ]
    assert optim.keys() == ref_optim.keys()
    for index, state in optim.items():
        assert all(torch.equal(v, ref_optim[index][k]) for k, v in state.items()), index  # type: ignore[index, union-attr]
