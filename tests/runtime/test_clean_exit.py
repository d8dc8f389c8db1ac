"""Issue 37: a job ends its process group when it calls ``dist.destroy_process_group()``.

A 2-rank torchrun job (1F1B, gloo) aborted at exit in about 8 of 63 runs ("terminate called
without an active exception", SIGABRT), the same script on ``torch.distributed.pipelining`` in
none of 18. With pipetrain the default process group outlived ``destroy_process_group()``: the
check for FSDP stages imported ``torch.distributed.fsdp`` after ``init_process_group``, which
imports ``torch.distributed.nn.functional``, whose functions keep ``group.WORLD`` (evaluated at
import) as a default; the runtime and the transport held it too. So the group and its gloo threads
lived into interpreter finalization, where a gloo worker thread that drops the last reference to a
collective's tensor (``clip_grad_norm_``'s all-gather) needs the GIL and takes the process down.

The abort itself is a race (rare, more so on an idle machine: ``benchmarks/exit_stress.py`` counts
it); what these tests check is the invariant that rules it out: once ``destroy_process_group()``
returns, the group is gone and its threads with it, while the schedules live on, and no helper
thread of pipetrain's is inside a wait when a step has returned.
"""

from __future__ import annotations

import os
import sys
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from support.dist import run_ranks

WIDTH = 8
GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")  # ProcessGroupGloo's workers, gloo's TCP loop


def _thread_names() -> list[str]:
    """This process's native thread names (Linux); [] where /proc is not there."""
    if not os.path.isdir("/proc/self/task"):
        return []
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names


def _train_then_destroy(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from pipetrain import (
        PipelineError,
        PipelineScheduleRuntime,
        PipelineStage,
        Schedule1F1B,
        ScheduleZBVZeroBubble,
        clip_grad_norm_,
    )
    from pipetrain.plan import Costs, auto_schedule
    from pipetrain.runtime.transport import completion

    torch.manual_seed(0)
    x = torch.randn(8, WIDTH)
    schedules = []
    for kind in ("1F1B", "ZBVZeroBubble", "planned"):
        if kind == "1F1B":
            mine, num_stages, last = [rank], world, world - 1
        elif kind == "ZBVZeroBubble":
            mine, num_stages, last = [rank, 2 * world - 1 - rank], 2 * world, 0
        else:
            planned = auto_schedule(
                world, 4, Costs(f=1, b=2, i=1, w=1), stages_per_rank=2, placement="loop", time_limit=0.2
            )
            num_stages = planned.num_stages
            mine, last = planned.stages_of(rank), planned.stage_to_rank[num_stages - 1]
        modules = {s: nn.Linear(WIDTH, WIDTH) for s in mine}
        stages = [PipelineStage(modules[s], s, num_stages, "cpu") for s in mine]
        if kind == "1F1B":
            sched: Any = Schedule1F1B(stages[0], 4, loss_fn=nn.functional.mse_loss)
        elif kind == "ZBVZeroBubble":
            sched = ScheduleZBVZeroBubble(stages, 4, loss_fn=nn.functional.mse_loss)
        else:
            sched = PipelineScheduleRuntime(stages, planned, loss_fn=nn.functional.mse_loss)
        for _ in range(2):
            sched.step(*((x,) if 0 in mine else ()), target=x if rank == last else None)
            clip_grad_norm_([p for m in modules.values() for p in m.parameters()], 1.0)  # a collective
            # A step has returned: no helper lane is lent or inside a wait (on a c10d operation).
            busy = [lane for lane in completion._LANES if lane.owner is not None or lane.current is not None]
            assert not busy, (kind, len(busy))
        schedules.append((sched, 0 in mine, rank == last))

    threads_before = sorted(n for n in _thread_names() if n in GLOO_THREADS)
    group = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    # No gc.collect(): the group must go when torch lets it go, as without pipetrain. The schedules
    # are still alive (as module globals of a script would be at its exit).
    gone = group() is None
    threads_after = sorted(n for n in _thread_names() if n in GLOO_THREADS)
    held = []
    functional = sys.modules.get("torch.distributed.nn.functional")
    if functional is not None:
        held = [
            name
            for name, fn in vars(functional).items()
            if any(isinstance(v, dist.ProcessGroup) for v in (getattr(fn, "__defaults__", None) or ()))
        ]
    # A schedule whose group was destroyed says so.
    sched, first, last_rank = schedules[0]
    try:
        sched.step(*((x,) if first else ()), target=x if last_rank else None)
        refused = ""
    except PipelineError as err:
        refused = str(err)
    return {
        "gone": gone,
        "threads before": threads_before,
        "threads after": threads_after,
        "defaults holding a group": held,
        "refused": refused,
        "schedules alive": len(schedules),
    }


@pytest.mark.slow
def test_destroy_process_group_ends_the_group_while_schedules_live() -> None:
    """1F1B, ZBV and a planned schedule trained (with a collective after each step) on 2 gloo
    ranks, still referenced: ``destroy_process_group()`` frees the default group at once and its
    gloo threads end (before the fix the group lived on until interpreter finalization)."""
    for rank, res in enumerate(run_ranks(_train_then_destroy, 2, timeout=240)):
        assert res["schedules alive"] == 3, (rank, res)
        assert res["defaults holding a group"] == [], (rank, res)
        assert res["gone"], (rank, res)
        if res["threads before"]:  # Linux: the gloo threads were there, and are gone
            assert res["threads after"] == [], (rank, res)
        assert "destroyed" in res["refused"], (rank, res)
