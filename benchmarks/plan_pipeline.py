"""plan_pipeline against the hand splits peers use, and against every contiguous cut (issue 29 §1).

Two suites, every schedule simulated by the one simulator (pipetrain.plan.simulate):

- **LLM-like profiles** (8 ranks, 32 microbatches, 1 and 2 stages per rank): Llama-3-8B-like
  layers from ANCHORS.md — the embedding ~0 time but 2.4 blocks of parameters, 30-32 blocks, the
  head at 2.3 blocks' forward with logits larger than a block's activations; bytes for one 8K-token
  sequence a microbatch (hidden 4096, bf16, Adam in mixed precision: 16 bytes a parameter). Each
  at ample memory, at 80 GB, halfway between the least and the fastest named schedule's memory on
  torchtitan's split, and below every hand split's least-memory named schedule (nothing
  hand-split fits; static still fits).
  Reported: plan_pipeline's makespan beside torchtitan's default split and the min-max time cut,
  each with its best named schedule that fits (the same stages per rank; with 2, loop or V).
- **Random profiles** (9-12 layers, 4 ranks, 8 microbatches, 1 and 2 stages per rank): beside
  the best named schedule on the best contiguous cut that fits, by brute force over every cut,
  at ample memory, at a limit between the least and the most any cut's named schedules need, and
  below what every named schedule needs on every cut (there only a plan with recompute or a
  constructed order fits).

Run: ``python benchmarks/plan_pipeline.py [--time-limit 10] [--random 8] [--out FILE.md]``
(``--quick``: fewer cases, 3 s each). Ratios above 1 mean plan_pipeline's makespan is shorter.
The search is time-bound: on a loaded machine it finds less.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pipetrain.plan import LayerCost, ScheduleError, build_schedule, plan_pipeline, simulate
from pipetrain.plan.generators import family, schedule_names
from pipetrain.plan.pipeline import format_bytes
from pipetrain.plan.pipeline.cuts import Cut, hand_splits, layer_symbol, sizes_of
from pipetrain.plan.pipeline.model import Profile, StageValues
from pipetrain.plan.schedule import Schedule

GB = 1e9
HIDDEN, SEQ, VOCAB = 4096, 8192, 128_256
BLOCK_PARAMS = 218e6  # Llama-3-8B: (8.03e9 - 2 * 525e6) / 32
EMBED_PARAMS = VOCAB * HIDDEN  # 525M: 2.4 blocks
BYTES_PER_PARAM = 16  # Adam, bf16 mixed: 2 + 2 + 4 master + 8 moments


def llm_profile(blocks: int, head: float = 2.3, separate_norm: bool = True) -> list[LayerCost]:
    """A Llama-3-8B-like layer list, per 8K-token microbatch; times in block forwards."""
    out_b = 2.0 * SEQ * HIDDEN  # a block's output, bf16: 67 MB
    block_act = 34.0 * SEQ * HIDDEN  # Korthikanti et al.'s 34 s h bytes (flash attention): 1.14 GB
    logits = SEQ * VOCAB * (2 + 2)  # bf16 logits and their fp32 softmax halves: 4.2 GB
    layers = [
        LayerCost(
            "tok_embeddings",
            f=0.02,
            i=0.0,
            w=0.05,
            activation_bytes=SEQ * 8.0,
            output_bytes=out_b,
            static_bytes=EMBED_PARAMS * BYTES_PER_PARAM,
        )
    ]
    for k in range(blocks):
        layers.append(
            LayerCost(
                f"layers.{k}",
                f=1.0,
                i=1.05,
                w=0.95,
                activation_bytes=block_act,
                output_bytes=out_b,
                static_bytes=BLOCK_PARAMS * BYTES_PER_PARAM,
            )
        )
    if separate_norm:
        layers.append(
            LayerCost(
                "norm",
                f=0.01,
                i=0.01,
                w=0.0,
                activation_bytes=out_b,
                output_bytes=out_b,
                static_bytes=HIDDEN * BYTES_PER_PARAM,
            )
        )
    layers.append(
        LayerCost(
            "output",
            f=head,
            i=head,
            w=0.95 * head,
            activation_bytes=logits,
            output_bytes=4.0,
            static_bytes=EMBED_PARAMS * BYTES_PER_PARAM,
        )
    )
    return layers


def random_profile(rng: random.Random, n: int) -> list[LayerCost]:
    layers = []
    for k in range(n):
        f = round(rng.uniform(0.2, 2.0), 2)
        layers.append(
            LayerCost(
                f"l{k}",
                f=f,
                i=round(f * rng.uniform(0.8, 1.4), 2),
                w=round(f * rng.uniform(0.4, 1.1), 2),
                activation_bytes=round(rng.uniform(0.2, 2.0), 2) * GB,
                output_bytes=round(rng.uniform(0.02, 0.2), 3) * GB,
                static_bytes=round(rng.uniform(0.2, 3.0), 2) * GB,
            )
        )
    return layers


# ------------------------------------------------------------------ named schedules on a cut


@dataclass(frozen=True)
class Named:
    """One named schedule simulated on one cut."""

    name: str
    v: int
    placement: str
    makespan: float
    peak: float


_BUILT: dict[tuple[str, int, int, int], Schedule | None] = {}


def _schedule(name: str, ranks: int, micro: int, v: int) -> Schedule | None:
    key = (name, ranks, micro, v)
    if key not in _BUILT:
        try:
            built: Schedule | None = build_schedule(name, ranks, micro, v)
        except ScheduleError:
            built = None
        if built is not None and built.num_stages != ranks * v:
            built = None
        _BUILT[key] = built
    return _BUILT[key]


def named_on(
    layers: Sequence[LayerCost], cut: Cut, ranks: int, micro: int, v: int, placements: Sequence[str]
) -> list[Named]:
    """Every named schedule of these placements on ``cut``, simulated (no recompute)."""
    costs = StageValues.of(Profile(layers), cut).costs(frozenset(), 0.0)
    out = []
    for name in schedule_names():
        place = family(name).placement
        if name == "ForwardOnly" or place not in placements:
            continue
        schedule = _schedule(name, ranks, micro, v)
        if schedule is None:
            continue
        result = simulate(schedule, costs, check=False)
        out.append(Named(name, v, place, result.makespan, max((result.peak_memory_bytes or {0: 0.0}).values())))
    return out


def best_fit(candidates: Sequence[Named], limit: float | None) -> Named | None:
    fitting = [c for c in candidates if limit is None or c.peak <= limit]
    return min(fitting, key=lambda c: c.makespan) if fitting else None


def placements_for(v: int) -> tuple[str, ...]:
    return ("loop",) if v == 1 else ("loop", "v")


def geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(x) for x in values) / len(values)) if values else float("nan")


def _plan(
    layers: Sequence[LayerCost], ranks: int, micro: int, limit: float | None, v: int, seconds: float
) -> tuple[float, str, float] | None:
    """(makespan, description, seconds) of plan_pipeline, or None when it finds nothing that fits."""
    started = time.perf_counter()
    try:
        plan = plan_pipeline(layers, ranks, micro, limit, stages_per_rank=v, time_limit=seconds)
    except ScheduleError:
        return None
    took = time.perf_counter() - started
    if limit is not None:
        assert max(plan.peak_memory_bytes.values()) <= limit * (1 + 1e-12)
    result = simulate(plan.schedule, plan.costs)
    assert abs(result.makespan - plan.makespan) <= 1e-9 * max(1.0, plan.makespan)
    sizes = ",".join(str(k) for k in plan.stage_sizes)
    recompute = f", recompute {len(plan.recompute)}" if plan.recompute else ""
    place = "V" if plan.placement == "v" else "loop"
    return plan.makespan, f"{plan.schedule.name} {place} [{sizes}]{recompute}", took


# ------------------------------------------------------------------ LLM-like suite


def llm_suite(seconds: float, quick: bool, lines: list[str]) -> None:
    ranks, micro = 8, 32
    profiles = [("32 blocks, norm + head", llm_profile(32)), ("30 blocks, head", llm_profile(30, separate_norm=False))]
    if not quick:
        profiles.append(("31 blocks, norm + head 2.5", llm_profile(31, head=2.5)))
    lines += [
        "## LLM-like profiles: 8 ranks, 32 microbatches",
        "",
        "Limits: `ample` none; `80GB`; `titan-mid` halfway between the least memory a named schedule needs on "
        "torchtitan's split and the peak of its fastest one; `<hand` 0.97x the least memory any named schedule "
        "needs on any hand split (nothing hand-split fits; static does). "
        "Each hand split with its best named schedule that fits, at the same stages per rank (2: loop or V).",
        "",
        "| profile | v | limit | plan_pipeline | makespan | s | torchtitan default | min-max time | best hand split "
        "| vs torchtitan | vs min-max |",
        "|---|---:|---|---|---:|---:|---|---|---|---:|---:|",
    ]
    vs_titan: list[float] = []
    vs_minmax: list[float] = []
    beat_minmax = 0
    compared_minmax = 0
    for label, layers in profiles:
        symbols = [layer_symbol(x.name) for x in layers]
        times, static = [x.time for x in layers], [x.static_bytes for x in layers]
        for v in (1, 2):
            splits = hand_splits(symbols, times, static, ranks * v)
            per_rule = {rule: named_on(layers, cut, ranks, micro, v, placements_for(v)) for rule, cut in splits}
            titan_rule = next(rule for rule in per_rule if "torchtitan default" in rule)
            minmax_rule = next(rule for rule in per_rule if "min-max time" in rule)
            titan_fast = best_fit(per_rule[titan_rule], None)
            assert titan_fast is not None
            titan_least = min(c.peak for c in per_rule[titan_rule])
            least_hand = min(c.peak for cands in per_rule.values() for c in cands)
            limits: list[tuple[str, float | None]] = [("ample", None), ("80GB", 80e9)]
            limits.append(("titan-mid", (titan_least + titan_fast.peak) / 2))
            limits.append(("<hand", least_hand * 0.97))
            if quick:
                limits = [limits[0], limits[2], limits[3]]
            for name, limit in limits:
                planned = _plan(layers, ranks, micro, limit, v, seconds)
                titan = best_fit(per_rule[titan_rule], limit)
                minmax = best_fit(per_rule[minmax_rule], limit)
                hands = [(rule, best_fit(c, limit)) for rule, c in per_rule.items()]
                fitting = [(rule, c) for rule, c in hands if c is not None]
                best_hand = min(fitting, key=lambda rc: rc[1].makespan) if fitting else None
                limit_text = name if limit is None else f"{name} ({format_bytes(limit)})"
                if planned is None:
                    lines.append(f"| {label} | {v} | {limit_text} | nothing fits | | | | | | | |")
                    continue
                makespan, how, took = planned

                def show(c: Named | None) -> str:
                    if c is None:
                        return "nothing fits"
                    return f"{c.name}{' V' if c.placement == 'v' and c.v == 2 else ''} {c.makespan:.1f}"

                r_titan = titan.makespan / makespan if titan is not None else None
                r_minmax = minmax.makespan / makespan if minmax is not None else None
                if r_titan is not None:
                    vs_titan.append(r_titan)
                if r_minmax is not None:
                    vs_minmax.append(r_minmax)
                    compared_minmax += 1
                    beat_minmax += r_minmax > 1 + 1e-9
                hand_text = f"{best_hand[0]}: {show(best_hand[1])}" if best_hand is not None else "nothing fits"
                if best_hand is not None:
                    assert makespan <= best_hand[1].makespan + 1e-9, (label, v, name)
                lines.append(
                    f"| {label} | {v} | {limit_text} | {how} | {makespan:.1f} | {took:.1f} | {show(titan)} | "
                    f"{show(minmax)} | {hand_text} | {_ratio(r_titan)} | {_ratio(r_minmax)} |"
                )
                print(lines[-1], flush=True)
    lines += [
        "",
        f"Geometric mean over the cases where the split fits: **{geomean(vs_titan):.3f}x** faster than torchtitan's "
        f"default split with its best named schedule ({len(vs_titan)} cases), **{geomean(vs_minmax):.3f}x** than the "
        f"min-max time cut with its best named schedule ({len(vs_minmax)} cases; faster in {beat_minmax} of "
        f"{compared_minmax}).",
        "",
    ]


def _ratio(r: float | None) -> str:
    return "" if r is None else f"{r:.3f}"


# ------------------------------------------------------------------ random suite, brute force


def random_suite(count: int, seconds: float, lines: list[str]) -> None:
    ranks, micro = 4, 8
    rng = random.Random(2026)
    lines += [
        "## Random profiles: 4 ranks, 8 microbatches, brute force over every cut",
        "",
        "`best cut` is the fastest named schedule (no recompute) on any contiguous cut that fits, found by simulating "
        "every named schedule on every cut; `mid` lies halfway between the least and the most memory a cut's named "
        "schedules need, `low` is 0.9x the least (no named schedule fits any cut).",
        "",
        "| profile | layers | v | limit | plan_pipeline | makespan | s | best cut (brute force) | cuts | plan / best |",
        "|---:|---:|---:|---|---|---:|---:|---|---:|---:|",
    ]
    worse = 0
    compared = 0
    planned_low = 0
    lows = 0
    for index in range(count):
        n = rng.randint(9, 12)
        layers = random_profile(rng, n)
        for v in (1, 2):
            stages = ranks * v
            every: list[tuple[Cut, Named]] = []
            cuts = 0
            for inner in itertools.combinations(range(1, n), stages - 1):
                cut = (0, *inner, n)
                cuts += 1
                every += [(cut, c) for c in named_on(layers, cut, ranks, micro, v, placements_for(v))]
            least = min(c.peak for _, c in every)
            most = max(c.peak for _, c in every)
            for name, limit in (("ample", None), ("mid", (least + most) / 2), ("low", 0.9 * least)):
                fitting = [(cut, c) for cut, c in every if limit is None or c.peak <= limit]
                best = min(fitting, key=lambda cc: cc[1].makespan) if fitting else None
                planned = _plan(layers, ranks, micro, limit, v, seconds)
                limit_text = name if limit is None else f"{name} ({format_bytes(limit)})"
                best_text = (
                    f"{best[1].name}{' V' if best[1].placement == 'v' else ''} [{','.join(map(str, sizes_of(best[0])))}] "
                    f"{best[1].makespan:.2f}"
                    if best is not None
                    else "nothing fits"
                )
                if name == "low":
                    lows += 1
                    planned_low += planned is not None
                if planned is None:
                    lines.append(f"| {index} | {n} | {v} | {limit_text} | nothing fits | | | {best_text} | {cuts} | |")
                    print(lines[-1], flush=True)
                    continue
                makespan, how, took = planned
                ratio = ""
                if best is not None:
                    compared += 1
                    worse += makespan > best[1].makespan + 1e-9
                    ratio = f"{makespan / best[1].makespan:.3f}"
                lines.append(
                    f"| {index} | {n} | {v} | {limit_text} | {how} | {makespan:.2f} | {took:.1f} | {best_text} | "
                    f"{cuts} | {ratio} |"
                )
                print(lines[-1], flush=True)
    lines += [
        "",
        f"plan_pipeline slower than the brute-force best named schedule on the best cut in **{worse} of {compared}** "
        f"cases; below every named schedule's memory on every cut it planned **{planned_low} of {lows}**.",
        "",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--time-limit", type=float, default=10.0, help="plan_pipeline's time limit, LLM suite (s)")
    parser.add_argument("--random-time-limit", type=float, default=3.0, help="its time limit, random suite (s)")
    parser.add_argument("--random", type=int, default=8, help="how many random profiles")
    parser.add_argument("--quick", action="store_true", help="fewer cases, 3 s each")
    parser.add_argument("--out", default=None, help="also write the tables to this markdown file")
    parser.add_argument("--skip-llm", action="store_true")
    parser.add_argument("--skip-random", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.time_limit = min(args.time_limit, 3.0)
        args.random = min(args.random, 3)
    lines: list[str] = [
        f"Generated by `python benchmarks/plan_pipeline.py {' '.join(sys.argv[1:])}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
    ]
    if not args.skip_llm:
        llm_suite(args.time_limit, args.quick, lines)
    if not args.skip_random:
        random_suite(args.random, args.random_time_limit, lines)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
