"""Start a benchmark on local ranks (two unless told) and collect what rank 0 reports."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def run_on_two_ranks(target: Callable[..., None], *args: Any) -> Any:
    """Run ``target(rank, port, results, *args)`` in 2 spawned processes; return what rank 0 put in ``results``."""
    return run_on_ranks(target, 2, *args)


def run_on_ranks(target: Callable[..., None], world: int, *args: Any) -> Any:
    """Run ``target(rank, port, results, *args)`` in ``world`` spawned processes; return rank 0's report."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.get_context("spawn")
    results: mp.Queue[object] = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, port, results, *args)) for r in range(world)]
    for p in procs:
        p.start()
    rows = results.get()
    for p in procs:
        p.join()
    return rows
