"""Run a function on N gloo processes on 127.0.0.1 and collect what each rank returns.

Tests run many cases inside one process group (spawning costs seconds), so the worker function
usually loops over cases itself. A rank's exception is re-raised here with its traceback; a rank still running when the time is
up has its threads' stacks dumped (faulthandler) into the error, so a hang names where it waits.
"""

from __future__ import annotations

import faulthandler
import os
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(
    rank: int,
    world: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    stacks: str,
    dump_after: float,
) -> None:
    torch.set_num_threads(1)
    dump = open(stacks, "w")  # faulthandler writes here until the process ends
    faulthandler.dump_traceback_later(dump_after, file=dump)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        # The store lives in the parent: a rank that finishes first cannot take it down with it.
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=120))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
        value = fn(rank, world, *args)
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()  # flush the result before leaving
        # Skip destroy_process_group: after an intended failure it may wait on dead peers.
        os._exit(0)


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` spawned gloo ranks; the list of their return values."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    port = store.port
    tmp = tempfile.mkdtemp(prefix="pipetrain-ranks-")
    stacks = [os.path.join(tmp, f"rank{r}.stacks") for r in range(world)]
    dump_after = max(timeout - 5.0, 1.0)
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, fn, args, results, stacks[r], dump_after), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(errors) < world:
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                if time.monotonic() > deadline:
                    errors.append(f"timed out after {timeout:g} s; ranks {sorted(out)} finished")
                    errors.extend(_stacks(r, stacks[r]) for r in range(world) if r not in out)
                    break
                if all(p.exitcode is not None for p in procs):
                    errors.append(f"every rank exited; only ranks {sorted(out)} reported (a rank crashed)")
                    break
                continue
            if ok:
                out[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
        del store  # only now: every rank has stopped using it
    if errors:
        raise AssertionError("a rank failed:\n" + "\n".join(errors))
    return [out[r] for r in range(world)]


def _stacks(rank: int, path: str) -> str:
    """What rank ``rank`` was doing when the time ran out (its faulthandler dump)."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        text = ""
    return f"--- rank {rank} stacks ---\n{text or '(none dumped)'}"
