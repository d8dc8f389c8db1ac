"""Checkpoints: saved by one pipeline layout, resumed by another, and never half-written.

A tiny GPT (4 layers, so 4 stages) trains 2 steps on 2 gloo ranks under ZBVZeroBubble and is
saved; the same ranks go on for one more step (the reference next-step loss), then a save that
fails after part of the files are written. The checkpoint then resumes on 4 ranks under 1F1B and
in one process without pipelining, each giving the reference's next-step loss.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from support.dist import run_ranks

pytestmark = pytest.mark.slow

MICROBATCHES = 4
SAVED_AT = 2


def _model() -> Any:
    from pipetrain.train.model import GPT, MODEL_SIZES

    return GPT(MODEL_SIZES["tiny"])


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    window = torch.randint(0, 256, (8, 33), generator=gen)
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def _pipeline(rank: int, world: int, schedule: str, seed: int) -> tuple[Any, Any, Any, list[Any]]:
    """This rank's schedule, optimizer, Checkpointer and stages for ``schedule`` over 4 stages."""
    import pipetrain
    from pipetrain.train.model import lm_loss

    torch.manual_seed(seed)
    parts = _model().split(4)
    mine = [rank, 3 - rank] if schedule == "ZBVZeroBubble" else [rank]
    stages = [pipetrain.PipelineStage(parts[s], s, 4, "cpu") for s in mine]
    cls = pipetrain.get_schedule_class(schedule)
    sched = cls(stages if len(stages) > 1 else stages[0], MICROBATCHES, loss_fn=lm_loss, timeout=60)
    params = [p for s in mine for p in parts[s].parameters()]
    return sched, torch.optim.Adam(params, lr=1e-2), stages, mine


def _step(sched: Any, optimizer: Any, step: int, mine: list[int]) -> float | None:
    x, y = _batch(step)
    losses: list[torch.Tensor] = []
    kwargs: dict[str, Any] = {"target": y, "losses": losses} if 3 in mine else {}
    sched.step(*((x,) if 0 in mine else ()), **kwargs)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(torch.stack(losses).mean()) if losses else None


class _DiedMidWriteError(Exception):
    pass


def _save_then_continue(rank: int, world: int, directory: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    import pipetrain.checkpoint as ckmod
    from pipetrain import PipelineError

    sched, optimizer, stages, mine = _pipeline(rank, world, "ZBVZeroBubble", seed=0)
    ckpt = ckmod.Checkpointer(directory, keep=2)
    assert ckpt.load(stages, optimizer).step == 0  # nothing there yet
    for step in range(SAVED_AT):
        _step(sched, optimizer, step, mine)
    ckpt.save(SAVED_AT, stages, optimizer, extra={"next_batch": SAVED_AT})
    next_loss = _step(sched, optimizer, SAVED_AT, mine)

    class Dies(FileSystemWriter):
        """Rank 1 dies once its data file is on disk; rank 0's is written too, the metadata never."""

        def write_data(self, plan: Any, planner: Any) -> Any:
            done = super().write_data(plan, planner)
            done.wait()
            if rank == 1:
                raise _DiedMidWriteError("killed while writing")
            return done

    ckmod._writer = lambda path: Dies(str(path), single_file_per_rank=True)  # type: ignore[assignment]
    try:
        ckpt.save(SAVED_AT + 1, stages, optimizer)
        failed = ""
    except PipelineError as err:  # on every rank: DCP gathers the writers' results
        failed = f"{type(err).__name__}: {err}"
    partial = Path(directory) / ".partial-step_000000003"
    return {
        "next_loss": next_loss,
        "failed": failed,
        "partial_files": sorted(p.name for p in partial.iterdir()) if partial.is_dir() else [],
        "latest": str(ckpt.latest()),
    }


def _resume(rank: int, world: int, directory: str, schedule: str) -> tuple[int, dict[str, Any], float | None, str]:
    from pipetrain import Checkpointer, PipelineError

    sched, optimizer, stages, mine = _pipeline(rank, world, schedule, seed=123)  # another init: all must load
    resumed = Checkpointer(directory).load(stages, optimizer)
    next_loss = _step(sched, optimizer, resumed.step, mine)
    # A module the checkpoint lacks, on rank 3 only: every rank raises, none waits in DCP's collectives.
    try:
        Checkpointer(directory).load([*stages, torch.nn.Linear(2, 2)] if rank == 3 else stages)
        refused = ""
    except PipelineError as err:
        refused = str(err)
    return resumed.step, resumed.extra, next_loss, refused


def _unpipelined_next_loss(directory: str) -> tuple[int, float]:
    """One process, the whole model, no pipeline: the loss of the step after the checkpoint."""
    from pipetrain import Checkpointer
    from pipetrain.train.model import lm_loss

    torch.manual_seed(7)
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    resumed = Checkpointer(directory).load(model, optimizer)
    x, y = _batch(resumed.step)
    chunks = zip(torch.tensor_split(model(x), MICROBATCHES), torch.tensor_split(y, MICROBATCHES), strict=True)
    loss = torch.stack([lm_loss(lo, ta) for lo, ta in chunks]).mean()
    return resumed.step, float(loss.detach())


def test_a_checkpoint_resumes_in_other_layouts_and_a_failed_save_leaves_it_usable(tmp_path: Path) -> None:
    directory = str(tmp_path / "ckpt")
    saved = run_ranks(_save_then_continue, 2, directory, timeout=150)
    for rank, res in enumerate(saved):
        assert "killed while writing" in res["failed"], (rank, res)
        assert res["latest"].endswith("step_000000002"), res
        assert res["partial_files"] and ".metadata" not in res["partial_files"], res  # files written, no metadata
    reference = saved[0]["next_loss"]  # rank 0 holds the last stage in a V
    assert reference is not None and math.isfinite(reference)
    assert sorted(os.listdir(directory)) == [".partial-step_000000003", "step_000000002"]

    on_four = run_ranks(_resume, 4, directory, "1F1B", timeout=150)
    assert [r[0] for r in on_four] == [SAVED_AT] * 4
    assert all(r[1] == {"next_batch": SAVED_AT} for r in on_four)
    assert on_four[3][2] == pytest.approx(reference, rel=1e-6, abs=0.0), (on_four[3][2], reference)
    for rank, (*_, refused) in enumerate(on_four):
        assert "holds no weight, bias" in refused and ("rank 3: " in refused or rank == 3), (rank, refused)

    step, alone = _unpipelined_next_loss(directory)
    assert step == SAVED_AT
    assert alone == pytest.approx(reference, rel=1e-6, abs=0.0), (alone, reference)


def _fsdp_save_and_reload(rank: int, world: int, directory: str) -> dict[str, Any]:
    """FSDP2 (DTensor parameters and Adam state, 2 shards): save, reload into a fresh sharded copy."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from pipetrain import Checkpointer

    mesh = init_device_mesh("cpu", (world,))

    def sharded(seed: int) -> tuple[Any, Any]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
        fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    model, optimizer = sharded(0)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    Checkpointer(directory).save(1, model, optimizer)
    other, other_opt = sharded(1)
    assert Checkpointer(directory).load(other, other_opt).step == 1
    same_params = all(
        torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), other.parameters(), strict=True)
    )
    same_state = all(
        torch.equal(optimizer.state[p]["exp_avg"].to_local(), other_opt.state[q]["exp_avg"].to_local())
        for p, q in zip(model.parameters(), other.parameters(), strict=True)
    )
    return {
        "params": same_params,
        "state": same_state,
        "full": {k: v.full_tensor().tolist() for k, v in model.state_dict().items()},
    }


def test_fsdp2_sharded_state_saves_and_loads_sharded_or_whole(tmp_path: Path) -> None:
    directory = str(tmp_path / "ckpt")
    results = run_ranks(_fsdp_save_and_reload, 2, directory, timeout=120)
    assert all(r["params"] and r["state"] for r in results), results
    from pipetrain import Checkpointer

    whole = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    Checkpointer(directory).load(whole)  # one process, no sharding
    for key, value in whole.state_dict().items():
        assert value.tolist() == results[0]["full"][key], key
