"""One order for every rank: ranks that planned separately run rank 0's schedule.

A program calls :func:`~pipetrain.plan.auto_schedule` (or plans a pipeline) on every rank, as it
would call ``build_schedule``. Those searches are timed, so two ranks can find different orders
of the same actions; each order alone is valid, but ranks running different ones would post
messages that never match. Before the first step of a planner's schedule (``Schedule.planned``),
rank 0 leaves its compute schedule in the store and every other rank reads it: where its own differs only in order (same ranks,
stages, placement and microbatches: the stages each rank holds are the same), it runs rank 0's
instead. Any valid order gives the same gradients, so this changes time and memory, never the
result. Schedules that differ in layout are left to the agreement that follows, which refuses
them naming both.
"""

from __future__ import annotations

from pipetrain.plan import Schedule
from pipetrain.runtime.failures import _ROUNDS, StoreWait

__all__ = ["rank0_order"]


def _same_layout(a: Schedule, b: Schedule) -> bool:
    return (
        a.num_ranks == b.num_ranks
        and a.num_stages == b.num_stages
        and a.num_microbatches == b.num_microbatches
        and a.stage_to_rank == b.stage_to_rank
    )


def rank0_order(wait: StoreWait, schedule: Schedule, rank: int) -> Schedule | None:
    """Rank 0's schedule where it is another order of ``schedule``'s actions, else None.

    Keyed by the round the first step's agreement is about to open (every rank counts rounds
    alike), so it needs no round of its own. Skipped without a store that holds keys.
    """
    failure = wait.failure
    if failure is None or schedule.num_ranks < 2:
        return None
    key = f"pipetrain/{failure.namespace}/order/{_ROUNDS.get(failure.namespace, 0) + 1}"
    store = failure.store
    try:
        if rank == 0:
            store.set(key, schedule.to_json())
            return None
        store.check([key])
    except Exception:  # a store without set/check (a fake backend's): nothing to share
        return None
    (text,) = wait.values(failure, [key])
    theirs = Schedule.from_json_text(text)
    if theirs == schedule or not _same_layout(theirs, schedule):
        return None
    theirs.name = schedule.name
    return theirs
