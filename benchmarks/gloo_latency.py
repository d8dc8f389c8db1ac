"""Latency of dependent gloo messages between 2 ranks, with and without compute between them.

No pipetrain here: plain ``torch.distributed``. Rank 0 sends a tiny tensor and waits for the
reply, rank 1 waits, then replies: 8 round trips, as a 2-rank 1F1B step makes. Between the
messages each side runs nothing, a busy loop of 100 µs, or a tiny Linear forward+backward. On a
machine where the ranks' main and gloo I/O threads share few cores, a message to a side that
was just computing waits for its thread to be woken, and the step time grows far beyond the
compute added: that latency, not the runtime, is most of a small 1F1B step (README, Runtime).

    python benchmarks/gloo_latency.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from _two_ranks import run_on_two_ranks

MODES = ("none", "busy 100 us", "linear f+b")
STEPS, WARMUP, ROUND_TRIPS = 200, 20, 8


def _compute(mode: str, layer: nn.Module) -> None:
    if mode == "busy 100 us":
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 1e-4:
            pass
    elif mode == "linear f+b":
        layer(torch.randn(2, 16, requires_grad=True)).sum().backward()


def _run(rank: int, port: int, results: mp.Queue[object]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    layer = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
    out, into = torch.randn(2, 16), torch.empty(2, 16)
    rows = []
    for mode in MODES:
        wall, cpu = [], []
        for step in range(WARMUP + STEPS):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(ROUND_TRIPS):
                if rank == 0:
                    _compute(mode, layer)
                    send = dist.isend(out, 1)
                    dist.irecv(into, 1).wait()
                    _compute(mode, layer)
                    send.wait()
                else:
                    dist.irecv(into, 0).wait()
                    _compute(mode, layer)
                    _compute(mode, layer)
                    dist.isend(out, 0).wait()
            if step >= WARMUP:
                wall.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
        local = torch.tensor([statistics.median(wall), statistics.median(cpu)], dtype=torch.float64)
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
        rows.append((mode, float(local[0]), float(local[1])))
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def main() -> None:
    rows = run_on_two_ranks(_run)
    print(
        f"{ROUND_TRIPS} dependent round trips of a 2x16 float tensor, 2 gloo ranks; median of {STEPS}, max over ranks"
    )
    print(f"{'between messages':<18} {'wall ms':>8} {'cpu ms':>8}")
    for mode, wall, cpu in rows:
        print(f"{mode:<18} {wall * 1e3:8.2f} {cpu * 1e3:8.2f}")


if __name__ == "__main__":
    main()
