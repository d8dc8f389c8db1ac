"""What a step holds beside what the plan promises, per schedule and rank (issue 28's table).

Each stage is four Linear(64, 64) + Tanh on microbatches of 256 rows, 8 microbatches, so saved
activations dominate. Per schedule: each rank's measured peak bytes of its second step
(:func:`pipetrain.memory.measure_step`: glibc's allocator on the CPU, every thread;
``max_memory_allocated`` on a GPU) beside ``simulate(runtime.schedule, costs)``'s peak, costs
measured by :func:`pipetrain.memory.stage_bytes`, each stage's transient by
:func:`pipetrain.profile_layers` (its layers' workspaces, composed as the planner does).
``return_outputs=False`` unless ``--return-outputs``.

    python benchmarks/memory_truth.py                 # 2 gloo ranks on the CPU
    python benchmarks/memory_truth.py --device cuda   # one GPU: one rank holding every stage (NCCL
                                                      # across ranks with --ranks 2 and 2 GPUs)
    python benchmarks/memory_truth.py --train         # pipetrain train's own report: measured beside
                                                      # promised per rank, bpe and small models
    python benchmarks/memory_truth.py --family mlp    # issue 37: every byte cost from stage_bytes
                                                      # (the first stage's as one), Costs(f=1, i=1,
                                                      # w=1, comm=0.05): GPipe, 1F1B, ZBH1,
                                                      # Interleaved1F1B, ZB-V, auto_schedule at a
                                                      # tight limit, a plan_pipeline plan

Exits 1 when a rank's measured peak exceeds its promise by more than three messages (one action's
temporaries), so ``gpu_check.py`` can run it as a check. ``--train`` runs ``pipetrain train`` (2
gloo ranks, 6 steps, 8 microbatches, batch 16; its second step measured) on the bpe model
(``--schedule auto --memory-limit 110MiB``, ZBVZeroBubble, 1F1B, InterleavedZeroBubble) and on the
default model (the same named schedules, auto within the machine's memory) and prints its
measured and promised bytes per rank (``summary.json``'s ``memory``).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from dataclasses import replace
from datetime import timedelta
from itertools import pairwise
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROWS, WIDTH, MICROBATCHES = 256, 64, 8
SCHEDULES = [
    ("GPipe", 1),
    ("1F1B", 1),
    ("ZBH1", 1),
    ("ZBH2", 1),
    ("Interleaved1F1B", 2),
    ("LoopedBFS", 2),
    ("InterleavedZeroBubble", 2),
    ("ZBVZeroBubble", 2),
    ("DualPipeV", 2),
    ("auto", 2),
]
# --family mlp (issue 37): the same stages, priced as a user would from stage_bytes alone,
# Costs(f=1, i=1, w=1, comm=0.05, **stage_bytes(...)): its transient too, no layer profile.
SAMPLE_EVERY: float | None = None  # seconds between the meter thread's readings; None: measure_step's
MLP_SCHEDULES = [
    ("GPipe", 1),
    ("1F1B", 1),
    ("ZBH1", 1),
    ("Interleaved1F1B", 2),
    ("ZBVZeroBubble", 2),
    ("auto", 2),  # auto_schedule at 0.9 of ZB-V's peak
    ("plan", 4),  # plan_pipeline over 4 blocks per rank, at 0.85 of its peak without a limit
]


def _stage() -> nn.Module:
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _one(
    rank: int, world: int, name: str, v: int, device: torch.device, keep: bool, family: str = "profile"
) -> tuple[int, float, float, float]:
    """(measured, promised, three messages, promised without transients: what is held between
    actions) for this rank under schedule ``name``."""
    from pipetrain import PipelineScheduleRuntime, PipelineStage
    from pipetrain.memory import stage_bytes
    from pipetrain.plan import Costs, auto_schedule, build_schedule

    if family == "mlp":
        return _mlp_one(rank, world, name, v, device, keep)
    torch.manual_seed(0)
    num_stages = world * v
    modules = [_stage().to(device) for _ in range(num_stages)]
    if name == "auto":  # under a tight limit: 1F1B's activations on a rank's share
        costs = Costs.per_rank(f=1, b=2, activation_bytes=1.0).cut_into(v)
        plan = auto_schedule(world, MICROBATCHES, costs, memory_limit=float(world), stages_per_rank=v, time_limit=2)
    else:
        plan = build_schedule(name, num_ranks=world, num_microbatches=MICROBATCHES, stages_per_rank=v)
    stages = [PipelineStage(modules[s], s, num_stages, device) for s in plan.stages_of(rank)]
    runtime = PipelineScheduleRuntime(stages, plan, loss_fn=_mse)
    y = torch.randn(MICROBATCHES * ROWS, WIDTH, device=device)
    measured = _measure(runtime, rank, world, keep, device, y)
    example = torch.randn(ROWS, WIDTH, device=device)
    sizes = [stage_bytes(m, example, device=device) for m in modules[:-1]]
    sizes.append(stage_bytes(modules[-1], example, loss_fn=_mse, target=y[:ROWS], device=device))
    keys = ("activation_bytes", "weight_grad_bytes", "message_bytes")
    transient = [_workspace(m, example, None) for m in modules[:-1]]
    transient.append(_workspace(modules[-1], example, y[:ROWS]))
    costs = Costs(f=1, b=2, comm=0.05, transient_bytes=transient, **{k: [s[k] for s in sizes] for k in keys})
    return (measured, *_promise(runtime, costs, rank, keep))


def _measure(runtime: Any, rank: int, world: int, keep: bool, device: torch.device, y: torch.Tensor) -> int:
    """This rank's measured peak over the second of two steps (the first makes the gradients)."""
    from pipetrain.memory import MemoryMeter, measure_step

    plan = runtime.schedule
    x = torch.randn(MICROBATCHES * ROWS, WIDTH, device=device)
    measured = 0
    for _ in range(2):
        kwargs: dict[str, Any] = {"return_outputs": keep}
        if plan.stage_to_rank[plan.num_stages - 1] == rank:
            kwargs.update(target=y, losses=[])
        if world > 1:
            dist.barrier()
        args = (x,) if plan.stage_to_rank[0] == rank else ()
        if SAMPLE_EVERY is None:
            measured = measure_step(runtime, *args, **kwargs).peak_bytes
        else:  # measure_step's meter, its thread reading more often
            with MemoryMeter(device, interval=SAMPLE_EVERY).attached(runtime) as meter:
                runtime.step(*args, **kwargs)
            measured = meter.peak_bytes
    return measured


def _promise(runtime: Any, costs: Any, rank: int, keep: bool) -> tuple[float, float, float]:
    """(promised, three messages, promised without transients) for this rank: simulate of what runs."""
    from pipetrain.plan import simulate

    promised = simulate(runtime.schedule, costs, keep_outputs=keep).peak_memory_bytes
    held = simulate(
        runtime.schedule, replace(costs, transient_bytes=None, b_transient_bytes=None), keep_outputs=keep
    ).peak_memory_bytes
    assert promised is not None and held is not None
    return promised[rank], 3.0 * max(costs.per_stage("message_bytes", runtime.schedule.num_stages)), held[rank]


def _mlp_one(
    rank: int, world: int, name: str, v: int, device: torch.device, keep: bool
) -> tuple[int, float, float, float]:
    """:func:`_one` for issue 37's family: ``world * v`` blocks, each priced by stage_bytes alone
    (the first as a first stage), ``Costs(f=1, i=1, w=1, comm=0.05, **bytes)`` for a named
    schedule; "auto": auto_schedule at 0.9 of ZB-V's peak; "plan": plan_pipeline over the blocks as
    layers (their stage_bytes; the transient as workspace) at 0.85 of its own peak without a limit
    (ample, if that does not fit). Rank 0 plans (a timed search) and the others run its plan."""
    from pipetrain import PipelineScheduleRuntime, PipelineStage
    from pipetrain.memory import stage_bytes
    from pipetrain.plan import Costs, LayerCost, ScheduleError, auto_schedule, build_schedule, plan_pipeline, simulate
    from pipetrain.recompute import recompute

    torch.manual_seed(0)
    blocks = [_stage().to(device) for _ in range(world * v)]
    example, target = torch.randn(ROWS, WIDTH, device=device), torch.randn(ROWS, WIDTH, device=device)
    sizes = [stage_bytes(blocks[0], example, device=device, first=True)]
    sizes += [stage_bytes(m, example, device=device) for m in blocks[1:-1]]
    sizes.append(stage_bytes(blocks[-1], example, loss_fn=_mse, target=target, device=device))
    costs = Costs(f=1, i=1, w=1, comm=0.05, **{k: [s[k] for s in sizes] for k in sizes[0]})
    modules: list[nn.Module] = list(blocks)
    planned: Any = None
    if name == "auto" and rank == 0:
        zbv = simulate(build_schedule("ZBVZeroBubble", world, MICROBATCHES, 2), costs).peak_memory_bytes
        assert zbv is not None
        limit = 0.9 * max(zbv.values())
        planned = auto_schedule(world, MICROBATCHES, costs, memory_limit=limit, stages_per_rank=v, time_limit=2)
    elif name == "plan" and rank == 0:
        layers = [
            LayerCost(
                f"block{k}", f=1.0, i=1.0, w=1.0, activation_bytes=s["activation_bytes"],
                weight_grad_bytes=s["weight_grad_bytes"], output_bytes=s["message_bytes"],
                workspace_bytes=max(s["transient_bytes"], s["b_transient_bytes"]),  # (one workspace a layer)
            )
            for k, s in enumerate(sizes)
        ]  # fmt: skip
        planned = plan_pipeline(layers, world, MICROBATCHES, None, comm=0.05, time_limit=2)
        try:
            planned = plan_pipeline(layers, world, MICROBATCHES, 0.85 * planned.memory, comm=0.05, time_limit=2)
        except ScheduleError:
            pass
    if name in ("auto", "plan"):
        shared = [planned]
        dist.broadcast_object_list(shared, src=0)
        planned = shared[0]
    if name == "plan":
        plan = planned.schedule
        costs = planned.costs
        bounds = [0]
        for names in planned.stage_layers:
            bounds.append(bounds[-1] + len(names))
        modules = [nn.Sequential(*blocks[a:b]) for a, b in pairwise(bounds)]
        modules = [recompute(m) if s in planned.recompute else m for s, m in enumerate(modules)]
    elif name == "auto":
        plan = planned
    else:
        plan = build_schedule(name, num_ranks=world, num_microbatches=MICROBATCHES, stages_per_rank=v)
    stages = [PipelineStage(modules[s], s, len(modules), device) for s in plan.stages_of(rank)]
    runtime = PipelineScheduleRuntime(stages, plan, loss_fn=_mse)
    measured = _measure(runtime, rank, world, keep, device, torch.randn(MICROBATCHES * ROWS, WIDTH, device=device))
    return (measured, *_promise(runtime, costs, rank, keep))


def _workspace(module: nn.Module, example: torch.Tensor, target: torch.Tensor | None) -> float:
    """A stage's workspace: its layers' (profile_layers), composed as the planner composes them."""
    from pipetrain import profile_layers
    from pipetrain.plan.pipeline.model import Profile

    loss = _mse if target is not None else None
    layers = profile_layers(module, example, loss_fn=loss, target=target, repeats=1)
    return Profile(layers).workspace(0, len(layers))


def _rank(
    rank: int, world: int, port: int, device_type: str, keep: bool, family: str, every: float | None, results: Any
) -> None:
    global SAMPLE_EVERY
    SAMPLE_EVERY = every
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    cases = MLP_SCHEDULES if family == "mlp" else SCHEDULES
    rows = [(name, *_one(rank, world, name, v, device, keep, family)) for name, v in cases]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        results.put(gathered)
    dist.barrier()
    dist.destroy_process_group()


def measure(
    device_type: str = "cpu", world: int = 2, keep: bool = False, family: str = "profile", every: float | None = None
) -> list[list[tuple[str, int, float, float, float]]]:
    """Per rank, per schedule: (name, measured, promised, tolerance, promised without transients) bytes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, world, port, device_type, keep, family, every, results))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    rows: list[list[tuple[str, int, float, float, float]]] = results.get()
    for p in procs:
        p.join()
    return rows


def report(rows: list[list[tuple[str, int, float, float, float]]]) -> tuple[str, bool]:
    """A markdown table (KB, measured / promised per rank, the ratio, and the ratio to what the
    promise holds between actions, without any action's transient) and whether every rank kept
    its promise."""
    world = len(rows)
    head = "| schedule | " + " | ".join(f"rank {r} measured / promised (÷ held)" for r in range(world)) + " |"
    lines = [head, "|---|" + "---:|" * world]
    ok = True
    for k, (name, *_) in enumerate(rows[0]):
        cells = []
        for r in range(world):
            _, measured, promised, tolerance, held = rows[r][k]
            within = measured <= promised + tolerance
            ok = ok and within
            mark = "" if within else " **over**"
            cells.append(
                f"{measured / 1e3:.0f} / {promised / 1e3:.0f} KB ({measured / promised:.2f}; "
                f"÷ held {measured / held:.2f}){mark}"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines), ok


TRAIN_RUNS = [
    ("bpe", "auto", ["--memory-limit", "110MiB"]),
    ("bpe", "ZBVZeroBubble", []),
    ("bpe", "1F1B", []),
    ("bpe", "InterleavedZeroBubble", []),
    ("small", "auto", []),
    ("small", "ZBVZeroBubble", []),
    ("small", "1F1B", []),
    ("small", "InterleavedZeroBubble", []),
]


def train_table(device: str = "cpu") -> str:
    """``pipetrain train``'s measured and promised bytes per rank (MiB), one row per run of TRAIN_RUNS."""
    import json
    import subprocess
    import tempfile

    lines = ["| model | schedule | rank 0 measured / promised | rank 1 measured / promised |", "|---|---|---:|---:|"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for model, schedule, extra in TRAIN_RUNS:
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, "-m", "pipetrain", "train", "--schedule", schedule, "--model", model,
                   "--ranks", "2", "--steps", "6", "--microbatches", "8", "--batch-size", "16",
                   "--device", device, "--out", out, "--json", *extra]  # fmt: skip
            run = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if run.returncode:
            lines.append(f"| {model} | {schedule} | failed: {run.stderr.strip().splitlines()[-1:]} | |")
            continue
        ranks = json.loads(run.stdout)["memory"]["ranks"]
        cells = []
        for rank in ("0", "1"):
            measured, promised = ranks[rank]["measured_peak_bytes"], ranks[rank]["promised_peak_bytes"]
            cells.append(f"{measured / 2**20:.2f} / {promised / 2**20:.2f} MiB ({measured / promised:.2f})")
        lines.append(f"| {model} | {schedule} | " + " | ".join(cells) + " |")
        print(lines[-1], file=sys.stderr, flush=True)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--ranks", type=int, default=None, help="default: 2 on the CPU, 1 on a GPU")
    parser.add_argument("--return-outputs", action="store_true")
    parser.add_argument(
        "--family",
        default="profile",
        choices=["profile", "mlp"],
        help="mlp: costs from stage_bytes alone, Costs(f=1, i=1, w=1, comm=0.05) (issue 37)",
    )
    parser.add_argument(
        "--sample-every",
        type=float,
        default=None,
        help="seconds between the meter thread's CPU readings (default measure_step's 0.0005; 0: continuously)",
    )
    parser.add_argument("--train", action="store_true", help="pipetrain train's measured and promised bytes instead")
    args = parser.parse_args()
    if args.train:
        print(train_table(args.device))
        return 0
    world = args.ranks or (2 if args.device == "cpu" else 1)
    if args.device == "cuda" and torch.cuda.device_count() < world:
        print(f"needs {world} GPUs, {torch.cuda.device_count()} visible", file=sys.stderr)
        return 2
    table, ok = report(measure(args.device, world, args.return_outputs, args.family, args.sample_every))
    print(table)
    print("every rank within its promise + three messages" if ok else "a rank exceeded its promise")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
