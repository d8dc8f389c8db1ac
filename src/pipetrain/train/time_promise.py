"""The time promise: what a step of ``pipetrain train`` should take, each term priced, beside what it took.

A training step is the pipeline (each rank's actions) and then each rank's optimizer step and
``zero_grad``. The planner's simulation prices each action's compute (``profile_layers``, one
layer at a time) and the latency of a message; on its own it leaves out:

* **the optimizer step** (Adam on the rank's parameters, and ``zero_grad``), measured per layer
  by :func:`pipetrain.profile_layers` (``LayerCost.optimizer``). A rank runs it after its last
  action, and the next step reaches the rank only at its first action (the first rank at once,
  the others after the pipeline fills): the step is at least, for every rank, its last action's
  end plus its optimizer step less its first action's start. The planner, whose
  simulation knows no step after this one, prices it spread over the microbatches' W and B
  (:func:`~pipetrain.plan.pipeline.layers.with_optimizer`);
* **posting a message** (rank time for each SEND and RECV the runtime posts, beside the latency):
  priced as ``Costs.send`` / ``Costs.recv`` on the lowered schedule the runtime runs;
* **the runtime's own time per action** (taking the received inputs, polling, bookkeeping
  between actions): ``Costs.action_overhead``, added to every compute action.

:func:`step_promise` prices a cut with these terms; :func:`timeline_terms` reads the same terms
back from a measured step (the runtime's timeline), so a gap between the two is attributed.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pipetrain.plan.costs import Costs
from pipetrain.plan.schedule import Schedule
from pipetrain.plan.timeline import Timeline

__all__ = [
    "LEFT_OUT",
    "StepTerms",
    "measured_step",
    "optimizer_tail",
    "priced_costs",
    "step_promise",
    "timeline_terms",
]

LEFT_OUT = (
    "the loop's own time outside sched.step (drawing the batch, reading the losses)",
    "the runtime's time between actions (Costs.action_overhead: not measured before the run, 20-30 us an action)",
    "waits longer than the measured latency (a rank's threads woken late on a busy machine)",
    "layers running slower or faster inside a stage than profiled one at a time",
)
"""What the priced step still leaves out (said in the summary beside the promise)."""

_COMPUTE = ("F", "B", "I", "W", "OVERLAP_F_B")
_POSTS = ("SEND_F", "SEND_B", "RECV_F", "RECV_B")


@dataclass(frozen=True)
class StepTerms:
    """What a step costs beyond its layers' compute, in seconds, as measured on this machine.

    ``optimizer``: per layer name, its optimizer step (and ``zero_grad``) per training step;
    ``send`` / ``recv``: rank time to post one message; ``action_overhead``: the runtime's time
    per compute action beyond the action itself."""

    optimizer: Mapping[str, float]
    send: float = 0.0
    recv: float = 0.0
    action_overhead: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "optimizer_s": dict(self.optimizer),
            "send_s": self.send,
            "recv_s": self.recv,
            "action_overhead_s": self.action_overhead,
        }


def priced_costs(compute: Costs, stage_layers: Sequence[Sequence[str]], terms: StepTerms, microbatches: int) -> Costs:
    """``compute`` (per-stage costs of a cut) with the step's other terms priced: each stage's
    optimizer step spread over its microbatches' W and B, message posts as ``send``/``recv``,
    the runtime's per-action time as ``action_overhead``."""
    n = len(stage_layers)
    per_mb = [sum(terms.optimizer.get(name, 0.0) for name in names) / microbatches for names in stage_layers]
    w = compute.per_stage("w", n)
    b = compute.per_stage("b", n)
    i = compute.per_stage("i", n)
    return replace(
        compute,
        b=[x + y for x, y in zip(b, per_mb, strict=True)],
        i=i,
        w=[x + y for x, y in zip(w, per_mb, strict=True)],
        send=terms.send,
        recv=terms.recv,
        action_overhead=terms.action_overhead,
    )


def step_promise(
    compute: Costs, schedule: Schedule, stage_layers: Sequence[Sequence[str]], terms: StepTerms
) -> dict[str, Any]:
    """The simulated step of ``schedule`` on a cut, term by term (seconds): ``compute_s`` the
    layers and the latency alone; ``optimizer_s`` with each rank's optimizer step after its last
    action (``spread_s``: spread over W and B instead, as the planner prices it); ``posts_s`` the
    lowered schedule (as the runtime runs it) with message posts and the per-action time, no
    optimizer; ``step_s`` all of them: the promise. ``left_out`` names what is still not priced."""
    from pipetrain.plan.simulate import simulate

    n_mb = schedule.num_microbatches
    alone = simulate(schedule, compute)
    spread = simulate(schedule, priced_costs(compute, stage_layers, StepTerms(terms.optimizer), n_mb)).makespan
    posts = simulate(schedule.lower(), priced_costs(compute, stage_layers, replace(terms, optimizer={}), n_mb))
    return {
        "compute_s": alone.makespan,
        "optimizer_s": optimizer_tail(alone.timeline, schedule, _per_rank(schedule, stage_layers, terms.optimizer)),
        "spread_s": spread,
        "posts_s": posts.makespan,
        "step_s": optimizer_tail(posts.timeline, schedule, _per_rank(schedule, stage_layers, terms.optimizer)),
        "costs": str(compute),
        "terms": terms.to_dict(),
        "left_out": list(LEFT_OUT),
    }


def _per_rank(schedule: Schedule, stage_layers: Sequence[Sequence[str]], optimizer: Mapping[str, float]) -> list[float]:
    """Each rank's optimizer step: the sum over the layers of the stages it holds."""
    per_rank = [0.0] * schedule.num_ranks
    for s, names in enumerate(stage_layers):
        per_rank[schedule.stage_to_rank[s]] += sum(optimizer.get(name, 0.0) for name in names)
    return per_rank


def optimizer_tail(timeline: Timeline, schedule: Schedule, per_rank: Sequence[float]) -> float:
    """The least period of steps that each end with every rank's optimizer step (``per_rank``,
    seconds): for every rank, its last action's end plus its optimizer step less its first
    compute action's start (the next step's work reaches a rank no sooner than it did in this
    one), and the step itself."""
    period = timeline.makespan
    for rank in range(schedule.num_ranks):
        mine = [e for e in timeline.events if e.rank == rank]
        starts = [e.start for e in mine if e.kind in _COMPUTE]
        if mine and starts:
            period = max(period, max(e.end for e in mine) + per_rank[rank] - min(starts))
    return period


def measured_step(step_times: Sequence[float], warmup: int = 2) -> float:
    """The median step time after ``warmup`` steps (all of them when there are no more)."""
    kept = list(step_times[warmup:]) or list(step_times)
    return float(statistics.median(kept)) if kept else float("nan")


def _stage_ranks(schedule: Schedule) -> dict[int, int]:
    return dict(schedule.stage_to_rank)


def _needs_message(kind: str, stage: int, schedule: Schedule) -> bool:
    """Whether a compute action of ``kind`` on ``stage`` takes an input from another rank."""
    ranks = _stage_ranks(schedule)
    if kind == "F":
        return stage > 0 and ranks[stage - 1] != ranks[stage]
    if kind in ("B", "I"):
        return stage < schedule.num_stages - 1 and ranks[stage + 1] != ranks[stage]
    return False


def timeline_terms(timeline: Timeline, schedule: Schedule) -> dict[str, Any]:
    """What a measured step spent, per rank (seconds): ``first_start`` when its first event began
    (from the step's start, where the timeline counts from it: the runtime's set-up, the input's
    split into microbatches), ``span`` its first to last event,
    ``compute`` in compute actions, ``posts`` posting messages, ``gaps`` the rest (waits and the
    runtime's time between actions); and over all ranks the medians of a SEND's and a RECV's
    post and of the gap before a compute action whose inputs were on the rank already (``ready_gap``:
    the runtime's own time per action, no wait in it)."""
    ranks: dict[str, Any] = {}
    sends: list[float] = []
    recvs: list[float] = []
    ready: list[float] = []
    for rank in range(timeline.num_ranks):
        events = sorted((e for e in timeline.events if e.rank == rank), key=lambda e: (e.start, e.end))
        if not events:
            continue
        compute = sum(e.duration for e in events if e.kind in _COMPUTE)
        posts = 0.0
        prev_end = None
        for e in events:
            if e.kind in _POSTS:
                (sends if e.kind.startswith("SEND") else recvs).append(e.duration)
            if prev_end is None or e.start >= prev_end:  # events posted together share one box
                if e.kind in _POSTS:
                    posts += e.duration
            if (
                prev_end is not None
                and e.kind in ("F", "B", "I", "W")
                and not _needs_message(e.kind, e.stage, schedule)
                and e.start >= prev_end
            ):
                ready.append(e.start - prev_end)
            prev_end = e.end if prev_end is None else max(prev_end, e.end)
        span = events[-1].end - events[0].start
        ranks[str(rank)] = {
            "first_start": events[0].start,
            "span": span,
            "compute": compute,
            "posts": posts,
            "gaps": max(0.0, span - compute - posts),
            "actions": sum(1 for e in events if e.kind in _COMPUTE),
        }

    def med(values: list[float]) -> float:
        return float(statistics.median(values)) if values else 0.0

    return {
        "makespan": timeline.makespan,
        "ranks": ranks,
        "send_post": med(sends),
        "recv_post": med(recvs),
        "ready_gap": med(ready),
    }
