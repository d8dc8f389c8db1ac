"""``pipetrain show / export / validate``: output, files, and one-line errors with exit code 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipetrain.cli import main
from pipetrain.plan import Schedule, build_schedule


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
