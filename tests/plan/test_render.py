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
