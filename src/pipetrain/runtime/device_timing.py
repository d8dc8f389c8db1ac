"""Timing compute where it runs: what a measured timeline of a GPU step shows.

The runtime queues GPU work and moves on, so host clocks around an action time its launch, not
its run: a GPU-bound step's timeline (and the costs ``pipetrain profile`` reads from it) would
show launches. With device timing on, the executor records a device event on the stream before
and after each compute action (after the stream's wait for the action's inputs, so a wait shows
as a gap) and keeps the host times for everything else. The events are read only when the step's
timeline is: one synchronisation at the step's start (so that a reference event recorded then
runs at once, tying the device's clock to the host's) and one when the timeline is built.

``_CLOCKS`` maps a device type to its clock; devices without one (the CPU, whose work runs when
the host calls it) keep the host times. Tests register a stand-in for the CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from pipetrain.plan.actions import Action

__all__ = ["DeviceClock", "device_clock", "on_device_times"]


class DeviceClock(Protocol):
    """Marks on a device's stream, read back as host-clock nanoseconds once the work is done."""

    def start(self) -> None:
        """Tie the device's clock to the host's (may wait for the device)."""

    def mark(self) -> Any:
        """A mark on the stream: it reads as the time the device reaches it."""

    def read(self, marks: Sequence[Any]) -> list[int]:
        """The host-clock time (``perf_counter_ns``) of each mark (waits for the last)."""


_EVENT: Any = torch.cuda.Event  # (untyped in torch's stubs)


class CudaClock:
    """CUDA events on the current stream of ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._ref: Any = None
        self._ref_ns = 0

    def start(self) -> None:
        torch.cuda.synchronize(self.device)  # the device is idle: the reference runs when recorded
        self._ref = _EVENT(enable_timing=True)
        self._ref.record(torch.cuda.current_stream(self.device))
        self._ref_ns = time.perf_counter_ns()  # (after the record call: it has run by now)

    def mark(self) -> Any:
        event = _EVENT(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))  # the stage's device, whichever is current
        return event

    def read(self, marks: Sequence[Any]) -> list[int]:
        if not marks:
            return []
        marks[-1].synchronize()
        ref, ref_ns = self._ref, self._ref_ns
        return [ref_ns + round(ref.elapsed_time(event) * 1e6) for event in marks]


_CLOCKS: dict[str, Callable[[torch.device], DeviceClock]] = {"cuda": CudaClock}


def device_clock(device: torch.device) -> DeviceClock | None:
    """A clock for compute on ``device``; None where the host's clock is the device's."""
    make = _CLOCKS.get(device.type)
    return None if make is None else make(device)


def on_device_times(
    events: list[tuple[Action, int, int]], timed: list[tuple[int, Any, Any]], clock: DeviceClock
) -> list[tuple[Action, int, int]]:
    """``events`` with each compute action timed on the device: ``timed`` holds, per such action,
    its index in ``events`` and its two marks."""
    if not timed:
        return events
    times = clock.read([mark for _, start, end in timed for mark in (start, end)])
    out = list(events)
    for k, (i, _, _) in enumerate(timed):
        out[i] = (events[i][0], times[2 * k], times[2 * k + 1])
    return out
