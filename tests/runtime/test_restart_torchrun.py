"""A user's own loop (``pipetrain.checkpoint.init_process_group`` + ``Checkpointer``) survives a
rank killed while writing a checkpoint, under ``torchrun --max-restarts 1``: the restarted job
resumes from the checkpoint before (the half-written one is never read) and ends where an
uninterrupted run does.

torch's plain ``init_process_group`` would not: the elastic agent keeps one store across restarts,
and gloo in the restarted group times out connecting to the dead attempt's addresses.

The loop ends with ``Checkpointer.save``, whose last barrier gloo's worker thread could drop after
the script ended: the restarted rank 1 then aborted at exit ("terminate called without an active
exception", 1 run in 40 under load; see ``Checkpointer._barrier``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.slow

STEPS = 6

SCRIPT = """
import os, signal, sys
import torch
from torch import nn
import torch.distributed as dist
import pipetrain
from pipetrain.checkpoint import init_process_group
from pipetrain.split import split_sequential

torch.set_num_threads(1)
init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
parts = split_sequential(nn.Sequential(*[nn.Linear(8, 8) for _ in range(world)]), world)
stage = pipetrain.PipelineStage(parts[rank], rank, world, "cpu")
sched = pipetrain.Schedule1F1B(stage, 4, loss_fn=nn.functional.mse_loss, timeout=60)
optimizer = torch.optim.Adam(parts[rank].parameters(), lr=1e-2)
ckpt = pipetrain.Checkpointer(sys.argv[1])
if rank == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    # Killed while writing the checkpoint of step 4: its data file is on disk, DCP's metadata never.
    import pipetrain.checkpoint as ckmod
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    class DiesWriting(FileSystemWriter):
        def write_data(self, plan, planner):
            done = super().write_data(plan, planner)
            done.wait()
            if "step_000000004" in str(self.path):
                os.kill(os.getpid(), signal.SIGKILL)
            return done

    ckmod._writer = lambda path: DiesWriting(str(path), single_file_per_rank=True)
start = ckpt.load(stage, optimizer).step
print(f"rank {rank} attempt {os.environ['TORCHELASTIC_RESTART_COUNT']} starts at step {start}", flush=True)
for step in range(start, int(sys.argv[2])):
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)
    sched.step(*((x,) if rank == 0 else ()), **({"target": y} if rank == world - 1 else {}))
    optimizer.step()
    optimizer.zero_grad()
    if (step + 1) % 2 == 0:
        ckpt.save(step + 1, stage, optimizer)
dist.destroy_process_group()
"""


def test_a_users_loop_resumes_after_torchrun_restarts_it(tmp_path: Path) -> None:
    from pipetrain import Checkpointer

    (tmp_path / "loop.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    # A rank that aborts (a C++ terminate) prints where each of its threads was.
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1"]
    done = subprocess.run(
        [*cmd, "loop.py", "ckpt", str(STEPS)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[:3000] + "\n…\n" + log[-3000:]
    # Attempt 0 died after the checkpoint of step 2 and before that of step 4 was complete.
    assert "rank 1 attempt 1 starts at step 2" in log, log[:3000] + "\n…\n" + log[-3000:]

    # The same training without a pipeline, in one go: the same parameters (to float rounding:
    # the pipeline sums the microbatches' gradients, plain autograd takes the batch at once).
    torch.manual_seed(0)
    plain = nn.Sequential(*[nn.Linear(8, 8) for _ in range(2)])
    optimizer = torch.optim.Adam(plain.parameters(), lr=1e-2)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 8, generator=gen)
        nn.functional.mse_loss(plain(x), y).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()
    resumed = nn.Sequential(*[nn.Linear(8, 8) for _ in range(2)])
    assert Checkpointer(tmp_path / "ckpt").load(resumed).step == STEPS
    for (name, a), b in zip(plain.state_dict().items(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
