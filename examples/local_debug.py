"""Debug a split model and a schedule in one process with LocalPipeline: no process group.

    python examples/local_debug.py

LocalPipeline runs every rank's actions in one process, in an order the schedule's
dependencies allow, with the same step() and the same gradients as the distributed runtime.
So a bad cut, a shape mismatch or a wrong custom schedule shows up here, under a debugger,
before any torchrun job. Here it checks that pipelined gradients equal plain training's.
"""

from __future__ import annotations

import torch
from torch import nn

from pipetrain import LocalPipeline
from pipetrain.split import split_sequential


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(8)), nn.Linear(16, 4))
    stages = split_sequential(model, 4)  # 2 ranks × 2 stages, balanced by parameter count
    print("stage sizes:", [sum(p.numel() for p in s.parameters()) for s in stages])

    x, y = torch.randn(32, 16), torch.randn(32, 4)
    pipe = LocalPipeline(stages, "Interleaved1F1B", n_microbatches=8, loss_fn=nn.functional.mse_loss, num_ranks=2)
    losses: list[torch.Tensor] = []
    pipe.step(x, target=y, losses=losses)
    piped = {name: p.grad.clone() for name, p in model.named_parameters()}
    print(f"pipelined loss (mean of {len(losses)} microbatches): {torch.stack(losses).mean().item():.6f}")

    model.zero_grad()
    chunks = zip(x.tensor_split(8), y.tensor_split(8), strict=True)
    loss = torch.stack([nn.functional.mse_loss(model(cx), cy) for cx, cy in chunks]).mean()
    loss.backward()
    print(f"plain loss:                               {loss.item():.6f}")
    for name, p in model.named_parameters():
        torch.testing.assert_close(piped[name], p.grad, msg=lambda m, n=name: f"{n}: {m}")
    print("gradients match plain training for every parameter")


if __name__ == "__main__":
    main()
