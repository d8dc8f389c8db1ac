"""FSDP and gradients: where UNSHARD/RESHARD and REDUCE_GRAD may sit relative to the compute.

(The scan tracks each stage's UNSHARD/RESHARD state as it goes; these are the checks that need
every compute step first.)
"""

# ruff: noqa: N806 - M, SM: microbatches, stages × microbatches (the papers' notation)

from __future__ import annotations

from pipetrain.plan.actions import Action
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.validate.index import X_I, Index, node_name, where


def check_unshard_first(index: Index, first_unshard: list[int]) -> None:
    """A stage that has UNSHARD actions must not compute before its first one."""
    SM, M = index.ids.SM, index.ids.M
    node_step = index.node_step
    for s, first in enumerate(first_unshard):
        if first < 0:
            continue
        # Any node of the stage computed before ``first``? (A min over slices: one check per node.)
        if all(min(node_step[g * SM + s * M : g * SM + s * M + M]) >= first for g in range(3)):
            continue
        steps = [(node_step[g * SM + s * M + m], g * SM + s * M + m) for g in range(3) for m in range(M)]
        early = min(((st, node) for st, node in steps if st >= 0), default=(first, -1))
        if early[0] < first:
            raise ScheduleError(
                f"{where(index.rank_of[s], early[0], node_name(index, early[1]))}: stage {s} is sharded here; "
                "an UNSHARD must precede its compute (and no RESHARD come between)"
            )


def check_reduce_grad(index: Index) -> None:
    """One REDUCE_GRAD per stage, after the stage's last B or W."""
    ids, node_step = index.ids, index.node_step
    M, SM = ids.M, ids.SM
    seen: dict[int, int] = {}
    for rank, step, action in index.reduce:
        s = action.stage
        here = where(rank, step, action)
        if not index.has_backward:
            raise ScheduleError(f"{here}: a forward-only schedule has no gradients to reduce")
        if s in seen:
            raise ScheduleError(f"{here}: duplicate REDUCE_GRAD for stage {s}, already at step {seen[s]}")
        seen[s] = step
        for m in range(M):
            sm = s * M + m
            last = node_step[2 * SM + sm] if index.x_kind[sm] == X_I else node_step[SM + sm]
            if last > step:
                kind = "W" if index.x_kind[sm] == X_I else "B"
                raise ScheduleError(
                    f"{where(rank, last, Action.parse(f'{s}{kind}{m}'))}: backward of stage {s} after its "
                    f"{action} (step {step}); REDUCE_GRAD must follow the stage's last B or W"
                )
