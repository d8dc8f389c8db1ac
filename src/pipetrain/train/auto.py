"""``pipetrain train --schedule auto``: profile the model's layers, plan the whole pipeline on rank 0
(the cut, the placement, which stages recompute, the order), share the plan, build the stages from it.

Every rank builds the whole model from one seed, so rank 0 can measure every layer
(:func:`pipetrain.profile_layers`: embedding, blocks, head + loss, on one microbatch) while the
others wait. Rank 0 alone plans (:func:`pipetrain.plan.plan_pipeline`, a time-limited search that
two ranks could finish differently) and broadcasts the plan; every rank cuts the model by the
plan's ``stage_layers`` (:func:`pipetrain.split.split_by_names`, which also marks the stages that
recompute) and keeps the stages the plan's schedule places on it. A planning error reaches every
rank as the same :class:`~pipetrain.PipelineError`.

``pipetrain profile`` keeps using :func:`write_profile` (per-stage costs measured over training steps)
and :func:`profile_model` (the layers file).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.errors import PipelineError
from pipetrain.plan import Schedule, costs_from_timelines
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.timeline import Timeline

__all__ = [
    "LATENCY_BUSY_S",
    "PROFILE_STEPS",
    "LayerPlan",
    "build_stages",
    "cut_costs",
    "is_auto",
    "machine_memory_per_rank",
    "measure_latency",
    "measure_posts",
    "plan_layers",
    "profile_model",
    "share_plan",
    "with_optimizer_time",
    "write_layers",
    "write_profile",
]

PROFILE_STEPS = 3
LATENCY_BUSY_S = 5e-4
"""Seconds each rank computes between the messages ``pipetrain train`` times for its latency
(:func:`measure_latency`'s ``busy``): a pipeline's messages reach ranks that were computing."""
"""Steps ``pipetrain profile`` measures for its costs file (they train like every other step)."""


def is_auto(name: str) -> bool:
    return name.strip().lower() == "auto"


# ----------------------------------------------------------------------------- the planner's side
# (pure Python: pipetrain.plan; imported here so the names used are in one place)


def _planner() -> Any:
    import pipetrain.plan.pipeline as planner

    return planner


def parse_memory_limit(text: str) -> float:
    """``--memory-limit`` in bytes: ``2GiB``, ``512MiB``, ``80e9``, ``80GB`` (PipelineError otherwise)."""
    try:
        value = float(_planner().parse_bytes(text))
    except ScheduleError as err:
        raise PipelineError(f"--memory-limit: {err}") from None
    if not value > 0:
        raise PipelineError(f"--memory-limit must be more than 0 bytes, got {text!r}")
    return value


def format_bytes(value: float) -> str:
    return str(_planner().format_bytes(value))


# ----------------------------------------------------------------------------- measuring


def profile_model(model: nn.Sequential, sample: torch.Tensor, target: torch.Tensor, loss_fn: Any) -> list[Any]:
    """One ``LayerCost`` per layer of ``model`` (its named children, in order) for one microbatch
    ``sample`` (token ids); the last layer's costs include ``loss_fn(output, target)``. Seconds and bytes."""
    from pipetrain import profile_layers

    # Medians of 9 runs each (profile_layers' default is 5): on a busy machine the plan follows the profile.
    layers: list[Any] = profile_layers(model, sample, loss_fn=loss_fn, target=target, repeats=9)
    return layers


def with_optimizer_time(layers: Sequence[Any], model: nn.Sequential, num_microbatches: int, lr: float) -> list[Any]:
    """``layers`` with each layer's optimizer step (Adam, timed on copies of its parameters) spread
    over the step's microbatches: ``w`` (and ``b``, the backward in one pass) grows by Adam's
    seconds / ``num_microbatches``.

    A training step is the pipeline and then each rank's optimizer step, and the next step waits
    for the slowest rank: an embedding or a head holds as many parameters as several blocks, so
    Adam on the rank that holds them can take longer than a block's work (measured on the bpe
    preset: 7 ms for the embedding, 1.3 ms for a block). Added to ``w`` (where each microbatch's
    weight gradients are made), the planner balances whole training steps, optimizer included."""
    from dataclasses import replace

    out = []
    children = dict(model.named_children())
    for layer in layers:
        params = [p.detach().clone() for p in children[layer.name].parameters()] if layer.name in children else []
        seconds = 0.0
        if params:
            for p in params:
                p.grad = torch.randn_like(p)
            optimizer = torch.optim.Adam(params, lr=lr)
            samples = []
            for trial in range(6):  # the first allocates Adam's state and is not counted
                t0 = time.perf_counter()
                optimizer.step()
                if trial:
                    samples.append(time.perf_counter() - t0)
            seconds = statistics.median(samples)
        share = seconds / num_microbatches
        out.append(replace(layer, w=layer.w + share, b=layer.b + share))
    return out


def measure_latency(nbytes: int, device: torch.device, repeats: int = 8, group: Any = None, busy: float = 0.0) -> float:
    """Median one-way time of a message of ``nbytes`` between ranks 0 and 1 (ping-pong; a collective:
    every rank calls it, the others only agree on the result). 0.0 with one rank.

    ``busy`` (seconds): each side computes that long before it sends, as a pipeline's ranks do
    (a message reaches a rank whose communication thread slept while it computed), and the time
    is the round trip less rank 1's compute, halved (on 2 loaded cores, gloo, a 229 KB message:
    170-225 us against 106-224 us idle)."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    result = torch.zeros(1, dtype=torch.float64)
    if world > 1 and rank in (0, 1):
        buf = torch.zeros(max(2, nbytes // 4), dtype=torch.float32, device=device)
        peer = 1 - rank
        samples = []
        for _ in range(repeats + 1):  # (the first, a warm-up, is dropped below)
            if rank == 0:
                _compute_for(busy, device)
                t0 = time.perf_counter()
                dist.send(buf, peer, group=group)
                dist.recv(buf, peer, group=group)
                samples.append((time.perf_counter() - t0 - float(buf[0])) / 2)
            else:
                dist.recv(buf, peer, group=group)
                buf[0] = _compute_for(busy, device)
                dist.send(buf, peer, group=group)
        if rank == 0:
            result[0] = max(0.0, statistics.median(samples[1:]))
    dist.broadcast(result, src=0, group=group)
    return float(result[0])


def _compute_for(seconds: float, device: torch.device) -> float:
    """Run small matrix products for about ``seconds``; the seconds it took (0.0 for none)."""
    if seconds <= 0:
        return 0.0
    t0 = time.perf_counter()
    a = torch.ones(64, 64, device=device)
    while time.perf_counter() - t0 < seconds:
        a = torch.tanh(a @ a)
    return time.perf_counter() - t0


def measure_posts(nbytes: int, device: torch.device, repeats: int = 8, group: Any = None) -> tuple[float, float]:
    """Median rank time to post a send and a receive of ``nbytes`` between ranks 0 and 1 (seconds;
    a collective, every rank gets rank 0's numbers; 0.0 with one rank): what a runtime pays per
    message beyond its latency, which the simulation prices as ``Costs.send`` / ``Costs.recv``."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    result = torch.zeros(2, dtype=torch.float64)
    if world > 1 and rank in (0, 1):
        out = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
        into = torch.zeros_like(out)
        peer = 1 - rank
        sends, recvs = [], []
        for trial in range(repeats + 1):
            t0 = time.perf_counter()
            handle = dist.irecv(into, peer, group=group)
            t1 = time.perf_counter()
            sent = dist.isend(out, peer, group=group)
            t2 = time.perf_counter()
            for work in (handle, sent):
                if work is not None:
                    work.wait()
            if trial:
                recvs.append(t1 - t0)
                sends.append(t2 - t1)
        result[0], result[1] = statistics.median(sends), statistics.median(recvs)
    dist.broadcast(result, src=0, group=group)
    return float(result[0]), float(result[1])


def machine_memory_per_rank(device: torch.device) -> tuple[float, str]:
    """The default ``--memory-limit``: a GPU's memory, or this machine's memory shared by its ranks."""
    if device.type == "cuda":
        total = float(torch.cuda.get_device_properties(device).total_memory)
        return total, f"the GPU's {format_bytes(total)}"
    try:
        total = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):
        return math.inf, "no limit (this machine's memory is unknown)"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))
    return total / max(1, local), f"this machine's {format_bytes(total)} shared by {local} ranks"


# ----------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class LayerPlan:
    """What rank 0 planned, as every rank receives it: the cut (layer names per stage), the stages
    that recompute, the schedule, the planner's summary (JSON-ready) and the line to print."""

    stage_layers: list[list[str]]
    recompute: list[int]
    schedule: Schedule
    summary: dict[str, Any]
    line: str


def cut_costs(
    layers: Sequence[Any], stage_layers: Sequence[Sequence[str]], recompute: Sequence[int], comm: float
) -> Any:
    """Per-stage ``Costs`` of a cut of ``layers`` (the planner's sums: ``simulate`` gives the plan's numbers)."""
    planner = _planner()
    from pipetrain.plan.pipeline.model import Profile, StageValues

    sizes = [len(names) for names in stage_layers]
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    profile = Profile(planner.as_layers(layers))
    return StageValues.of(profile, tuple(bounds)).costs(frozenset(recompute), comm)


def _stage_text(stage_layers: Sequence[Sequence[str]], schedule: Schedule) -> str:
    parts = []
    for s, names in enumerate(stage_layers):
        span = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
        parts.append(f"{span}@r{schedule.stage_to_rank[s]}")
    return " | ".join(parts)


def plan_layers(
    layers: Sequence[Any],
    num_ranks: int,
    num_microbatches: int,
    memory_limit: float,
    limit_source: str,
    *,
    stages_per_rank: int | None,
    comm: float,
    time_limit: float,
    baseline: tuple[str, list[list[str]]] | None = None,
    placement: str | None = None,
) -> LayerPlan:
    """Rank 0's plan for the profiled ``layers`` (``plan_pipeline``), with the line that says what was
    planned and how it compares, in simulation, with ``baseline`` (a named schedule and its cut) and
    the best hand split the planner tried."""
    from pipetrain.plan import simulate

    planner = _planner()
    limit = None if math.isinf(memory_limit) else memory_limit
    plan = planner.plan_pipeline(
        layers,
        num_ranks,
        num_microbatches,
        limit,
        stages_per_rank=stages_per_rank,
        placement=placement,
        comm=comm,
        time_limit=time_limit,
    )
    summary: dict[str, Any] = dict(plan.summary())
    summary["memory_limit_source"] = limit_source
    summary["comm_s"] = comm
    summary["layers"] = [layer.to_dict() for layer in plan.layers]
    recompute = sorted(plan.recompute)
    peaks = ", ".join(f"r{r} {format_bytes(v)}" for r, v in sorted(plan.peak_memory_bytes.items()))
    line = (
        f"auto: profiled {len(plan.layers)} layers; planned {len(plan.stage_layers)} stages "
        f"[{_stage_text(plan.stage_layers, plan.schedule)}], {plan.schedule.name or 'schedule'}, "
        f"recompute {recompute or 'none'}: simulated step {plan.makespan * 1e3:.4g} ms "
        f"(layers, latency and optimizer step; message posts in the time promise at the end), peak {peaks} "
        f"(limit {format_bytes(memory_limit) if limit is not None else 'none'})"
    )
    if baseline is not None:
        name, cut = baseline
        try:
            from pipetrain.plan import build_schedule

            named = build_schedule(name, num_ranks, num_microbatches, len(cut) // num_ranks)
            result = simulate(named, cut_costs(layers, cut, (), comm))
            summary["baseline"] = {
                "schedule": name,
                "stage_layers": cut,
                "makespan": result.makespan,
                "peak_memory_bytes": {str(r): v for r, v in sorted((result.peak_memory_bytes or {}).items())},
            }
            line += f"; {name} on the even cut {result.makespan * 1e3:.4g} ms ({result.makespan / plan.makespan:.3f}x)"
        except (ScheduleError, ValueError) as err:
            summary["baseline"] = {"schedule": name, "error": str(err)}
    best = plan.best_hand_split
    if best is not None:
        line += f"; best hand split ({best.rule.split(' = ')[0]}, {best.schedule_name}) {best.makespan * 1e3:.4g} ms"
    return LayerPlan([list(n) for n in plan.stage_layers], recompute, plan.schedule, summary, line)


def share_plan(plan: LayerPlan | str | None, group: Any = None) -> LayerPlan:
    """Rank 0's plan (or its error, a string) on every rank (a collective). Every rank raises the error."""
    box: list[Any] = [None]
    if dist.get_rank(group) == 0:
        assert plan is not None
        if isinstance(plan, str):
            box[0] = ("error", plan)
        else:
            box[0] = ("plan", plan.stage_layers, plan.recompute, plan.schedule.to_json(), plan.summary, plan.line)
    dist.broadcast_object_list(box, src=0, group=group)
    if box[0][0] == "error":
        raise PipelineError(f"--schedule auto: {box[0][1]}")
    _, stage_layers, recompute, text, summary, line = box[0]
    return LayerPlan(stage_layers, recompute, Schedule.from_json_text(text), summary, line)


def build_stages(model: nn.Module, plan: LayerPlan) -> list[nn.Module]:
    """Every stage module of the plan's cut (sharing the model's parameters), recompute applied."""
    from pipetrain.split import split_by_names

    return list(split_by_names(model, plan.stage_layers, recompute=plan.recompute))


# ----------------------------------------------------------------------------- pipetrain profile


def write_layers(path: str, layers: Sequence[Any], cfg: Any, comm: float) -> None:
    """Write the layer profile as the planner's layers file (``--layers-out``), with what it was measured on."""
    rows = -(-cfg.batch_size // cfg.microbatches)
    meta = {
        "time_unit": "s",
        "comm": comm,
        "model": cfg.model,
        "microbatch_rows": rows,
        "device": cfg.device,
        "torch": torch.__version__,
    }
    _planner().write_layers(path, list(layers), meta)
    print(
        f"profiled {len(layers)} layers on microbatches of {rows} sequences: wrote {path} "
        f"(pipetrain plan --layers {path} -p {cfg.ranks} -m {cfg.microbatches} --memory-limit 2GiB)",
        flush=True,
    )


def write_profile(path: str, schedule: Schedule, timelines: list[Timeline]) -> None:
    """Rank 0 writes the measured costs (``--costs`` form, one value per stage) to ``path``."""
    if dist.get_rank() != 0:
        return
    costs = costs_from_timelines(timelines, schedule.num_stages)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(f"{costs}\n")
    print(
        f"measured {len(timelines)} steps of {schedule.name or 'the schedule'}: wrote {path} "
        f"(pipetrain plan -p {schedule.num_ranks} -m {schedule.num_microbatches} --from-profile {path})"
    )
