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
from pipetrain.plan.dependencies import CODE, Dependencies
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
    med: dict[str, list[float | None]] = {
        kind.lower(): [
            statistics.median(samples[(kind, s)]) if samples.get((kind, s)) else None for s in range(num_stages)
        ]
        for kind in _COMPUTE
    }
    # A stage seen running its backward one way only: the other way from its own numbers (B as
    # I + W, I and W as half a B; a split costs more in practice, so B = I + W errs long).
    for s in range(num_stages):
        b, i, w = med["b"][s], med["i"][s], med["w"][s]
        if b is None and i is not None and w is not None:
            med["b"][s] = i + w
        elif b is not None and i is None and w is None:
            med["i"][s] = med["w"][s] = b / 2
    per_kind: dict[str, list[float]] = {}
    for kind, measured in med.items():
        known = [x for x in measured if x is not None]
        if known:
            fill = statistics.median(known)  # a stage never seen doing this kind: the others' median
            per_kind[kind] = [fill if x is None else x for x in measured]
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
    consumers that waited for it (their rank was idle in between); 0 when none waited.

    Which action produces a consumer's input is the dependency core's rule.
    """
    waits: list[float] = []
    for timeline in timelines:
        events = [e for e in timeline.events if e.kind in _COMPUTE and e.microbatch is not None and e.stage >= 0]
        if not events:
            continue
        num_stages = 1 + max(e.stage for e in events)
        num_microbatches = 1 + max(e.microbatch or 0 for e in events)
        deps = Dependencies(num_stages, num_microbatches, [0] * num_stages, lowered=False)
        ends: dict[int, tuple[int, float]] = {}  # product key -> (rank, end)
        by_rank: dict[int, list[TimelineEvent]] = defaultdict(list)
        for e in events:
            by_rank[e.rank].append(e)
            ends[deps.make_key[CODE[e.kind]][e.stage] + e.microbatch] = (e.rank, e.end)  # type: ignore[operator]
        for rank, ordered in by_rank.items():
            ordered.sort(key=lambda e: e.start)
            previous_end = float("-inf")
            for e in ordered:
                for key in deps.need_keys[CODE[e.kind]][e.stage]:
                    producer = ends.get(key + e.microbatch)  # type: ignore[operator]
                    if producer is not None and producer[0] != rank and producer[1] >= previous_end:
                        waits.append(max(0.0, e.start - producer[1]))
                previous_end = max(previous_end, e.end)
    return statistics.median(waits) if waits else 0.0
