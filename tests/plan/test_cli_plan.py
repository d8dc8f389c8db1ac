"""``pipetrain show / export / validate``: output, files, and one-line errors with exit code 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipetrain.cli import main
from pipetrain.plan import Schedule, ScheduleError, build_schedule


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_show_prints_the_grid(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "show", "1F1B", "--ranks", "2", "--microbatches", "3")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("1F1B: 2 ranks, 2 stages, 3 microbatches")
    assert lines[1].split() == ["step", "rank", "0", "rank", "1"]
    assert build_schedule("1F1B", 2, 3).format() in out


def test_show_lowered_and_passes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "show", "ZBVZeroBubble", "-p", "2", "-m", "4", "--lowered")
    assert code == 0 and "(lowered)" in out and "SEND_F" in out and "UNSHARD" not in out
    code, out, _ = run(capsys, "show", "ZBH1", "-p", "2", "-m", "4", "--fsdp", "--grad-reduce", "--prefetch", "0")
    assert code == 0 and "UNSHARD" in out and "REDUCE_GRAD" in out and "RECV_B" in out
    # ZB-V alternates a rank's two stages: one gather per stage by default, many at one stage at a time.
    _, default, _ = run(capsys, "show", "ZBVZeroBubble", "-p", "2", "-m", "4", "--fsdp")
    _, tight, _ = run(capsys, "show", "ZBVZeroBubble", "-p", "2", "-m", "4", "--fsdp", "--max-unsharded", "1")
    assert default.count("UNSHARD") == 4 < tight.count("UNSHARD")


def test_export_csv_and_json_round_trip(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    csv_path, json_path = tmp_path / "s.csv", tmp_path / "s.json"
    code, out, _ = run(capsys, "export", "Interleaved1F1B", "-p", "2", "-m", "5", "-v", "2", "--csv", str(csv_path))
    assert code == 0 and str(csv_path) in out
    assert Schedule.from_csv(csv_path).actions == build_schedule("Interleaved1F1B", 2, 5, 2).actions
    code, _, _ = run(capsys, "export", "GPipe", "-p", "3", "-m", "2", "--lowered", "--json", str(json_path))
    assert code == 0
    assert Schedule.from_json(json_path) == build_schedule("GPipe", 3, 2).lower()


def test_validate_good_files(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "good.csv"
    build_schedule("ZBH1", 3, 6).lower().to_csv(path)
    code, out, _ = run(capsys, "validate", str(path))
    assert code == 0
    assert out.strip() == f"{path}: valid lowered schedule, 3 ranks, 3 stages, 6 microbatches"


def test_validate_matching_models(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Early receives run under gloo's matching, and deadlock under NCCL's strict group order."""
    from pipetrain.plan.passes.early_recv import post_receives_early

    path = tmp_path / "early.csv"
    post_receives_early(build_schedule("1F1B", 2, 4).lower(), 4).to_csv(path)
    code, out, _ = run(capsys, "validate", str(path), "--matching", "gloo")
    assert code == 0
    assert out.strip() == f"{path}: valid lowered (gloo matching) schedule, 2 ranks, 2 stages, 4 microbatches"
    code, _, err = run(capsys, "validate", str(path))
    assert code == 1
    assert "rank 0, step 8, action 0B0: deadlock: waits for its 0RECV_B0 (step 0)" in err


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("0F0,0B0,0F1\n1F0,1B0,1F1,1B1\n", "rank 0, step 2, action 0F1: has no backward"),
        ("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n", "rank 0, step 1, action 0B0: deadlock"),
        ("0F0,0F0abc\n", "rank 0, step 1: cannot parse action '0F0abc'"),
    ],
)
def test_validate_bad_file_exits_1_with_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str, expected: str
) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(content)
    code, out, err = run(capsys, "validate", str(path))
    assert code == 1
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert err.startswith(f"pipetrain validate: error: {path}: ")
    assert expected in err


def test_errors_are_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for argv, expected in [
        (("show", "NoSuchSchedule", "-p", "2", "-m", "2"), "unknown schedule 'NoSuchSchedule'"),
        (("show", "GPipe", "-p", "0", "-m", "2"), "num_ranks must be an integer >= 1"),
        (("show", "GPipe"), "needs --ranks and --microbatches"),
        (("validate", str(tmp_path / "missing.csv")), "cannot read"),
        (("show", "GPipe", "-p", "2", "-m", "2", "--fsdp", "--prefetch", "-1"), "prefetch"),
    ]:
        code, _, err = run(capsys, *argv)
        assert code == 1, argv
        assert len(err.strip().splitlines()) == 1, err
        assert expected in err


def test_no_traceback_from_the_console(tmp_path: Path) -> None:
    path = tmp_path / "broken.csv"
    path.write_text("0F0,0SEND_F0\n1F0\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pipetrain", "validate", str(path)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"pipetrain validate: error: {path}: rank 1, step 0, action 1F0: needs the output of 0F0 from rank 0, but no "
        "1RECV_F0 comes before it (the 0SEND_F0 at step 1 on rank 0 has no matching RECV)"
    ]


def test_unreadable_file_is_named_once(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "binary.csv"
    path.write_bytes(b"\xff\xfe\x00garbage")
    for command in ("validate", "show"):
        code, out, err = run(capsys, command, str(path))
        assert code == 1 and out == ""
        assert err.strip() == f"pipetrain {command}: error: {path}: not a UTF-8 text file (invalid start byte)"


def test_huge_microbatch_in_a_file_is_a_one_line_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "huge.csv"
    path.write_text("0F0,0B0,0F30000000\n")
    for argv in (("validate", str(path)), ("simulate", str(path)), ("show", str(path), "--lowered")):
        code, out, err = run(capsys, *argv)
        assert code == 1 and out == "", argv
        assert err.strip().splitlines() == [
            f"pipetrain {argv[0]}: error: {path}: rank 0, step 2, action 0F30000000: microbatch 30000000 implies "
            "30000001 microbatches, but stage 0 has no forward 0F1; microbatches must be numbered 0..M-1 without "
            "gaps, with an F on every stage for each"
        ]


@pytest.mark.parametrize("flags", [("--fsdp",), ("--grad-reduce",), ("--merge-iw",), ("--grad-reduce", "--fsdp")])
def test_passes_on_an_already_lowered_file_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flags: tuple[str, ...]
) -> None:
    path = tmp_path / "low.csv"
    build_schedule("1F1B", 2, 3).lower().to_csv(path)
    for command in (("show",), ("export", "--json", str(tmp_path / "out.json"))):
        code, out, err = run(capsys, command[0], str(path), *command[1:], *flags)
        assert code == 1 and out == ""
        assert err.strip() == (
            f"pipetrain {command[0]}: error: {path} is already lowered, so {' and '.join(flags)} cannot be applied; "
            "give a compute-only schedule (a name, or a file without SEND/RECV)"
        )
    assert not (tmp_path / "out.json").exists()
    # --lowered alone asks for nothing the file lacks
    code, out, _ = run(capsys, "show", str(path), "--lowered")
    assert code == 0 and "(lowered)" in out


def test_a_bad_option_shows_the_sub_command_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["show", "1F1B", "-p", "2", "-m", "2", "-x"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: pipetrain show ") and "pipetrain show: error: unrecognized arguments: -x" in err


def test_a_closed_pipe_is_not_an_error() -> None:
    """`pipetrain show … | head`: no 'Broken pipe' message when the reader stops early."""
    proc = subprocess.run(
        f"{sys.executable} -m pipetrain show ZBVZeroBubble -p 16 -m 512 | head -1",
        shell=True,
        capture_output=True,
        text=True,
        check=True,
    )
    assert proc.stdout.startswith("ZBVZeroBubble: 16 ranks") and proc.stderr == ""


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["export", "1F1B", "-p", "2", "-m", "2", "--csv", "{d}/x.json"], "--csv {d}/x.json: the name ends in .json but --csv writes CSV; name it {d}/x.csv"),
        (["export", "1F1B", "-p", "2", "-m", "2", "--json", "{d}/x.csv"], "--json {d}/x.csv: the name ends in .csv but --json writes JSON"),
        (["plan", "-p", "2", "-m", "4", "--csv", "{d}/x.json"], "--csv {d}/x.json: the name ends in .json"),
        (["simulate", "1F1B", "-p", "2", "-m", "2", "--trace", "{d}/t.png"], "--trace {d}/t.png: the name ends in .png but --trace writes JSON"),
        (["show", "ZBVZeroBubble", "-p", "4", "-m", "8", "--prefetch", "2"], "--prefetch sets how far FSDP unshards ahead; it needs --fsdp"),
        (["show", "ZBVZeroBubble", "-p", "4", "-m", "8", "--max-unsharded", "1"], "--max-unsharded sets how many stages FSDP keeps gathered; it needs --fsdp"),
    ],
)  # fmt: skip
def test_output_names_and_flags_that_would_be_ignored_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _, err = run(capsys, *(a.format(d=tmp_path) for a in argv))
    assert code == 1 and message.format(d=tmp_path) in err
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


def test_export_without_an_extension_adds_it(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = run(capsys, "export", "1F1B", "-p", "2", "-m", "2", "--json", str(tmp_path / "s"))
    assert code == 0 and out.strip() == f"wrote {tmp_path / 's.json'}"
    assert Schedule.load(tmp_path / "s.json") == build_schedule("1F1B", 2, 2)


def test_size_flags_that_contradict_a_file_are_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "s.csv"
    build_schedule("Interleaved1F1B", 2, 4, 2).to_csv(path)
    code, _, err = run(capsys, "simulate", str(path), "-p", "4", "-m", "3")
    assert code == 1 and f"--ranks 4 contradicts {path}, a schedule of 2 ranks (leave --ranks out)" in err
    code, _, err = run(capsys, "show", str(path), "-v", "1")
    assert code == 1 and "--stages-per-rank 1 contradicts" in err and "2 stages per rank" in err
    code, out, _ = run(capsys, "show", str(path), "-p", "2", "-m", "4", "-v", "2")  # agreeing flags are fine
    assert code == 0 and "2 ranks, 4 stages, 4 microbatches" in out


def test_a_csv_named_json_gets_a_hint(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text(build_schedule("1F1B", 2, 2).to_csv_text())
    code, _, err = run(capsys, "validate", str(path))
    assert code == 1 and "malformed schedule JSON" in err and "is it a CSV file named .json?" in err


def test_a_stray_largest_microbatch_names_its_action(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """torch 2.13's 1F1B order as its CSV writer gives it: the last rank runs one F too many."""
    path = tmp_path / "t.csv"
    path.write_text("0F0,0F1,0F2,0F3,0B0,0B1,0B2,0B3\n1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3,1F4\n")
    code, _, err = run(capsys, "validate", str(path))
    assert code == 1
    assert (
        f"{path}: rank 0: stage 0 microbatch 4 has no forward 0F4 (the schedule has 5 microbatches because "
        "rank 1, step 8, action 1F4 names microbatch 4)"
    ) in err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import pipetrain

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"pipetrain {pipetrain.__version__}"


def _commands() -> dict[str, str]:
    """Each sub-command and its --help text."""
    import argparse

    from pipetrain.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: p.format_help() for name, p in sub.choices.items()}


def test_every_command_has_a_description_line() -> None:
    for name, text in _commands().items():
        # argparse puts the description after the usage block, before the arguments
        body = text.split("\n\n")
        assert len(body) > 2 and not body[1].lstrip().startswith(("positional arguments", "options")), name
        assert body[1].strip()[0].isupper(), (name, body[1])


def test_the_readme_lists_every_command() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    for name in _commands():
        assert f"pipetrain {name}" in readme, f"README never shows `pipetrain {name}`"


@pytest.mark.parametrize(
    ("typed", "meant"),
    [("ZBVZeroBuble", "ZBVZeroBubble"), ("interleaved1f1c", "Interleaved1F1B"), ("GPipes", "GPipe")],
)
def test_a_mistyped_schedule_name_gets_a_suggestion(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, typed: str, meant: str
) -> None:
    hint = f"unknown schedule {typed!r}; did you mean {meant!r}?"
    with pytest.raises(ScheduleError) as caught:
        build_schedule(typed, 4, 8)
    assert hint in str(caught.value)
    for command, *more in (("show",), ("simulate",), ("export", "--csv", str(tmp_path / "s.csv"))):
        code, _, err = run(capsys, command, typed, "-p", "4", "-m", "8", *more)
        assert code == 1 and hint in err, (command, err)
    # far from every name: no guess, the list of names as before
    with pytest.raises(ScheduleError, match=r"unknown schedule 'xyz' \(known schedules: GPipe, 1F1B"):
        build_schedule("xyz", 4, 8)


def test_the_runtime_suggests_a_schedule_class_too() -> None:
    pytest.importorskip("torch")
    from pipetrain.schedules import get_schedule_class

    with pytest.raises(ValueError, match=r"unknown schedule 'ZBVZeroBuble'; did you mean 'ZBVZeroBubble'\?"):
        get_schedule_class("ZBVZeroBuble")
    with pytest.raises(ValueError, match=r"did you mean 'ScheduleZBVZeroBubble'\?"):
        get_schedule_class("ScheduleZBVZeroBuble")


@pytest.mark.parametrize("ext", ["json", "csv"])
def test_a_layers_file_given_as_a_profile_points_at_plan_layers(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, ext: str
) -> None:
    from pipetrain.plan import LayerCost, write_layers

    path = tmp_path / f"layers.{ext}"
    write_layers(path, [LayerCost("a", f=1, i=1, w=1), LayerCost("b", f=1, i=1, w=1)])
    code, _, err = run(capsys, "simulate", "1F1B", "--ranks", "2", "--microbatches", "4", "--from-profile", str(path))
    assert code == 1 and "per-layer file" in err and "pipetrain plan --layers FILE" in err


@pytest.mark.parametrize("limit", ["-5GiB", "-3"])
def test_a_negative_memory_limit_is_refused_by_its_own_check(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, limit: str
) -> None:
    from pipetrain.plan import LayerCost, write_layers

    path = tmp_path / "layers.json"
    write_layers(path, [LayerCost("a", f=1, i=1, w=1), LayerCost("b", f=1, i=1, w=1)])
    code, _, err = run(capsys, "plan", "-p", "2", "-m", "4", "--layers", str(path), "--memory-limit", limit)
    assert code == 1 and ">= 0" in err and "expected one argument" not in err
