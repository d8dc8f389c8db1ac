"""Merge an I directly followed by the W of the same (stage, microbatch) into one full B.

Useful when the weight-gradient is not deferred anyway: one backward call instead of two.
B produces what I produced, where I was, so every dependency stays met.
"""

from __future__ import annotations

from pipetrain.plan._graph import B, I, W
from pipetrain.plan.actions import Action, make_action
from pipetrain.plan.schedule import Schedule


def merge_input_weight(schedule: Schedule) -> Schedule:
    """Return ``schedule`` with each I(s, m) whose next non-idle action is W(s, m) turned into B(s, m)."""
    out: dict[int, list[Action | None]] = {}
    for r in range(schedule.num_ranks):
        program = schedule.actions[r]
        merged: list[Action | None] = []
        pending = -1  # index in ``merged`` of an I that may still merge
        for a in program:
            if a is None:
                merged.append(None)
                continue
            if pending >= 0:
                prev = merged[pending]
                assert prev is not None
                if a.kind is W and a.stage == prev.stage and a.microbatch == prev.microbatch:
                    merged[pending] = make_action(prev.stage, B, prev.microbatch)
                    pending = -1
                    continue
                pending = -1
            if a.kind is I:
                pending = len(merged)
            merged.append(a)
        out[r] = merged
    return schedule._derived(out)
