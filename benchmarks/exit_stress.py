"""Issue 37: does every 2-rank torchrun job exit 0? Many short jobs in a row, counted.

    .venv/bin/python benchmarks/exit_stress.py --runs 60 --load        # a busy process per core beside
    .venv/bin/python benchmarks/exit_stress.py --runs 30 --destroy no --schedules 1F1B

Each run is ``torchrun --standalone --nproc-per-node 2`` of this file's worker: a tiny model cut into
stages, a few training steps on gloo (CPU), then ``destroy_process_group()`` or not, and a normal
exit. The runs cycle through the schedules (1F1B, ZBVZeroBubble, and a planned one: ``auto_schedule``
on each rank, run by ``PipelineScheduleRuntime``, which settles on rank 0's order) and through
with/without ``destroy_process_group()``. A run fails when torchrun's exit code is not 0 or its
stderr says "terminate called" (an abort at exit: one rank died with SIGABRT). ``--load [N]`` runs
N busy processes (default: one per core) for the whole time, as when another job shares the cores.
``--impl torch`` runs the same worker on ``torch.distributed.pipelining`` (1F1B and ZBV only).
By default each step is followed by two collectives (``clip_grad_norm_``, an all-reduce of the loss).

What an abort is (issue 37; a core dump's stacks): a gloo worker thread (``pt_gloo_runloop``)
destroys a finished collective whose tensor Python already let go of, so it takes the GIL to free
the tensor's Python object; the interpreter is finalizing, the thread is made to exit inside a C++
destructor, and libstdc++ calls ``std::terminate``. ``destroy_process_group()`` joins those threads
before exit, but only if nothing else holds the group: pipetrain held it (its FSDP check imported
``torch.distributed.fsdp`` after ``init_process_group``, pinning the group in
``torch.distributed.nn.functional``'s defaults; the runtime and transport referenced it). Without
``destroy_process_group()`` the group lives into finalization with any library, torch's included.

Measured (2-CPU VM shared with other work, ``--load`` = 2 busy processes, 2026-12-07), failed / runs:

    before the fix, pipetrain, collectives:      destroy 0 / 30, no destroy 1 / 30
    after the fix,  pipetrain, collectives:      destroy 0 / 50, no destroy 1 / 50
    torch.distributed.pipelining, collectives:   no destroy 2 / 50
    torch alone, a pinned group + collectives right before destroy + exit: 11 / 40 (unpinned 0 / 40)
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

SCHEDULES = ("1F1B", "ZBVZeroBubble", "auto")
WIDTH = 32
_KEPT: list[object] = []  # --keep: what a script's module globals hold until the interpreter exits


def _worker(schedule: str, destroy: bool, impl: str, steps: int, collectives: bool, keep: bool) -> None:
    """One rank of one job (run by torchrun)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from pipetrain import clip_grad_norm_

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    microbatches = 4
    if impl == "torch":
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleZBVZeroBubble
    else:
        from pipetrain import PipelineStage, Schedule1F1B, ScheduleZBVZeroBubble  # type: ignore[assignment]

    if schedule == "1F1B":
        mine = [rank]
        num_stages = world
    else:  # two stages per rank
        num_stages = 2 * world
        mine = [rank, 2 * world - 1 - rank] if schedule == "ZBVZeroBubble" else []
    planned = None
    if schedule == "auto":
        from pipetrain import PipelineScheduleRuntime
        from pipetrain.plan import Costs, auto_schedule

        planned = auto_schedule(
            world,
            microbatches,
            Costs(f=1, b=2, i=1, w=1, comm=0.1),
            stages_per_rank=2,
            placement="loop",
            time_limit=0.3,
        )
        num_stages = planned.num_stages
        mine = planned.stages_of(rank)
    torch.manual_seed(0)
    modules = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(num_stages)]
    stages = [PipelineStage(modules[s], s, num_stages, torch.device("cpu")) for s in mine]
    loss_fn = nn.functional.mse_loss
    if planned is not None:
        sched = PipelineScheduleRuntime(stages, planned, loss_fn=loss_fn)
        last = planned.stage_to_rank[num_stages - 1] == rank
    elif schedule == "1F1B":
        sched = Schedule1F1B(stages[0], microbatches, loss_fn=loss_fn)
        last = rank == world - 1
    else:
        sched = ScheduleZBVZeroBubble(stages, microbatches, loss_fn=loss_fn)
        last = rank == 0  # the V ends on rank 0
    first = 0 in mine
    params = [p for s in mine for p in modules[s].parameters()]
    optimizer = torch.optim.SGD(params, lr=0.01)
    x = torch.randn(8, WIDTH)
    for _ in range(steps):
        optimizer.zero_grad()
        inputs = (x,) if first else ()
        losses: list[torch.Tensor] = []
        if last:
            sched.step(*inputs, target=x, losses=losses)
        else:
            sched.step(*inputs)
        if collectives:  # the whole model's gradient norm: a collective (gloo's worker threads run it)
            clip_grad_norm_(params, max_norm=1.0)
        optimizer.step()
        if collectives:  # the step's loss on every rank, for the log: another collective
            loss = torch.stack(losses).mean().detach() if last else torch.zeros(())
            dist.all_reduce(loss)
    if keep:
        _KEPT.extend([sched, stages, modules, optimizer, x])
    if destroy:
        dist.destroy_process_group()


def _busy() -> None:
    while True:
        pass


def _core_limit() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def _run_one(
    schedule: str,
    destroy: bool,
    impl: str,
    steps: int,
    collectives: bool,
    keep: bool,
    env: dict[str, str],
    cwd: Path,
    timeout: float,
    cores: bool = False,
) -> tuple[int, str, float]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        os.path.abspath(__file__),
        "--worker",
        "--schedule",
        schedule,
        "--impl",
        impl,
        "--steps",
        str(steps),
        *(["--no-collectives"] if not collectives else []),
        *(["--keep"] if keep else []),
        *(["--destroy", "yes"] if destroy else ["--destroy", "no"]),
    ]
    t0 = time.monotonic()
    try:
        done = subprocess.run(
            cmd,
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            preexec_fn=_core_limit if cores else None,
        )
        rc, err = done.returncode, done.stderr
    except subprocess.TimeoutExpired as exc:
        rc, err = -999, f"timed out after {timeout:g} s\n{exc.stderr or ''}"
    return rc, err if isinstance(err, str) else str(err), time.monotonic() - t0


def _env(recv_ahead: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env = {k: v for k, v in env.items() if not k.startswith("TORCHELASTIC_")}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONFAULTHANDLER="1")
    src = str(Path(__file__).resolve().parent.parent / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if recv_ahead is not None:
        env["PIPETRAIN_RECV_AHEAD"] = recv_ahead
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument(
        "--schedules", default=",".join(SCHEDULES), help="comma-separated, from " + ", ".join(SCHEDULES)
    )
    parser.add_argument("--destroy", choices=("yes", "no", "both"), default="both")
    parser.add_argument("--load", type=int, nargs="?", const=os.cpu_count() or 2, default=0, metavar="N")
    parser.add_argument("--impl", choices=("pipetrain", "torch"), default="pipetrain")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--no-collectives",
        action="store_true",
        help="no collectives between steps (clip_grad_norm_, and an all_reduce of the loss for the log)",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="the schedule, model and optimizer stay alive until the interpreter exits (as a script's globals)",
    )
    parser.add_argument("--recv-ahead", default=None, help="PIPETRAIN_RECV_AHEAD for the runs")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per run")
    parser.add_argument(
        "--cores",
        type=Path,
        default=None,
        metavar="DIR",
        help="run each job in DIR/run<i> with core dumps on (core_pattern 'core'); keep the folders of failed runs",
    )
    parser.add_argument("--quiet", action="store_true", help="print only failed runs and the summary")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--schedule", default="1F1B", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.schedule, args.destroy == "yes", args.impl, args.steps, not args.no_collectives, args.keep)
        return

    schedules = [s for s in args.schedules.split(",") if s]
    for s in schedules:
        if s not in SCHEDULES:
            parser.error(f"unknown schedule {s!r}")
        if args.impl == "torch" and s == "auto":
            parser.error("--impl torch runs 1F1B and ZBVZeroBubble only")
    destroys = {"yes": [True], "no": [False], "both": [True, False]}[args.destroy]
    combos = list(itertools.product(schedules, destroys))
    env = _env(args.recv_ahead)

    import multiprocessing as mp

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the busy processes go too
    busy = [mp.Process(target=_busy, daemon=True) for _ in range(args.load)]
    for p in busy:
        p.start()
    runs: Counter[tuple[str, bool]] = Counter()
    failed: Counter[tuple[str, bool]] = Counter()
    aborted: Counter[tuple[str, bool]] = Counter()
    seconds = 0.0
    try:
        with tempfile.TemporaryDirectory(prefix="pipetrain-exit-stress-") as tmp:
            for i in range(args.runs):
                schedule, destroy = combos[i % len(combos)]
                cwd = Path(tmp) if args.cores is None else args.cores / f"run{i + 1}"
                cwd.mkdir(parents=True, exist_ok=True)
                rc, err, took = _run_one(
                    schedule,
                    destroy,
                    args.impl,
                    args.steps,
                    not args.no_collectives,
                    args.keep,
                    env,
                    cwd,
                    args.timeout,
                    args.cores is not None,
                )
                seconds += took
                terminate = "terminate called" in err
                bad = rc != 0 or terminate
                key = (schedule, destroy)
                runs[key] += 1
                failed[key] += bad
                aborted[key] += terminate
                if bad or not args.quiet:
                    how = "FAILED" + (" (terminate called)" if terminate else "") if bad else "ok"
                    print(f"run {i + 1}: {schedule}, destroy={destroy}: exit {rc}, {took:.1f} s, {how}", flush=True)
                if bad:
                    print("    " + err[-3000:].replace("\n", "\n    "), flush=True)
                elif args.cores is not None:
                    shutil.rmtree(cwd, ignore_errors=True)
    finally:
        for p in busy:
            p.kill()
            p.join()

    print()
    print(
        f"impl {args.impl}, load {args.load} busy process(es), {args.steps} steps per run"
        f"{'' if args.no_collectives else ' (each with clip_grad_norm_ and a loss all_reduce)'}"
        f"{', kept alive to the end' if args.keep else ''}, "
        f"PIPETRAIN_RECV_AHEAD={args.recv_ahead if args.recv_ahead is not None else '(unset)'}, "
        f"{seconds / max(1, args.runs):.1f} s per run"
    )
    print(f"{'schedule':<15} {'destroy':<8} {'runs':>5} {'failed':>7} {'terminate':>10}")
    for key in combos:
        print(f"{key[0]:<15} {'yes' if key[1] else 'no':<8} {runs[key]:>5} {failed[key]:>7} {aborted[key]:>10}")
    total, bad = sum(runs.values()), sum(failed.values())
    print(f"{'all':<15} {'':<8} {total:>5} {bad:>7} {sum(aborted.values()):>10}")


if __name__ == "__main__":
    main()
