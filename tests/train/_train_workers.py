"""Functions run in spawned ranks by the launcher tests (module level, so they pickle)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from pipetrain.train.launch import DistEnv, init_process_group


def all_reduce_rank(env: DistEnv, out_dir: str) -> None:
    init_process_group(env, "cpu", timeout_s=60)
    try:
        value = torch.tensor([float(env.rank + 1)])
        dist.all_reduce(value)
        Path(out_dir, f"rank{env.rank}.txt").write_text(f"{env.world_size} {torch.get_num_threads()} {value.item()}")
    finally:
        dist.destroy_process_group()


def fail_on_rank_one(env: DistEnv) -> None:
    if env.rank == 1:
        raise ValueError("bad data on purpose")
