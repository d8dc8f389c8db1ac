"""LocalPipeline and the distributed runtime run one step driver: the same script gives the same results.

The script passes its inputs only where stage 0 is held, its target only where the last stage
is, and a keyword argument (a mask every stage takes) everywhere. In one process every stage is
held; on 2 gloo ranks each rank holds its own.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from pipetrain import LocalPipeline
from pipetrain.errors import PipelineError
from support.dist import run_ranks

WIDTH = 4
M = 4
CASES = (("1F1B", 2), ("ZBVZeroBubble", 4))  # (schedule, stages) on 2 ranks


class MaskedLinear(nn.Module):
    """Every stage needs ``mask``: step()'s keyword arguments must reach all of them."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * mask


def _layers(num_stages: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [MaskedLinear() for _ in range(num_stages)]


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)
    return x, y, (torch.rand(8, WIDTH, generator=g) > 0.3).float()


def _script(pipe: Any, held: list[int], layers: list[nn.Module]) -> dict[str, Any]:
    """What a user writes once and runs both ways."""
    x, y, mask = _data()
    first, last = 0 in held, len(layers) - 1 in held
    losses: list[torch.Tensor] = []
    out = pipe.step(*((x,) if first else ()), target=y if last else None, losses=losses, mask=mask)
    evaluated: list[torch.Tensor] = []
    ev = pipe.eval(*((x,) if first else ()), target=y if last else None, losses=evaluated, mask=mask)
    return {
        "losses": [float(v) for v in losses],
        "eval losses": [float(v) for v in evaluated],
        "out": None if out is None else out.tolist(),
        "eval": None if ev is None else ev.tolist(),
        "grads": {s: [p.grad.tolist() for p in layers[s].parameters()] for s in held},
    }


def _local(name: str, num_stages: int) -> dict[str, Any]:
    layers = _layers(num_stages)
    pipe = LocalPipeline(layers, name, M, loss_fn=nn.functional.mse_loss, num_ranks=2)
    return _script(pipe, list(range(num_stages)), layers)


def _ranks(rank: int, world: int) -> dict[str, Any]:
    from pipetrain import PipelineStage, get_schedule_class
    from pipetrain.plan import build_schedule
    from pipetrain.plan.passes.early_recv import post_receives_early
    from pipetrain.runtime import DEFAULT_RECV_AHEAD

    results: dict[str, Any] = {}
    for name, num_stages in CASES:
        layers = _layers(num_stages)
        placement = build_schedule(name, world, M, num_stages // world).stage_to_rank
        mine = sorted(s for s, r in placement.items() if r == rank)
        stages = [PipelineStage(layers[s], s, num_stages, "cpu") for s in mine]
        sched = get_schedule_class(name)(stages if len(stages) > 1 else stages[0], M, loss_fn=nn.functional.mse_loss)
        # What runs is the lowered schedule with gloo's early receives, visible as such.
        lowered = build_schedule(name, world, M, num_stages // world).lower()
        assert sched.pipeline_order_with_comms == post_receives_early(lowered, DEFAULT_RECV_AHEAD).actions
        results[name] = _script(sched, mine, layers)
    # A target given on every rank (torch's examples pass it only where the last stage is, but
    # torch ignores it elsewhere) changes nothing: the same losses, the parameters being unchanged.
    x, y, mask = _data()
    again: list[torch.Tensor] = []
    sched.step(*((x,) if rank == 0 else ()), target=y, losses=again, mask=mask)
    results["target on every rank"] = [float(v) for v in again]
    return results


def _merge(parts: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The ranks' results of ``name`` as one process would have them (the last stage's values)."""
    merged: dict[str, Any] = {"grads": {}}
    for part in parts:
        mine = part[name]
        merged["grads"].update(mine["grads"])
        if mine["out"] is not None:
            merged.update({k: mine[k] for k in ("losses", "eval losses", "out", "eval")})
    return merged


@pytest.mark.slow
def test_the_same_script_gives_the_same_results_in_one_process_and_on_gloo_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PIPETRAIN_SINGLE_TAG", raising=False)
    monkeypatch.delenv("PIPETRAIN_RECV_AHEAD", raising=False)
    parts = run_ranks(_ranks, 2)
    for name, num_stages in CASES:
        local = _local(name, num_stages)
        ranks = _merge(parts, name)
        assert sorted(ranks["grads"]) == list(range(num_stages))
        assert local["losses"] and local["eval losses"]
        for key in ("losses", "eval losses", "out", "eval"):
            torch.testing.assert_close(torch.tensor(ranks[key]), torch.tensor(local[key]), msg=f"{name} {key}")
        for s in range(num_stages):
            for got, want in zip(ranks["grads"][s], local["grads"][s], strict=True):
                torch.testing.assert_close(torch.tensor(got), torch.tensor(want), msg=f"{name} stage {s}")
    # ZBVZeroBubble (the last case) on 2 ranks: rank 0 holds stages 0 and 3 (the last), rank 1
    # holds 1 and 2 and was given the target too.
    last_case = CASES[-1][0]
    assert last_case == "ZBVZeroBubble"
    assert parts[1]["target on every rank"] == []
    assert parts[0]["target on every rank"] == parts[0][last_case]["losses"] != []


def test_keywords_reach_every_stage_and_target_is_optional_without_loss() -> None:
    """In one process every stage is held: keywords reach all of them; eval needs no target."""
    layers = _layers(2)
    pipe = LocalPipeline(layers, "GPipe", M, loss_fn=nn.functional.mse_loss)
    x, _, mask = _data()
    out = pipe.eval(x, mask=mask)
    want = layers[1](layers[0](x, mask), mask)
    torch.testing.assert_close(out, want.detach())
    with pytest.raises(PipelineError, match=r"holds the last stage .* but step\(\) got no target"):
        pipe.step(x, mask=mask)


def test_a_target_of_another_batch_size_is_an_error_naming_both_shapes() -> None:
    layers = _layers(2)
    pipe = LocalPipeline(layers, "1F1B", M, loss_fn=nn.functional.mse_loss)
    x, y, mask = _data()
    with pytest.raises(PipelineError, match=r"target has shape \[6, 4\] but the input has shape \[8, 4\].*stage 1"):
        pipe.step(x, target=y[:6], mask=mask)
    assert all(p.grad is None for layer in layers for p in layer.parameters())
    pipe.step(x, target=y, mask=mask)  # and the pipeline still runs
