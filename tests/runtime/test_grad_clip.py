"""Gradient clipping across pipeline ranks equals torch's clipping of the whole model."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from pipetrain import clip_grad_norm_, grad_norm
from pipetrain.errors import PipelineError
from support.dist import run_ranks
from support.models import assert_grads_equal, make_batch, mlp_layers, reference


def _clip_cases(rank: int, world: int) -> list[str]:
    from pipetrain import get_schedule_class

    done = []
    m = 4
    x, y = make_batch("mlp", 8)
    for name, v in (("1F1B", 1), ("ZBVZeroBubble", 2)):
        num_stages = world * v
        placement = {s: s for s in range(world)} if v == 1 else {0: 0, 3: 0, 1: 1, 2: 1}
        mine = sorted(s for s, r in placement.items() if r == rank)
        for norm_type in (2.0, 1.0, math.inf, 0.0):
            for no_params_on_last_rank in (False, True):
                layers = mlp_layers(num_stages)
                if no_params_on_last_rank:  # rank 1 holds no parameter: its share of the norm is 0
                    for s, r in placement.items():
                        if r == world - 1:
                            layers[s] = nn.Tanh()
                ref_layers, _, _ = reference(layers, x, y, m)
                ref_params = [p for layer in ref_layers for p in layer.parameters()]
                want_norm = torch.nn.utils.clip_grad_norm_(ref_params, 0.05, norm_type)

                from pipetrain import PipelineStage

                local = [copy.deepcopy(layers[s]) for s in mine]
                stages = [PipelineStage(mod, s, num_stages, "cpu") for mod, s in zip(local, mine, strict=True)]
                sched = get_schedule_class(name)(stages if v > 1 else stages[0], m, loss_fn=nn.functional.mse_loss)
                assert (sched.has_first_stage, sched.has_last_stage) == (0 in mine, num_stages - 1 in mine)
                sched.step(*((x,) if sched.has_first_stage else ()), target=y if sched.has_last_stage else None)
                params = [p for mod in local for p in mod.parameters()]
                case = f"{name} norm {norm_type:g} no-params={no_params_on_last_rank}"
                torch.testing.assert_close(grad_norm(params, norm_type), want_norm, msg=lambda e, c=case: f"{c}: {e}")
                got_norm = clip_grad_norm_(params, 0.05, norm_type)
                torch.testing.assert_close(got_norm, want_norm, msg=lambda e, c=case: f"{c}: {e}")
                assert_grads_equal(dict(zip(mine, local, strict=True)), ref_layers, case)
                done.append(case)
    return done


@pytest.mark.slow
def test_clipping_across_ranks_equals_clipping_the_whole_model() -> None:
    results = run_ranks(_clip_cases, 2)
    assert all(len(r) == 16 for r in results), results


def _nonfinite(rank: int, world: int) -> str:
    layer = nn.Linear(2, 2)
    for p in layer.parameters():
        p.grad = torch.ones_like(p)
    if rank == 1:
        layer.weight.grad[0, 0] = float("inf")
    try:
        clip_grad_norm_(layer.parameters(), 1.0, error_if_nonfinite=True)
    except PipelineError as err:
        return str(err)
    return "no error"


@pytest.mark.slow
def test_a_nonfinite_gradient_fails_every_rank_naming_the_rank() -> None:
    messages = run_ranks(_nonfinite, 2)
    for message in messages:
        assert "is inf" in message and "rank 1 of the pipeline group are not finite" in message, message


def test_without_a_process_group_it_is_torchs_clipping() -> None:
    torch.manual_seed(0)
    ours, theirs = nn.Linear(3, 3), nn.Linear(3, 3)
    theirs.load_state_dict(ours.state_dict())
    for model in (ours, theirs):
        model(torch.ones(2, 3)).pow(2).sum().backward()
    got = clip_grad_norm_(ours.parameters(), 0.1)
    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.1)
    torch.testing.assert_close(got, want)
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    assert float(clip_grad_norm_([nn.Parameter(torch.zeros(1))], 1.0)) == 0.0  # no gradients at all


def test_a_weight_tied_between_two_stages_of_a_rank_counts_once() -> None:
    """Under a V placement the embedding (stage 0) and the head (last stage) share rank 0: the
    stages' parameters list the tied weight twice."""
    torch.manual_seed(0)
    tied = nn.Parameter(torch.randn(3, 3))
    tied.grad = torch.ones(3, 3)
    other = nn.Parameter(torch.randn(3))
    other.grad = torch.full((3,), 2.0)
    assert float(grad_norm([tied, other, tied])) == pytest.approx((9 * 1.0 + 3 * 4.0) ** 0.5)
    clip_grad_norm_([tied, other, tied], 1.0)
    total = torch.cat([tied.grad.flatten(), other.grad]).norm()
    assert float(total) == pytest.approx(1.0, rel=1e-5)  # scaled once, to the limit
