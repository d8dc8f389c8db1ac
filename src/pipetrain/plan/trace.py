"""Chrome trace JSON (chrome://tracing, Perfetto) from a Timeline.

One process per rank, a "compute" thread for F/B/I/W/OVERLAP_F_B and a "communication" thread for
SEND/RECV, each action an ``"X"`` (complete) event whose category says which it is. torch 2.13
labels I and OVERLAP_F_B as communication; here only SEND/RECV are.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pipetrain.plan.timeline import Timeline

__all__ = ["category", "to_chrome_trace", "write_chrome_trace"]

_COMPUTE = frozenset({"F", "B", "I", "W", "OVERLAP_F_B"})
_COMM = frozenset({"SEND_F", "RECV_F", "SEND_B", "RECV_B"})
_THREADS = {"compute": 0, "communication": 1, "other": 2}


def category(kind: str) -> str:
    """ "compute", "communication" or "other" (UNSHARD, RESHARD, REDUCE_GRAD)."""
    if kind in _COMPUTE:
        return "compute"
    if kind in _COMM:
        return "communication"
    return "other"


def to_chrome_trace(timeline: Timeline, *, us_per_unit: float | None = None) -> dict[str, Any]:
    """The trace as a dict. Times are in microseconds: measured seconds scale by 1e6; cost-model
    units by ``us_per_unit`` (default 1000, so one unit shows as 1 ms)."""
    if us_per_unit is None:
        us_per_unit = 1e6 if timeline.unit == "s" else 1000.0
    t0 = timeline.start
    events: list[dict[str, Any]] = []
    for rank in range(timeline.num_ranks):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for name, tid in _THREADS.items():
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}})
    for e in sorted(timeline.events, key=lambda e: (e.rank, e.start)):
        cat = category(e.kind)
        events.append(
            {
                "name": e.action,
                "cat": cat,
                "ph": "X",
                "ts": (e.start - t0) * us_per_unit,
                "dur": max(e.end - e.start, 0.0) * us_per_unit,
                "pid": e.rank,
                "tid": _THREADS[cat],
                "args": {"kind": e.kind, "stage": e.stage, "microbatch": e.microbatch},
            }
        )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"title": timeline.title, "source": timeline.source, "unit": timeline.unit or "cost-model units"},
    }


def write_chrome_trace(timeline: Timeline, path: str | os.PathLike[str], *, us_per_unit: float | None = None) -> None:
    """Write the trace JSON to ``path``."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(to_chrome_trace(timeline, us_per_unit=us_per_unit), fh)
        fh.write("\n")
