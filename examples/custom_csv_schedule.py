"""Run a schedule you wrote yourself, as a CSV file, with PipelineScheduleRuntime.

    torchrun --nproc-per-node 2 examples/custom_csv_schedule.py

The CSV below is torch.distributed.pipelining's format: one row per rank, one action per cell
(``<stage><KIND><microbatch>``), an empty cell for an idle step. It is a ZB-H1-style order for
2 ranks and 4 microbatches: the backward is split into I (input gradient, on the critical
path) and W (weight gradient, deferred to fill what would otherwise be bubbles). pipetrain
checks it (dependencies, deadlock), simulates it, adds the SEND/RECV actions, and runs it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from pipetrain import PipelineScheduleRuntime, PipelineStage
from pipetrain.plan import Costs, Schedule, simulate

CSV = """\
0F0,0F1,0F2,0I0,0F3,0I1,0W0,0I2,0W1,0I3,0W2,0W3
,1F0,1I0,1F1,1I1,1W0,1F2,1I2,1W1,1F3,1I3,1W2,1W3
"""


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    plan = Schedule.from_csv_text(CSV, name="my-zb-h1")
    plan.validate()  # raises ScheduleError naming rank, step and action if something is off
    if rank == 0:
        print(plan.format())
        sim = simulate(plan, Costs(f=1, b=2, i=1, w=1))
        print(f"simulated: makespan {sim.makespan:g}, bubble {sim.bubble:.1%}")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    parts = [model[:2], model[2:]]
    stage = PipelineStage(parts[rank], rank, plan.num_stages, torch.device("cpu"))
    runtime = PipelineScheduleRuntime([stage], plan, loss_fn=nn.functional.mse_loss)

    torch.manual_seed(1)
    x, y = torch.randn(16, 32), torch.randn(16, 1)
    optimizer = torch.optim.SGD(parts[rank].parameters(), lr=0.1)
    for step in range(5):
        losses: list[torch.Tensor] = []
        if rank == 0:
            runtime.step(x)
        else:
            runtime.step(target=y, losses=losses)
            print(f"step {step + 1}: loss {torch.stack(losses).mean().item():.4f}", flush=True)
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
