"""Tiny models and a non-pipelined reference for the runtime tests."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

MULTI_STAGE = {"Interleaved1F1B": 2, "LoopedBFS": 2, "InterleavedZeroBubble": 2, "ZBVZeroBubble": 2, "DualPipeV": 2}


def stages_per_rank(name: str) -> int:
    return MULTI_STAGE.get(name, 1)


def mlp_layers(num_stages: int, width: int = 8, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(num_stages)]


def transformer_layers(num_stages: int, d_model: int = 8, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [
        nn.TransformerEncoderLayer(d_model, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)
        for _ in range(num_stages)
    ]


def make_layers(kind: str, num_stages: int) -> list[nn.Module]:
    return mlp_layers(num_stages) if kind == "mlp" else transformer_layers(num_stages)


def make_batch(kind: str, batch: int, seq: int = 3, width: int = 8, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (batch, width) if kind == "mlp" else (batch, seq, width)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def reference(
    layers: list[nn.Module], x: Any, y: torch.Tensor, n_microbatches: int, loss_fn: Any = nn.functional.mse_loss
) -> tuple[list[nn.Module], list[torch.Tensor], torch.Tensor]:
    """Non-pipelined training on the whole batch: the mean of the microbatch losses, backward once."""
    model = nn.Sequential(*copy.deepcopy(layers))
    losses = [
        loss_fn(model(xi), yi)
        for xi, yi in zip(x.tensor_split(n_microbatches), y.tensor_split(n_microbatches), strict=True)
    ]
    torch.stack(losses).mean().backward()
    with torch.no_grad():
        out = model(x)
    return list(model), [loss.detach() for loss in losses], out


def assert_grads_equal(stages: Mapping[int, nn.Module], ref: Sequence[nn.Module], case: str) -> None:
    """Every parameter gradient of ``stages`` (stage index -> this rank's module) equals that of
    the reference's module for the same stage."""
    for s, mod in stages.items():
        for (name, p), q in zip(mod.named_parameters(), ref[s].parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda e, n=f"{case}: stage {s} {name}": f"{n}: {e}")


def train_csv_schedule(rank: int, csv: str) -> list[int]:
    """On a spawned gloo rank: one step of the schedule in ``csv`` (mlp stages) through
    PipelineScheduleRuntime, checked against plain training (gradients, losses); this rank's stages."""
    from pipetrain import PipelineScheduleRuntime, PipelineStage
    from pipetrain.plan import Schedule

    schedule = Schedule.from_csv(csv)
    m, num_stages = schedule.num_microbatches, schedule.num_stages
    layers = make_layers("mlp", num_stages)
    x, y = make_batch("mlp", 2 * m)
    ref_layers, ref_losses, _ = reference(layers, x, y, m)
    mine = [s for s, r in schedule.stage_to_rank.items() if r == rank]
    stages = [PipelineStage(layers[s], s, num_stages, "cpu") for s in mine]
    runtime = PipelineScheduleRuntime(stages, schedule, loss_fn=nn.functional.mse_loss)
    losses: list[torch.Tensor] = []
    runtime.step(*((x,) if 0 in mine else ()), target=y if num_stages - 1 in mine else None, losses=losses)
    assert_grads_equal({s: layers[s] for s in mine}, ref_layers, f"rank {rank}")
    if num_stages - 1 in mine:
        torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
    return mine


class Explodes(nn.Module):
    """A module with a bug: its forward raises on call number ``fail_on`` (counting from 0)."""

    def __init__(self, fail_on: int) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0
        self.fail_on = fail_on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls - 1 == self.fail_on:
            raise ValueError("bug in the module")
        return self.lin(x)


class TransformerBlock(nn.Module):
    """A pre-norm transformer block: LayerNorm, q/k/v in one Linear, SDPA, a GELU MLP (its first
    Linear with a bias where ``up_bias``), residuals; the split-backward tests' block."""

    def __init__(self, d: int = 16, heads: int = 2, up_bias: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.up = nn.Linear(d, 4 * d, bias=up_bias)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(nn.functional.gelu(self.up(self.ln2(x))))
