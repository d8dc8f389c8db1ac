"""Ranks that cut one model differently are refused before their first step, on every rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from pipetrain import LocalPipeline, PipelineError, PipelineStage
from pipetrain.split import split_by_names, split_layers, split_sequential
from support.dist import run_ranks


def _model(width: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, width), nn.Tanh(), nn.Linear(width, width), nn.LayerNorm(width), nn.Linear(width, 2)
    )


def _step(stage_modules: list[nn.Module], rank: int, world: int) -> str:
    """One 1F1B step with this rank's stage; the error text, or 'ok'."""
    from pipetrain import Schedule1F1B

    stage = PipelineStage(stage_modules[rank], rank, world, "cpu")
    sched = Schedule1F1B(stage, 2, loss_fn=nn.functional.mse_loss)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    try:
        sched.step(x if rank == 0 else None, target=y if rank == world - 1 else None)
    except PipelineError as err:
        return str(err)
    return "ok"


def _scenarios(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # The case: split_sequential(model, 2, by=weights) with different weights per rank.
    weights = [1, 1, 1, 1, 1] if rank == 0 else [1, 1, 1, 1, 5]
    out["weights"] = _step(split_sequential(_model(), world, by=weights), rank, world)
    # The same cut on both ranks trains.
    out["same"] = _step(split_sequential(_model(), world, by=[1, 1, 1, 1, 1]), rank, world)
    # One cut, but a different model on rank 1 (wider layers).
    out["model"] = _step(split_sequential(_model(8 if rank == 0 else 16), world, by=[1, 1, 1, 1, 1]), rank, world)
    # Rank 1 gives its stage the module of stage 0.
    parts = split_sequential(_model(), world, by=[1, 1, 1, 1, 1])
    out["index"] = _step([parts[0], parts[0]] if rank == 1 else parts, rank, world)
    # A time cut is measured on rank 0 and shared: rank 1's own measurement would cut elsewhere.
    import pipetrain.split as split

    if rank == 1:
        split.layer_times = lambda layers, *a, **k: [100.0, 1.0, 1.0, 1.0, 1.0]  # type: ignore[assignment]
    else:
        split.layer_times = lambda layers, *a, **k: [1.0, 1.0, 1.0, 1.0, 100.0]  # type: ignore[assignment]
    cut = split_sequential(_model(), world, by="time", sample_input=torch.randn(2, 4))
    out["time_cut"] = [list(s._modules) for s in cut]
    out["time"] = _step(cut, rank, world)
    return out


def test_ranks_that_cut_differently_are_refused_on_both_ranks() -> None:
    r0, r1 = run_ranks(_scenarios, 2, timeout=180)
    # rank 0 cut [0, 1] [2, 3, 4]; rank 1 (weight 5 on layer 4) cut [0, 1, 2, 3] [4]: layers 2 and 3 would
    # run on neither rank.
    assert "the ranks cut the model into different stages" in r0["weights"]
    assert "the ranks cut the model into different stages" in r1["weights"]
    assert r0["weights"].startswith("rank 0: the ranks cut") and r1["weights"].startswith("rank 1: the ranks cut")
    assert "rank 0 holds stage 0 = [0, 1] of the cut stage 0 = [0, 1], stage 1 = [2, 3, 4]" in r0["weights"]
    assert "rank 1 holds stage 1 = [4] of the cut stage 0 = [0, 1, 2, 3], stage 1 = [4]" in r0["weights"]
    assert "rank 1 holds stage 1 = [4]" in r1["weights"] and "rank 0 holds stage 0 = [0, 1]" in r1["weights"]
    for text in (r0["weights"], r1["weights"]):
        assert "Layers placed differently: [2, 3], which would run twice or not at all" in text
    assert r0["same"] == r1["same"] == "ok"
    for text in (r0["model"], r1["model"]):
        assert "the ranks built different models" in text and "stage 0 = [0, 1]" in text
    assert "rank 1: stage 1 was given the module of stage 0 of its cut ([0, 1])" in r1["index"]
    assert "rank 0: rank 1 gave its stage 1 the module of stage 0 of its cut ([0, 1])" in r0["index"]
    assert r0["time_cut"] == r1["time_cut"] == [["0", "1", "2", "3"], ["4"]]
    assert r0["time"] == r1["time"] == "ok"


def test_local_pipeline_refuses_stages_of_two_cuts() -> None:
    model = _model()
    a = split_sequential(model, 2, by=[1, 1, 1, 1, 1])
    b = split_sequential(model, 2, by=[5, 1, 1, 1, 1])
    with pytest.raises(PipelineError, match=r"cut the model into different stages.*placed differently: \[1\]"):
        LocalPipeline([a[0], b[1]], "GPipe", n_microbatches=2, loss_fn=nn.functional.mse_loss)
    with pytest.raises(PipelineError, match="stage 0 was given the module of stage 1 of its cut"):
        LocalPipeline([a[1], a[0]], "GPipe", n_microbatches=2, loss_fn=nn.functional.mse_loss)
    with pytest.raises(PipelineError, match="comes from a cut into 2 stages"):
        LocalPipeline([a[0]], "GPipe", n_microbatches=2, loss_fn=nn.functional.mse_loss)
    # Stages of one cut, and modules built otherwise, run.
    LocalPipeline(a, "GPipe", n_microbatches=2, loss_fn=nn.functional.mse_loss)
    LocalPipeline([nn.Linear(4, 4), nn.Linear(4, 2)], "GPipe", n_microbatches=2, loss_fn=nn.functional.mse_loss)
    named = split_by_names(model, [["0", "1"], ["2", "3", "4"]])
    layered = split_layers(model, 2, by=[1, 1, 5, 1, 1])
    assert [list(s._modules) for s in named] == [list(s._modules) for s in layered]
    LocalPipeline([named[0], layered[1]], "GPipe", n_microbatches=2, loss_fn=nn.functional.mse_loss)


class _Wrapper(nn.Module):
    """Holds its module as ``.module``, as DDP does."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.module(x)
        return out


def test_a_wrapped_stage_is_checked_and_a_container_of_stages_is_not() -> None:
    from pipetrain.split import stage_cut

    parts = split_sequential(_model(), 4, by=[1, 1, 1, 1, 1])
    assert stage_cut(_Wrapper(parts[1])) is stage_cut(parts[1])
    with pytest.raises(PipelineError, match="stage 0 was given the module of stage 1"):
        LocalPipeline([_Wrapper(parts[1]), parts[0]], "GPipe", n_microbatches=2)
    # Two stages of a 4-stage cut run as one stage of 2: not a stage of that cut, so not compared.
    merged = [nn.Sequential(parts[0], parts[1]), nn.Sequential(parts[2], parts[3])]
    assert stage_cut(merged[0]) is None
    LocalPipeline(merged, "GPipe", n_microbatches=2, loss_fn=nn.functional.mse_loss)
