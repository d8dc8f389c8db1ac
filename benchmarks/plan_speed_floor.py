"""The least pure Python can spend on plan_speed's "all four", beside what pipetrain spends.

Issue 14 asks build + validate + lower + validate-lowered of ZBV at 32 ranks × 2 stages × 256
microbatches to run at least 20× faster than torch 2.13's schedule constructor. This measures,
on that schedule, loops that do strictly less than each step must (no checks, no error paths,
the answers precomputed where a real step would have to derive them), and adds them up:

- **make**: one Action tuple per compute action, appended to its rank's list, from ready-made
  (stage, kind, microbatch) triples (no generator logic at all);
- **read**: every action of a schedule visited once, unpacked, and its position stored (the
  least a checker does: where each part runs, to check order and duplicates); once on the
  compute schedule (49,152 actions) and once on the lowered one (112,832);
- **run**: one unit-time abstract execution of the compute graph, on integer programs and
  pipetrain's need tables (built outside the timing), with no bookkeeping beyond end times, and
  without the W (nothing waits for a W, and a W waits only for its own I, earlier on its rank,
  so a W cannot block a run): whether the programs deadlock cannot be decided without visiting
  every F and B/I and its needs;
- **messages**: one SEND and one RECV Action per cross-rank message, from ready-made triples in
  each rank's final order (no placement logic), then each rank's lowered list assembled by one
  ``extend`` per compute action.

validate = read + run; lower (which must reject what validate rejects, and places messages by a
unit-time run) = read + run + messages; validate lowered = read lowered + run. The floor is make +
2 × (read + run) + messages + read lowered + run. Each loop is the best of ``--repeat`` runs with
the collector off, as pipetrain's steps pause it.

Run: ``.venv/bin/python benchmarks/plan_speed_floor.py [--repeat N] [--no-torch] [--ranks P
--microbatches M]`` (default 32 and 256: issue 14's size).
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from typing import Any

from pipetrain.plan import build_schedule
from pipetrain.plan.actions import Action, new_action
from pipetrain.plan.dependencies import C_F, C_I, C_W, Dependencies

NAME, STAGES_PER_RANK = "ZBVZeroBubble", 2


def best(repeat: int, fn: Callable[[], Any]) -> float:
    times = []
    for _ in range(repeat):
        gc.collect()
        gc.disable()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        gc.enable()
    return min(times)


def make(triples: list[list[tuple[Any, ...]]]) -> list[list[Action]]:
    new = new_action
    out = []
    for row in triples:
        acts: list[Action] = []
        append = acts.append
        for s, kind, m in row:
            append(new(Action, (s, kind, m, None)))
        out.append(acts)
    return out


def read(rows: list[list[Action | None]], num_microbatches: int, size: int) -> list[int]:
    where = [-1] * size
    M = num_microbatches  # noqa: N806
    for row in rows:
        for step, action in enumerate(row):
            s, _, m, _ = action  # type: ignore[misc]
            where[s * M + (m or 0)] = step
    return where


def run(programs: list[list[int]], need1: list[int], need2: list[int]) -> list[int]:
    """Unit-time run: per part, its end time; a rank stops at a part whose need has not ended."""
    end = [-1] * len(need1) + [0]
    waiter = [-1] * len(end)
    pc = [0] * len(programs)
    free = [0] * len(programs)
    queue = list(range(len(programs)))
    while queue:
        r = queue.pop()
        program = programs[r]
        i, t = pc[r], free[r]
        n = len(program)
        while i < n:
            x = program[i]
            e1, e2 = end[need1[x]], end[need2[x]]
            if e1 < 0 or e2 < 0:
                waiter[need1[x] if e1 < 0 else need2[x]] = r
                break
            t = max(t, e1, e2) + 1
            end[x] = t
            if waiter[x] >= 0:
                queue.append(waiter[x])
            i += 1
        pc[r], free[r] = i, t
    return end


def messages(
    comm: list[list[tuple[Any, ...]]], cuts: list[list[int]], computes: list[list[Action]]
) -> list[list[Action]]:
    """Each rank's SEND/RECV made from ready-made triples, then its lowered list assembled."""
    new = new_action
    out = []
    for r, acts in enumerate(computes):
        ops = [new(Action, (s, kind, m, None)) for s, kind, m in comm[r]]
        cut = cuts[r]
        row = ops[: cut[0]]
        extend, append = row.extend, row.append
        for k, action in enumerate(acts):
            append(action)
            extend(ops[cut[k] : cut[k + 1]])
        out.append(row)
    return out


def message_plan(lowered_rows: list[list[Action | None]]) -> tuple[list[list[tuple[Any, ...]]], list[list[int]]]:
    """Per rank, its SEND/RECV as (stage, kind, microbatch) in program order, and how many come
    before each compute action (the last entry: all of them). FSDP actions and REDUCE_GRAD,
    a few per stage, are left out."""
    comm, cuts = [], []
    for row in lowered_rows:
        triples: list[tuple[Any, ...]] = []
        cut = []
        for a in row:
            assert a is not None
            if a.kind.value in ("F", "B", "I", "W"):
                cut.append(len(triples))
            elif a.kind.value in ("SEND_F", "RECV_F", "SEND_B", "RECV_B"):
                triples.append((a.stage, a.kind, a.microbatch))
        cut.append(len(triples))
        comm.append(triples)
        cuts.append(cut)
    return comm, cuts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-torch", action="store_true", help="skip torch's constructor")
    parser.add_argument("--ranks", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=256)
    args = parser.parse_args()
    RANKS, MICROBATCHES = args.ranks, args.microbatches  # noqa: N806
    if not args.no_torch:
        import _torch_reference  # noqa: F401  (imports torch outside the timings)
    gc.collect()
    gc.freeze()

    schedule = build_schedule(NAME, RANKS, MICROBATCHES, STAGES_PER_RANK)
    lowered = schedule.lower(fsdp=True, grad_reduce=True)
    S, M = schedule.num_stages, schedule.num_microbatches  # noqa: N806
    SM = S * M  # noqa: N806
    rank_of = [schedule.stage_to_rank[s] for s in range(S)]
    compute_rows = [list(schedule.actions[r]) for r in range(RANKS)]
    lowered_rows = [list(lowered.actions[r]) for r in range(RANKS)]
    triples = [[(a.stage, a.kind, a.microbatch) for a in row if a is not None] for row in compute_rows]

    # Integer programs and need tables, as pipetrain's checkers build them (outside the timing).
    node_base = {"F": 0, "B": SM, "I": SM, "W": 2 * SM}
    programs = [
        [node_base[a.kind.value] + a.stage * M + a.microbatch for a in row if a is not None and a.kind.value != "W"]  # type: ignore[operator]
        for row in compute_rows
    ]
    need1, need2 = Dependencies(S, M, rank_of, lowered=False).flat_needs((C_F, C_I, C_W))
    comm, cuts = message_plan(lowered_rows)  # (outside the timing)
    computes = make(triples)

    t_make = best(args.repeat, lambda: make(triples))
    t_read = best(args.repeat, lambda: read(compute_rows, M, SM))  # type: ignore[arg-type]
    t_read_lowered = best(args.repeat, lambda: read(lowered_rows, M, SM))
    t_run = best(args.repeat, lambda: run(programs, need1, need2))
    t_messages = best(args.repeat, lambda: messages(comm, cuts, computes))
    floor = t_make + 2 * (t_read + t_run) + t_messages + t_read_lowered + t_run
    ends = run(programs, need1, need2)
    assert all(ends[x] >= 0 for row in programs for x in row)  # the run reached every part: it did the work

    ours = {
        "build": best(args.repeat, lambda: build_schedule(NAME, RANKS, MICROBATCHES, STAGES_PER_RANK)),
        "validate": best(args.repeat, schedule.validate),
        "lower": best(args.repeat, lambda: schedule.lower(fsdp=True, grad_reduce=True)),
        "validate lowered": best(args.repeat, lowered.validate),
    }
    floors = {
        "build": t_make,
        "validate": t_read + t_run,
        "lower": t_read + t_run + t_messages,
        "validate lowered": t_read_lowered + t_run,
    }
    print(f"{NAME} {RANKS} × {STAGES_PER_RANK} × {MICROBATCHES}: {len(schedule):,} actions, {len(lowered):,} lowered")
    print()
    print("| step | floor (least pure Python can spend) | pipetrain | pipetrain / floor |")
    print("|---|---:|---:|---:|")
    for step in ours:
        print(f"| {step} | {floors[step]:.3f} s | {ours[step]:.3f} s | {ours[step] / floors[step]:.1f}× |")
    total = sum(ours.values())
    print(f"| **all four** | **{floor:.3f} s** | **{total:.3f} s** | {total / floor:.1f}× |")
    print()
    print(
        f"Floor loops: make {t_make:.3f} s, read {t_read:.3f} s, read lowered {t_read_lowered:.3f} s, "
        f"run {t_run:.3f} s, messages {t_messages:.3f} s (best of {args.repeat})."
    )
    if not args.no_torch:
        from _torch_reference import torch_schedule_object

        runs = 3 if RANKS <= 32 else 1  # (one construction at 64 ranks takes tens of seconds)
        t_torch = best(runs, lambda: torch_schedule_object(NAME, RANKS, MICROBATCHES, STAGES_PER_RANK))
        print(
            f"torch 2.13's constructor: {t_torch:.2f} s (best of {runs}). 1/20 of that is {t_torch / 20:.3f} s; "
            f"torch / floor = {t_torch / floor:.1f}×, torch / pipetrain = {t_torch / total:.1f}×."
        )


if __name__ == "__main__":
    main()
