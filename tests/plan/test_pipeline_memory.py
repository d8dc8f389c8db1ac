"""plan_pipeline's fast memory checks against simulate (issue 37 item 2): what W reads
(``weight_grad_bytes``, held from I's end to W's) and each action's transient at its own time."""

from __future__ import annotations

import random
import time

import pytest

from pipetrain.plan import LayerCost, ScheduleError, plan_pipeline, simulate
from pipetrain.plan.pipeline.model import Profile, StageValues, vector_peak
from pipetrain.plan.pipeline.scoring import _held
from pipetrain.plan.pipeline.search import Search
from pipetrain.plan.pipeline.space import layouts_for

GB = 1e9


def _layers(rng: random.Random, n: int, wgrad_ratio: float, output: float) -> list[LayerCost]:
    """Random layers whose W reads ``wgrad_ratio`` times what F keeps, some with a workspace."""
    out = []
    for k in range(n):
        f = round(rng.uniform(0.5, 2.0), 2)
        act = round(rng.uniform(0.5, 2.0), 2) * GB
        out.append(
            LayerCost(
                f"l{k}",
                f=f,
                i=round(f * rng.uniform(0.8, 1.3), 2),
                w=round(f * rng.uniform(0.5, 1.0), 2),
                activation_bytes=act,
                weight_grad_bytes=wgrad_ratio * act,
                output_bytes=output * GB,
                static_bytes=round(rng.uniform(0.5, 2.0), 2) * GB,
                workspace_bytes=(0.3 + 0.1 * k) * GB if k % 3 == 1 else 0.0,
            )
        )
    return out


@pytest.mark.parametrize(("v", "place"), [(1, "loop"), (2, "loop"), (2, "v")])
@pytest.mark.parametrize("ratio", [0.5, 2.0])
def test_the_fast_model_is_simulates_peak_without_message_bytes(v: int, place: str, ratio: float) -> None:
    """With no message bytes (no buffers: the one part the fast model only bounds), the fast
    walk of every named order and the count vectors give simulate's peak on every rank, with and
    without recompute: activations, what W reads from I's end, static bytes and each action's
    transient at its own time."""
    rng = random.Random(7)
    ranks, micro = 3, 6
    layers = _layers(rng, 3 * ranks * v, ratio, output=0.0)
    search = Search(Profile(layers), ranks, micro, None, 0.0, time.perf_counter() + 10, 10.0, 0)
    (layout,) = [lay for lay in layouts_for(ranks, micro, len(layers), v, place, 0.0)[0] if lay.placement == place]
    cut = tuple(range(0, len(layers) + 1, 3))
    sv = search.values(cut)
    assert layout.named
    for recompute in (frozenset[int](), frozenset({1, len(cut) - 2})):
        for named in layout.named:
            if named.paired:
                continue  # (simulate times an overlapped pair as one action)
            peaks = simulate(layout.schedule_of(named.name), sv.costs(recompute, 0.0)).peak_memory_bytes
            assert peaks is not None
            fast = search.rank_needs(layout, cut, recompute, named.orders)
            assert fast == pytest.approx([peaks[r] for r in range(ranks)]), (named.name, recompute)
            for r, stages in enumerate(layout.rank_stages):
                held = _held(layout, sv, stages, recompute)
                by_vectors = vector_peak(named.vectors[r], held, [sv.transient(s, recompute) for s in stages])
                static = sum(sv.static[s] for s in stages)
                assert static + by_vectors == pytest.approx(peaks[r]), (named.name, r)


def test_what_w_reads_counts_in_the_fast_model() -> None:
    """A stage whose W reads twice its activation: ZB orders (split) need more than 1F1B's (one
    pass) on the same cut, in the fast model as in simulate."""
    rng = random.Random(3)
    layers = _layers(rng, 6, 2.0, output=0.0)
    search = Search(Profile(layers), 2, 4, None, 0.0, time.perf_counter() + 10, 10.0, 0)
    (layout,) = layouts_for(2, 4, 6, 1, "loop", 0.0)[0]
    cut = (0, 3, 6)
    named = {n.name: n for n in layout.named}
    one_pass = search.rank_needs(layout, cut, frozenset(), named["1F1B"].orders)
    split = search.rank_needs(layout, cut, frozenset(), named["ZBH1"].orders)
    assert split[0] > one_pass[0]
    sv = StageValues.of(Profile(layers), cut)
    peaks = simulate(layout.schedule_of("ZBH1"), sv.costs(frozenset(), 0.0)).peak_memory_bytes
    assert peaks is not None and split == pytest.approx([peaks[0], peaks[1]])


@pytest.mark.parametrize("seed", range(4))
def test_plan_pipeline_never_returns_a_plan_over_its_limit_when_w_reads_more(seed: int) -> None:
    """What W reads outweighs the activations (weight_grad_bytes = 1.8 x activation_bytes), with
    message buffers: at limits from the least to ample, the plan's simulated peak is within the
    limit on every rank, and is the plan's promise; below the least, ScheduleError names it."""
    rng = random.Random(seed)
    ranks, micro = 2, 4
    layers = _layers(rng, rng.randint(6, 9), 1.8, output=0.1)
    statics = sum(x.static_bytes for x in layers) / ranks
    acts = sum(x.activation_bytes for x in layers) / ranks
    fitted = 0
    for tight in (0.4, 0.8, 1.2, 2.0, 4.0):
        limit = max(x.static_bytes for x in layers) + statics + tight * acts
        try:
            plan = plan_pipeline(layers, ranks, micro, limit, comm=0.1, time_limit=0.4)
        except ScheduleError as exc:
            assert "fit" in str(exc), exc
            continue
        fitted += 1
        peaks = simulate(plan.schedule, plan.costs).peak_memory_bytes
        assert peaks is not None
        assert all(peak <= limit + 1e-6 for peak in peaks.values()), (tight, peaks, limit)
        assert plan.peak_memory_bytes == pytest.approx(peaks)
    assert fitted >= 2  # the ample limits fit


@pytest.mark.parametrize("seed", range(3))
def test_nothing_fits_names_the_least_memory_at_which_a_plan_is_returned(seed: int) -> None:
    """Below every plan's memory the error names the least found (the microbatches one at a time,
    simulated): with that limit plan_pipeline returns a plan within it; a little below, nothing."""
    rng = random.Random(seed)
    layers = _layers(rng, rng.randint(6, 9), 1.8, output=0.1)
    statics = sum(x.static_bytes for x in layers) / 2
    # (A limit above what the cut that balances static bytes leaves a rank, not found by a timed
    # climb under every load, and below one microbatch's activations more.)
    with pytest.raises(ScheduleError, match="static memory fits") as info:
        plan_pipeline(layers, 2, 4, 1.1 * statics, comm=0.1, time_limit=0.3)
    least = float(str(info.value).split("the least found is ")[1].split("(")[1].split(" bytes")[0])
    plan = plan_pipeline(layers, 2, 4, least, comm=0.1, time_limit=0.3)
    peaks = simulate(plan.schedule, plan.costs).peak_memory_bytes
    assert peaks is not None and max(peaks.values()) <= least
    with pytest.raises(ScheduleError, match="no plan fits"):
        plan_pipeline(layers, 2, 4, 0.999 * least, comm=0.1, time_limit=0.3)
