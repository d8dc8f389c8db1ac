"""``pipetrain simulate`` and ``pipetrain compare``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipetrain.cli import main
from pipetrain.cli.sim_cmds import compare_rows
from pipetrain.plan import Action, Schedule
from pipetrain.plan.costs import Costs
from pipetrain.plan.generators import build_schedule, schedule_names
from pipetrain.plan.simulate import simulate


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_simulate_prints_summary(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "simulate", "1F1B", "--ranks", "4", "--microbatches", "8", "--costs", "f=1,b=2")
    assert code == 0
    assert "makespan 33 (lower bound 33), bubble 27.3%" in out
    assert "   3        24         9            1         3" in out  # rank 3: busy, idle, peak, when


def test_every_peak_says_its_unit_and_plan_counts_as_simulate(capsys: pytest.CaptureFixture[str]) -> None:
    """simulate's 8 stage activations for ZB-V are plan's and compare's 4 (microbatches of a rank's share)."""
    code, out, _ = run(capsys, "simulate", "ZBVZeroBubble", "-p", "4", "-m", "8", "--costs", "f=1,b=2")
    assert code == 0
    assert "peak 8 stage activations = 4 microbatches of a rank's share" in out.splitlines()[0]
    assert "rank      busy      idle   stage act.  rank shares   at time" in out
    assert "   0        24       1.5            8            4       3.5" in out
    assert "ZB-V's 8 stage act. on 2 stages per rank are 4 rank shares" in out
    code, out, _ = run(capsys, "compare", "-p", "4", "-m", "8")
    header = next(line for line in out.splitlines() if line.startswith("| schedule"))
    assert "| peak stage activations per rank | peak (microbatches of a rank's share) |" in header
    assert "| ZBVZeroBubble | 8 | 25.5 | 5.9% | 0.77 | 8 8 8 8 | 4 | 96 |" in out
    code, out, _ = run(capsys, "plan", "-p", "4", "-m", "8", "--costs", "f=1,b=2", "--time-limit", "0.3")
    assert code == 0
    assert "stage act.  rank shares  fits" in out
    zbv = next(line for line in out.splitlines() if line.startswith("  ZBVZeroBubble")).split()
    assert zbv[4:6] == ["8", "4"]  # v, makespan, bubble, then the peak as simulate and as plan count it
    code, out, _ = run(capsys, "simulate", "ZBVZeroBubble", "-p", "4", "-m", "8", "--costs", "f=1,b=2", "--json")
    data = json.loads(out)
    assert data["peak_memory"]["0"] == 8 and data["peak_memory_rank_shares"]["0"] == 4
    assert data["units"]["peak_memory"] == "stage activations"
    assert data["units"]["peak_memory_rank_shares"].startswith("microbatches of a rank's share")
    rows, _ = compare_rows(4, 8, None, Costs.per_rank(f=1, b=2))
    assert rows[0]["units"]["peak_activations"] == "stage activations"


def test_simulate_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "simulate", "zbvzerobubble", "-p", "4", "-m", "8", "--costs", "f=1,i=1,w=1,comm=0.5", "--json"
    )
    assert code == 0
    data = json.loads(out)
    # Plain numbers are one rank's share: ZB-V's two stages per rank take half each.
    expect = simulate(build_schedule("ZBVZeroBubble", 4, 8), Costs(f=0.5, i=0.5, w=0.5, comm=0.5))
    assert data["makespan"] == expect.makespan
    assert data["peak_memory"] == {str(r): v for r, v in expect.peak_memory.items()}
    assert data["schedule"] == "ZBVZeroBubble" and data["costs"] == str(expect.costs)
    assert data["costs_given"] == "f=1,b=2,i=1,w=1,comm=0.5"


@pytest.mark.parametrize("costs", ["f=1,b=2", "f=1,i=1,w=1,comm=0.5,bytes=10", "f=1:1:2:1:1:1:1:1,b=2,comm=0.1"])
def test_costs_mean_the_same_in_simulate_compare_and_plan(capsys: pytest.CaptureFixture[str], costs: str) -> None:
    """DESIGN §4: --costs means the same thing in every command. simulate's makespan of each
    schedule is compare's row for it, and plan's line for it."""
    code, out, _ = run(capsys, "compare", "-p", "4", "-m", "8", "--costs", costs, "--json")
    assert code == 0
    rows = {row["schedule"]: row for row in json.loads(out) if "makespan" in row}
    per_stage = ":" in costs
    code, plan_out, _ = run(
        capsys, "plan", "-p", "4", "-m", "8", "--costs", costs, "--time-limit", "0.5", "--top", "20"
    )
    assert code == 0
    planned = {  # "  Name v makespan bubble memory fits"
        (cells[0], int(cells[1])): float(cells[2])
        for cells in (line.split() for line in plan_out.splitlines() if line.startswith("  ") and "%" in line)
    }
    simulated, in_plan = 0, 0
    for name, row in rows.items():
        if per_stage and row["stages"] != 8:
            continue  # (eight per-stage values fix eight stages)
        code, out, _ = run(capsys, "simulate", name, "-p", "4", "-m", "8", "--costs", costs, "--json")
        assert code == 0, name
        assert json.loads(out)["makespan"] == row["makespan"], name
        key = (name, row["stages"] // 4)
        simulated += 1
        if key in planned:
            assert f"{planned[key]:.4g}" == f"{row['makespan']:.4g}", name
            in_plan += 1
    assert simulated >= (5 if per_stage else 9) and in_plan >= (5 if per_stage else 8)


def test_stages_spread_unevenly_take_plain_costs_per_stage(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Two stages on rank 0, one on rank 1: no whole number of stages per rank to cut a rank's
    share into, so simulate (like compare) takes plain costs per stage, and says nothing of shares."""
    s = Schedule(
        {0: [Action.parse(a) for a in "0F0 1F0 1B0 0B0".split()], 1: [Action.parse(a) for a in "2F0 2B0".split()]}
    )
    path = tmp_path / "uneven.csv"
    s.to_csv(path)
    code, out, _ = run(capsys, "simulate", str(path), "--costs", "f=1,b=2,comm=0.5", "--json")
    assert code == 0
    assert json.loads(out)["makespan"] == simulate(s, Costs(f=1, b=2, comm=0.5)).makespan
    code, out, _ = run(capsys, "simulate", str(path), "--costs", "f=1,b=2")
    assert code == 0 and "share" not in out


def test_simulate_says_plain_costs_are_a_ranks_share(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "simulate", "ZBVZeroBubble", "-p", "4", "-m", "8", "--costs", "f=1,b=2")
    assert code == 0
    assert "costs: f=1,b=2,i=1,w=1,comm=0 for one rank's share of the model, so each of its 2 stages takes " in out
    assert "makespan 25.5" in out
    code, out, _ = run(capsys, "simulate", "1F1B", "-p", "4", "-m", "8", "--costs", "f=1,b=2")
    assert code == 0
    assert "costs: f=1,b=2,i=1,w=1,comm=0\n" in out
    assert "share" not in out  # one stage per rank: the share is the stage


def test_simulate_lowered_csv_file_and_outputs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    csv = tmp_path / "s.csv"
    build_schedule("Interleaved1F1B", 2, 4, 2).to_csv(csv)
    trace, svg = tmp_path / "t.json", tmp_path / "t.svg"
    code, out, _ = run(capsys, "simulate", str(csv), "--lowered", "--trace", str(trace), "--svg", str(svg), "--grid")
    assert code == 0
    assert "(lowered schedule)" in out
    assert "rank 1" in out and "t/units" in out  # the grid
    kinds = {e["args"]["kind"] for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"}
    assert {"F", "B", "SEND_F", "RECV_B"} <= kinds
    assert svg.read_text().startswith("<?xml")


def test_simulate_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "simulate", "NoSuch", "-p", "2", "-m", "2")
    assert code == 1 and "unknown schedule 'NoSuch'" in err and "Traceback" not in err
    code, _, err = run(capsys, "simulate", "GPipe", "-p", "2", "-m", "2", "--costs", "f=-1")
    assert code == 1 and "cost f must be a finite number >= 0" in err
    code, _, err = run(capsys, "simulate", "GPipe", "-p", "2", "-m", "2", "--costs", "f=1:2:3")
    assert code == 1 and "3 per-stage values, but the schedule has 2 stages" in err


def test_simulate_refuses_a_broken_file_naming_it(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "broken.csv"
    path.write_text("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1,1F1\n")
    code, out, err = run(capsys, "simulate", str(path))
    assert code == 1 and out == ""
    assert f"{path}: rank 1, step 4, action 1F1: duplicate 1F1" in err and "Traceback" not in err


def test_compare_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "compare", "--ranks", "4", "--microbatches", "8")
    assert code == 0
    lines = [ln for ln in out.splitlines() if ln.startswith("| ")]
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]] for ln in lines[1:]}
    assert set(rows) == set(schedule_names())  # every schedule accepts p=4, m=8
    assert rows["1F1B"][:4] == ["4", "33", "27.3%", "1.00"]
    assert rows["1F1B"][4] == "4 3 2 1"
    assert rows["ZBH1"][1] == "27"
    assert int(rows["GPipe"][6]) == 2 * 8 * 3  # a SEND per forward and per backward between ranks


def test_compare_scales_costs_by_stages_per_rank() -> None:
    rows, results = compare_rows(4, 8, None, Costs(f=1, b=2))
    by_name = {r["schedule"]: r for r in rows}
    # the same model: total work per rank is the same for one and for two stages per rank
    for res in results:
        assert sum(res.busy.values()) == pytest.approx(
            sum(results[0].busy.values()) * (1 / 3 if res.schedule_name == "ForwardOnly" else 1)
        )
    assert by_name["ZBVZeroBubble"]["stages"] == 8
    assert (
        by_name["ZBVZeroBubble"]["peak_activations_model_share"]
        == max(by_name["ZBVZeroBubble"]["peak_activations"]) / 2
    )
    assert by_name["1F1B"]["vs_1f1b"] == 1.0


def test_compare_png_and_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "all.png"
    code, out, _ = run(capsys, "compare", "-p", "2", "-m", "4", "-v", "2", "--png", str(png), "--json")
    assert code == 0
    rows = json.loads(out)
    assert rows and all(r["stages"] == 4 for r in rows)  # only schedules that take 2 stages per rank
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_compare_no_schedule_fits(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "compare", "-p", "0", "-m", "4")
    assert code == 1 and "no schedule accepts" in err


@pytest.mark.parametrize(
    ("flag", "name", "written", "magic"),
    [
        ("--png", "noext", "noext.png", b"\x89PNG"),
        ("--svg", "noext", "noext.svg", b"<?xml"),
        ("--png", "t.png", "t.png", b"\x89PNG"),
        ("--png", "T.PNG", "T.PNG", b"\x89PNG"),
        ("--svg", "t.svg", "t.svg", b"<?xml"),
    ],
)
def test_picture_format_follows_the_flag_and_the_written_path_is_printed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flag: str, name: str, written: str, magic: bytes
) -> None:
    code, out, _ = run(capsys, "simulate", "1F1B", "-p", "2", "-m", "2", flag, str(tmp_path / name))
    assert code == 0
    assert out.splitlines()[-1] == f"wrote timeline {tmp_path / written}"
    assert (tmp_path / written).read_bytes().startswith(magic)
    assert [p.name for p in tmp_path.iterdir()] == [written]


@pytest.mark.parametrize(
    ("flag", "name", "expected"),
    [
        ("--svg", "as.png", "the name ends in .png but --svg writes SVG; name it {dir}/as.svg"),
        ("--png", "as.svg", "the name ends in .svg but --png writes PNG; name it {dir}/as.png"),
        ("--png", "x.xyz", "the name ends in .xyz but --png writes PNG; name it {dir}/x.png"),
    ],
)
def test_picture_name_that_contradicts_the_flag_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flag: str, name: str, expected: str
) -> None:
    path = tmp_path / name
    code, out, err = run(capsys, "simulate", "1F1B", "-p", "2", "-m", "2", flag, str(path))
    assert code == 1 and out == ""
    assert err.strip() == f"pipetrain simulate: error: {flag} {path}: " + expected.format(dir=tmp_path)
    assert not any(tmp_path.iterdir())
    code, _, err = run(capsys, "compare", "-p", "2", "-m", "2", "--png", str(tmp_path / "all.svg"))
    assert code == 1 and "the name ends in .svg but --png writes PNG" in err


def test_compare_png_without_extension(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = run(capsys, "compare", "-p", "2", "-m", "2", "--png", str(tmp_path / "all"))
    assert code == 0 and out.splitlines()[-1] == f"wrote {tmp_path / 'all.png'}"
    assert (tmp_path / "all.png").read_bytes()[:4] == b"\x89PNG"


def test_picture_help_says_how_names_are_treated(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "a name without an extension gets .png; one with another extension is refused" in text
    assert "a name without an extension gets .svg; one with another extension is refused" in text


def test_unknown_picture_format_in_the_library_is_a_schedule_error(tmp_path: Path) -> None:
    from pipetrain.plan.errors import ScheduleError
    from pipetrain.plan.render import render_timeline

    timeline = simulate(build_schedule("1F1B", 2, 2)).timeline
    with pytest.raises(ScheduleError, match=r"cannot write .*x\.xyz: 'xyz' is not a picture format"):
        render_timeline(timeline, tmp_path / "x.xyz")
    assert render_timeline(timeline, tmp_path / "plain") == str(tmp_path / "plain.png")
    assert render_timeline(timeline, tmp_path / "forced.png", format="svg") == str(tmp_path / "forced.png")
    assert (tmp_path / "forced.png").read_text().startswith("<?xml")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("-v", "0"), "--stages-per-rank must be >= 1, got 0"),
        (("--memory-limit", "-1"), "--memory-limit must be a finite number >= 0, got -1"),
        (("--memory-limit", "nan"), "--memory-limit must be a finite number >= 0, got nan"),
        (("--memory-limit", "inf"), "--memory-limit must be a finite number >= 0, got inf"),
        (("-m", "0"), "--microbatches must be >= 1, got 0"),
        (("--time-limit", "0"), "--time-limit must be a finite number of seconds > 0, got 0"),
        (("--time-limit", "nan"), "--time-limit must be a finite number of seconds > 0, got nan"),
        (("--time-limit", "inf"), "--time-limit must be a finite number of seconds > 0, got inf"),
    ],
)
def test_plan_rejects_bad_numbers(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str) -> None:
    code, out, err = run(capsys, "plan", "-p", "2", "-m", "4", *argv)
    assert code == 1 and out == ""
    assert err.strip() == f"pipetrain plan: error: {message}"


@pytest.mark.parametrize(("placement", "label"), [("v", "(V placement)"), ("loop", "(loop placement)")])
def test_plan_placement_alone_plans_two_stages_per_rank(
    capsys: pytest.CaptureFixture[str], placement: str, label: str
) -> None:
    code, out, _ = run(capsys, "plan", "-p", "4", "-m", "8", "--placement", placement, "--time-limit", "0.3")
    assert code == 0
    chosen = next(line for line in out.splitlines() if line.startswith("->"))
    assert chosen.split()[1] == "2" and chosen.endswith(label), chosen


def test_compare_rejects_zero_stages_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "compare", "-p", "2", "-m", "4", "-v", "0")
    assert code == 1 and err.strip() == "pipetrain compare: error: --stages-per-rank must be >= 1, got 0"


def test_rank_schedules_checks_its_arguments() -> None:
    from pipetrain.plan.errors import ScheduleError
    from pipetrain.plan.search import rank_schedules

    with pytest.raises(ScheduleError, match="stages_per_rank must be an integer >= 1, got 0"):
        rank_schedules(2, 4, Costs(), stages_per_rank=0)
    with pytest.raises(ScheduleError, match="memory_limit must be a finite number >= 0, got nan"):
        rank_schedules(2, 4, Costs(), float("nan"))


def test_zero_costs_still_hold_activations(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "simulate", "1F1B", "-p", "2", "-m", "4", "--costs", "f=0,b=0")
    assert code == 0
    assert "   0         0         0            2         0" in out  # rank 0 holds 2 microbatches, as with f=1,b=2


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\xff\xfe", "not a UTF-8 text file"),
        (b"", "holds no measured forward times (f=...)"),
        (b"comm=0.001", "holds no measured forward times (f=...)"),
    ],
    ids=["binary", "empty", "no-f"],
)
def test_plan_refuses_a_costs_file_without_costs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, content: bytes, message: str
) -> None:
    """A profile that is not text, or holds no forward times, is refused in one line (it used to
    be a traceback, or a plan for the default costs)."""
    path = tmp_path / "costs.txt"
    path.write_bytes(content)
    code, out, err = run(capsys, "plan", "-p", "2", "-m", "4", "--from-profile", str(path))
    assert code == 1 and out == ""
    assert err.strip().startswith(f"pipetrain plan: error: --from-profile {path}: {message}")
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("command", ["simulate", "compare", "plan"])
def test_every_costs_command_reads_a_costs_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str
) -> None:
    """simulate, compare and plan take ``--from-profile FILE`` alike (# lines and blank lines
    skipped, lines joined), and give what ``--costs`` with the same text gives."""
    path = tmp_path / "costs.txt"
    path.write_text("# measured by hand\nf=1:1:1.5:1,b=2:2:3:2\n\ncomm=0.1\n")
    spec = "f=1:1:1.5:1,b=2:2:3:2,comm=0.1"
    sizes = ["ZBVZeroBubble", "-p", "2", "-m", "4"] if command == "simulate" else ["-p", "2", "-m", "4"]
    extra = ["--time-limit", "0.5"] if command == "plan" else []
    code, from_file, _ = run(capsys, command, *sizes, *extra, "--from-profile", str(path))
    assert code == 0
    code, from_spec, _ = run(capsys, command, *sizes, *extra, "--costs", spec)
    assert code == 0
    if command != "plan":  # (plan's search is timed: its construction may differ run to run)
        assert from_file == from_spec
    assert "1.5" in from_file
    with pytest.raises(SystemExit):
        run(capsys, command, *sizes, "--from-profile", str(path), "--costs", spec)
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_profile_for_other_stages_is_named_with_its_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "costs.txt"
    path.write_bytes(b"\xef\xbb\xbf" + b"f=1:1:1:1,b=2:2:2:2\n")  # with a UTF-8 BOM, as Notepad writes
    code, out, err = run(capsys, "simulate", "1F1B", "-p", "2", "-m", "4", "--from-profile", str(path))
    assert code == 1 and out == ""
    assert f"--from-profile {path}: cost f gives 4 per-stage values, but the schedule has 2 stages" in err, err
    assert "-v" in err
    assert (
        run(capsys, "simulate", "Interleaved1F1B", "-p", "2", "-m", "4", "-v", "2", "--from-profile", str(path))[0] == 0
    )


def test_per_stage_costs_of_different_lengths_are_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "costs.txt"
    path.write_text("f=1:1:1,b=2:2:2:2\n")
    code, out, err = run(capsys, "plan", "-p", "2", "-m", "4", "--from-profile", str(path))
    assert code == 1 and out == ""
    assert f"--from-profile {path}" in err and "f 3, b 4 values" in err, err


def test_plan_says_what_its_memory_is_in_stage_activations_for_per_stage_costs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With per-stage costs too (as --from-profile gives), the memory printed in a rank's share is
    translated into the stage activations `pipetrain simulate` prints."""
    code, out, _ = run(
        capsys, "plan", "-p", "2", "-m", "4", "--costs", "f=1:1:1:1,b=2:2:2:2", "--memory-limit", "1.5",
        "--time-limit", "0.3",
    )  # fmt: skip
    assert code == 0
    chosen = next(line for line in out.splitlines() if line.startswith("->")).split()
    assert chosen[1] == "2" and chosen[4:6] == ["3", "1.5"]  # v, ..., stage activations, rank shares
    assert "stage act.  rank shares  fits" in out


def test_compare_says_whether_its_costs_are_per_stage(capsys: pytest.CaptureFixture[str]) -> None:
    """Plain numbers are a rank's share, cut per stage; with any ':' value all are per stage."""
    code, out, _ = run(capsys, "compare", "-p", "2", "-m", "4", "-v", "2", "--costs", "f=0.5:0.5:0.5:0.5,b=2")
    assert code == 0 and out.splitlines()[0].endswith("per stage, 2 stages per rank")
    code, out, _ = run(capsys, "compare", "-p", "2", "-m", "4", "--costs", "f=0.5,b=2")
    assert code == 0 and out.splitlines()[0].endswith("per rank's share of the model")
