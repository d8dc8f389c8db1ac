"""The GPU check: pipetrain on CUDA, gradients, no host synchronisation, step times (``make gpu-check``).

With one GPU: every schedule on one rank with all its stages on the GPU (PipelineScheduleRuntime
on a one-rank group) and in LocalPipeline; gradients equal those of plain training of the same
model; steady-state steps run under ``torch.cuda.set_sync_debug_mode("error")`` (any host
synchronisation raises), then a step with a new sequence length; step time beside plain,
non-pipelined training. With two or more GPUs, also: every schedule on 2 ranks over NCCL
(gradients, zero counted host reads after the first step, no synchronisation in steady state,
sequence lengths changing between steps). Then ``benchmarks/runtime_vs_torch.py --device cuda``
beside torch.distributed.pipelining: on 2 NCCL ranks, or with one GPU on one rank holding every
stage; and ``benchmarks/memory_truth.py --device cuda``: each rank's ``max_memory_allocated`` over
a step beside the plan's promised peak, for every schedule. Exits 0 when every check passed, 1
when one failed, 2 when there is no GPU to check.

    python benchmarks/gpu_check.py [--steps 20] [--schedules GPipe,1F1B] [--skip-bench]

``--device cpu`` runs the same checks on the CPU (gloo, order-only matching as NCCL does, no
sync-debug mode): how the project's CPU tests check this script.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

MULTI_STAGE = {"Interleaved1F1B": 2, "LoopedBFS": 2, "InterleavedZeroBubble": 2, "ZBVZeroBubble": 2, "DualPipeV": 2}
WIDTH, BATCH, MICROBATCHES = 64, 16, 4
SEQ, NEW_SEQ = 16, 24
NO_GPU = 2


class Block(nn.Module):
    """A residual MLP over (batch, sequence, width): shapes follow the sequence length."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def _layers(num_stages: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [Block(WIDTH) for _ in range(num_stages)]


def _batch(seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seq)
    x, y = torch.randn(BATCH, seq, WIDTH, generator=g), torch.randn(BATCH, seq, WIDTH, generator=g)
    return x.to(device), y.to(device)


def _plain_grads(layers: list[nn.Module], x: torch.Tensor, y: torch.Tensor) -> list[list[torch.Tensor]]:
    """Plain training's gradients: the mean of the microbatch losses, one backward."""
    model = nn.Sequential(*copy.deepcopy(layers)).to(x.device)
    losses = [
        nn.functional.mse_loss(model(xi), yi)
        for xi, yi in zip(x.tensor_split(MICROBATCHES), y.tensor_split(MICROBATCHES), strict=True)
    ]
    torch.stack(losses).mean().backward()
    return [[p.grad.detach().clone() for p in m.parameters() if p.grad is not None] for m in model]


def _grads_match(layers: dict[int, nn.Module], want: list[list[torch.Tensor]]) -> str:
    """ "" when every gradient of ``layers`` (stage -> module) equals plain training's, else why not."""
    for s, module in layers.items():
        got = [p.grad for p in module.parameters()]
        for i, (g, w) in enumerate(zip(got, want[s], strict=True)):
            if g is None:
                return f"stage {s} parameter {i} has no gradient"
            try:
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
            except AssertionError as err:
                return f"stage {s} parameter {i}: {str(err).splitlines()[0]}"
    return ""


@contextlib.contextmanager
def _no_sync(device: torch.device) -> Iterator[None]:
    """Any host synchronisation with the GPU raises inside (nothing to watch on the CPU)."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn: Callable[[], None], device: torch.device, steps: int) -> float:
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _check_steps(
    step: Callable[[torch.Tensor, torch.Tensor], None],
    layers: list[nn.Module],
    mine: dict[int, nn.Module],
    device: torch.device,
) -> dict[str, str]:
    """Warm-up step, gradients, steady steps without host sync, a new length; "" for each check passed."""
    from pipetrain.runtime.transport.host import host_reads

    out: dict[str, str] = {}
    x, y = _batch(SEQ, device)

    def fresh_step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        for m in mine.values():
            m.zero_grad(set_to_none=True)
        step(xb, yb)

    fresh_step(x, y)  # the first step learns the layouts
    _sync(device)
    out["grads"] = _grads_match(mine, _plain_grads(layers, x, y))
    before = host_reads()
    try:
        with _no_sync(device):
            fresh_step(x, y)
            fresh_step(x, y)
        out["no sync (steady)"] = ""
    except RuntimeError as err:
        out["no sync (steady)"] = str(err).splitlines()[0][:200]
    x2, y2 = _batch(NEW_SEQ, device)
    try:
        with _no_sync(device):
            fresh_step(x2, y2)
        out["no sync (new length)"] = ""
    except RuntimeError as err:
        out["no sync (new length)"] = str(err).splitlines()[0][:200]
    _sync(device)
    out["grads (new length)"] = _grads_match(mine, _plain_grads(layers, x2, y2))
    reads = host_reads() - before
    out["host reads"] = "" if reads == 0 else f"{reads} host reads after the first step"
    return out


# ----------------------------------------------------------------------------- one device
def _one_device(device: torch.device, names: list[str], steps: int) -> list[tuple[str, dict[str, str], float, float]]:
    from pipetrain import LocalPipeline, PipelineStage, get_schedule_class

    rows = []
    loss_fn = nn.functional.mse_loss
    with _one_rank_group(device):
        for name in names:
            for runner in ("runtime", "LocalPipeline"):
                v = MULTI_STAGE.get(name, 1)
                num_stages = v if runner == "runtime" else 2 * v
                layers = _layers(num_stages)
                mods = [copy.deepcopy(m).to(device) for m in layers]
                if runner == "runtime":
                    stages = [PipelineStage(m, i, num_stages, device) for i, m in enumerate(mods)]
                    sched: Any = get_schedule_class(name)(stages if v > 1 else stages[0], MICROBATCHES, loss_fn=loss_fn)
                else:
                    sched = LocalPipeline(mods, name, MICROBATCHES, loss_fn=loss_fn, num_ranks=2, device=device)

                def step(x: torch.Tensor, y: torch.Tensor, sched: Any = sched) -> None:
                    sched.step(x, target=y)

                label = f"{name} ({runner})"
                if name == "ForwardOnly":
                    x, _ = _batch(SEQ, device)
                    result = {"eval": ""}
                    try:
                        sched.eval(x)
                        with _no_sync(device):
                            sched.eval(x)
                    except RuntimeError as err:
                        result["eval"] = str(err).splitlines()[0][:200]
                    rows.append((label, result, float("nan"), float("nan")))
                    continue
                result = _check_steps(step, layers, dict(enumerate(mods)), device)
                x, y = _batch(SEQ, device)
                plain = nn.Sequential(*copy.deepcopy(layers)).to(device)

                def plain_step(plain: nn.Module = plain, x: torch.Tensor = x, y: torch.Tensor = y) -> None:
                    plain.zero_grad(set_to_none=True)
                    loss_fn(plain(x), y).backward()

                ours = _median_ms(lambda x=x, y=y, step=step: step(x, y), device, steps)
                theirs = _median_ms(plain_step, device, steps)
                rows.append((label, result, ours, theirs))
    return rows


@contextlib.contextmanager
def _one_rank_group(device: torch.device) -> Iterator[None]:
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _device_timing(device: torch.device, width: int = 4096, batch: int = 4096) -> tuple[dict[str, str], str]:
    """A GPU-bound ZBV step on one rank, timed on the host and then on the device (``device_timing``):
    device-timed compute must fill the step, in program order without overlap; host-timed compute
    is the launches. Returns the checks and a line of figures."""
    from pipetrain import PipelineStage, ScheduleZBVZeroBubble

    torch.manual_seed(0)
    mods = [nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)).to(device) for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, width, generator=g).to(device), torch.randn(batch, width, generator=g).to(device)
    busy: dict[bool, float] = {}
    wall: dict[bool, float] = {}
    out: dict[str, str] = {}
    with _one_rank_group(device):
        stages = [PipelineStage(m, i, 2, device) for i, m in enumerate(mods)]
        sched = ScheduleZBVZeroBubble(stages, 4, loss_fn=nn.functional.mse_loss)
        for on in (False, True):
            sched.device_timing = on
            sched.step(x, target=y)  # warm-up
            _sync(device)
            t0 = time.perf_counter()
            sched.step(x, target=y)
            timeline = sched.last_timeline
            _sync(device)
            wall[on] = time.perf_counter() - t0
            assert timeline is not None
            boxes = sorted((e.start, e.end) for e in timeline.events if e.kind in ("F", "B", "I", "W"))
            busy[on] = sum(end - start for start, end in boxes)
            if on:
                overlaps = sum(1 for a, b in itertools.pairwise(boxes) if b[0] < a[1] - 1e-6)
                out["device-timed compute in order"] = "" if overlaps == 0 else f"{overlaps} boxes overlap"
    share = busy[True] / wall[True]
    out["device-timed compute fills the step"] = "" if 0.8 <= share <= 1.05 else f"it covers {share:.0%} of the step"
    line = (
        f"GPU-bound ZBV step (1 rank, width {width}): host-timed compute {busy[False] * 1e3:.1f} ms of "
        f"{wall[False] * 1e3:.1f} ms ({busy[False] / wall[False]:.0%}); device-timed {busy[True] * 1e3:.1f} ms of "
        f"{wall[True] * 1e3:.1f} ms ({share:.0%})"
    )
    return out, line


# ----------------------------------------------------------------------------- NCCL ranks
def _rank(rank: int, world: int, port: int, device_type: str, names: list[str], results: Any) -> None:
    import torch.distributed as dist

    from pipetrain import PipelineStage, get_schedule_class
    from pipetrain.plan import build_schedule

    try:
        torch.set_num_threads(1)
        cuda = device_type == "cuda"
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=120),
            **({"device_id": device} if cuda else {}),
        )
        rows = []
        for name in names:
            v = MULTI_STAGE.get(name, 1)
            num_stages = world * v
            placement = build_schedule(name, world, MICROBATCHES, v).stage_to_rank
            mine_idx = [s for s, r in placement.items() if r == rank]
            layers = _layers(num_stages)
            mine = {s: copy.deepcopy(layers[s]).to(device) for s in mine_idx}
            stages = [PipelineStage(mine[s], s, num_stages, device) for s in mine_idx]
            sched = get_schedule_class(name)(
                stages if v > 1 else stages[0], MICROBATCHES, loss_fn=nn.functional.mse_loss
            )
            first, last = 0 in mine, num_stages - 1 in mine

            def step(
                x: torch.Tensor, y: torch.Tensor, sched: Any = sched, first: bool = first, last: bool = last
            ) -> None:
                sched.step(*((x,) if first else ()), target=y if last else None)

            if name == "ForwardOnly":
                x, _ = _batch(SEQ, device)
                sched.eval(*((x,) if first else ()))
                with _no_sync(device):
                    sched.eval(*((x,) if first else ()))
                rows.append((name, {"eval": ""}))
                continue
            result = _check_steps(step, layers, mine, device)
            result["control plane"] = "" if sched._transport.control else "headers travel in the data"
            rows.append((name, result))
        dist.barrier()
        results.put((rank, rows, None))
    except BaseException:
        results.put((rank, [], traceback.format_exc()))


def _ranks(device_type: str, world: int, names: list[str]) -> list[tuple[str, dict[str, str]]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if device_type == "cpu":
        os.environ["PIPETRAIN_SINGLE_TAG"] = "1"  # order-only matching, as NCCL does
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, device_type, names, results)) for r in range(world)]
    for p in procs:
        p.start()
    merged: dict[str, dict[str, str]] = {}
    errors = []
    for _ in range(world):
        rank, rows, error = results.get(timeout=600)
        if error is not None:
            errors.append(f"rank {rank}:\n{error}")
        for name, result in rows:
            into = merged.setdefault(name, {})
            for key, why in result.items():
                if why or key not in into:
                    into[key] = f"rank {rank}: {why}" if why else ""
    for p in procs:
        p.join(timeout=60)
    if errors:
        raise RuntimeError("\n".join(errors))
    return list(merged.items())


# ----------------------------------------------------------------------------- report
def _report(title: str, rows: list[tuple[str, dict[str, str]]]) -> bool:
    print(f"\n{title}")
    ok = True
    for label, result in rows:
        failed = {k: why for k, why in result.items() if why}
        ok = ok and not failed
        checks = ", ".join(result)
        status = "ok" if not failed else "FAILED: " + "; ".join(f"{k}: {why}" for k, why in failed.items())
        print(f"  {label:<36} {status}  ({checks})")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--steps", type=int, default=20, help="timed steps per schedule")
    parser.add_argument("--schedules", default="", help="comma-separated subset (default: every schedule)")
    parser.add_argument("--skip-bench", action="store_true", help="skip runtime_vs_torch.py")
    parser.add_argument("--world", type=int, default=2, help="ranks of the NCCL checks")
    opts = parser.parse_args()
    if opts.device == "cuda" and not torch.cuda.is_available():
        built = torch.version.cuda or "none (a CPU-only build)"
        print(
            f"gpu-check: no CUDA device is available (torch {torch.__version__}, CUDA {built}): nothing was "
            "checked. Run `make gpu-check` on a machine with an NVIDIA GPU and a CUDA build of torch.",
            file=sys.stderr,
        )
        return NO_GPU
    from pipetrain.plan import schedule_names

    names = [n for n in opts.schedules.split(",") if n] or schedule_names()
    device = torch.device("cuda", 0) if opts.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # gradients compared with plain training's
        torch.backends.cudnn.allow_tf32 = False
        print(f"gpu-check: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    rows = _one_device(device, names, opts.steps)
    ok = _report(f"one {device.type} device: every schedule, all stages on it", [(r[0], r[1]) for r in rows])
    if device.type == "cuda":
        checks, line = _device_timing(device)
        ok = _report("device timing (sched.device_timing = True)", [("ZBVZeroBubble", checks)]) and ok
        print(f"  {line}")
    print(f"\n  {'step time':<36} {'pipetrain ms':>12} {'plain ms':>9} {'ratio':>6}")
    for label, _, ours, theirs in rows:
        if ours == ours:  # not NaN (ForwardOnly has no training step)
            print(f"  {label:<36} {ours:12.2f} {theirs:9.2f} {ours / theirs:6.2f}")
    gpus = torch.cuda.device_count() if device.type == "cuda" else opts.world
    if gpus < 2:
        print("\nonly one GPU: the NCCL checks between ranks need two (skipped)")
    else:
        world = min(opts.world, gpus)
        transport = "NCCL" if device.type == "cuda" else "gloo, order-only matching as NCCL"
        try:
            nccl_rows = _ranks(opts.device, world, names)
            ok = _report(f"{world} ranks over {transport}: every schedule", nccl_rows) and ok
        except Exception as err:
            print(f"\n{world} ranks over {transport}: FAILED\n{err}")
            ok = False
    if device.type == "cuda":
        # Memory truth (issue 28): each rank's max_memory_allocated over a step beside simulate's promise.
        ranks = "2" if gpus >= 2 else "1"
        print(f"\nbenchmarks/memory_truth.py --device cuda --ranks {ranks} (measured / promised peak bytes):")
        sys.stdout.flush()
        truth = Path(__file__).with_name("memory_truth.py")
        done = subprocess.run([sys.executable, str(truth), "--device", "cuda", "--ranks", ranks], check=False)
        ok = ok and done.returncode == 0
    if device.type == "cuda":
        # The split backward's price on the GPU (issue 35): (I + W) / B on transformer blocks,
        # eager, checkpointed (pipetrain's route and torch's wrapper) and compiled.
        split = Path(__file__).with_name("split_backward.py")
        print("\nbenchmarks/split_backward.py --device cuda --blocks 4 --wide ((I + W) / B, W's share):")
        for extra in (
            ["--ac", "none"],
            ["--ac", "pipetrain"],
            ["--ac", "wrapper"],
            ["--compile"],
            ["--compile", "between"],
        ):
            sys.stdout.flush()
            args = ["--device", "cuda", "--blocks", "4", "--wide", "--reps", "20", *extra]
            done = subprocess.run([sys.executable, str(split), *args], check=False, capture_output=True, text=True)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith(("ratio", "largest"))]
            print(
                f"  {' '.join(extra):<16} "
                + ("; ".join(lines) if done.returncode == 0 else "FAILED " + done.stderr[-300:])
            )
            ok = ok and done.returncode == 0
    if not opts.skip_bench and device.type == "cuda":
        ranks = "2" if gpus >= 2 else "1"  # one GPU: one process holds every stage, in both libraries
        bench = Path(__file__).with_name("runtime_vs_torch.py")
        print(f"\nbenchmarks/runtime_vs_torch.py --device cuda --ranks {ranks} (beside torch.distributed.pipelining):")
        sys.stdout.flush()
        args = ["--device", "cuda", "--ranks", ranks, "--steps", str(opts.steps)]
        done = subprocess.run([sys.executable, str(bench), *args], check=False)
        ok = ok and done.returncode == 0
    print(f"\ngpu-check: {'every check passed' if ok else 'FAILED (see above)'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
