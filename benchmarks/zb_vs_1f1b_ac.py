"""Real run: ZB-V against 1F1B with and without activation checkpointing, 2 gloo ranks, the bpe model.

Issue 35's bar: ZB-V must not lose to 1F1B (median tokens/s) with every block checkpointed
(`pipetrain train --activation-checkpointing`) nor without. Each run is a fresh `pipetrain train`
(2 spawned gloo ranks, one thread each); the four configurations go round-robin ``--runs`` times,
each round starting one further along, so every configuration sees the same machine. Tokens/s is
a step's tokens over the median step time after ``--warmup``. Run:
``python benchmarks/zb_vs_1f1b_ac.py [--runs 5] [--steps 20] [--model bpe]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_pipeline_real import load, tokens_per_s
from plan_pipeline_real import train as _train

CONFIGS = [("ZBVZeroBubble", False), ("1F1B", False), ("ZBVZeroBubble", True), ("1F1B", True)]


def train(schedule: str, ac: bool, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One run of plan_pipeline_real's kind, with --activation-checkpointing when asked."""
    return _train(schedule, out, args, ["--activation-checkpointing"] if ac else [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--steps", type=int, default=20, help="steps per run (default 20)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of tokens/s (default 2)")
    parser.add_argument("--model", default="bpe")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    print(f"load average before: {load()} ({os.cpu_count()} CPUs)", flush=True)
    runs: dict[tuple[str, bool], list[float]] = {c: [] for c in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.runs):
            for j in range(len(CONFIGS)):
                schedule, ac = CONFIGS[(j + k) % len(CONFIGS)]
                summary = train(schedule, ac, Path(tmp) / f"{schedule}-{ac}-{k}", args)
                runs[(schedule, ac)].append(tokens_per_s(summary, args.warmup))
                label = f"{schedule}{' +AC' if ac else ''}"
                print(
                    f"round {k + 1} {label:>18}: {runs[(schedule, ac)][-1]:8.1f} tokens/s (load {load()})", flush=True
                )
    print(f"load average after: {load()}\n")
    print("| schedule | activation checkpointing | tokens/s per run | median |")
    print("|---|---|---|---:|")
    med = {c: statistics.median(v) for c, v in runs.items()}
    for (schedule, ac), values in runs.items():
        print(
            f"| {schedule} | {'every block' if ac else 'none'} | {', '.join(f'{v:.0f}' for v in values)} | {med[(schedule, ac)]:.0f} |"
        )
    for ac in (False, True):
        ratio = med[("ZBVZeroBubble", ac)] / med[("1F1B", ac)]
        print(f"ZB-V / 1F1B, {'with' if ac else 'without'} activation checkpointing: {ratio:.3f}x (bar: >= 1.0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
