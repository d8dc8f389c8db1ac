"""Timeline pictures, Chrome traces and the time-aligned text grid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipetrain.plan.costs import Costs
from pipetrain.plan.generators import build_schedule
from pipetrain.plan.render import format_time_grid, render_timeline, render_timelines
from pipetrain.plan.simulate import simulate
from pipetrain.plan.timeline import Timeline, TimelineEvent
from pipetrain.plan.trace import category, to_chrome_trace, write_chrome_trace


def test_text_grid_is_aligned_to_time() -> None:
    r = simulate(build_schedule("GPipe", 2, 2), Costs(f=1, b=2))
    grid = format_time_grid(r.timeline).splitlines()
    assert grid[0].split() == ["t/units", "0", "1", "2", "3", "4", "5", "6", "7", "8"]
    assert grid[1] == "rank 0  0F0 0F1 ... ... ... 0B0 --- 0B1 ---"
    assert grid[2] == "rank 1  ... 1F0 1F1 1B0 --- 1B1 --- ... ..."


def test_text_grid_tick_and_column_cap() -> None:
    r = simulate(build_schedule("1F1B", 2, 4), Costs(f=1, b=2))
    half = format_time_grid(r.timeline, tick=0.5).splitlines()
    assert half[1].split()[:3] == ["rank", "0", "0F0"]
    assert half[1].split()[3] == "---"  # F=1 spans two half-unit columns
    capped = format_time_grid(r.timeline, tick=0.01, max_columns=20).splitlines()
    assert all(len(row.split()) == 2 + 20 for row in capped[1:])  # "rank", "0", 20 cells
    times = [float(x) for x in capped[0].split()[1:]]
    assert times == sorted(times) and times[0] == 0.0
    assert format_time_grid(Timeline(2, [])) == "(empty timeline)"


def test_chrome_trace_categories_and_processes() -> None:
    s = build_schedule("DualPipeV", 2, 4, 2).lower()
    r = simulate(s, Costs(f=1, i=1, w=1, comm=0.5))
    trace = to_chrome_trace(r.timeline)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(r.timeline.events)
    by_kind: dict[str, set[str]] = {}
    for e in events:
        by_kind.setdefault(e["args"]["kind"], set()).add(e["cat"])
        assert e["pid"] in (0, 1) and e["dur"] >= 0
    for kind in ("F", "I", "W", "B", "OVERLAP_F_B"):
        if kind in by_kind:
            assert by_kind[kind] == {"compute"}, kind
    assert "I" in by_kind and "OVERLAP_F_B" in by_kind
    assert by_kind["SEND_F"] == {"communication"} and by_kind["RECV_B"] == {"communication"}
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    f0 = next(e for e in events if e["name"] == "0F0")
    assert (f0["ts"], f0["dur"]) == (0.0, 1000.0)
    assert category("REDUCE_GRAD") == "other"


def test_chrome_trace_measured_seconds_and_file(tmp_path: Path) -> None:
    tl = Timeline(1, [TimelineEvent(0, "0F0", "F", 0, 0, 10.0, 10.25)], source="measured", unit="s")
    trace = to_chrome_trace(tl)
    ev = next(e for e in trace["traceEvents"] if e["ph"] == "X")
    assert (ev["ts"], ev["dur"]) == (0.0, 250000.0)
    path = tmp_path / "t.json"
    write_chrome_trace(tl, path)
    assert json.loads(path.read_text())["traceEvents"]


def test_png_and_svg_pictures(tmp_path: Path) -> None:
    r = simulate(build_schedule("ZBVZeroBubble", 2, 4, 2), Costs(f=1, i=1, w=1))
    png, svg = tmp_path / "t.png", tmp_path / "t.svg"
    render_timeline(r.timeline, png)
    render_timeline(r.timeline, svg)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = svg.read_text()
    assert "<svg" in text
    assert "ZBVZeroBubble" in text and "makespan 25" in text  # title with sizes and numbers
    assert "weight grad" in text and "idle (bubble)" in text  # legend


def test_stacked_measured_and_simulated(tmp_path: Path) -> None:
    sim = simulate(build_schedule("1F1B", 2, 3), Costs(f=1, b=2)).timeline
    measured = Timeline(
        2,
        [
            TimelineEvent(e.rank, e.action, e.kind, e.stage, e.microbatch, 5 + e.start * 0.01, 5 + e.end * 0.011)
            for e in sim.events
        ],
        title="measured",
        source="measured",
        unit="s",
    )
    out = tmp_path / "both.svg"
    render_timelines([measured, sim], out, share_time_axis=False)
    text = out.read_text()
    assert "measured" in text and "time (s)" in text and "time (cost-model units)" in text
    with pytest.raises(ValueError):
        render_timelines([], tmp_path / "none.png")


def test_box_labels_name_stage_kind_and_microbatch() -> None:
    from pipetrain.plan.render import box_labels

    e = TimelineEvent(0, "12F3", "F", 12, 3, 0.0, 1.0)
    assert box_labels(e) == ["12F3", "12\nF3", "3"]
    pair = TimelineEvent(0, "(0F7;7B3)OVERLAP_F_B", "OVERLAP_F_B", 0, 7, 0.0, 3.0)
    assert box_labels(pair) == ["0F7|7B3", "0F7\n7B3", "7|3"]


def test_fit_label_prefers_the_whole_action() -> None:
    from pipetrain.plan.render import fit_label

    e = TimelineEvent(0, "12F3", "F", 12, 3, 0.0, 1.0)
    assert fit_label(e, 1.0, 0.3, 8.0) == ("12F3", 8.0)  # wide box: one line
    two = fit_label(e, 0.2, 0.3, 8.0)
    assert two is not None and two[0] == "12\nF3"  # narrow, tall enough for two lines
    assert fit_label(e, 0.2, 0.15, 8.0) == ("3", 8.0)  # too flat: the microbatch, stage left to the shade
    assert fit_label(e, 0.01, 0.3, 8.0) is None


def _drawn_labels(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every string drawn with Axes.text from now on (the box labels, the titles aside)."""
    from matplotlib.axes import Axes

    drawn: list[str] = []
    original = Axes.text

    def spy(self: Axes, x: float, y: float, s: str, *args: object, **kwargs: object) -> object:
        drawn.append(s)
        return original(self, x, y, s, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Axes, "text", spy)
    return drawn


@pytest.mark.parametrize(
    ("name", "v", "costs", "rule"),
    [
        ("Interleaved1F1B", 4, Costs(f=1, b=2), "4th stage of a rank (rank r: stage r+12)"),
        ("ZBVZeroBubble", 2, Costs(f=1, i=1, w=1), "2nd stage of a rank (rank r: stage 7-r)"),
        ("DualPipeV", 2, Costs(f=1, i=1, w=1), "2nd stage of a rank (rank r: stage 7-r)"),
    ],
)
def test_every_box_shows_its_stage_and_the_legend_every_shade(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, v: int, costs: Costs, rule: str
) -> None:
    timeline = simulate(build_schedule(name, 4, 10 if name == "DualPipeV" else 8, v), costs).timeline
    drawn = _drawn_labels(monkeypatch)
    out = tmp_path / "t.svg"
    render_timeline(timeline, out)
    compute = [e for e in timeline.events if e.kind in ("F", "B", "I", "W", "OVERLAP_F_B")]
    expected = sorted(e.action.removesuffix("OVERLAP_F_B").strip("()").replace(";", "|") for e in compute)
    assert sorted(s.replace("\n", "|" if "F" in s and "B" in s else "") for s in drawn[: len(compute)]) == expected
    svg = out.read_text()
    shades = v if name == "Interleaved1F1B" else 2
    for k, nth in enumerate(("1st", "2nd", "3rd", "4th")[:shades]):
        assert f"<!-- {nth} stage of a rank" in svg, k
    assert rule in svg
    for kind in (
        ("F forward", "B backward") if name == "Interleaved1F1B" else ("F forward", "I input grad", "W weight grad")
    ):
        assert f"<!-- {kind} -->" in svg


def test_one_stage_per_rank_needs_no_shade_legend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    timeline = simulate(build_schedule("1F1B", 4, 8), Costs(f=1, b=2)).timeline
    drawn = _drawn_labels(monkeypatch)
    out = tmp_path / "t.svg"
    render_timeline(timeline, out)
    assert "0F0" in drawn and "3B7" in drawn
    assert "stage of a rank" not in out.read_text()
