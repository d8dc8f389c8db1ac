"""Costs from measured timelines: what ``pipetrain profile`` writes and ``auto_schedule`` plans for.

Durations are medians over every measured step (a step with a stall or a cold cache does not
move them). Compute actions are timed from the moment their inputs were there, so a box is
compute alone; message latency is read from the waits: where a rank sat idle until a message
from another rank let its next action start, the time from the producer's end to that start is a
sample, and ``comm`` is their median (0 when no rank ever waited). Clocks of ranks on one machine
agree (a monotonic system clock); across machines the latency samples are only as good as the
clocks' agreement.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence

from pipetrain.plan.costs import Costs
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.timeline import Timeline, TimelineEvent

__all__ = ["costs_from_timelines", "message_latency"]

_COMPUTE = ("F", "B", "I", "W")


def costs_from_timelines(
    timelines: Sequence[Timeline], num_stages: int, activation_bytes: Sequence[float] | None = None
) -> Costs:
    """Per-stage median F, B, I, W over ``timelines`` and the median message latency, as Costs."""
    if not timelines:
        raise ScheduleError("no measured timeline to take costs from")
    samples: dict[tuple[str, int], list[float]] = defaultdict(list)
    for timeline in timelines:
        for e in timeline.events:
            if e.kind in _COMPUTE and 0 <= e.stage < num_stages:
                samples[(e.kind, e.stage)].append(e.duration)
    if not any(samples.get(("F", s)) for s in range(num_stages)):
        raise ScheduleError("the measured timelines hold no forward (F) action")
    per_kind: dict[str, list[float]] = {}
    for kind in _COMPUTE:
        measured = [
            statistics.median(samples[(kind, s)]) if samples.get((kind, s)) else None for s in range(num_stages)
        ]
        known = [x for x in measured if x is not None]
        if not known:
            continue
        fill = statistics.median(known)  # a stage never seen doing this kind: the others' median
        per_kind[kind.lower()] = [fill if x is None else x for x in measured]
    if "i" not in per_kind and "b" in per_kind:
        per_kind["i"] = [b / 2 for b in per_kind["b"]]
        per_kind["w"] = [b / 2 for b in per_kind["b"]]
    if "b" not in per_kind and "i" in per_kind and "w" in per_kind:
        per_kind["b"] = [i + w for i, w in zip(per_kind["i"], per_kind["w"], strict=True)]
    return Costs(
        f=per_kind["f"],
        b=per_kind.get("b"),
        i=per_kind.get("i"),
        w=per_kind.get("w"),
        comm=message_latency(timelines),
        activation_bytes=list(activation_bytes) if activation_bytes is not None else None,
    )


def message_latency(timelines: Sequence[Timeline]) -> float:
    """Median time from a producer's end to the start of its consumer on another rank, over the
    consumers that waited for it (their rank was idle in between); 0 when none waited."""
    waits: list[float] = []
    for timeline in timelines:
        ends: dict[tuple[str, int, int], tuple[int, float]] = {}
        by_rank: dict[int, list[TimelineEvent]] = defaultdict(list)
        for e in timeline.events:
            if e.kind in _COMPUTE and e.microbatch is not None:
                by_rank[e.rank].append(e)
                if e.kind == "F":
                    ends[("F", e.stage, e.microbatch)] = (e.rank, e.end)
                elif e.kind in ("B", "I"):
                    ends[("G", e.stage, e.microbatch)] = (e.rank, e.end)
        for rank, events in by_rank.items():
            events.sort(key=lambda e: e.start)
            previous_end = float("-inf")
            for e in events:
                assert e.microbatch is not None
                if e.kind == "F":
                    producer = ends.get(("F", e.stage - 1, e.microbatch))
                elif e.kind in ("B", "I"):
                    producer = ends.get(("G", e.stage + 1, e.microbatch))
                else:
                    producer = None
                if producer is not None and producer[0] != rank and producer[1] >= previous_end:
                    waits.append(max(0.0, e.start - producer[1]))
                previous_end = max(previous_end, e.end)
    return statistics.median(waits) if waits else 0.0
