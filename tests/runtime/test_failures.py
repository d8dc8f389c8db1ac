"""A failure on one rank becomes a clear error on every rank, quickly; bad input is named."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

from support.dist import run_ranks
from support.models import Explodes

pytestmark = pytest.mark.slow


class Unsendable(nn.Module):
    """Returns its activation with a lock beside it: a plain value that cannot be pickled."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        import threading

        return {"x": self.lin(x), "lock": threading.Lock()}


def _expect_error(fn: Any) -> tuple[str, float]:
    from pipetrain.errors import PipelineError

    t0 = time.monotonic()
    try:
        fn()
    except PipelineError as err:
        return str(err), time.monotonic() - t0
    raise AssertionError("no PipelineError was raised")


def _scenarios(rank: int, world: int) -> dict[str, tuple[str, float]]:
    import torch.distributed as dist

    from pipetrain import PipelineScheduleRuntime, PipelineStage, Schedule1F1B, ScheduleGPipe
    from pipetrain.plan import Schedule

    out: dict[str, tuple[str, float]] = {}
    loss = nn.functional.mse_loss
    x = torch.randn(8, 4)
    y = torch.randn(8, 4)

    def stage(group: Any, module: nn.Module | None = None, index: int | None = None) -> PipelineStage:
        torch.manual_seed(0)
        return PipelineStage(module or nn.Linear(4, 4), rank if index is None else index, world, "cpu", group=group)

    def inputs(first: Any = x, last: Any = y) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return ((first,) if rank == 0 else ()), {"target": last if rank == world - 1 else None}

    # 1. A module raises mid-step on the middle rank (microbatch 2 of 4 in step 1): everybody stops.
    group = dist.new_group(backend="gloo")
    sched = Schedule1F1B(stage(group, Explodes(fail_on=6 if rank == 1 else -1)), 4, loss_fn=loss, timeout=60)
    args, kw = inputs()
    sched.step(*args, **kw)
    out["module raises"] = _expect_error(lambda: sched.step(*args, **kw))

    # From here on a rank may fail its first step before a slower peer has built its schedule;
    # that peer's constructor then refuses the round ("not started because ..."), so building
    # and stepping are timed together.

    # 2. Batch smaller than the number of microbatches (detected on the first rank only).
    group = dist.new_group(backend="gloo")

    def small_batch() -> None:
        sched = ScheduleGPipe(stage(group), 4, loss_fn=loss, timeout=60)
        args, kw = inputs(first=torch.randn(3, 4))
        sched.step(*args, **kw)

    out["small batch"] = _expect_error(small_batch)

    # 3. Target missing on the last stage's rank.
    group = dist.new_group(backend="gloo")

    def no_target() -> None:
        sched = ScheduleGPipe(stage(group), 4, loss_fn=loss, timeout=60)
        args, _ = inputs()
        sched.step(*args, target=None)

    out["no target"] = _expect_error(no_target)

    # 4. Stages that do not match the schedule's placement (rank 1 passes stage 0).
    group = dist.new_group(backend="gloo")

    def wrong_stage() -> None:
        st = stage(group, index=0 if rank == 1 else rank)
        s = ScheduleGPipe(st, 4, loss_fn=loss, timeout=60)
        a, k = inputs()
        s.step(*a, **k)

    out["wrong stage"] = _expect_error(wrong_stage)

    # 5. A schedule that fails validation is refused on every rank before any communication.
    group = dist.new_group(backend="gloo")
    broken = Schedule.from_csv_text("\n".join(f"{r}B0,{r}F0" for r in range(world)) + "\n")

    def invalid() -> None:
        PipelineScheduleRuntime(stage(group), broken, loss_fn=loss, timeout=60)

    out["invalid schedule"] = _expect_error(invalid)

    # 6. A stage output that cannot be sent (a value pickle refuses) fails on the sending rank, and
    #    the ranks waiting for it hear why.
    group = dist.new_group(backend="gloo")

    def unsendable() -> None:
        sched = ScheduleGPipe(stage(group, Unsendable() if rank == 0 else None), 4, loss_fn=loss, timeout=60)
        args, kw = inputs()
        sched.step(*args, **kw)

    out["unsendable output"] = _expect_error(unsendable)
    return out


def test_every_rank_fails_fast_and_names_the_failure() -> None:
    results = run_ranks(_scenarios, 3, timeout=240)
    for rank, res in enumerate(results):
        msg, elapsed = res["module raises"]
        assert elapsed < 30, (rank, elapsed, msg)
        # the failing rank, its action, the step and the cause are named on every rank
        assert "rank 1, step 1, action 1F2: ValueError: bug in the module" in msg, (rank, msg)
        msg, elapsed = res["small batch"]
        assert elapsed < 30 and "args[0]" in msg and "rank 0" in msg, (rank, msg)
        msg, elapsed = res["no target"]
        assert elapsed < 30 and "target" in msg and f"rank {2}" in msg, (rank, msg)
        msg, elapsed = res["wrong stage"]
        assert elapsed < 30 and "rank 1" in msg and "stages [0]" in msg, (rank, msg)
        msg, _ = res["invalid schedule"]
        assert "cannot run" in msg and "B0" in msg and "needs" in msg, (rank, msg)
        msg, elapsed = res["unsendable output"]
        assert elapsed < 30 and "rank 0, step 0, action 0SEND_F0" in msg and "pickle" in msg, (rank, msg)


def _late_to_agree(rank: int, world: int) -> dict[str, tuple[str, float]]:
    import os

    import torch.distributed as dist

    from pipetrain import PipelineStage, ScheduleGPipe

    store = dist.distributed_c10d._get_default_store()
    out: dict[str, tuple[str, float]] = {}
    x = torch.randn(8, 4)
    for mode in ("tags", "single tag"):
        if mode == "single tag":
            os.environ["PIPETRAIN_SINGLE_TAG"] = "1"  # headers on the control plane, as under NCCL
        group = dist.new_group(backend="gloo")
        torch.manual_seed(0)
        stage = PipelineStage(nn.Linear(4, 4), rank, world, "cpu", group=group)
        sched = ScheduleGPipe(stage, 4, loss_fn=nn.functional.mse_loss, timeout=10)
        dist.barrier()  # every rank built its schedule before rank 2 can fail (else rank 0 is not started)
        if rank == 0:
            # Rank 0 comes to the agreement last, once rank 1 gave up there: rank 1 waited for rank
            # 0's key and read the story of rank 2, which was past the agreement (it needs rank 1's
            # key only) and failed. Rank 0 then finds every key it needs and passes.
            store.wait([f"test/late_to_agree/{mode}"])
        out[mode] = _expect_error(lambda s=sched: s.step(*((x,) if rank == 0 else ()), target=None))
        if rank == 1:
            store.set(f"test/late_to_agree/{mode}", "stopped")
    dist.barrier()  # nobody leaves early: a closed connection would wake rank 0 by itself
    return out


def test_a_peer_that_fails_while_agreeing_wakes_a_rank_already_past_the_agreement() -> None:
    """Rank 1 hears of rank 2's failure while it waits to agree with rank 0, and stops there,
    having posted nothing: no failure notice. Rank 0, arriving later, finds rank 1's key and passes
    the agreement, then waits for rank 1's gradient. It must learn of the failure at once (from the
    round's story), not at its 10 s timeout. (The flaky "no target" case above, made deterministic.)"""
    results = run_ranks(_late_to_agree, 3, timeout=120)
    for mode in ("tags", "single tag"):
        msg, elapsed = results[1][mode]
        assert "stopped before the first step" in msg, (mode, msg)  # the phase under test
        msg, elapsed = results[0][mode]
        assert elapsed < 5, (mode, elapsed, msg)
        assert "rank 0, step 0" in msg and "0RECV_B" in msg and "rank 2, step 0" in msg and "no target" in msg, msg


class Slow(nn.Module):
    """A stage that takes its time: its peer fails while a send to it is still pending."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.3)
        return self.lin(x)


def _fails_with_a_send_pending(rank: int, world: int) -> tuple[str, float]:
    from pipetrain import ScheduleGPipe
    from pipetrain.stage import PipelineStage

    torch.manual_seed(0)
    module = Explodes(fail_on=2) if rank == 0 else Slow()
    sched = ScheduleGPipe(PipelineStage(module, rank, world, "cpu"), 4, loss_fn=nn.functional.mse_loss, timeout=60)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    result = _expect_error(lambda: sched.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None))
    if rank == 0:
        time.sleep(8)  # a failed rank lives on for a while (logging, cleanup): its connections stay open
    return result


def test_a_rank_failing_with_a_send_still_pending_does_not_stall_its_peer() -> None:
    """Rank 0 fails at microbatch 2 while its send of microbatch 1 waits for the slow rank 1 to post
    the receive. That send must stay alive: gloo would otherwise leave the connection stuck, and
    rank 1 would wait its whole timeout for data and for the failure notice queued behind it."""
    results = run_ranks(_fails_with_a_send_pending, 2, timeout=120)
    msg, elapsed = results[1]
    # without the fix rank 1 waits until rank 0's process ends (8 s here), its I/O thread spinning
    assert elapsed < 5 and "rank 0, step 0, action 0F2: ValueError: bug in the module" in msg, (elapsed, msg)


class Widens(nn.Module):
    """Stage 0 with a bug: from call ``at`` on, its output is wider than stage 1 expects."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0
        self.at = at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out = self.lin(x)
        return torch.cat([out, out[:, :1]], dim=1) if self.calls > self.at else out


def _disagreements(rank: int, world: int) -> dict[str, tuple[str, float]]:
    import torch.distributed as dist

    from pipetrain import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleZBVZeroBubble

    out: dict[str, tuple[str, float]] = {}
    loss = nn.functional.mse_loss
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    args, kw = ((x,) if rank == 0 else ()), {"target": y if rank == world - 1 else None}

    def stage(group: Any, index: int, num_stages: int = world, module: nn.Module | None = None) -> PipelineStage:
        torch.manual_seed(0)
        return PipelineStage(module or nn.Linear(4, 4), index, num_stages, "cpu", group=group)

    # 1. A schedule class refuses its arguments on rank 1 only (ZBV wants 2 stages per rank): the
    #    other ranks stop at their first step instead of waiting their timeout for rank 1.
    group = dist.new_group(backend="gloo")

    def refused() -> None:
        mine = [rank, 2 * world - 1 - rank]
        stages = [stage(group, s, 2 * world) for s in (mine[:1] if rank == 1 else mine)]
        sched = ScheduleZBVZeroBubble(stages, 4, loss_fn=loss, timeout=60)
        sched.step(*args, target=y if rank == 0 else None)  # rank 0 holds the last stage in a V

    out["class refuses"] = _expect_error(refused)

    # 2. Ranks that built different schedules (4 against 8 microbatches) are stopped before any
    #    message is exchanged: gloo would abort the process on the size mismatch.
    group = dist.new_group(backend="gloo")

    def mismatch() -> None:
        sched = Schedule1F1B(stage(group, rank), 8 if rank == 1 else 4, loss_fn=loss, timeout=60)
        target = torch.randn(16 if rank == 1 else 8, 4) if rank == world - 1 else None
        sched.step(*args, target=target)

    out["different microbatches"] = _expect_error(mismatch)

    # 3. A stage output that changes shape mid-step breaks the next stage: both shapes are named.
    group = dist.new_group(backend="gloo")
    sched = ScheduleGPipe(stage(group, rank, module=Widens(at=2) if rank == 0 else None), 4, loss_fn=loss, timeout=60)
    evaluator = ScheduleGPipe(stage(group, rank), 4)
    out["changed shape"] = _expect_error(lambda: sched.step(*args, **kw))

    # 4. After a failure neither the schedule nor the group runs again, and the error says why:
    #    not the failed object, not another one built before the failure, not a new one.
    out["step again"] = _expect_error(lambda: sched.step(*args, **kw))
    out["other schedule, same group"] = _expect_error(lambda: evaluator.eval(*args))
    out["new schedule, same group"] = _expect_error(lambda: ScheduleGPipe(stage(group, rank), 4, loss_fn=loss))

    # 5. Uneven microbatches (10 rows in 3, 3, 2, 2) and a failure unrelated to shapes: no shape note.
    group = dist.new_group(backend="gloo")
    sched = ScheduleGPipe(stage(group, rank, module=Explodes(fail_on=2) if rank == 1 else None), 4, loss_fn=loss)
    ten = ((torch.randn(10, 4),) if rank == 0 else ()), {"target": torch.randn(10, 4) if rank == world - 1 else None}
    out["uneven, unrelated failure"] = _expect_error(lambda: sched.step(*ten[0], **ten[1]))

    # 6. Ranks whose programs differ only in compute (a DDP stage beside a stage with no
    #    parameters, which DDP cannot wrap) exchange the same messages: they agree and train.
    from torch.nn.parallel import DistributedDataParallel

    alone = [dist.new_group([r], backend="gloo") for r in range(world)]
    group = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    module = DistributedDataParallel(nn.Linear(4, 4), process_group=alone[0]) if rank == 0 else nn.Tanh()
    sched = Schedule1F1B(PipelineStage(module, rank, world, "cpu", group=group), 4, loss_fn=loss, timeout=60)
    sched.step(*args, **kw)
    out["ddp beside no parameters"] = ("trained", 0.0)

    # 7. One schedule read from a file of another name on each rank: names may differ, sizes and
    #    messages agree, so they train.
    import os
    import tempfile

    from pipetrain import PipelineScheduleRuntime
    from pipetrain.plan import Schedule, build_schedule

    group = dist.new_group(backend="gloo")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"mine_on_rank{rank}.csv")
        build_schedule("1F1B", world, 4).to_csv(path)
        plan = Schedule.from_csv(path)
    assert plan.name == f"mine_on_rank{rank}", plan.name
    PipelineScheduleRuntime([stage(group, rank)], plan, loss_fn=loss, timeout=60).step(*args, **kw)
    out["same schedule, other names"] = ("trained", 0.0)
    return out


def test_disagreeing_ranks_shape_changes_and_dead_groups_are_named() -> None:
    results = run_ranks(_disagreements, 2, timeout=240)
    for rank, res in enumerate(results):
        msg, elapsed = res["class refuses"]
        assert elapsed < 10 and "rank 1: ScheduleZBVZeroBubble" in msg and "2 stages per rank" in msg, (rank, msg)
        msg, elapsed = res["different microbatches"]
        assert elapsed < 10 and "different schedules" in msg, (rank, msg)
        assert "4 microbatches" in msg and "8 microbatches" in msg, (rank, msg)
        msg, _ = res["changed shape"]
        assert "rank 1, step 0, action 1F2: RuntimeError" in msg, (rank, msg)
        assert "stage 1 received the output of stage 0 for microbatch 2 as float32 [2, 5]" in msg, (rank, msg)
        assert "float32 [2, 4] for microbatch 1" in msg, (rank, msg)
        for case in ("step again", "other schedule, same group", "new schedule, same group"):
            msg, elapsed = res[case]
            assert elapsed < 1 and "already failed" in msg and "1F2" in msg and "dist.new_group" in msg, (case, msg)
        msg, _ = res["uneven, unrelated failure"]
        assert "rank 1, step 0, action 1F2: ValueError: bug in the module" in msg and "shapes" not in msg, msg
        assert res["ddp beside no parameters"][0] == "trained"
        assert res["same schedule, other names"][0] == "trained"


def _peer_exits(rank: int, world: int) -> tuple[str, float]:
    from pipetrain import Schedule1F1B
    from pipetrain.stage import PipelineStage

    torch.manual_seed(0)
    module = Explodes(fail_on=0) if rank == 1 else Slow()
    sched = Schedule1F1B(PipelineStage(module, rank, world, "cpu"), 4, loss_fn=nn.functional.mse_loss, timeout=60)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    # rank 1 fails at once and its process ends (the harness exits right after it returns); rank 0,
    # still in its slow forward, then finds the connection closed when it posts its send
    return _expect_error(lambda: sched.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None))


def test_a_closed_connection_is_explained_by_the_failure_that_closed_it() -> None:
    msg, elapsed = run_ranks(_peer_exits, 2, timeout=120)[0]
    assert elapsed < 10, (elapsed, msg)
    assert "because rank 1, step 0, action 1F0: ValueError: bug in the module" in msg, msg


class Stalls(nn.Module):
    """A stage that hangs for a while on its first call without raising (a stuck data loader, a lock)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        self.seconds = 0.0
        return self.lin(x)


def _stalled(rank: int, world: int) -> tuple[str, float]:
    from pipetrain import Schedule1F1B
    from pipetrain.stage import PipelineStage

    torch.manual_seed(0)
    module = Stalls(4.0) if rank == 1 else nn.Linear(4, 4)
    sched = Schedule1F1B(PipelineStage(module, rank, world, "cpu"), 4, loss_fn=nn.functional.mse_loss, timeout=1.5)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    return _expect_error(lambda: sched.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None))


def test_a_stalled_rank_is_bounded_by_the_timeout_and_named_as_the_suspect() -> None:
    (msg0, elapsed0), (msg1, _) = run_ranks(_stalled, 2, timeout=120)
    assert 1.4 < elapsed0 < 10, (elapsed0, msg0)  # bounded by the 1.5 s timeout; slack for a loaded machine
    assert "timed out after 1.5 s" in msg0 and "rank 1, or a rank it waits for, may be stalled" in msg0, msg0
    assert "because rank 0, step 0" in msg1 and "may be stalled" in msg1, msg1
