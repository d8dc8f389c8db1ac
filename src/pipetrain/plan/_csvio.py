"""Torch's CSV format of a schedule (what :class:`~pipetrain.plan.schedule.Schedule` reads and
writes): one row per rank, one cell per step, empty = idle; torch 2.15's lowered form with its
WAIT_SEND_F, WAIT_SEND_B and WAIT_REDUCE_GRAD cells written on request and checked when read."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence

from pipetrain.plan.actions import Action, ActionKind, make_action, parse_torch_wait, torch_wait
from pipetrain.plan.errors import ScheduleError

__all__ = ["csv_text", "parse_csv_text"]


def csv_text(programs: Sequence[Sequence[Action | None]], *, torch_waits: bool) -> str:
    """The CSV text of the rank programs (rank order), with torch's waits when ``torch_waits``
    (the caller asks it of a lowered schedule only)."""
    buf = io.StringIO()
    writer = csv.writer(buf)
    for program in programs:
        writer.writerow(_with_torch_waits(program) if torch_waits else ["" if a is None else str(a) for a in program])
    return buf.getvalue()


def parse_csv_text(text: str) -> dict[int, list[Action | None]]:
    """The rank programs of torch's CSV text, torch 2.15's waits dropped (and checked)."""
    if "\x00" in text:
        raise ScheduleError("CSV contains a NUL byte; is this a schedule file?")
    try:
        rows = list(csv.reader(io.StringIO(text, newline="")))
    except csv.Error as err:
        raise ScheduleError(f"malformed CSV: {err}") from None
    if not rows:
        raise ScheduleError("the CSV holds no rows; expected one row per rank")
    actions: dict[int, list[Action | None]] = {}
    for rank, row in enumerate(rows):
        parsed: list[Action | None] = []
        waits: list[tuple[int, Action, int, str]] = []  # (place in parsed, awaited action, step, cell)
        for step, cell in enumerate(row):
            try:
                if _WAIT in cell and (awaited := parse_torch_wait(cell)) is not None:
                    waits.append((len(parsed), awaited, step, cell))  # dropped, its cell with it
                    continue
                parsed.append(Action.parse(cell))
            except ScheduleError as err:
                raise ScheduleError(f"rank {rank}, step {step}: {err}") from None
        if waits:
            _check_torch_waits(rank, parsed, waits)
        actions[rank] = parsed
    return actions


_WAIT = "WAIT_"  # in every torch wait cell: the one test the reader makes of the others


def _with_torch_waits(program: Sequence[Action | None]) -> list[str]:
    """A lowered rank program's cells in torch 2.15's lowered format, waits placed by torch's rule
    (its ``_add_reduce_grad`` and ``_add_wait_send`` passes at their defaults): a WAIT_REDUCE_GRAD
    right after its REDUCE_GRAD; the WAIT_SEND_F of a stage's forward send right after that stage's
    backward (B or I) of the same microbatch, which shows the receiver took it; every other send's
    wait (SEND_B, and a forward send no backward of its own follows) at the end of the row, in the
    order of the sends. Idle cells are left out."""
    cells: list[str] = []
    pending: dict[Action, None] = {}  # sends not yet awaited, in order
    for action in program:
        if action is None:
            continue
        cells.append(str(action))
        kind = action.kind
        if kind is ActionKind.SEND_F or kind is ActionKind.SEND_B:
            pending[action] = None
        elif kind is ActionKind.REDUCE_GRAD:
            cells.append(torch_wait(action))
        elif kind.is_compute:
            for part in action.parts:
                if part.kind.is_backward:
                    send = make_action(part.stage, ActionKind.SEND_F, part.microbatch)
                    if send in pending:
                        del pending[send]
                        cells.append(torch_wait(send))
    cells.extend(torch_wait(send) for send in pending)
    return cells


def _check_torch_waits(
    rank: int, parsed: Sequence[Action | None], waits: Sequence[tuple[int, Action, int, str]]
) -> None:
    """Each wait of a rank's row must come after the send or REDUCE_GRAD it waits for, once (as in
    torch's own check): ``waits`` holds, per wait, its place among the ``parsed`` actions. O(row)."""
    issued: set[Action] = set()
    done = 0
    for place, awaited, step, cell in waits:
        for action in parsed[done:place]:
            if action is not None and action.kind in _AWAITED:
                issued.add(action)
        done = place
        if awaited not in issued:
            raise ScheduleError(
                f"rank {rank}, step {step}: {cell.strip()} waits for {awaited}, but rank {rank} has no "
                f"{awaited} before it still to wait for"
            )
        issued.remove(awaited)


_AWAITED = frozenset({ActionKind.SEND_F, ActionKind.SEND_B, ActionKind.REDUCE_GRAD})
