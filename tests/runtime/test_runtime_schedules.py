"""Every schedule on real gloo ranks: losses, gradients and outputs equal non-pipelined training."""

from __future__ import annotations

import pytest
import torch

from support.dist import run_ranks
from support.models import make_batch, make_layers, reference, stages_per_rank, train_csv_schedule

pytestmark = pytest.mark.slow


def _check_all_schedules(rank: int, world: int, kinds: tuple[str, ...], single_tag: bool) -> list[str]:
    from torch import nn

    from pipetrain import PipelineStage, get_schedule_class
    from pipetrain.plan import build_schedule, schedule_names

    done = []
    for name in schedule_names():
        for kind in kinds:
            v = stages_per_rank(name)
            num_stages = world * v
            m = 2 * world
            layers = make_layers(kind, num_stages)
            x, y = make_batch(kind, 2 * m)
            ref_layers, ref_losses, ref_out = reference(layers, x, y, m)
            placement = build_schedule(name, world, m, v).stage_to_rank
            mine = [s for s, r in placement.items() if r == rank]
            stages = [PipelineStage(layers[s], s, num_stages, "cpu") for s in mine]
            cls = get_schedule_class(name)
            sched = cls(stages if v > 1 else stages[0], m, loss_fn=nn.functional.mse_loss)
            assert sched._transport.single_tag is single_tag
            losses: list[torch.Tensor] = []
            is_first, is_last = 0 in mine, num_stages - 1 in mine
            out = sched.step(*((x,) if is_first else ()), target=y if is_last else None, losses=losses)
            case = f"{name}/{kind}/{world} ranks"
            if name != "ForwardOnly":
                for s in mine:
                    for (pname, p), q in zip(layers[s].named_parameters(), ref_layers[s].parameters(), strict=True):
                        torch.testing.assert_close(
                            p.grad, q.grad, msg=lambda e, c=case, s=s, n=pname: f"{c}: stage {s} {n}: {e}"
                        )
                    assert not stages[mine.index(s)].has_state(), case
            if is_last:
                torch.testing.assert_close(
                    torch.stack(losses), torch.stack(ref_losses), msg=lambda e, c=case: f"{c}: {e}"
                )
                torch.testing.assert_close(out, ref_out, msg=lambda e, c=case: f"{c}: output: {e}")
            else:
                assert out is None and losses == [], case
            merged = sched.gather_timeline()
            assert merged is not None and {e.rank for e in merged.events} == set(range(world)), case
            assert merged.start == 0 and merged.makespan > 0, case
            evaluated = sched.eval(*((x,) if is_first else ()))
            if is_last:
                torch.testing.assert_close(evaluated, ref_out, msg=lambda e, c=case: f"{c}: eval: {e}")
            assert sched.last_timeline is not None and sched.last_timeline.source == "measured"
            done.append(case)
    return done


@pytest.mark.parametrize("single_tag", [False, True], ids=["tags", "single_tag"])
@pytest.mark.parametrize("world", [2, 4])
def test_every_schedule_matches_plain_training(world: int, single_tag: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``single_tag`` puts every operation on one tag: gloo then matches like NCCL, by order only."""
    from pipetrain.plan import schedule_names

    monkeypatch.setenv("PIPETRAIN_SINGLE_TAG", "1" if single_tag else "0")
    results = run_ranks(_check_all_schedules, world, ("mlp", "transformer"), single_tag)
    assert all(len(r) == 2 * len(schedule_names()) for r in results)


@pytest.mark.parametrize("ahead", ["0", "1"])
def test_every_schedule_with_a_bounded_receive_window(ahead: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Receives posted ahead of their place, at most ``ahead`` at a time (0: none early): same results."""
    from pipetrain.plan import schedule_names

    monkeypatch.setenv("PIPETRAIN_SINGLE_TAG", "0")
    monkeypatch.setenv("PIPETRAIN_RECV_AHEAD", ahead)
    results = run_ranks(_check_all_schedules, 2, ("mlp",), False)
    assert all(len(r) == len(schedule_names()) for r in results)


def _train_lowered(rank: int, world: int, csv: str, window: str) -> str:
    import os

    os.environ["PIPETRAIN_RECV_AHEAD"] = window
    train_csv_schedule(rank, csv)
    return f"rank {rank}"


@pytest.mark.parametrize("window", ["0", "4"])
def test_a_schedule_lowered_with_early_receives_runs_on_gloo(
    window: str, tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lower(recv_ahead=2) gives a schedule valid under gloo's matching only: gloo's runtime runs it
    (with or without its own receive window) with plain training's gradients."""
    from pathlib import Path

    from pipetrain.plan import build_schedule

    monkeypatch.setenv("PIPETRAIN_SINGLE_TAG", "0")
    low = build_schedule("Interleaved1F1B", 2, 4, 2).lower(recv_ahead=2)
    csv = str(Path(str(tmp_path)) / "early.csv")
    low.to_csv(csv)
    assert run_ranks(_train_lowered, 2, csv, window) == ["rank 0", "rank 1"]
