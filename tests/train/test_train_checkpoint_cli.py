"""``pipetrain train --checkpoint-dir DIR [--checkpoint-every N]``: the options and their errors.

The resume itself (under torchrun, a rank killed) is in ``test_train_restart.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipetrain.cli import main
from pipetrain.train.loop import TrainConfig


def test_help_names_the_checkpoint_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    assert "--checkpoint-dir DIR" in text and "--checkpoint-every N" in text


def test_checkpoints_are_off_unless_asked() -> None:
    cfg = TrainConfig()
    assert (cfg.checkpoint_dir, cfg.checkpoint_every) == (None, 10)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--checkpoint-every", "0", "--checkpoint-dir", "ck"], "--checkpoint-every must be >= 1, got 0"),
        (["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir (where the checkpoints go)"),
    ],
)
def test_bad_checkpoint_options_are_one_line_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--steps", "1", *argv]) == 1
    assert capsys.readouterr().err.strip() == f"pipetrain train: error: {message}"


def test_a_checkpoint_dir_that_is_a_file_is_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "ckpt"
    a_file.write_text("x")
    assert main(["train", "--steps", "1", "--checkpoint-dir", str(a_file)]) == 1
    assert f"--checkpoint-dir {a_file} is a file; give a directory" in capsys.readouterr().err


def test_resuming_with_other_settings_says_the_run_now_differs(capsys: pytest.CaptureFixture[str]) -> None:
    from pipetrain.checkpoint import Resumed
    from pipetrain.train.loop import _result_so_far

    saved = {"losses": [5.0, 4.0, 3.0], "run": {"seed": 0, "model": "tiny", "batch_size": 8, "lr": 3e-3}}
    resumed = Resumed(step=2, extra=saved, path=Path("ck/step_000000002"))
    result = _result_so_far(resumed, 2, TrainConfig(model="tiny", batch_size=8, lr=3e-3, seed=1, steps=4))
    assert result.losses == [5.0, 4.0]  # the steps the checkpoint covers
    out = capsys.readouterr().out
    assert "resuming a run made with seed 0 (now 1)" in out and "batch_size" not in out
    assert "resumed from ck/step_000000002 after 2 of 4 steps" in out
    _result_so_far(resumed, 2, TrainConfig(model="tiny", batch_size=8, lr=3e-3, seed=0, steps=4))
    assert "note" not in capsys.readouterr().out
