"""A GPT split across pipeline stages with PipelineStage and a schedule class, run by torchrun.

    torchrun --nproc-per-node 2 examples/gpt_pipeline.py                  # 2 ranks on this machine
    torchrun --nproc-per-node 2 examples/gpt_pipeline.py --schedule 1F1B  # another schedule
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        examples/gpt_pipeline.py --device cuda                            # 8 GPUs on 2 nodes

Each rank builds the whole model from the same seed, cuts it into stages, and keeps the stages
its schedule places on it. This is the code ``pipetrain train`` runs, written out in one page.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from pipetrain import PipelineScheduleSingle, PipelineStage, clip_grad_norm_, get_schedule_class
from pipetrain.plan import build_schedule
from pipetrain.train.data import TextData
from pipetrain.train.model import GPT, GPTConfig, lm_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="ZBVZeroBubble")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()

    # 1. Join the job torchrun started: gloo on CPU, NCCL with one GPU per process.
    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    # 2. Which stage runs where: ask the planner (V placement for ZBV: rank r holds r and 2P-1-r).
    plan = build_schedule(args.schedule, world, args.microbatches)
    num_stages = plan.num_stages
    mine = plan.stages_of(rank)

    # 3. Same seed on every rank → the same model everywhere; cut it into balanced stages.
    torch.manual_seed(0)
    # Embedding and head are a layer each: add blocks until every stage gets at least one layer.
    cfg = GPTConfig(n_layers=max(GPTConfig().n_layers, num_stages - 2))
    model = GPT(cfg)
    parts = model.split(num_stages)  # by parameter count; pipetrain.split also cuts by measured time
    stages = [PipelineStage(parts[s].to(device), s, num_stages, device) for s in mine]

    # 4. The schedule class, exactly as with torch.distributed.pipelining.
    cls = get_schedule_class(args.schedule)
    single = issubclass(cls, PipelineScheduleSingle)
    schedule = cls(stages[0] if single else stages, args.microbatches, loss_fn=lm_loss)

    params = [p for s in mine for p in parts[s].parameters()]
    optimizer = torch.optim.Adam(params, lr=3e-3)
    data = TextData.from_stdlib()
    first, last = 0 in mine, num_stages - 1 in mine
    for step in range(args.steps):
        x, y = data.batch(step, batch_size=16, seq_len=cfg.seq_len)  # same batch on every rank
        losses: list[torch.Tensor] = []
        inputs = (x.to(device),) if first else ()
        if last:
            schedule.step(*inputs, target=y.to(device), losses=losses)
        else:
            schedule.step(*inputs)
        # 5. Clip by the whole model's gradient norm: every rank gets the same total.
        norm = clip_grad_norm_(params, max_norm=1.0)
        if last:
            print(f"step {step + 1}: loss {torch.stack(losses).mean().item():.4f}, grad norm {norm:.3f}", flush=True)
        optimizer.step()
        optimizer.zero_grad()

    # 6. Each rank saves the stages it holds; their keys are the whole model's keys.
    torch.save({k: v for s in mine for k, v in parts[s].state_dict().items()}, f"gpt_rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
