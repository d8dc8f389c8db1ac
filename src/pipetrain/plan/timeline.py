"""Timeline: when each action ran on each rank, simulated or measured.

One format for both, so the same renderers (PNG/SVG, Chrome trace, text grid) draw a cost-model
simulation and a recorded training step the same way, and side by side.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pipetrain.plan._jsonio import parse_json_text, read_json, write_json
from pipetrain.plan.errors import ScheduleError

__all__ = ["Timeline", "TimelineEvent"]

_FORMAT = "pipetrain.timeline"
_VERSION = 1


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    """One action on one rank: ``action`` is ``str(Action)``, ``kind`` its ActionKind value."""

    rank: int
    action: str
    kind: str
    stage: int
    microbatch: int | None
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "action": self.action,
            "kind": self.kind,
            "stage": self.stage,
            "microbatch": self.microbatch,
            "start": self.start,
            "end": self.end,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TimelineEvent:
        try:
            mb = data.get("microbatch")
            return cls(
                rank=int(data["rank"]),
                action=str(data["action"]),
                kind=str(data["kind"]),
                stage=int(data["stage"]),
                microbatch=None if mb is None else int(mb),
                start=float(data["start"]),
                end=float(data["end"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ScheduleError(f"malformed timeline event {dict(data)!r}: {err!r}") from None


@dataclass
class Timeline:
    """Every event of one pipeline step, for ``num_ranks`` ranks.

    ``source`` is "simulated" or "measured"; ``unit`` is "" for cost-model units and "s" for
    measured seconds.
    """

    num_ranks: int
    events: list[TimelineEvent] = field(default_factory=list)
    title: str = ""
    source: str = "simulated"
    unit: str = ""

    @property
    def start(self) -> float:
        return min((e.start for e in self.events), default=0.0)

    @property
    def end(self) -> float:
        return max((e.end for e in self.events), default=0.0)

    @property
    def makespan(self) -> float:
        """Time from the first event's start to the last event's end."""
        return self.end - self.start if self.events else 0.0

    def events_of(self, rank: int) -> list[TimelineEvent]:
        """Events of ``rank`` sorted by start time."""
        return sorted((e for e in self.events if e.rank == rank), key=lambda e: (e.start, e.end))

    def shifted(self, offset: float) -> Timeline:
        """A copy with every time moved by ``offset`` (e.g. to start a measured step at 0)."""
        events = [
            TimelineEvent(e.rank, e.action, e.kind, e.stage, e.microbatch, e.start + offset, e.end + offset)
            for e in self.events
        ]
        return Timeline(self.num_ranks, events, self.title, self.source, self.unit)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "num_ranks": self.num_ranks,
            "title": self.title,
            "source": self.source,
            "unit": self.unit,
            "events": [e.to_dict() for e in self.events],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Timeline:
        if not isinstance(data, Mapping) or data.get("format") != _FORMAT:
            raise ScheduleError(f'not a pipetrain timeline: expected an object with "format": "{_FORMAT}"')
        try:
            events = [TimelineEvent.from_dict(e) for e in data["events"]]
            return cls(
                num_ranks=int(data["num_ranks"]),
                events=events,
                title=str(data.get("title", "")),
                source=str(data.get("source", "simulated")),
                unit=str(data.get("unit", "")),
            )
        except (KeyError, TypeError, ValueError) as err:
            if isinstance(err, ScheduleError):
                raise
            raise ScheduleError(f"malformed timeline JSON: {err!r}") from None

    def to_json(self, path: str | os.PathLike[str] | None = None, *, indent: int | None = None) -> str:
        """The JSON text; also written to ``path`` when one is given."""
        return write_json(self.to_dict(), path, indent)

    @classmethod
    def from_json(cls, source: str | os.PathLike[str]) -> Timeline:
        """Read a timeline from a JSON file; a string that names no existing file and starts with
        '{' is parsed as JSON text (for older callers: :meth:`from_json_text` says so explicitly)."""
        return cls.from_dict(read_json(source, "timeline"))

    @classmethod
    def from_json_text(cls, text: str) -> Timeline:
        """Read a timeline from JSON text (as :meth:`to_json` returns it)."""
        return cls.from_dict(parse_json_text(text, "timeline"))
