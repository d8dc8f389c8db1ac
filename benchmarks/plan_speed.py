"""Planning speed: build + validate + lower here, beside torch 2.13's schedule constructors.

torch builds its pipeline order, validates it and lowers it (FSDP unshard/reshard, REDUCE_GRAD,
SEND/RECV) in the schedule constructor; it is constructed here with light stand-in stage objects
(no process group). Our side does the same work: build the compute schedule, validate it, and
lower it with the same passes (``lower(fsdp=True, grad_reduce=True)``, which rejects whatever
``validate()`` rejects: its structural checks, then the unit-time run that placing the messages
needs anyway decides whether the programs run to the end); validating the lowered schedule (the
NCCL deadlock model; torch has no equivalent) is timed in its own column, and "all four" (build,
validate, lower, validate the lowered schedule: issue 14's measure) has its own speed-up. Both
sides run in one process, after ``gc.freeze()`` of what the imports allocated, and both keep the
best of several runs, each after a full collection: ours ``--repeat`` (default 3), torch's
``--torch-repeat`` (default 3 at 32 ranks and 1 at 64, where one construction takes tens of
seconds).

Run: ``.venv/bin/python benchmarks/plan_speed.py [--repeat N] [--torch-repeat N] [--no-torch]
[--config NAME:RANKS:MICROBATCHES ...]``.
Prints a markdown table: per configuration our times, torch's, the speed-up, and the growth from
the smaller to the larger size (4× the actions: linear growth is about 4×).
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from typing import Any

from pipetrain.plan import build_schedule

CONFIGS = [
    ("ZBVZeroBubble", 32, 256),
    ("ZBVZeroBubble", 64, 512),
    ("InterleavedZeroBubble", 32, 256),
    ("InterleavedZeroBubble", 64, 512),
]
STAGES_PER_RANK = 2


def best_of(repeat: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    """Fastest of ``repeat`` runs (each after a full collection, as in a fresh process)."""
    best, result = float("inf"), None
    for _ in range(repeat):
        result = None  # the previous run's result is garbage before the next one starts
        gc.collect()
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def ours(name: str, p: int, m: int, repeat: int) -> dict[str, float | int]:
    t_build, s = best_of(repeat, lambda: build_schedule(name, p, m, STAGES_PER_RANK))
    t_validate, _ = best_of(repeat, s.validate)
    t_lower, low = best_of(repeat, lambda: s.lower(fsdp=True, grad_reduce=True))
    t_check, _ = best_of(repeat, low.validate)
    # lower() validates its input itself; build + lower is the work torch's constructor does.
    return {
        "build": t_build,
        "validate": t_validate,
        "lower": t_lower,
        "total": t_build + t_lower,
        "validate_lowered": t_check,
        # Issue 14's measure: everything a user runs to get a checked, lowered schedule.
        "all": t_build + t_validate + t_lower + t_check,
        "actions": len(s),
        "lowered_actions": len(low),
    }


def torch_repeat_for(p: int, requested: int | None) -> int:
    """Runs of torch's constructor to keep the best of: ``requested``, else 3 up to 32 ranks and 1 above."""
    if requested is not None:
        return requested
    return 3 if p <= 32 else 1


def torch_constructor(name: str, p: int, m: int, repeat: int) -> float:
    """Best of ``repeat`` constructions of torch's schedule (order, validation and its lowering passes)."""
    from _torch_reference import torch_schedule_object

    seconds, theirs = best_of(repeat, lambda: torch_schedule_object(name, p, m, STAGES_PER_RANK))
    if theirs is None:
        raise SystemExit(f"torch rejects {name} with {p} ranks × {STAGES_PER_RANK} stages × {m} microbatches")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement of ours (best is kept)")
    parser.add_argument(
        "--torch-repeat",
        type=int,
        default=None,
        help="runs per measurement of torch's constructor (best is kept; default 3 at 32 ranks, 1 at 64)",
    )
    parser.add_argument("--no-torch", action="store_true", help="skip torch's constructors (they take minutes)")
    parser.add_argument(
        "--config",
        action="append",
        metavar="NAME:RANKS:MICROBATCHES",
        help="run only these configurations (repeatable; default: all four), e.g. ZBVZeroBubble:32:256",
    )
    args = parser.parse_args()
    configs = CONFIGS
    if args.config:
        configs = []
        for text in args.config:
            name, ranks, microbatches = text.split(":")
            configs.append((name, int(ranks), int(microbatches)))
    if not args.no_torch:
        import _torch_reference  # noqa: F401  (imports torch: its cost stays outside the timings)
    # Move what the imports allocated (torch's many objects) out of the collector's way, so that
    # neither side's timings include rescanning them.
    gc.collect()
    gc.freeze()

    rows = []
    for name, p, m in configs:
        mine = ours(name, p, m, args.repeat)
        runs = torch_repeat_for(p, args.torch_repeat)
        theirs = None if args.no_torch else torch_constructor(name, p, m, runs)
        rows.append((name, p, m, mine, theirs, runs))

    print(
        "| schedule | ranks × stages × microbatches | actions (lowered) | build | validate | lower (incl. validate) "
        "| **build + lower** | validate lowered | all four | torch constructor | speed-up (build + lower) "
        "| speed-up (all four) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, p, m, mine, theirs, runs in rows:
        torch_cell = "—" if theirs is None else f"{theirs:.2f} s (best of {runs})"
        ratio = "—" if theirs is None else f"**{theirs / mine['total']:.0f}×**"
        ratio_all = "—" if theirs is None else f"{theirs / mine['all']:.1f}×"
        print(
            f"| {name} | {p} × {STAGES_PER_RANK} × {m} | {mine['actions']:,} ({mine['lowered_actions']:,}) "
            f"| {mine['build']:.3f} s | {mine['validate']:.3f} s | {mine['lower']:.3f} s | **{mine['total']:.3f} s** "
            f"| {mine['validate_lowered']:.3f} s | {mine['all']:.3f} s | {torch_cell} | {ratio} | {ratio_all} |"
        )
    print()
    print(
        f"Times are the best of {args.repeat} runs for ours and of the runs shown for torch's constructor, "
        "each run after a full collection."
    )
    growth = []
    for name in dict.fromkeys(n for n, _, _ in configs):
        sizes = [r for r in rows if r[0] == name]
        if len(sizes) != 2:
            continue  # (growth needs both sizes)
        small, large = sizes
        line = f"- {name}: ours {large[3]['total'] / small[3]['total']:.1f}×"
        line += f" (validate lowered {large[3]['validate_lowered'] / small[3]['validate_lowered']:.1f}×)"
        if small[4] is not None and large[4] is not None:
            line += f", torch {large[4] / small[4]:.1f}×"
        growth.append(line)
    if growth:
        print()
        print("Growth from 32 × 2 × 256 to 64 × 2 × 512 (4× the actions; linear ≈ 4×):")
        print("\n".join(growth))


if __name__ == "__main__":
    main()
