"""torch 2.15's activation-liveness analysis: which activations of a rank are alive together.

``analyze_pipeline_activation_liveness(schedule, pp_rank=, stage_indices=, granularity=)`` reads
one rank's program: an activation (stage, microbatch) lives from its forward to the action that
frees it, its full backward (B) or, when the backward is split, its weight backward (W; the
input backward I alone does not free it). Both ends count as in use, and so do all parts of one
OVERLAP_F_B. Lifetimes that never overlap share a slot; the result numbers the slots, for a
caller that keeps one buffer (or arena region) per slot. It allocates nothing.

The positions are those of the order the schedule runs: ``pipeline_order_with_comms`` for a
pipetrain schedule object (SEND/RECV included, as torch's runtime schedules), a
:class:`~pipetrain.plan.Schedule`'s own actions as given. Same meaning as torch's; the
positions differ where the lowered orders differ.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from pipetrain.plan import Action, ActionKind, Schedule

__all__ = ["PipelineActivationLiveness", "analyze_pipeline_activation_liveness"]

Granularity = Literal["microbatch", "stage_microbatch"]
Key = tuple[int, int]  # (stage, microbatch)


@dataclass(frozen=True, eq=True)
class PipelineActivationLiveness:
    """Activation slots of one rank (torch 2.15's class of the same name and fields).

    ``slot_by_stage_and_microbatch`` maps each analysed (stage, microbatch) to its slot, numbered
    from 0; ``num_slots`` slots suffice. With ``granularity="microbatch"`` the analysed stages of
    a microbatch share one lifetime (first forward to last release) and one slot.
    """

    pp_rank: int
    granularity: Granularity
    stage_indices: tuple[int, ...]
    num_microbatches: int
    slot_by_stage_and_microbatch: Mapping[Key, int]
    num_slots: int
    _activation_lifetime_by_stage_and_microbatch: Mapping[Key, tuple[int, int]] = field(repr=False)

    __hash__ = None  # type: ignore[assignment]  # the mappings are not hashable (as torch's)

    def slot_for(self, stage_index: int, microbatch_index: int) -> int:
        """The slot of (``stage_index``, ``microbatch_index``); ValueError if it was not analysed."""
        slot = self.slot_by_stage_and_microbatch.get((stage_index, microbatch_index))
        if slot is None:
            raise ValueError(f"no activation slot for stage {stage_index}, microbatch {microbatch_index}")
        return slot

    def get_activation_lifetime(self, stage_index: int, microbatch_index: int) -> tuple[int, int]:
        """(forward position, release position) in the rank's order, both inclusive."""
        span = self._activation_lifetime_by_stage_and_microbatch.get((stage_index, microbatch_index))
        if span is None:
            raise ValueError(f"no activation lifetime for stage {stage_index}, microbatch {microbatch_index}")
        return span


def _rank_order(schedule: Any, pp_rank: int) -> tuple[list[Action | None], int]:
    """The order ``pp_rank`` runs and the number of microbatches."""
    if not isinstance(schedule, Schedule):
        # a schedule object: the lowered order it runs (its pipeline_order_with_comms)
        schedule = getattr(schedule, "schedule", schedule)
    if not isinstance(schedule, Schedule):
        raise TypeError(
            "analyze_pipeline_activation_liveness takes a pipetrain schedule object (one with a schedule "
            f"to run) or a pipetrain.plan.Schedule, got {type(schedule).__name__}"
        )
    if pp_rank not in schedule.actions:
        raise ValueError(f"rank {pp_rank} is not in the schedule (ranks {sorted(schedule.actions)})")
    return list(schedule.actions[pp_rank]), schedule.num_microbatches


def _parts(order: list[Action | None], stages: set[int], n: int) -> Iterator[tuple[int, Action]]:
    """(position, compute part) for each part of a tracked stage in ``order``, in order."""
    for position, cell in enumerate(order):
        action = cell
        if action is None or not action.kind.is_compute:
            continue
        for part in action.parts:
            if part.stage not in stages:
                continue
            if part.microbatch is None or not 0 <= part.microbatch < n:
                raise ValueError(f"{part} at position {position} has a microbatch outside 0..{n - 1}")
            yield position, part


def _spans(order: list[Action | None], stages: set[int], n: int) -> dict[Key, tuple[int, int]]:
    """Each tracked activation's (forward, release) positions, or ValueError naming what is off."""
    forward: dict[Key, int] = {}
    release: dict[Key, int] = {}
    split: set[Key] = set()  # had an I
    for position, part in _parts(order, stages, n):
        key = (part.stage, part.microbatch or 0)
        if part.kind is ActionKind.I:
            if key in split:
                raise ValueError(f"stage {key[0]}, microbatch {key[1]} has two input backwards")
            split.add(key)
            continue
        if part.kind is ActionKind.W and key not in split:
            raise ValueError(f"{part} at position {position} has no input backward (I) before it")
        # F starts the lifetime; B, or W after an I, ends it
        found = forward if part.kind is ActionKind.F else release
        if key in found:
            raise ValueError(f"stage {key[0]}, microbatch {key[1]}: {part} is the second of its kind")
        found[key] = position
    wanted = {(s, m) for s in stages for m in range(n)}
    for what, seen in (("forward", forward), ("full or weight backward", release)):
        if seen.keys() != wanted:
            missing, extra = sorted(wanted - seen.keys()), sorted(seen.keys() - wanted)
            raise ValueError(f"the {what} actions do not match the tracked activations: {missing=}, {extra=}")
    for key in sorted(wanted):
        if release[key] < forward[key]:
            raise ValueError(f"stage {key[0]}, microbatch {key[1]} is released before its forward")
    return {key: (forward[key], release[key]) for key in wanted}


def _colour(spans: Sequence[tuple[int, int]]) -> tuple[list[int], int]:
    """Interval colouring, greedy by start: a slot is reused once its last span ended before
    the next starts (inclusive ends). Returns the slot of each span, in input order, and the count."""
    slots = [0] * len(spans)
    busy: list[tuple[int, int]] = []  # (end, slot) of spans still holding their slot
    free: list[int] = []
    used = 0
    for i in sorted(range(len(spans)), key=lambda j: (spans[j][0], spans[j][1], j)):
        start, end = spans[i]
        while busy and busy[0][0] < start:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            slots[i] = heapq.heappop(free)
        else:
            slots[i], used = used, used + 1
        heapq.heappush(busy, (end, slots[i]))
    return slots, used


def analyze_pipeline_activation_liveness(
    schedule: Any,
    *,
    pp_rank: int,
    stage_indices: Sequence[int],
    granularity: Granularity,
) -> PipelineActivationLiveness:
    """Lifetimes and reusable slots of rank ``pp_rank``'s activations for ``stage_indices``
    (torch 2.15's function of the same name; see the module docstring). ``schedule`` is a
    pipetrain schedule object or a :class:`~pipetrain.plan.Schedule`; every rank may analyse any
    rank. ValueError for a bad granularity or selection, or an order without exactly one forward
    and one release per tracked activation."""
    if granularity not in ("microbatch", "stage_microbatch"):
        raise ValueError(f"granularity must be 'microbatch' or 'stage_microbatch', got {granularity!r}")
    tracked = tuple(stage_indices)
    if not tracked:
        raise ValueError("stage_indices must name at least one stage")
    if len(set(tracked)) != len(tracked):
        raise ValueError(f"stage_indices must not repeat a stage, got {list(tracked)}")
    order, n = _rank_order(schedule, pp_rank)
    spans = _spans(order, set(tracked), n)
    if granularity == "microbatch":
        per_mb = [(min(spans[(s, m)][0] for s in tracked), max(spans[(s, m)][1] for s in tracked)) for m in range(n)]
        mb_slots, count = _colour(per_mb)
        slot = {(s, m): mb_slots[m] for s in tracked for m in range(n)}
        life = {(s, m): per_mb[m] for s in tracked for m in range(n)}
    else:
        keys = sorted(spans)
        key_slots, count = _colour([spans[k] for k in keys])
        slot = dict(zip(keys, key_slots, strict=True))
        life = {k: spans[k] for k in keys}
    return PipelineActivationLiveness(
        pp_rank=pp_rank,
        granularity=granularity,
        stage_indices=tracked,
        num_microbatches=n,
        slot_by_stage_and_microbatch=MappingProxyType(dict(sorted(slot.items()))),
        num_slots=count,
        _activation_lifetime_by_stage_and_microbatch=MappingProxyType(dict(sorted(life.items()))),
    )
