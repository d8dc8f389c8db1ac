"""What `pipetrain train` reports: progress lines, bubble, costs taken from a measured timeline."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipetrain.plan import build_schedule
from pipetrain.plan.costs import Costs
from pipetrain.plan.schedule import Schedule
from pipetrain.plan.timeline import Timeline, TimelineEvent
from pipetrain.train.outputs import bubble_fraction, write_outputs
from pipetrain.train.progress import StepReporter


def _ev(rank: int, action: str, kind: str, stage: int, start: float, end: float) -> TimelineEvent:
    return TimelineEvent(rank, action, kind, stage, 0, start, end)


def test_plain_progress_lines_when_not_a_terminal() -> None:
    stream = io.StringIO()
    reporter = StepReporter(12, title="1F1B × 2 ranks", stream=stream)
    reporter.update(0, 5.25, 1234.4)
    reporter.update(11, 2.5, 99.0)
    reporter.close()
    assert stream.getvalue().splitlines() == [
        "1F1B × 2 ranks",  # what the bar's label says on a terminal
        "step  1/12  loss 5.2500  1,234 tokens/s",
        "step 12/12  loss 2.5000  99 tokens/s",
    ]


def test_bubble_counts_only_compute() -> None:
    tl = Timeline(
        2,
        [_ev(0, "0F0", "F", 0, 0, 1), _ev(0, "0B0", "B", 0, 3, 4), _ev(1, "1F0", "F", 1, 1, 2),
         _ev(1, "1B0", "B", 1, 2, 3), _ev(1, "1SEND_B0", "SEND_B", 1, 3, 4)],
    )  # fmt: skip
    assert bubble_fraction(tl) == pytest.approx(1 - 4 / 8)
    assert bubble_fraction(Timeline(2, [])) == 0.0


def test_summary_files_from_a_measured_step(tmp_path: Path) -> None:
    plan = build_schedule("GPipe", 2, 2)
    events = []
    t = {0: 0.0, 1: 0.5}
    for rank in range(2):
        for a in plan.actions[rank]:
            if a is not None:
                events.append(TimelineEvent(rank, str(a), a.kind.value, a.stage, a.microbatch, t[rank], t[rank] + 0.5))
                t[rank] += 0.5
    measured = Timeline(2, events, source="measured", unit="s")
    result = SimpleNamespace(losses=[5.0, 4.0], step_times=[0.5, 0.25])
    cfg = SimpleNamespace(schedule="GPipe", steps=2, batch_size=4, model="tiny", device="cpu")
    files = write_outputs(tmp_path, plan, measured, result, cfg, tokens_per_step=128)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_loss"] == 4.0 and summary["tokens_per_s_last"] == 512
    assert summary["measured_step_s"] == pytest.approx(measured.makespan)
    assert str(tmp_path / "summary.md") in files
    assert "| measured |" in (tmp_path / "summary.md").read_text()
    assert Timeline.from_json(tmp_path / "measured_timeline.json").events == measured.events
    simulated = Timeline.from_json(tmp_path / "simulated_timeline.json")
    # Simulated with the measured per-stage costs (0.5 s each): GPipe's 2 × 2 makespan is 6 actions long.
    assert simulated.makespan == pytest.approx(summary["simulated_step_s"]) == pytest.approx(3.0)
    for name in ("measured_timeline.png", "simulated_timeline.png", "timelines.png", "measured_trace.json"):
        assert str(tmp_path / name) in files and (tmp_path / name).stat().st_size > 0
    trace = json.loads((tmp_path / "simulated_trace.json").read_text())
    assert {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"} == {str(a) for a in plan.iter_actions() if a}
    # The measured costs, as a string `pipetrain plan --costs` reads back (guide §4).
    costs = Costs.parse((tmp_path / "costs.txt").read_text())
    assert costs.f == costs.b == (0.5, 0.5) and costs.comm == 0.0
    assert summary["costs"] == (tmp_path / "costs.txt").read_text().strip()
    # The schedule it trained, as a file train --schedule takes.
    kept = Schedule.load(tmp_path / "schedule.json")
    assert kept.actions == plan.actions and kept.name == "GPipe"
    assert f"--schedule {tmp_path / 'schedule.json'}" in (tmp_path / "summary.md").read_text()
    assert "auto" not in summary


def test_ranks_of_one_machine_share_the_timeline_zero_and_strangers_do_not() -> None:
    """Ranks of one machine are measured from the earliest barrier exit among them (their clock is
    one); a rank whose exit is far from it (another machine under the same name) from its own."""
    from pipetrain.plan.timeline import TimelineEvent
    from pipetrain.train.loop import on_one_axis

    def event(rank: int, start: float) -> TimelineEvent:
        return TimelineEvent(rank, f"{rank}F0", "F", rank, 0, start, start + 0.001)

    parts = [
        ("a/1", 100.0, False, [event(0, 100.0002)]),
        ("a/1", 100.0003, False, [event(1, 100.0005)]),
        ("a/1", 50_000.0, False, [event(2, 50_000.0001)]),  # same name, another clock
        ("b/2", 7.0, True, [event(3, 0.25)]),  # already relative to the step's start
    ]
    starts = {e.rank: e.start for e in on_one_axis(parts)}
    assert starts[0] == pytest.approx(0.0002, abs=1e-9) and starts[1] == pytest.approx(0.0005, abs=1e-9)
    assert starts[2] == pytest.approx(0.0001, abs=1e-6) and starts[3] == 0.25


def test_a_measured_step_without_a_plain_forward_still_leaves_its_summary(tmp_path: Path) -> None:
    """(A custom schedule whose every F sits inside an OVERLAP_F_B, say.) No costs to take from it:
    no costs.txt and no simulation, but the summary and the schedule are written."""
    plan = build_schedule("GPipe", 2, 2)
    measured = Timeline(2, [TimelineEvent(0, "0W0", "W", 0, 0, 0.0, 0.5)], source="measured", unit="s")
    result = SimpleNamespace(losses=[5.0, 4.0], step_times=[0.5, 0.25])
    cfg = SimpleNamespace(schedule="GPipe", steps=2, batch_size=4, model="tiny", device="cpu")
    write_outputs(tmp_path, plan, measured, result, cfg, tokens_per_step=128)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["costs"].startswith("not measured: ") and "forward" in summary["costs"]
    assert not (tmp_path / "costs.txt").exists() and "simulated_step_s" not in summary
    assert (tmp_path / "schedule.json").exists()
