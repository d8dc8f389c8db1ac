"""Run a function on N gloo processes on 127.0.0.1 and collect what each rank returns.

Tests run many cases inside one process group (spawning costs seconds), so the worker function
usually loops over cases itself. A rank's exception is re-raised here with its traceback.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...], results: Any) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=120),
        )
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
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, results), daemon=True) for r in range(world)]
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
    if errors:
        raise AssertionError("a rank failed:\n" + "\n".join(errors))
    return [out[r] for r in range(world)]
