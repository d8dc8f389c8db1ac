"""Planning the whole pipeline: cut a per-layer profile into stages, place them on ranks, choose
which stages recompute their activations, and the schedule, within a memory budget in bytes.

:func:`plan_pipeline` is the entry point; :mod:`.search` describes how it searches and
docs/semantics.md ("Planning the whole pipeline") the memory model.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from itertools import pairwise

from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.pipeline.cuts import hand_splits, layer_symbol
from pipetrain.plan.pipeline.layers import (
    BYTES_PER_PARAMETER,
    LayerCost,
    as_layers,
    format_bytes,
    parse_bytes,
    read_layers,
    read_layers_meta,
    static_bytes_for,
    write_layers,
)
from pipetrain.plan.pipeline.model import Profile
from pipetrain.plan.pipeline.result import PipelinePlan, megatron_layout, parse_megatron_layout
from pipetrain.plan.pipeline.search import HandSplit, Search, layouts_for
from pipetrain.plan.search import Candidate as NamedCandidate
from pipetrain.plan.search import _count, _finite

__all__ = [
    "BYTES_PER_PARAMETER",
    "HandSplit",
    "LayerCost",
    "PipelinePlan",
    "format_bytes",
    "hand_splits",
    "layer_symbol",
    "megatron_layout",
    "parse_bytes",
    "parse_megatron_layout",
    "plan_pipeline",
    "read_layers",
    "read_layers_meta",
    "static_bytes_for",
    "write_layers",
]


def plan_pipeline(
    layers: Iterable[LayerCost],
    num_ranks: int,
    num_microbatches: int,
    memory_limit: float | str | None,
    *,
    stages_per_rank: int | None = None,
    placement: str | None = None,
    comm: float = 0.0,
    time_limit: float = 10.0,
    seed: int = 0,
) -> PipelinePlan:
    """Cut ``layers`` into stages, place them on ``num_ranks`` ranks, choose which stages recompute
    and the schedule, so that one step of ``num_microbatches`` is fastest and every rank's peak
    memory is within ``memory_limit`` bytes (a number, text such as ``"80GiB"``, or None for no
    limit).

    ``layers`` are per layer and microbatch, in model order (:class:`LayerCost`). The plan's
    stages are contiguous and non-empty. ``stages_per_rank`` (default: 1, and 2 in a loop or a V)
    and ``placement`` (``"loop"`` or ``"v"``) restrict the layouts; ``comm`` is the latency of a
    message between ranks, in the layers' time unit. The search (see
    :mod:`pipetrain.plan.pipeline.search`) returns within about ``time_limit`` seconds (the hand
    splits are always evaluated, even past it) and is never slower than the best named schedule
    that fits on any hand split it evaluates (equal layer counts, torchtitan's default, Megatron's
    even and account-for-embedding/loss splits, the min-max time cut, DeepSpeed's parameter
    balance), at every layout it considers.

    ``simulate(plan.schedule, plan.costs)`` reproduces ``plan.makespan`` and
    ``plan.peak_memory_bytes``. Raises ScheduleError when nothing fits, naming the rank and its
    bytes when static memory alone is over the limit.
    """
    started = time.perf_counter()
    checked = as_layers(layers)
    ranks = _count("num_ranks", num_ranks)
    micro = _count("num_microbatches", num_microbatches)
    limit = None if memory_limit is None else parse_bytes(memory_limit)
    v = None if stages_per_rank is None else _count("stages_per_rank", stages_per_rank)
    if placement is not None and placement not in ("loop", "v"):
        raise ScheduleError(f"placement must be 'loop' or 'v', got {placement!r}")
    if placement == "v" and v not in (None, 2):
        raise ScheduleError(f"placement 'v' needs 2 stages per rank, got stages_per_rank={v}")
    latency = _finite("comm", comm)
    seconds = _finite("time_limit (seconds)", time_limit, positive=True)
    profile = Profile(checked)
    searched, extra = layouts_for(ranks, micro, profile.n, v, placement, latency)
    if not searched:
        need = ranks * (v or 1)
        raise ScheduleError(
            f"{profile.n} layers cannot make {need} non-empty stages ({ranks} ranks x {v or 1} per rank); "
            "give fewer ranks or finer layers"
        )
    search = Search(profile, ranks, micro, limit, latency, started + seconds, seconds, seed)
    search.run(searched, extra)
    best = search.best_verified()
    if best is None:
        if limit is None:
            raise ScheduleError("no schedule builds for these sizes")  # pragma: no cover - 1F1B always does
        raise search.nothing_fits(searched)
    assert best.result is not None and best.schedule is not None
    result, schedule = best.result, best.schedule
    peaks = dict(result.peak_memory_bytes or dict.fromkeys(range(ranks), 0.0))
    best_named = None
    if search.baseline:
        named = min(search.baseline, key=lambda c: c.makespan)
        if named.result is not None and named.schedule is not None and named.named is not None:
            peak = max((named.result.peak_memory_bytes or {0: 0.0}).values())
            best_named = NamedCandidate(named.named, named.layout.v, named.schedule, named.result, peak, True)
    stage_layers = [profile.names[a:b] for a, b in pairwise(best.cut)]
    schedule.planned = True  # (a timed search: ranks that each plan run rank 0's order)
    return PipelinePlan(
        schedule=schedule,
        makespan=result.makespan,
        memory=max(peaks.values(), default=0.0),
        best_named=best_named,
        stage_layers=stage_layers,
        recompute=best.recompute,
        costs=result.costs,
        peak_memory_bytes=peaks,
        bubble=result.bubble,
        memory_limit=limit,
        num_ranks=ranks,
        num_microbatches=micro,
        stages_per_rank=best.layout.v,
        placement=best.layout.placement,
        layers=tuple(checked),
        hand_splits=tuple(search.hand),
        how=best.how,
        search_seconds=time.perf_counter() - started,
        notes=tuple(search.log),
    )
