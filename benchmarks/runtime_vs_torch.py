"""Step time of pipetrain beside torch.distributed.pipelining: same schedule, model and ranks.

Two gloo ranks on 127.0.0.1 (or ``--ranks 1``: one process holding every stage), one thread each.
For each schedule and model size the two runtimes get identical copies of the model and the same
batch, and their steps alternate in one run (so machine noise hits both alike). Prints the median
step time of each, the ratio pipetrain / torch (below 1 means pipetrain is faster) and the same
ratio of CPU time per step (all threads of the process), which a busy machine disturbs less than
wall-clock time.

    python benchmarks/runtime_vs_torch.py [--steps 40] [--warmup 5] [--device cuda] [--ranks 1]

``--device cuda``: NCCL, rank r on GPU r (``--ranks N`` needs N GPUs), each step timed to the
GPUs' end; it adds the model "huge", compute-bound on a GPU (the others are overhead-bound there).
On gloo before torch 2.13, torch's own multi-stage schedules fail where two neighbouring stages
share a rank (its first step sends between them, and gloo cannot send to its own rank): ZBV on 2
ranks, every multi-stage schedule on 1.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from _two_ranks import run_on_ranks

SCHEDULES = {"1F1B": 1, "Interleaved1F1B": 2, "ZBVZeroBubble": 2}
# name: (width, layers per stage, batch, microbatches)
MODELS = {
    "small (overhead-bound)": (16, 1, 16, 8),
    "large (compute-bound on CPUs)": (512, 4, 256, 8),
    "huge (GPU compute-bound)": (4096, 4, 4096, 8),
}


def _layers(width: int, per_stage: int, num_stages: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Sequential(*[m for _ in range(per_stage) for m in (nn.Linear(width, width), nn.ReLU())])
        for _ in range(num_stages)
    ]


def _placement(name: str, world: int, v: int) -> dict[int, int]:
    from pipetrain.plan import build_schedule

    return build_schedule(name, world, 8, v).stage_to_rank


def _bench(
    rank: int,
    port: int,
    results: mp.Queue[object],
    world: int,
    steps: int,
    warmup: int,
    schedules: dict[str, int],
    models: dict[str, tuple[int, int, int, int]],
    device_type: str = "cpu",
) -> None:
    torch.set_num_threads(1)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device_type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),
        **({"device_id": device} if device_type == "cuda" else {}),
    )
    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    import torch.distributed.pipelining as tpp

    import pipetrain

    rows = []
    loss_fn = nn.functional.mse_loss
    for model_name, (width, per_stage, batch, m) in models.items():
        for name, v in schedules.items():
            num_stages = world * v
            placement = _placement(name, world, v)
            mine = sorted(s for s, r in placement.items() if r == rank)
            layers = _layers(width, per_stage, num_stages)
            ours_layers = [copy.deepcopy(layers[s]).to(device) for s in mine]
            torch_layers = [copy.deepcopy(layers[s]).to(device) for s in mine]
            ours_stages = [
                pipetrain.PipelineStage(mod, s, num_stages, device) for mod, s in zip(ours_layers, mine, strict=True)
            ]
            torch_stages = [
                tpp.PipelineStage(mod, s, num_stages, device) for mod, s in zip(torch_layers, mine, strict=True)
            ]
            ours_cls = pipetrain.get_schedule_class(name)
            torch_cls = tpp.schedules.get_schedule_class(name)
            ours = ours_cls(ours_stages if v > 1 else ours_stages[0], m, loss_fn=loss_fn)
            theirs = torch_cls(torch_stages if v > 1 else torch_stages[0], m, loss_fn=loss_fn)
            g = torch.Generator().manual_seed(1)
            x = torch.randn(batch, width, generator=g).to(device)
            y = torch.randn(batch, width, generator=g).to(device)
            first, last = 0 in mine, num_stages - 1 in mine
            args = (x,) if first else ()
            target = y if last else None
            times: dict[str, list[float]] = {"torch": [], "pipetrain": []}
            cpu: dict[str, list[float]] = {"torch": [], "pipetrain": []}
            for i in range(warmup + steps):
                pair = [("torch", theirs, torch_layers), ("pipetrain", ours, ours_layers)]
                for label, sched, mods in pair if i % 2 == 0 else pair[::-1]:  # neither always goes first
                    for mod in mods:
                        mod.zero_grad(set_to_none=True)
                    sync()
                    dist.barrier()
                    c0 = time.process_time()
                    t0 = time.perf_counter()
                    sched.step(*args, target=target)
                    sync()
                    elapsed = time.perf_counter() - t0
                    if i >= warmup:
                        times[label].append(elapsed)
                        cpu[label].append(time.process_time() - c0)
            # Both ranks' times matter: a step ends when the slowest rank ends.
            local = torch.tensor(
                [statistics.median(times[k]) for k in ("torch", "pipetrain")]
                + [statistics.median(cpu[k]) for k in ("torch", "pipetrain")],
                dtype=torch.float64,
                device=device,
            )
            dist.all_reduce(local, op=dist.ReduceOp.MAX)
            rows.append((model_name, name, *(float(v) for v in local.cpu())))
    if rank == 0:
        results.put(rows)
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated subset")
    parser.add_argument("--models", default="", help="small, large, huge (default: small,large; on cuda all three)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: NCCL, rank r on GPU r")
    parser.add_argument("--ranks", type=int, default=2, choices=(1, 2), help="1: one process holds every stage")
    opts = parser.parse_args()
    opts.models = opts.models or ("small,large,huge" if opts.device == "cuda" else "small,large")
    for key in list(SCHEDULES):
        if key not in opts.schedules.split(","):
            del SCHEDULES[key]
    for key in list(MODELS):
        if key.split()[0] not in opts.models.split(","):
            del MODELS[key]
    if opts.device == "cuda" and torch.cuda.device_count() < opts.ranks:
        raise SystemExit(
            f"runtime_vs_torch.py: error: --device cuda --ranks {opts.ranks} needs {opts.ranks} "
            f"GPU{'s' * (opts.ranks > 1)}, {torch.cuda.device_count()} visible (torch {torch.__version__}, "
            f"CUDA {torch.version.cuda or 'none: a CPU-only build'})"
        )
    world = opts.ranks
    rows = run_on_ranks(_bench, world, world, opts.steps, opts.warmup, SCHEDULES, MODELS, opts.device)
    where = (
        f"NCCL, {world} GPU{'s' * (world > 1)}"
        if opts.device == "cuda"
        else f"gloo, {world} CPU process{'es' * (world > 1)}"
    )
    print(
        f"median step time (wall clock) and CPU time per step, max over the {world} rank(s) ({where}); "
        "ratio = pipetrain / torch"
    )
    print(f"{'model':<24} {'schedule':<16} {'torch ms':>9} {'pipetrain ms':>13} {'ratio':>6} {'cpu ratio':>10}")
    for model_name, name, t_torch, t_ours, c_torch, c_ours in rows:
        print(
            f"{model_name:<24} {name:<16} {t_torch * 1e3:9.2f} {t_ours * 1e3:13.2f} {t_ours / t_torch:6.2f} "
            f"{c_ours / c_torch:10.2f}"
        )


if __name__ == "__main__":
    main()
