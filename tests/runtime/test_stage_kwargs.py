"""``stage_kwargs``: extra keyword inputs (a mask, a bias) for any stage, given where it runs.

torch.distributed.pipelining has no way to give a later stage its own inputs (pytorch#130055):
they must be threaded through every stage's outputs. Here each rank passes the same
``{stage: {name: value}}`` to ``step``; the rank holding the stage splits it into microbatches.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from pipetrain import REPLICATE, LocalPipeline, TensorChunkSpec
from pipetrain.errors import PipelineError
from support.dist import run_ranks
from support.models import assert_grads_equal

WIDTH = 4
NUM_STAGES = 4
M = 4


class Masked(nn.Module):
    """``lin(x) * mask + bias``: a stage that needs data the previous stage does not have."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.tanh(self.lin(x)) * mask
        return out if bias is None else out + bias


def _layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(WIDTH, WIDTH) if s % 2 == 0 else Masked() for s in range(NUM_STAGES)]


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(10, WIDTH, generator=g), torch.randn(10, WIDTH, generator=g)  # 10 into 4: uneven
    mask_t = (torch.rand(WIDTH, 10, generator=g) > 0.3).float()  # batch on dim 1
    bias = torch.randn(WIDTH, generator=g)  # one value for every microbatch
    return x, y, mask_t, bias


def _extra(mask_t: torch.Tensor, bias: torch.Tensor) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
    """Stage 1 gets the mask; stage 3 the mask and a bias that is replicated, not split."""
    kwargs = {1: {"mask": mask_t}, 3: {"mask": mask_t, "bias": bias}}
    specs = {1: {"mask": TensorChunkSpec(1)}, 3: {"mask": TensorChunkSpec(1), "bias": REPLICATE}}
    return kwargs, specs


def _reference(
    layers: list[nn.Module], x: torch.Tensor, y: torch.Tensor, mask_t: torch.Tensor, bias: torch.Tensor
) -> tuple[list[nn.Module], list[torch.Tensor], torch.Tensor]:
    """Whole model, one microbatch at a time, mean loss: what the pipeline must reproduce."""
    model = copy.deepcopy(layers)

    def run(xi: torch.Tensor, mi: torch.Tensor) -> torch.Tensor:
        h = xi
        for s, layer in enumerate(model):
            h = layer(h, mi.t(), bias if s == 3 else None) if isinstance(layer, Masked) else layer(h)
        return h

    parts = zip(x.tensor_split(M), y.tensor_split(M), mask_t.tensor_split(M, dim=1), strict=True)
    losses = [nn.functional.mse_loss(run(xi, mi), yi) for xi, yi, mi in parts]
    torch.stack(losses).mean().backward()
    with torch.no_grad():
        out = torch.cat([run(xi, mi) for xi, mi in zip(x.tensor_split(M), mask_t.tensor_split(M, dim=1), strict=True)])
    return model, [loss.detach() for loss in losses], out


class _TransposedMask(nn.Module):
    """Adapts a stage so the test can give the mask batch-second (exercises a chunk spec)."""

    def __init__(self, inner: Masked) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner(x, mask.t(), bias)


def _wrapped(layers: list[nn.Module]) -> list[nn.Module]:
    return [m if s % 2 == 0 else _TransposedMask(m) for s, m in enumerate(layers)]  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"])
def test_local_pipeline_gives_each_stage_its_inputs(name: str) -> None:
    layers = _layers()
    x, y, mask_t, bias = _data()
    ref, ref_losses, ref_out = _reference(layers, x, y, mask_t, bias)
    kwargs, specs = _extra(mask_t, bias)
    pipe = LocalPipeline(_wrapped(layers), name, n_microbatches=M, loss_fn=nn.functional.mse_loss, num_ranks=2)
    losses: list[torch.Tensor] = []
    pipe.step(x, target=y, losses=losses, stage_kwargs=kwargs, stage_kwargs_chunk_spec=specs)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
    assert_grads_equal({s: layers[s] for s in range(NUM_STAGES)}, ref, name)
    out = pipe.eval(x, stage_kwargs=kwargs, stage_kwargs_chunk_spec=specs)
    torch.testing.assert_close(out, ref_out)


def test_bad_stage_kwargs_name_what_is_wrong() -> None:
    layers = _layers()
    x, y, mask_t, _ = _data()
    pipe = LocalPipeline(_wrapped(layers), "1F1B", n_microbatches=M, loss_fn=nn.functional.mse_loss, num_ranks=4)
    cases: list[tuple[dict[str, Any], str]] = [
        (
            {"stage_kwargs": {4: {"mask": mask_t}}},
            r"stage_kwargs: 4 is not a stage index \(the pipeline has stages 0..3\)",
        ),
        ({"stage_kwargs": [mask_t]}, r"stage_kwargs must be a dict \{stage index: \{name: value\}\}, got list"),
        ({"stage_kwargs": {1: mask_t}}, r"stage_kwargs\[1\] must be a dict of keyword names to values"),
        (
            {"stage_kwargs": {1: {"mask": mask_t.t().clone().requires_grad_()}}},
            r"stage_kwargs\[1\]\['mask'\] requires grad, .* have stage 0 return it",
        ),
        (
            {"stage_kwargs": {1: {"mask": mask_t}}, "stage_kwargs_chunk_spec": {2: {"mask": REPLICATE}}},
            r"stage_kwargs_chunk_spec must be a dict over stages that stage_kwargs names \(\[1\]\)",
        ),
        (
            {"stage_kwargs": {1: {"mask": mask_t}}, "stage_kwargs_chunk_spec": {1: {"mask_t": REPLICATE}}},
            r"stage_kwargs_chunk_spec\[1\] must be a dict over the names stage_kwargs\[1\] gives \(\['mask'\]\)",
        ),
        (  # 3 columns into 4 microbatches
            {
                "stage_kwargs": {1: {"mask": mask_t[:, :3]}},
                "stage_kwargs_chunk_spec": {1: {"mask": TensorChunkSpec(1)}},
            },
            r"stage_kwargs\[1\]\['mask'\]",
        ),
        ({"stage_kwargs_chunk_spec": {1: {}}}, r"stage_kwargs_chunk_spec was given without stage_kwargs"),
    ]
    for extra, message in cases:
        with pytest.raises(PipelineError, match=message):
            pipe.step(x, target=y, **extra)
    with pytest.raises(PipelineError, match=r"rank 0.*stage 0 microbatch 0 gets \['scale'\] both from stage_kwargs"):
        pipe.step(x, target=y, scale=1.0, stage_kwargs={0: {"scale": 2.0}})


class _Emits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.lin(x)
        return {"x": h, "mask": torch.ones_like(h)}


def test_a_name_the_previous_stage_already_sends_is_refused() -> None:
    mods = [_Emits(), Masked()]
    x, y, mask_t, _ = _data()
    pipe = LocalPipeline(mods, "GPipe", n_microbatches=2, loss_fn=nn.functional.mse_loss, num_ranks=2)
    with pytest.raises(
        PipelineError,
        match=r"stage 1 microbatch 0 gets \['mask'\] both from the keyword inputs given to step\(\) .* and from stage 0's output",
    ):
        pipe.step(x, target=y, stage_kwargs={1: {"mask": mask_t.t()}})


def _distributed(rank: int, world: int) -> list[str]:
    from pipetrain import PipelineStage, get_schedule_class
    from pipetrain.plan import build_schedule

    x, y, mask_t, bias = _data()
    kwargs, specs = _extra(mask_t, bias)
    checked = []
    for name, v in (("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2)):
        num_stages = world * v
        layers = _layers()[:num_stages] if num_stages < NUM_STAGES else _layers()
        if num_stages == 2:
            use_kwargs, use_specs = {1: kwargs[1]}, {1: specs[1]}
        else:
            use_kwargs, use_specs = kwargs, specs
        ref_layers = layers + [nn.Identity()] * (NUM_STAGES - num_stages)
        ref, ref_losses, ref_out = _reference(ref_layers, x, y, mask_t, bias)
        placement = build_schedule(name, world, M, v).stage_to_rank
        mine = [s for s, r in placement.items() if r == rank]
        mods = _wrapped(layers)
        stages = [PipelineStage(mods[s], s, num_stages, "cpu") for s in mine]
        cls = get_schedule_class(name)
        sched = cls(stages if v > 1 else stages[0], M, loss_fn=nn.functional.mse_loss)
        last = num_stages - 1 in mine
        losses: list[torch.Tensor] = []
        # Every rank passes the same stage_kwargs; only the rank holding a stage uses its entry.
        sched.step(
            *((x,) if 0 in mine else ()),
            target=y if last else None,
            losses=losses,
            stage_kwargs=use_kwargs,
            stage_kwargs_chunk_spec=use_specs,
        )
        assert_grads_equal({s: layers[s] for s in mine}, ref, f"{name} rank {rank}")
        out = sched.eval(*((x,) if 0 in mine else ()), stage_kwargs=use_kwargs, stage_kwargs_chunk_spec=use_specs)
        if last:
            torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
            torch.testing.assert_close(out, ref_out)
        checked.append(name)
    # A keyword that requires grad would reach later stages, whose keyword inputs get no gradient.
    with pytest.raises(
        PipelineError, match=r"keyword argument 'mask' requires grad, but step\(\) also gives it to stage"
    ):
        sched.step(*((x,) if 0 in mine else ()), target=y if last else None, mask=mask_t.t().clone().requires_grad_())
    return checked


@pytest.mark.slow
def test_stage_kwargs_on_gloo_ranks_match_plain_training() -> None:
    results = run_ranks(_distributed, 2)
    assert results == [["1F1B", "Interleaved1F1B", "ZBVZeroBubble"]] * 2
