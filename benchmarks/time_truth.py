"""The time promise (issue 37, item 5): a plan's simulated step beside the measured step, term by term.

For the ``bpe`` and ``small`` presets (through ``pipetrain train``) and a tiny Hugging Face
``LlamaForCausalLM`` (hidden 128, 6 layers, vocabulary 8000; through the Python API: profile,
plan, run), on 2 gloo ranks, for ``--schedule auto`` (the plan), 1F1B and ZB-V on the even cut:

* the simulated step: the layers' compute and latency alone (what a plan printed before), with
  the optimizer step spread in (what the planner prices), and with the message posts on the
  lowered schedule (the promise ``pipetrain train`` now prints; :mod:`pipetrain.train.time_promise`);
* the measured median step after 2 warm-up steps (the slowest rank's), and measured/simulated;
* where the rest goes, from the last step's measured timeline: each rank's compute (its actions'
  boxes), message posts and gaps (waits, the runtime's time between actions), the median gap
  before an action whose inputs were already on the rank (the runtime's own time per action),
  each rank's optimizer step, and the step simulated from the measured action times (what the
  cost model misses when its action times are right).

Runs alternate (model by model, schedule by schedule, ``--rounds`` times); the load average is
printed beside each run, and a run started above ``--quiet-load`` is marked loaded::

    python benchmarks/time_truth.py [--models bpe small llama] [--rounds 2] [--steps 14] [--json FILE]
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
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
SCHEDULES = ("auto", "1F1B", "ZBVZeroBubble")
LLAMA = {"hidden": 128, "layers": 6, "vocab": 8000, "seq": 64, "heads": 4}


def load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def wait_quiet(quiet: float, limit: float) -> float:
    """Wait up to ``limit`` seconds for the 1-minute load average to fall below ``quiet``; the seconds waited."""
    t0 = time.perf_counter()
    while limit > 0 and load() > quiet and time.perf_counter() - t0 < limit:
        time.sleep(5)
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- attribution


def attribution(promise: dict[str, Any], timeline: Any, schedule: Any, timings: dict[str, Any]) -> dict[str, Any]:
    """Where measured and simulated part, from one run: the model (the lowered schedule, posts,
    the per-action gap, each rank's optimizer after its last action) on the step's own measured
    action times (``model_on_measured_s``: what the simulation gets right when its action times
    are right), and each rank's compute boxes over what the profile priced for the same actions
    (``profile_ratio``: the profile's error, layers timed one at a time vs in a stage)."""
    from dataclasses import replace

    from pipetrain.plan import costs_from_timelines, simulate
    from pipetrain.plan.costs import Costs
    from pipetrain.train.time_promise import optimizer_tail, timeline_terms

    terms = timeline_terms(timeline, schedule)
    n = schedule.num_stages
    measured = costs_from_timelines([timeline], n)
    measured = replace(measured, send=terms["send_post"], recv=terms["recv_post"], action_overhead=terms["ready_gap"])
    opt = [timings[str(r)]["optimizer_s"] for r in range(schedule.num_ranks)]
    on_measured = optimizer_tail(simulate(schedule.lower(), measured).timeline, schedule, opt)
    profile = Costs.parse(promise["costs"])
    ratio: dict[str, float] = {}
    for rank in range(schedule.num_ranks):
        boxes = [e for e in timeline.events if e.rank == rank and e.kind in ("F", "B", "I", "W")]
        priced = sum(profile.per_stage(e.kind.lower(), n)[e.stage] for e in boxes)
        ratio[str(rank)] = sum(e.duration for e in boxes) / priced if priced > 0 else float("nan")
    return {"terms": terms, "model_on_measured_s": on_measured, "profile_ratio": ratio}


# ----------------------------------------------------------------------------- presets


def preset_run(model: str, schedule: str, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One ``pipetrain train`` run; its summary's time check and the last step's timeline terms."""
    from pipetrain.plan.schedule import Schedule
    from pipetrain.plan.timeline import Timeline

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable, "-m", "pipetrain", "train", "--schedule", schedule, "--model", model,
        "--ranks", "2", "--steps", str(args.steps), "--microbatches", str(args.microbatches),
        "--batch-size", str(args.batch_size), "--out", str(out),
    ]  # fmt: skip
    if schedule == "auto":
        cmd += ["--plan-time-limit", str(args.plan_time_limit)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=HERE.parent, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    timeline = Timeline.from_json(out / "measured_timeline.json")
    ran = Schedule.load(str(out / "schedule.json"))
    row = {
        "time": summary["time"],
        **attribution(summary["time"]["promise"], timeline, ran, summary["time"]["ranks"]),
        "sim_measured_s": summary.get("simulated_step_s"),
        "plan": summary.get("plan", {}).get("stage_layers"),
        "planner_makespan_s": summary.get("plan", {}).get("makespan"),
    }
    return row


# ----------------------------------------------------------------------------- the HF model


def _llama() -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=LLAMA["vocab"],
        hidden_size=LLAMA["hidden"],
        intermediate_size=4 * LLAMA["hidden"],
        num_hidden_layers=LLAMA["layers"],
        num_attention_heads=LLAMA["heads"],
        num_key_value_heads=LLAMA["heads"],
        max_position_embeddings=LLAMA["seq"],
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config)


def _even_cut(names: list[str], stages: int) -> list[list[str]]:
    size, extra = divmod(len(names), stages)
    out, k = [], 0
    for s in range(stages):
        n = size + (1 if s < extra else 0)
        out.append(names[k : k + n])
        k += n
    return out


def _llama_rank(rank: int, port: int, results: Any, schedule_name: str, args: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from pipetrain import PipelineScheduleRuntime, PipelineStage, profile_layers
    from pipetrain.hf import decoder_layers
    from pipetrain.memory import retain_freed_memory
    from pipetrain.plan import build_schedule, costs_from_timelines, simulate
    from pipetrain.plan.pipeline.layers import with_optimizer
    from pipetrain.plan.timeline import Timeline
    from pipetrain.split import split_by_names, stages_for_rank
    from pipetrain.train.auto import (
        LATENCY_BUSY_S,
        LayerPlan,
        cut_costs,
        measure_latency,
        measure_posts,
        plan_layers,
        share_plan,
    )
    from pipetrain.train.layout import _median_layers
    from pipetrain.train.loop import on_one_axis
    from pipetrain.train.time_promise import StepTerms, measured_step, step_promise

    torch.set_num_threads(1)
    retain_freed_memory()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mb_count, batch, seq = args["microbatches"], args["batch_size"], LLAMA["seq"]
    rows = batch // mb_count

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        return torch.randint(0, LLAMA["vocab"], (batch, seq), generator=g), torch.randint(
            0, LLAMA["vocab"], (batch, seq), generator=g
        )

    model = _llama()
    layers_list = decoder_layers(model)
    names = [n for n, _ in layers_list]
    x0, y0 = data(0)
    latency = measure_latency(rows * seq * LLAMA["hidden"] * 4, torch.device("cpu"), busy=LATENCY_BUSY_S)
    posts = measure_posts(rows * seq * LLAMA["hidden"] * 4, torch.device("cpu"))
    dist.barrier()
    # (as pipetrain train profiles: 9 repeats, every rank at once, each layer's median over the ranks)
    mine = profile_layers(layers_list, x0[:rows], loss_fn=loss_fn, target=y0[:rows], repeats=9)
    everyone: list[Any] = [None] * 2
    dist.all_gather_object(everyone, [m.to_dict() for m in mine])
    layers = _median_layers(mine, everyone) if rank == 0 else []
    plan: LayerPlan | None = None
    if rank == 0:
        if schedule_name == "auto":
            plan = plan_layers(
                with_optimizer(layers, mb_count),
                2,
                mb_count,
                float("inf"),
                "none",
                stages_per_rank=None,
                comm=latency,
                time_limit=args["plan_time_limit"],
            )
        else:
            per_rank = 2 if schedule_name == "ZBVZeroBubble" else 1
            named = build_schedule(schedule_name, 2, mb_count, per_rank)
            plan = LayerPlan(_even_cut(names, named.num_stages), [], named, {}, "")
    shared = share_plan(plan)
    promise: list[Any] = [None]
    if rank == 0:
        terms = StepTerms({layer.name: layer.optimizer for layer in layers}, send=posts[0], recv=posts[1])
        compute = cut_costs(layers, shared.stage_layers, shared.recompute, latency)
        promise[0] = step_promise(compute, shared.schedule, shared.stage_layers, terms)
        promise[0]["planner_makespan_s"] = plan.summary.get("makespan") if plan is not None else None
    dist.broadcast_object_list(promise, src=0)

    modules = split_by_names(decoder_layers(model), shared.stage_layers, recompute=shared.recompute)
    held = [PipelineStage(m, s, len(modules), "cpu") for s, m in stages_for_rank(modules, shared.schedule, rank)]
    runtime = PipelineScheduleRuntime(held, shared.schedule, loss_fn=loss_fn)
    params = [p for st in held for p in st.submodule.parameters()]
    optimizer = torch.optim.Adam(params, lr=1e-3)
    step_times, opt_times = [], []
    origin = 0.0
    for step in range(args["steps"]):
        x, y = data(step)
        if step == args["steps"] - 1:
            dist.barrier()
        t0 = time.perf_counter()
        origin = t0
        runtime.step(x, target=y, return_outputs=False)
        t1 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        step_times.append(t2 - t0)
        opt_times.append(t2 - t1)
    local = runtime.last_timeline
    events = [e for e in local.events if e.rank == rank] if local is not None else []
    import socket

    gathered: list[Any] = [None] * 2
    dist.all_gather_object(gathered, (socket.gethostname(), origin, False, events))
    timings: list[Any] = [None] * 2
    dist.all_gather_object(timings, {"step_s": measured_step(step_times), "optimizer_s": measured_step(opt_times)})
    if rank == 0:
        timeline = Timeline(2, on_one_axis(gathered), source="measured", unit="s")
        measured_costs = costs_from_timelines([timeline], shared.schedule.num_stages)
        sim_measured = simulate(shared.schedule, measured_costs).makespan
        measured = max(t["step_s"] for t in timings)
        by_rank = {str(r): t for r, t in enumerate(timings)}
        results.put(
            {
                "time": {
                    "measured_step_s": measured,
                    "ranks": {str(r): t for r, t in enumerate(timings)},
                    "promise": promise[0],
                    "ratio": measured / promise[0]["step_s"],
                },
                **attribution(promise[0], timeline, shared.schedule, by_rank),
                "sim_measured_s": sim_measured,
                "plan": shared.stage_layers,
                "planner_makespan_s": promise[0]["planner_makespan_s"],
            }
        )
    dist.destroy_process_group()


def llama_run(schedule: str, args: argparse.Namespace) -> dict[str, Any]:
    from _two_ranks import run_on_two_ranks

    os.environ["OMP_NUM_THREADS"] = "1"
    opts = {
        "microbatches": args.microbatches,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "plan_time_limit": args.plan_time_limit,
    }
    row: dict[str, Any] = run_on_two_ranks(_llama_rank, schedule, opts)
    return row


# ----------------------------------------------------------------------------- report


def line(model: str, schedule: str, row: dict[str, Any], before: float, after: float, quiet: float) -> str:
    t, p, terms = row["time"], row["time"]["promise"], row["terms"]
    ranks = terms["ranks"]
    per_rank = "; ".join(
        f"r{r} compute {v['compute'] * 1e3:.1f} posts {v['posts'] * 1e3:.1f} gaps {v['gaps'] * 1e3:.1f} "
        f"opt {t['ranks'][r]['optimizer_s'] * 1e3:.1f}"
        for r, v in sorted(ranks.items())
    )
    mark = "" if max(before, after) <= quiet else " LOADED"
    sim_meas = row.get("sim_measured_s")
    return (
        f"| {model} | {schedule} | {t['measured_step_s'] * 1e3:.1f} | {p['compute_s'] * 1e3:.1f} | "
        f"{p['optimizer_s'] * 1e3:.1f} ({p['spread_s'] * 1e3:.1f}) | {p['step_s'] * 1e3:.1f} | **{t['ratio']:.3f}** | "
        f"{t['measured_step_s'] / p['compute_s']:.3f} | {terms['makespan'] * 1e3:.1f} | "
        f"{'-' if sim_meas is None else f'{sim_meas * 1e3:.1f}'} | {row['model_on_measured_s'] * 1e3:.1f} | "
        f"{'/'.join(f'{v:.2f}' for _, v in sorted(row['profile_ratio'].items()))} | {per_rank} | "
        f"{terms['send_post'] * 1e6:.0f}/{terms['recv_post'] * 1e6:.0f}/{terms['ready_gap'] * 1e6:.0f} | "
        f"{before:.2f}→{after:.2f}{mark} |"
    )


HEADER = (
    "| model | schedule | measured step ms | sim: compute+latency | +optimizer after (spread in W) | "
    "+posts (promise) | "
    "measured/promise | measured/compute-only | last step's timeline ms | sim from measured actions | "
    "model on measured actions | action boxes / profile per rank | "
    "per rank (ms) | post send/recv, ready gap (us) | load before→after |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|"
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["bpe", "small", "llama"])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--plan-time-limit", type=float, default=5.0)
    parser.add_argument("--quiet-load", type=float, default=1.5, help="load average above which a run is LOADED")
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="before each run, wait up to S seconds for the load average to fall below --quiet-load",
    )
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()} ({os.cpu_count()} CPUs)", flush=True)
    print(HEADER, flush=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            for model in args.models:
                order = args.schedules if k % 2 == 0 else list(reversed(args.schedules))
                for schedule in order:
                    waited = wait_quiet(args.quiet_load, args.wait_quiet)
                    before = load()
                    if model == "llama":
                        row = llama_run(schedule, args)
                    else:
                        row = preset_run(model, schedule, Path(tmp) / f"{model}-{schedule}-{k}", args)
                    after = load()
                    row.update(
                        model=model, schedule=schedule, round=k, load_before=before, load_after=after, waited_s=waited
                    )
                    rows.append(row)
                    print(line(model, schedule, row, before, after, args.quiet_load), flush=True)
    print(f"load average after: {os.getloadavg()}")
    ratios: dict[tuple[str, str], list[float]] = {}
    for row in rows:
        ratios.setdefault((row["model"], row["schedule"]), []).append(row["time"]["ratio"])
    print("\n| model | schedule | measured/promise per run | median |\n|---|---|---|---:|")
    for (model, schedule), values in ratios.items():
        print(f"| {model} | {schedule} | {', '.join(f'{v:.3f}' for v in values)} | {statistics.median(values):.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
