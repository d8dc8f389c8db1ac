"""``make gpu-check`` (benchmarks/gpu_check.py): a clear refusal without CUDA, and its checks on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=env, check=False
    )


def test_without_cuda_it_says_so_and_fails() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU visible, even on a machine with some
    done = _run(env=env)
    assert done.returncode == 2, done
    assert "no CUDA device is available" in done.stderr and "nothing was checked" in done.stderr
    assert "passed" not in done.stdout


@pytest.mark.slow
def test_its_checks_pass_on_the_cpu() -> None:
    """The same checks on the CPU: one device (runtime and LocalPipeline), then 2 gloo ranks
    matching by order only, as NCCL does (gradients, no host read after the first step)."""
    done = _run("--device", "cpu", "--schedules", "ZBVZeroBubble,ForwardOnly", "--steps", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "FAILED" not in out and "gpu-check: every check passed" in out
    for line in ("ZBVZeroBubble (runtime)", "ZBVZeroBubble (LocalPipeline)", "2 ranks over gloo"):
        assert line in out, out
    assert out.count(" ok ") == 6, out  # 4 one-device rows, 2 two-rank rows


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a GPU")
def test_on_gpus() -> None:  # pragma: no cover - runs where GPUs are
    done = _run("--steps", "5", "--skip-bench")
    assert done.returncode == 0, done.stdout + done.stderr
