"""`pipetrain train`: arguments, errors, the plain reference run (no processes needed here)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipetrain.cli import build_parser, main
from pipetrain.errors import PipelineError
from pipetrain.plan import ScheduleError, build_schedule
from pipetrain.train.loop import TrainConfig, TrainResult, _agrees, _mismatch, plan_for, reference_losses
from pipetrain.train.model import GPT

TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


def test_help_lists_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["train", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for option in ("--ranks", "--stages-per-rank", "--schedule", "--microbatches", "--steps", "--batch-size",
                   "--device", "--out", "--seed", "--check"):  # fmt: skip
        assert option in text


def test_defaults_are_the_demo() -> None:
    args = build_parser().parse_args(["train"])
    assert (args.schedule, args.ranks, args.stages_per_rank, args.device, args.check) == (
        "ZBVZeroBubble", None, None, "cpu", False,
    )  # fmt: skip
    plan = plan_for(TrainConfig(), 2)
    assert (plan.num_ranks, plan.num_stages, plan.name) == (2, 4, "ZBVZeroBubble")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--steps", "0"], "--steps must be >= 1, got 0"),
        (["train", "--batch-size", "4", "--microbatches", "8"], "--batch-size 4 is smaller than --microbatches 8"),
        (["train", "--clip-grad-norm", "0"], "--clip-grad-norm must be > 0, got 0.0"),
    ],
)
def test_bad_arguments_are_one_line_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.strip() == f"pipetrain train: error: {message}"


def test_schedule_problems_are_reported_before_spawning(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--schedule", "NoSuchSchedule"]) == 1
    assert "unknown schedule 'NoSuchSchedule'" in capsys.readouterr().err
    assert main(["train", "--schedule", "ZBVZeroBubble", "--stages-per-rank", "3"]) == 1
    assert "ZBVZeroBubble" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks the message shown without enough GPUs")
def test_cuda_without_gpus_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--device", "cuda"]) == 1
    err = capsys.readouterr().err
    if torch.cuda.is_available():
        assert "--device cuda with 2 ranks needs 2 GPUs (one per rank), 1 visible" in err
    else:  # a CPU-only torch (as here) says so, not "0 GPUs visible"
        assert "--device cuda, but torch" in err and ("CPU-only build" in err or "sees no GPU" in err), err


def test_no_cuda_reason_names_the_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipetrain.train.launch import no_cuda_reason

    monkeypatch.setattr(torch.version, "cuda", None)
    assert "is a CPU-only build; install a CUDA build of torch" in no_cuda_reason()
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert no_cuda_reason().endswith("(CUDA 13.0) sees no GPU (CUDA_VISIBLE_DEVICES=''): check the driver (nvidia-smi)")


def test_check_verdict_names_the_first_differing_step() -> None:
    good = TrainResult(losses=[5.0, 4.0], reference=[5.0, 4.0 * (1 + 5e-5)])
    assert _agrees(good)
    bad = TrainResult(losses=[5.0, 4.0, 3.0], reference=[5.0, 4.01, 3.5])
    assert not _agrees(bad)
    assert _mismatch(bad) == "--check failed at step 2: pipelined loss 4.000000 vs plain 4.010000 (rtol 1e-04)"
    assert not _agrees(TrainResult(losses=[5.0], reference=[]))
    clipped = TrainResult(losses=[5.0], reference=[5.0], grad_norms=[2.0], reference_grad_norms=[2.5])
    assert not _agrees(clipped)
    assert _mismatch(clipped) == (
        "--check failed at step 1: pipelined gradient norm 2.000000 vs plain 2.500000 (rtol 1e-04)"
    )
    assert _agrees(TrainResult(losses=[5.0], reference=[5.0], grad_norms=[2.0], reference_grad_norms=[2.0]))


def test_the_model_grows_to_give_every_stage_a_layer() -> None:
    cfg = TrainConfig(model="tiny")
    assert cfg.model_config_for(3).n_layers == cfg.model_config.n_layers == 2
    assert cfg.model_config_for(8).n_layers == 6
    assert len(GPT(cfg.model_config_for(8)).split(8)) == 8


def test_unknown_schedule_is_a_schedule_error() -> None:
    with pytest.raises(ScheduleError, match="unknown schedule 'NoSuchSchedule'"):
        plan_for(TrainConfig(schedule="NoSuchSchedule"), 2)


def test_ranks_must_match_torchrun(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for key, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(key, value)
    assert main(["train", "--ranks", "3"]) == 1
    assert "--ranks 3 but torchrun started WORLD_SIZE=2" in capsys.readouterr().err


def test_a_csv_schedule_must_fit_the_ranks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "s.csv"
    build_schedule("1F1B", 3, 4).to_csv(path)
    assert plan_for(TrainConfig(schedule=str(path)), 3).num_ranks == 3
    with pytest.raises(PipelineError, match="schedule for 3 ranks, but 2 ranks run"):
        plan_for(TrainConfig(schedule=str(path)), 2)


def test_plain_reference_is_deterministic_and_learns() -> None:
    torch.set_num_threads(1)
    cfg = TrainConfig(model="tiny", steps=8, batch_size=8, microbatches=4, lr=1e-2, max_text_bytes=200_000)
    first = reference_losses(cfg, torch.device("cpu"))
    assert first == reference_losses(cfg, torch.device("cpu"))
    assert len(first) == 8
    assert first[-1] < first[0] - 0.5
    assert reference_losses(TrainConfig(**{**cfg.__dict__, "seed": 1}), torch.device("cpu")) != first


def test_unknown_model_size_is_a_clear_error() -> None:
    with pytest.raises(PipelineError, match="unknown model size 'huge'"):
        _ = TrainConfig(model="huge").model_config


def _recorded_spawn(monkeypatch: pytest.MonkeyPatch) -> list[TrainConfig]:
    """Replace the process launcher: the test sees the config instead of a training run."""
    import pipetrain.train.launch

    seen: list[TrainConfig] = []
    monkeypatch.setattr(pipetrain.train.launch, "spawn", lambda fn, ranks, cfg: seen.append(cfg))
    return seen


def test_a_schedule_file_sets_the_microbatches(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "s.csv"
    build_schedule("1F1B", 2, 4).to_csv(path)
    seen = _recorded_spawn(monkeypatch)
    # 4 sequences for the file's 4 microbatches: fine, although the default --microbatches is 8
    assert main(["train", "--schedule", str(path), "--batch-size", "4", "--out", str(tmp_path / "run")]) == 0
    assert [(cfg.microbatches, cfg.ranks, cfg.batch_size) for cfg in seen] == [(4, 2, 4)]
    assert main(["train", "--schedule", str(path), "--batch-size", "3"]) == 1
    assert capsys.readouterr().err.strip() == (
        f"pipetrain train: error: --batch-size 3 is smaller than the 4 microbatches of {path}"
    )
    assert main(["train", "--schedule", str(path), "--microbatches", "8"]) == 1
    assert capsys.readouterr().err.strip() == (
        f"pipetrain train: error: --microbatches 8 contradicts {path}, a schedule of 4 microbatches "
        "(leave --microbatches out)"
    )
    # --stages-per-rank was ignored for a file; now it must agree with the file's placement.
    assert main(["train", "--schedule", str(path), "--stages-per-rank", "2"]) == 1
    assert capsys.readouterr().err.strip() == (
        f"pipetrain train: error: --stages-per-rank 2 contradicts {path}, a schedule of 2 stages on 2 ranks "
        "(leave --stages-per-rank out)"
    )
    assert (
        main(["train", "--schedule", str(path), "--stages-per-rank", "1", "--batch-size", "4", "--out", str(tmp_path)])
        == 0
    )
    assert len(seen) == 2


def test_problems_found_before_training_not_after(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Each of these used to train first (or not train at all) and fail or mislead at the end."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    assert main(["train", "--out", str(a_file), "--steps", "1"]) == 1
    assert f"--out {a_file} is a file; give a directory" in capsys.readouterr().err
    assert main(["train", "--schedule", "ForwardOnly", "--steps", "1"]) == 1
    assert "ForwardOnly has no backward, so it cannot train" in capsys.readouterr().err
    broken = tmp_path / "broken.csv"
    broken.write_text("0F0,0F1,0B0\n1F0,1B0,1F1,1B1\n")
    assert main(["train", "--schedule", str(broken), "--steps", "1"]) == 1
    assert f"{broken}: rank 0, step 1, action 0F1: has no backward" in capsys.readouterr().err
    # a layers file that cannot be written used to fail after the steps (and only .json/.csv read back)
    for bad in (tmp_path, tmp_path / "missing" / "layers.json"):
        assert main(["profile", "--layers-out", str(bad), "--steps", "2"]) == 1
        assert f"--layers-out {bad}: give a file in an existing directory" in capsys.readouterr().err
    # a costs file that cannot be written used to fail after the measured steps
    for bad in (tmp_path, tmp_path / "missing" / "costs.txt"):
        assert main(["profile", "--costs-out", str(bad), "--steps", "2"]) == 1
        assert f"--costs-out {bad}: give a file in an existing directory" in capsys.readouterr().err


def test_without_matplotlib_train_says_it_draws_no_pictures(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import pipetrain.cli.train_cmd as train_cmd
    import pipetrain.train.launch as launch

    started: list[int] = []
    monkeypatch.setattr(launch, "spawn", lambda fn, ranks, cfg: started.append(ranks))
    monkeypatch.setattr(train_cmd, "_importable", lambda module: module != "matplotlib")
    assert main(["train", "--steps", "1", "--out", str(tmp_path / "run")]) == 0
    assert started == [2]
    assert "no timeline pictures are drawn" in capsys.readouterr().err
    assert main(["train", "--schedule", "NoSuchSchedule"]) == 1  # nothing to train: no note, just the error
    assert "timeline pictures" not in capsys.readouterr().err
    monkeypatch.setattr(train_cmd, "_importable", lambda module: True)
    assert main(["train", "--steps", "1", "--out", str(tmp_path / "run")]) == 0
    assert "timeline pictures" not in capsys.readouterr().err
