"""Real run: `pipetrain train --schedule auto` against ZBVZeroBubble on the default even cut, 2 gloo ranks, the bpe model.

Issue 29's target: the planned pipeline's median tokens/s ≥ 1.15× ZB-V's on the even cut (equal
blocks per stage, the embedding with the first stage and the head with the last), over 5 runs of
each, alternating which goes first so both see the same machine. Run:
``python benchmarks/plan_pipeline_real.py [--runs 5] [--steps 20] [--model bpe]``.

Each run is a fresh `pipetrain train` (2 spawned gloo ranks, one thread each). Its tokens/s are
a step's tokens over the median wall time of its steps after the first ``--warmup`` (from the
run's summary.json; the median, not the mean, so that a step slowed by other work on the machine
does not move it). A second figure takes each run's fastest step instead (as ``timeit`` does: the
least disturbed estimate of what the schedule can do); the target is on the first. Neither includes the planned run's profiling and planning, done before step 1:
the command's wall time, printed beside, does. The machine's load average is printed before,
after and with each run: on 2 cores shared with other work the numbers move by 10 % or more
between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def train(schedule: str, out: Path, args: argparse.Namespace, extra: Sequence[str] = ()) -> dict[str, Any]:
    """One `pipetrain train` run (``extra``: more options); its summary, with the wall time of the whole command."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable, "-m", "pipetrain", "train", "--schedule", schedule, "--model", args.model,
        "--ranks", "2", "--steps", str(args.steps), "--microbatches", str(args.microbatches),
        "--batch-size", str(args.batch_size), "--out", str(out),
        *extra,
    ]  # fmt: skip
    if schedule == "auto":
        cmd += ["--plan-time-limit", str(args.plan_time_limit)]
        if args.memory_limit:
            cmd += ["--memory-limit", args.memory_limit]
        if args.placement:
            cmd += ["--placement", args.placement]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=HERE.parent, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    summary["wall_s"] = wall
    return summary


def tokens_per_s(summary: dict[str, Any], warmup: int, pick: Any = statistics.median) -> float:
    return float(summary["tokens_per_step"] / pick(summary["step_times_s"][warmup:]))


def head_cost(plan: dict[str, Any]) -> tuple[float, float, float]:
    """(head + loss, mean block, embedding) F+I+W seconds per microbatch, from the planned run's profile."""
    layers = plan["layers"]
    t = {layer["name"]: layer["f"] + layer["i"] + layer["w"] for layer in layers}
    blocks = [v for k, v in t.items() if k.startswith("block")]
    return t["head"], statistics.mean(blocks), t["embed"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each (default 5)")
    parser.add_argument("--steps", type=int, default=20, help="steps per run (default 20)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of tokens/s (default 2)")
    parser.add_argument("--model", default="bpe")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--plan-time-limit", type=float, default=5.0)
    parser.add_argument("--memory-limit", default=None, help="for the planned run (default: the machine's)")
    parser.add_argument(
        "--placement", choices=("loop", "v"), help="for the planned run (default: the planner's choice)"
    )
    parser.add_argument("--baseline", default="ZBVZeroBubble", help="the named schedule on the even cut")
    parser.add_argument("--json", metavar="FILE", help="also write every run's numbers there")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error("--steps must be more than --warmup")

    print(f"load average before: {load()} ({os.cpu_count()} CPUs)", flush=True)
    runs: dict[str, list[float]] = {"auto": [], args.baseline: []}
    best: dict[str, list[float]] = {"auto": [], args.baseline: []}
    walls: dict[str, list[float]] = {"auto": [], args.baseline: []}
    plans: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.runs):
            order = ["auto", args.baseline] if k % 2 == 0 else [args.baseline, "auto"]
            for schedule in order:
                summary = train(schedule, Path(tmp) / f"{schedule}-{k}", args)
                runs[schedule].append(tokens_per_s(summary, args.warmup))
                best[schedule].append(tokens_per_s(summary, args.warmup, min))
                walls[schedule].append(summary["wall_s"])
                if schedule == "auto":
                    plans.append(summary["plan"])
                print(
                    f"run {k + 1} {schedule:>14}: {runs[schedule][-1]:8.1f} tokens/s (fastest step {best[schedule][-1]:.1f}) "
                    f"(command {summary['wall_s']:.1f} s, load {load()})",
                    flush=True,
                )
    print(f"load average after: {load()}")
    med = {name: statistics.median(v) for name, v in runs.items()}
    ratio = med["auto"] / med[args.baseline]
    med_best = {name: statistics.median(v) for name, v in best.items()}
    head, block, embed = head_cost(plans[-1])
    cuts = sorted({" | ".join(",".join(n) for n in p["stage_layers"]) + f" ({p['schedule']})" for p in plans})
    print()
    print(f"model {args.model}: head + loss {head * 1e3:.1f} ms = {head / block:.2f} blocks "
          f"(block {block * 1e3:.1f} ms, embedding {embed * 1e3:.2f} ms; F+I+W per microbatch of "
          f"{-(-args.batch_size // args.microbatches)} sequences, rank 0's profile of the last planned run)")  # fmt: skip
    print(f"planned: {len(cuts)} distinct plan(s) over {len(plans)} runs: " + "; ".join(cuts))
    sims = [p["baseline"]["makespan"] / p["makespan"] for p in plans if "makespan" in p.get("baseline", {})]
    if sims:
        print(
            f"simulated speedup over {args.baseline} on the even cut (planner's costs): median {statistics.median(sims):.3f}x"
        )
    print()
    print("| schedule | tokens/s per run (median step) | median | by fastest step | median | command wall (median) |")
    print("|---|---|---:|---|---:|---:|")
    for name, values in runs.items():
        label = "auto (planned)" if name == "auto" else f"{name}, even cut"
        print(
            f"| {label} | {', '.join(f'{v:.0f}' for v in values)} | {med[name]:.0f} | "
            f"{', '.join(f'{v:.0f}' for v in best[name])} | {med_best[name]:.0f} | "
            f"{statistics.median(walls[name]):.1f} s |"
        )
    print()
    print(f"median tokens/s ratio auto / {args.baseline}: {ratio:.3f}x (target >= 1.15x)")
    print(f"by each run's fastest step: {med_best['auto'] / med_best[args.baseline]:.3f}x")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"runs": runs, "best": best, "walls": walls, "ratio": ratio, "plans": plans}, indent=1) + "\n",
            encoding="utf-8",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
