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
