"""The time promise (issue 37, item 5): the terms a plain simulation leaves out (the optimizer step,
message posts, the runtime's time per action) are read and written with the costs and layers,
priced in the planner's and the simulator's makespans, named in the summaries, and read back from
a measured timeline. No timing here: synthetic costs and timelines (benchmarks/time_truth.py times)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipetrain.plan import build_schedule, simulate
from pipetrain.plan.costs import Costs
from pipetrain.plan.pipeline import LayerCost, plan_pipeline, read_layers, write_layers
from pipetrain.plan.pipeline.layers import with_optimizer
from pipetrain.plan.timeline import Timeline, TimelineEvent
from pipetrain.train.loop import _time_check, time_line
from pipetrain.train.time_promise import LEFT_OUT, StepTerms, priced_costs, step_promise, timeline_terms

# ----------------------------------------------------------------------------- Costs.action_overhead


def test_action_overhead_is_read_and_written_with_the_costs() -> None:
    costs = Costs.parse("f=1,b=2,comm=0.5,send=0.1,recv=0.2,action_overhead=0.25")
    assert costs.action_overhead == 0.25
    again = Costs.parse(str(costs))
    assert again == costs
    assert "action_overhead=0.25" in str(costs)
    assert "action_overhead" not in str(Costs.parse("f=1"))  # absent when 0, as before


def test_action_overhead_is_refused_when_negative_or_per_stage() -> None:
    with pytest.raises(Exception, match="action_overhead"):
        Costs(f=1, action_overhead=-1)
    with pytest.raises(Exception, match="action_overhead takes one number"):
        Costs.parse("f=1,action_overhead=1:2")


def test_action_overhead_is_added_to_every_compute_action_once_not_to_bytes() -> None:
    costs = Costs(f=[1.0, 2.0], b=[2.0, 4.0], action_overhead=0.5, activation_bytes=[10.0, 20.0])
    assert costs.per_stage("f", 2) == [1.5, 2.5]
    assert costs.per_stage("b", 2) == [2.5, 4.5]
    assert costs.per_stage("i", 2) == [1.5, 2.5]
    assert costs.per_stage("activation_bytes", 2) == [10.0, 20.0]
    # cut into stages, the per-action time stays per action
    assert Costs.per_rank(f=2.0, action_overhead=0.5).cut_into(2).per_stage("f", 4) == [1.5] * 4


def test_the_simulated_makespan_pays_the_overhead_once_per_action() -> None:
    schedule = build_schedule("1F1B", 1, 3)  # one rank: 3 F and 3 B, one after the other
    plain = simulate(schedule, Costs(f=1.0, b=2.0)).makespan
    with_overhead = simulate(schedule, Costs(f=1.0, b=2.0, action_overhead=0.25)).makespan
    assert plain == pytest.approx(9.0)
    assert with_overhead == pytest.approx(9.0 + 6 * 0.25)


# ----------------------------------------------------------------------------- LayerCost.optimizer


def _layers(optimizer: float = 0.0) -> list[LayerCost]:
    return [
        LayerCost("embed", f=0.1, i=0.0, w=0.2, optimizer=3 * optimizer),
        LayerCost("block0", f=1.0, i=1.0, w=1.0, optimizer=optimizer),
        LayerCost("block1", f=1.0, i=1.0, w=1.0, optimizer=optimizer),
        LayerCost("head", f=2.0, i=2.0, w=2.0, optimizer=2 * optimizer),
    ]


@pytest.mark.parametrize("suffix", [".json", ".csv"])
def test_the_optimizer_time_is_read_and_written_in_layers_files(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"layers{suffix}"
    write_layers(path, _layers(optimizer=0.125))
    assert [layer.optimizer for layer in read_layers(path)] == [0.375, 0.125, 0.125, 0.25]


def test_layers_files_without_the_optimizer_read_as_not_measured(tmp_path: Path) -> None:
    csv = tmp_path / "old.csv"
    csv.write_text("name,f,i,w\nblock,1,1,1\n", encoding="utf-8")
    old_json = tmp_path / "old.json"
    old_json.write_text(json.dumps([{"name": "block", "f": 1.0}]), encoding="utf-8")
    assert read_layers(csv)[0].optimizer == 0.0
    assert read_layers(old_json)[0].optimizer == 0.0


def test_with_optimizer_spreads_each_layers_step_over_its_microbatches_once() -> None:
    layers = _layers(optimizer=0.5)
    spread = with_optimizer(layers, 4)
    for before, after in zip(layers, spread, strict=True):
        assert after.w == pytest.approx(before.w + before.optimizer / 4)  # type: ignore[operator]
        assert after.b == pytest.approx(before.b + before.optimizer / 4)  # type: ignore[operator]
        assert (after.f, after.i, after.optimizer) == (before.f, before.i, 0.0)
    assert with_optimizer(spread, 4) == spread  # spread twice: counted once
    with pytest.raises(Exception, match="num_microbatches"):
        with_optimizer(layers, 0)


def test_the_planners_makespan_includes_the_optimizer_step() -> None:
    # One rank holds everything: a step is every action one after the other, then the optimizer.
    layers = _layers(optimizer=0.5)
    total = sum(layer.optimizer for layer in layers)
    without = plan_pipeline(layers, 1, 4, None, time_limit=1).makespan
    priced = plan_pipeline(with_optimizer(layers, 4), 1, 4, None, time_limit=1).makespan
    assert priced == pytest.approx(without + total)


def test_the_planner_moves_a_heavy_optimizer_step_off_the_busy_rank() -> None:
    # Two equal blocks and a head whose Adam step outweighs a block: priced, the plan is slower
    # than unpriced but never slower than the unpriced plan's cut paying the optimizer.
    layers = _layers(optimizer=2.0)
    plan = plan_pipeline(with_optimizer(layers, 4), 2, 4, None, stages_per_rank=1, time_limit=1)
    unpriced = plan_pipeline(layers, 2, 4, None, stages_per_rank=1, time_limit=1)
    from pipetrain.train.auto import cut_costs

    spread = with_optimizer(layers, 4)
    unpriced_paying = simulate(unpriced.schedule, cut_costs(spread, unpriced.stage_layers, (), 0.0)).makespan
    assert plan.makespan >= unpriced.makespan
    assert plan.makespan <= unpriced_paying + 1e-9


# ----------------------------------------------------------------------------- the step promise


def _cut() -> tuple[list[list[str]], Costs]:
    from pipetrain.train.auto import cut_costs

    stage_layers = [["embed", "block0"], ["block1", "head"]]
    return stage_layers, cut_costs(_layers(optimizer=0.5), stage_layers, (), 0.1)


def test_priced_costs_spread_each_stages_optimizer_and_carry_the_posts() -> None:
    stage_layers, compute = _cut()
    terms = StepTerms({"embed": 1.5, "block0": 0.5, "block1": 0.5, "head": 1.0}, send=0.01, recv=0.02)
    priced = priced_costs(compute, stage_layers, terms, 4)
    assert priced.per_stage("w", 2) == pytest.approx([1.2 + 2.0 / 4, 3.0 + 1.5 / 4])
    assert priced.per_stage("b", 2) == pytest.approx([2.2 + 2.0 / 4, 6.0 + 1.5 / 4])
    assert priced.per_stage("f", 2) == compute.per_stage("f", 2)
    assert (priced.send, priced.recv, priced.comm) == (0.01, 0.02, 0.1)


def test_the_step_promise_prices_each_term_and_names_what_it_leaves_out() -> None:
    stage_layers, compute = _cut()
    schedule = build_schedule("1F1B", 2, 4)
    optimizer = {"embed": 1.5, "block0": 0.5, "block1": 0.5, "head": 1.0}
    bare = step_promise(compute, schedule, stage_layers, StepTerms({}))
    assert bare["compute_s"] == pytest.approx(simulate(schedule, compute).makespan)
    assert bare["optimizer_s"] == pytest.approx(bare["compute_s"])
    assert bare["step_s"] == pytest.approx(bare["compute_s"])  # lowered with free posts: the same step
    with_opt = step_promise(compute, schedule, stage_layers, StepTerms(optimizer))
    assert with_opt["optimizer_s"] > with_opt["compute_s"]
    posts = step_promise(compute, schedule, stage_layers, StepTerms(optimizer, send=0.05, recv=0.05))
    assert posts["step_s"] > posts["optimizer_s"] == pytest.approx(with_opt["optimizer_s"])
    assert posts["terms"] == {"optimizer_s": optimizer, "send_s": 0.05, "recv_s": 0.05, "action_overhead_s": 0.0}
    assert posts["left_out"] == list(LEFT_OUT)


def test_each_ranks_optimizer_step_follows_its_last_action_and_the_next_step_reaches_it_later() -> None:
    # 1F1B, 2 ranks, f=1, b=2, no latency: rank 0 ends the step (its last B), rank 1 ends 2 earlier
    # and starts 1 later (it waits for rank 0's first F).
    stage_layers = [["a"], ["b"]]
    compute = Costs(f=[1.0, 1.0], b=[2.0, 2.0])
    schedule = build_schedule("1F1B", 2, 2)
    plain = simulate(schedule, compute).makespan
    first = step_promise(compute, schedule, stage_layers, StepTerms({"a": 0.5}))
    assert first["optimizer_s"] == pytest.approx(plain + 0.5)  # the first rank's: all of it
    hidden = step_promise(compute, schedule, stage_layers, StepTerms({"b": 3.0}))
    assert hidden["optimizer_s"] == pytest.approx(plain)  # 3 fits in rank 1's 2 + 1 before and after
    late = step_promise(compute, schedule, stage_layers, StepTerms({"b": 5.0}))
    assert late["optimizer_s"] == pytest.approx(plain - 2.0 + 5.0 - 1.0)
    assert late["spread_s"] > plain  # the planner's pricing, for comparison


def test_the_time_line_names_the_terms_and_the_ratio() -> None:
    stage_layers, compute = _cut()
    schedule = build_schedule("1F1B", 2, 4)
    promise = step_promise(compute, schedule, stage_layers, StepTerms({"head": 1.0}, send=1e-4, recv=2e-4))
    timing = {"0": {"step_s": 2.0, "optimizer_s": 0.1}, "1": {"step_s": 3.0, "optimizer_s": 0.2}}
    check = _time_check(promise, timing)
    assert check["measured_step_s"] == 3.0  # the slowest rank's
    assert check["ratio"] == pytest.approx(3.0 / promise["step_s"])
    text = time_line(check)
    for words in (
        "measured 3000.0 ms a step",
        "optimizer step",
        "message posts (100+200 us",
        "not priced",
        LEFT_OUT[0],
    ):
        assert words in text
    assert "no simulated step" in time_line(_time_check(None, timing))


# ----------------------------------------------------------------------------- a measured step, read back


def _ev(rank: int, kind: str, stage: int, mb: int, start: float, end: float) -> TimelineEvent:
    return TimelineEvent(rank, f"{stage}{kind}{mb}", kind, stage, mb, start, end)


def test_timeline_terms_split_a_rank_into_compute_posts_and_gaps() -> None:
    schedule = build_schedule("GPipe", 2, 1)  # stage 0 on rank 0, stage 1 on rank 1
    events = [
        _ev(0, "F", 0, 0, 0.0, 1.0),
        _ev(0, "SEND_F", 0, 0, 1.0, 1.1),
        _ev(0, "RECV_B", 0, 0, 1.1, 1.2),
        _ev(0, "B", 0, 0, 4.0, 6.0),  # waited for rank 1's gradient: a gap, not a ready one
        _ev(1, "RECV_F", 1, 0, 0.0, 0.2),
        _ev(1, "F", 1, 0, 1.5, 2.5),  # waited for rank 0's output
        _ev(1, "B", 1, 0, 2.75, 3.75),  # last stage: its input is its own, the 0.25 before it is the runtime's
        _ev(1, "SEND_B", 1, 0, 3.75, 3.8),
    ]
    terms = timeline_terms(Timeline(2, events, source="measured", unit="s"), schedule)
    r0, r1 = terms["ranks"]["0"], terms["ranks"]["1"]
    assert (r0["span"], r0["compute"], r0["posts"]) == pytest.approx((6.0, 3.0, 0.2))
    assert (r0["first_start"], r1["first_start"]) == (0.0, 0.0)
    assert r0["gaps"] == pytest.approx(2.8)
    assert (r1["compute"], r1["posts"], r1["actions"]) == pytest.approx((2.0, 0.25, 2))
    assert terms["ready_gap"] == pytest.approx(0.25)
    assert terms["send_post"] == pytest.approx(0.075)
    assert terms["recv_post"] == pytest.approx(0.15)


# ----------------------------------------------------------------------------- the plan's summary


def test_the_plans_summary_says_what_its_makespan_prices_and_leaves_out() -> None:
    apart = plan_pipeline(_layers(optimizer=0.5), 2, 4, None, comm=0.1, time_limit=1)
    terms = apart.summary()["makespan_terms"]
    assert terms == apart.step_terms()
    assert any("compute" in t for t in terms["prices"]) and any("comm 0.1" in t for t in terms["prices"])
    assert any("optimizer step (3.5 in all" in t for t in terms["leaves_out"])
    assert any("posting a message" in t for t in terms["leaves_out"])
    assert any("per action" in t for t in terms["leaves_out"])
    spread = plan_pipeline(with_optimizer(_layers(optimizer=0.5), 4), 2, 4, None, comm=0.1, time_limit=1)
    assert any("optimizer step where" in t for t in spread.step_terms()["prices"])
    assert not any("optimizer" in t for t in spread.step_terms()["leaves_out"])


def test_pipetrain_plan_prices_a_layers_files_optimizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pipetrain.cli import main

    path = tmp_path / "layers.json"
    write_layers(path, _layers(optimizer=0.5))
    main(["plan", "--layers", str(path), "-p", "1", "-m", "4", "--json", "--time-limit", "1"])
    summary = json.loads(capsys.readouterr().out)
    without = plan_pipeline(_layers(), 1, 4, None, time_limit=1).makespan
    assert summary["makespan"] == pytest.approx(without + 3.5)
    assert any("optimizer step where" in t for t in summary["makespan_terms"]["prices"])


# ----------------------------------------------------------------------------- profile_layers measures it


def test_profile_layers_times_each_layers_optimizer_step_and_none_for_a_layer_without_parameters() -> None:
    torch = pytest.importorskip("torch")
    from torch import nn

    from pipetrain import profile_layers

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    layers = profile_layers(
        model, torch.randn(4, 8), loss_fn=nn.functional.mse_loss, target=torch.zeros(4, 4), repeats=2
    )
    assert [layer.name for layer in layers] == ["0", "1", "2"]
    assert layers[0].optimizer > 0 and layers[2].optimizer > 0
    assert layers[1].optimizer == 0.0
    assert all(p.grad is None for p in model.parameters())  # timed on copies: the model is as it was
