"""The send-waiting helper threads: shared by every schedule of a process, never woken at exit.

A thread per schedule outlived its schedule (a program that built 30 schedules kept 31 threads);
stopping it with its schedule made it wake at interpreter exit and abort the process ("terminate
called without an active exception"). Helper threads are now lanes lent to a schedule while it
has jobs on them (completion.py explains why that is safe at exit).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipetrain.runtime.transport import completion
from pipetrain.runtime.transport.completion import Waiter
from support.dist import run_ranks
from support.exits import spawned_train, torchrun_train

WIDTH = 4


class _Work:
    """A stand-in for a ``torch.distributed`` work that completes when told to."""

    def __init__(self, done: bool = True) -> None:
        self.event = threading.Event()
        if done:
            self.event.set()

    def wait(self, *timeout: Any) -> bool:
        if not self.event.wait(timeout[0].total_seconds() if timeout else None):
            raise RuntimeError("Timed out")
        return True


def _helpers() -> int:
    return sum(t.name == "pipetrain-sends" and t.is_alive() for t in threading.enumerate())


def _waiter() -> Waiter:
    return Waiter(None, timeout=30.0, poll=0.01, where=lambda: "rank 0")


def test_waiters_share_one_lane_and_an_idle_lane_holds_nothing() -> None:
    before = _helpers()
    for _ in range(10):
        waiter = _waiter()
        work = _Work()
        waiter.background([work], keep=None, on_done=None, what="a send")
        waiter.drain()
        ref = weakref.ref(work)
        del waiter, work
        assert ref() is None  # nothing keeps the step's works: the lane that waited holds none
    assert _helpers() <= max(before, 1)


def test_a_lane_stuck_on_a_dead_peer_is_replaced_then_reused() -> None:
    """After a failure the abandoned wait keeps its lane until it ends; the next schedule gets another."""
    first = _waiter()
    stuck = _Work(done=False)
    first._bg.put(completion._Job([stuck], "a send to a dead peer"))  # the step failed: never drained
    first.close()
    second = _waiter()
    second.background([_Work()], keep=None, on_done=None, what="a send")
    second.drain()
    assert second._bg.lane is not first._bg.lane  # the stuck lane was not lent again
    lanes = len(completion._LANES)
    stuck.event.set()  # the dead peer's connection closes: the wait ends and frees the lane
    deadline = time.monotonic() + 10
    while first._bg.lane is not None and first._bg.lane.owner is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    for _ in range(5):
        third = _waiter()
        third.background([_Work()], keep=None, on_done=None, what="a send")
        third.drain()
    assert len(completion._LANES) == lanes


def test_jobs_of_one_waiter_run_in_order_on_its_lane() -> None:
    """A waiter's jobs queue behind each other (as on one thread); another waiter is not held up."""
    slow_waiter, other = _waiter(), _waiter()
    gate = _Work(done=False)
    order: list[str] = []
    slow_waiter._bg.put(completion._Job([gate], "first", on_done=lambda: order.append("first")))
    slow_waiter._bg.put(completion._Job([_Work()], "second", on_done=lambda: order.append("second")))
    other.background([_Work()], keep=None, on_done=None, what="elsewhere")
    other.drain()  # its own lane: not behind the gated job
    assert slow_waiter._bg.lane is not other._bg.lane
    gate.event.set()
    deadline = time.monotonic() + 10
    while len(slow_waiter._finished) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    slow_waiter.run_callbacks()
    assert order == ["first", "second"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_starts_lanes_of_its_own() -> None:
    """A child has none of its parent's threads: a lane it inherited by name would never run."""
    waiter = _waiter()
    waiter.background([_Work()], keep=None, on_done=None, what="a send")
    waiter.drain()  # the parent has a lane
    pid = os.fork()
    if pid == 0:  # the child: a wait that hung on the parent's lane would never end
        code = 1
        try:
            child = _waiter()
            child.background([_Work()], keep=None, on_done=None, what="a send")
            child.drain()
            code = 0 if len(completion._LANES) == 1 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def _build_step_drop(rank: int, world: int) -> dict[str, int]:
    from pipetrain import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleZBVZeroBubble,
    )

    def threads() -> dict[str, int]:
        return {
            "python": threading.active_count(),
            "helpers": _helpers(),
            "os": len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0,
        }

    def build(i: int) -> Any:
        kind = i % 4
        if kind in (0, 1):
            stage = PipelineStage(nn.Linear(WIDTH, WIDTH), rank, world, "cpu")
            cls = Schedule1F1B if kind == 0 else ScheduleGPipe
            return cls(stage, 4, loss_fn=nn.functional.mse_loss, timeout=60)
        mine = [rank, rank + world] if kind == 2 else [rank, 2 * world - 1 - rank]
        stages = [PipelineStage(nn.Linear(WIDTH, WIDTH), s, 2 * world, "cpu") for s in mine]
        cls = ScheduleInterleaved1F1B if kind == 2 else ScheduleZBVZeroBubble
        return cls(stages, 4, loss_fn=nn.functional.mse_loss, timeout=60)

    def last_rank(i: int) -> int:
        return 0 if i % 4 == 3 else world - 1  # ZBV's V ends on rank 0

    torch.manual_seed(0)
    x = torch.randn(8, WIDTH)
    # A first schedule starts the lane; ten more (built, stepped twice, evaluated, dropped) add none.
    schedule = build(0)
    schedule.step(*((x,) if rank == 0 else ()), target=x if rank == world - 1 else None)
    del schedule
    before = threads()
    for i in range(10):
        schedule = build(i)
        for _ in range(2):
            schedule.step(*((x,) if rank == 0 else ()), target=x if rank == last_rank(i) else None)
        schedule.eval(*((x,) if rank == 0 else ()))
        del schedule  # no gc.collect(): a lane does not wait for its schedule to be collected
    after = threads()
    gc.collect()
    return {**{f"{k} before": v for k, v in before.items()}, **{f"{k} after": v for k, v in after.items()}}


@pytest.mark.slow
def test_dropped_schedules_leave_no_thread_behind() -> None:
    """Ten schedules built, stepped and dropped on 2 gloo ranks: the thread count does not grow (it
    grew by one per schedule: helper-25 counted 31 threads after 30 schedules)."""
    for rank, res in enumerate(run_ranks(_build_step_drop, 2, timeout=180)):
        assert res["helpers before"] == res["helpers after"] == 1, (rank, res)
        assert res["python after"] == res["python before"], (rank, res)
        assert res["os after"] == res["os before"], (rank, res)


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["spawn", "torchrun"])
def test_training_runs_exit_cleanly(launch: str, tmp_path: Path) -> None:
    """``pipetrain train`` (spawned, and under torchrun) exits with 0 and nothing on stderr, three
    times in a row (the helper thread stopped with its schedule aborted 3 of 10 spawned runs at exit;
    ``python tests/support/exits.py`` runs this loop 20 times)."""
    run = spawned_train if launch == "spawn" else torchrun_train
    for i in range(3):
        rc, err = run(tmp_path / f"run{i}")
        assert rc == 0 and err == "", (i, rc, err[-3000:])


FAILS_WITH_SENDS_PENDING = """
import os, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
from torch import nn
import pipetrain

rank, port = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)
store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)


class Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.3)  # rank 1 meanwhile sent every gradient and waits for those sends at its step's end
        raise ValueError("bug in the backward")


class FailsInStep2(nn.Linear):
    calls = 0

    def forward(self, x):
        self.calls += 1
        out = super().forward(x)
        return Boom.apply(out) if self.calls > 8 else out


torch.manual_seed(0)
module = FailsInStep2(4, 4) if rank == 0 else nn.Linear(4, 4)
sched = pipetrain.ScheduleGPipe(pipetrain.PipelineStage(module, rank, 2, "cpu"), 8, loss_fn=nn.functional.mse_loss)
x = torch.randn(16, 4)
sched.step(*((x,) if rank == 0 else ()), target=x if rank == 1 else None)
try:
    sched.step(*((x,) if rank == 0 else ()), target=x if rank == 1 else None)
except pipetrain.PipelineError as err:
    print(err, flush=True)
if rank == 1:
    store.set("rank 1 leaves", "1")
    sys.exit(3)  # under test: its lane waits on its sends to rank 0
store.wait(["rank 1 leaves"])  # the store is rank 0's: it leaves last
time.sleep(0.05)
os._exit(3)  # closes the connection while rank 1 exits
"""


@pytest.mark.slow
def test_a_rank_that_failed_with_sends_pending_exits_with_its_code(tmp_path: Path) -> None:
    """Rank 0's backward fails while rank 1 waits at its step's end for its sends of gradients
    (a helper lane waits on them); rank 1 leaves with its own exit code. The lane's wait, abandoned,
    ended when rank 0's exit closed the connection, while rank 1's interpreter finalized: SIGABRT
    ("terminate called without an active exception"). Now such waits are ended at exit, before
    the interpreter finalizes (it aborted in 8 of 8 runs before)."""
    from pipetrain.train.launch import free_port

    script = tmp_path / "fails.py"
    script.write_text(FAILS_WITH_SENDS_PENDING)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    port = str(free_port())
    cmd = [sys.executable, str(script)]
    procs = [
        subprocess.Popen([*cmd, str(r), port], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in (0, 1)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for rank, (proc, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        text = out.decode() + err.decode()
        assert b"bug in the backward" in out, (rank, text)
        assert proc.returncode == 3 and b"terminate called" not in err, (rank, proc.returncode, text)
