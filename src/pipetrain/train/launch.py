"""Where the ranks come from: torchrun's environment, or local processes spawned here.

Under ``torchrun`` (RANK, WORLD_SIZE, MASTER_ADDR … set) this process is one rank of the job and
the process group is made from that environment, so the same command trains across nodes.
Otherwise ``spawn`` starts one process per rank on 127.0.0.1 and turns a failure in any of
them into one :class:`PipelineError` in the caller.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException, start_processes

from pipetrain.checkpoint import attempt_store
from pipetrain.errors import PipelineError
from pipetrain.memory import retain_freed_memory

__all__ = ["DistEnv", "free_port", "init_process_group", "spawn", "torchrun_env"]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job. ``init_method`` None means ``env://`` (torchrun)."""

    rank: int
    world_size: int
    local_rank: int
    init_method: str | None = None


def torchrun_env(environ: dict[str, str] | None = None) -> DistEnv | None:
    """The rank torchrun gave this process, or None when not launched by torchrun."""
    env = os.environ if environ is None else environ
    if not all(name in env for name in _TORCHRUN_VARS):
        return None
    try:
        rank = int(env["RANK"])
        world = int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", "0"))
    except ValueError as err:
        raise PipelineError(f"torchrun environment is malformed: {err}") from None
    if not 0 <= rank < world:
        raise PipelineError(f"torchrun environment: RANK={rank} is not in [0, WORLD_SIZE={world})")
    return DistEnv(rank=rank, world_size=world, local_rank=local, init_method=None)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the spawned ranks' rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def no_cuda_reason() -> str:
    """Why torch sees no GPU, in words a user can act on."""
    if torch.version.cuda is None:
        return (
            f"torch {torch.__version__} is a CPU-only build; install a CUDA build of torch "
            "(https://pytorch.org/get-started/locally/)"
        )
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f" (CUDA_VISIBLE_DEVICES={hidden!r})" if hidden is not None else ""
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU{where}: check the driver (nvidia-smi)"


def init_process_group(env: DistEnv, device: str, timeout_s: float = 300.0) -> torch.device:
    """Join the job: gloo on CPU (one thread per rank), NCCL on CUDA (one GPU per local rank)."""
    if device == "cuda":
        if not torch.cuda.is_available():
            raise PipelineError(f"rank {env.rank}: --device cuda, but {no_cuda_reason()}")
        if env.local_rank >= torch.cuda.device_count():
            raise PipelineError(
                f"rank {env.rank}: local rank {env.local_rank} needs a GPU, only {torch.cuda.device_count()} visible"
            )
        torch.cuda.set_device(env.local_rank)
        dev = torch.device("cuda", env.local_rank)
        backend = "nccl"
    elif device == "cpu":
        torch.set_num_threads(1)
        retain_freed_memory()  # (no page faults for each step's large temporaries)
        dev = torch.device("cpu")
        backend = "gloo"
    else:
        raise PipelineError(f"device must be 'cpu' or 'cuda', got {device!r}")
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=timeout_s)}
    if env.init_method is not None:
        kwargs.update(init_method=env.init_method, rank=env.rank, world_size=env.world_size)
    else:
        kwargs.update(store=attempt_store(timeout_s), rank=env.rank, world_size=env.world_size)
    if backend == "nccl":
        kwargs["device_id"] = dev
    dist.init_process_group(backend, **kwargs)
    return dev


def _child(local_rank: int, fn: Callable[..., Any], world: int, port: int, args: tuple[Any, ...]) -> None:
    env = DistEnv(rank=local_rank, world_size=world, local_rank=local_rank, init_method=f"tcp://127.0.0.1:{port}")
    fn(env, *args)


def spawn(fn: Callable[..., Any], nprocs: int, *args: Any) -> None:
    """Run ``fn(env, *args)`` in ``nprocs`` fresh processes, one rank each; re-raise the first failure.

    ``fn`` must be importable (a module-level function): the processes are started with the
    "spawn" method so that torch and the rendezvous start clean in each.
    """
    if nprocs < 1:
        raise PipelineError(f"need at least one rank, got {nprocs}")
    port = free_port()
    # torch logs a warning per surviving process it stops after a failure; the error says enough.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    try:
        # torch leaves start_processes unannotated
        start_processes(_child, args=(fn, nprocs, port, args), nprocs=nprocs, join=True, start_method="spawn")  # type: ignore[no-untyped-call]
    except ProcessRaisedException as err:
        raise PipelineError(f"rank {err.error_index} failed: {_last_line(str(err))}") from None
    except ProcessExitedException as err:
        raise PipelineError(f"rank {err.error_index} exited with code {err.exit_code}") from None


def _last_line(traceback_text: str) -> str:
    lines = [line for line in traceback_text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else traceback_text
