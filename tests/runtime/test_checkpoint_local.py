"""Checkpointer in one process: which checkpoints it keeps, which it reads, what it restores."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch import nn

from pipetrain import Checkpointer, PipelineError


def _trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    return model, optimizer


def test_the_last_n_are_kept_and_a_partial_one_is_never_read(tmp_path: Path) -> None:
    model, optimizer = _trained()
    ckpt = Checkpointer(tmp_path, keep=2)
    assert ckpt.latest() is None
    (tmp_path / ".partial-step_000000009").mkdir()  # a crash's leftovers: no metadata
    (tmp_path / ".partial-step_000000009" / "__0_0.distcp").write_bytes(b"half")
    for step in (1, 2, 3):
        ckpt.save(step, model, optimizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000002", "step_000000003"]
    assert ckpt.latest() == tmp_path / "step_000000003"


def test_what_is_restored_model_optimizer_rng_step_extra(tmp_path: Path) -> None:
    model, optimizer = _trained()
    optimizer.param_groups[0]["lr"] = 5e-3  # as a learning-rate schedule would leave it
    torch.manual_seed(42)
    random.seed(42)
    Checkpointer(tmp_path).save(7, model, optimizer, extra={"sampler": [3, 1]})
    expected = torch.rand(3), random.random()

    other, other_opt = _trained(seed=1)
    resumed = Checkpointer(tmp_path).load(other, other_opt)
    assert (resumed.step, resumed.extra, resumed.path) == (7, {"sampler": [3, 1]}, tmp_path / "step_000000007")
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert other_opt.param_groups[0]["lr"] == 5e-3
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        mine, theirs = optimizer.state[p], other_opt.state[q]
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_a_model_the_checkpoint_does_not_hold_is_named(tmp_path: Path) -> None:
    model, optimizer = _trained()
    Checkpointer(tmp_path).save(1, model, optimizer)
    with pytest.raises(PipelineError, match=r"holds no extra\.weight"):
        Checkpointer(tmp_path).load(nn.ModuleDict({"extra": nn.Linear(2, 2)}))
    with pytest.raises(PipelineError, match="not a complete checkpoint"):
        Checkpointer(tmp_path).load(model, path=tmp_path / "nowhere")
    with pytest.raises(PipelineError, match="keep must be at least 1"):
        Checkpointer(tmp_path, keep=0)
