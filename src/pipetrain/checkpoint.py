"""Checkpoints that survive a crash and load into another pipeline layout.

A checkpoint is a ``torch.distributed.checkpoint`` (DCP) directory keyed by the *whole model's*
parameter names, which pipetrain's stages keep (``split_sequential``, the tracing frontend): the
model, the optimizer's state per parameter name, each rank's RNG state, the step and whatever the
caller adds (its data position). Nothing in it depends on which rank held which stage, so a job
saved by 2 ranks running ZBVZeroBubble resumes on 4 ranks running 1F1B, or in one process
without pipelining.

Writing is atomic: the ranks write into ``DIR/.partial-step_N`` and rank 0 renames it to
``DIR/step_N`` only once DCP's metadata (written last, after every rank's files) is there. A crash
while writing leaves a partial directory that nothing reads and the next save removes; the
previous checkpoint stays usable. The last ``keep`` checkpoints are kept. ``DIR`` must be visible
to every rank (one machine, or a shared file system).

Typical use, the same on every rank::

    ckpt = Checkpointer("ckpt", keep=2)
    start = ckpt.load(stages, optimizer).step      # 0 when ckpt/ holds none yet
    for step in range(start, steps):
        ...                                        # one training step
        if (step + 1) % 10 == 0:
            ckpt.save(step + 1, stages, optimizer)
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import random
import re
import shutil
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.storage import StorageWriter
from torch.distributed.distributed_c10d import PrefixStore, Store
from torch.distributed.rendezvous import rendezvous

from pipetrain.errors import PipelineError

__all__ = ["Checkpointer", "Resumed", "attempt_store", "init_process_group"]

_STEP_DIR = re.compile(r"^step_(\d+)$")
_PARTIAL = ".partial-"
_META = "pipetrain"  # the step, the caller's extra state and the saving layout (rank 0 writes it)
_LAST_BARRIER: list[Any] = []  # the work of the last barrier, kept until the next one (see _barrier)


@dataclass
class Resumed:
    """What :meth:`Checkpointer.load` restored: the step to continue from (0 when nothing was
    found), the ``extra`` dict given to :meth:`Checkpointer.save`, and the directory read."""

    step: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None


Modules = nn.Module | Any | Sequence[nn.Module | Any]  # modules, PipelineStages, or a list of them


class Checkpointer:
    """Save and resume a pipelined job under ``directory``; call every method on every rank.

    ``group``: the process group whose ranks hold the model between them (default: the default
    group; no group at all when ``torch.distributed`` is not initialised, for one process).
    """

    def __init__(self, directory: str | os.PathLike[str], *, keep: int = 2, group: dist.ProcessGroup | None = None):
        if keep < 1:
            raise PipelineError(f"keep must be at least 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self.group = group

    # ------------------------------------------------------------------ finding
    def checkpoints(self) -> list[Path]:
        """The complete checkpoints in the directory, oldest first."""
        if not self.directory.is_dir():
            return []
        found = []
        for entry in self.directory.iterdir():
            match = _STEP_DIR.match(entry.name)
            if match and (entry / ".metadata").is_file():
                found.append((int(match.group(1)), entry))
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        found = self.checkpoints()
        return found[-1] if found else None

    # ------------------------------------------------------------------ saving
    def save(
        self,
        step: int,
        modules: Modules,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        extra: dict[str, Any] | None = None,
    ) -> Path:
        """Write the state after ``step`` steps as ``DIR/step_<step>``; returns that path.

        ``modules``: this rank's stages (or their modules). ``extra``: anything picklable to get
        back from :meth:`load`, as rank 0 passes it (say, the data loader's position).
        """
        if step < 0:
            raise PipelineError(f"step must be >= 0, got {step}")
        rank, distributed = self._rank()
        final = self.directory / f"step_{step:09d}"
        partial = self.directory / f"{_PARTIAL}{final.name}"
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # left by a crash while writing this step before
            partial.mkdir(parents=True)
        self._barrier(distributed)
        state: dict[str, Any] = {}
        with self._all_or_none(distributed):
            mods = _modules(modules)
            state.update({f"model.{k}": v for k, v in _model_state(mods).items()})
            if optimizer is not None:
                state.update(_optimizer_state(mods, optimizer))
        state[f"rng.{rank}"] = _rng_state()
        if rank == 0:
            meta = {"step": step, "extra": dict(extra or {}), "world_size": self._world(distributed)}
            state[_META] = pickle.dumps(meta)
        previous = self.latest()
        with _single_process_quiet(), _as_pipeline_error(f"writing checkpoint {final} failed", previous):
            dcp_save(state, storage_writer=_writer(partial), process_group=self.group)
        if rank == 0:
            self._publish(partial, final)
        self._barrier(distributed)
        return final

    def _publish(self, partial: Path, final: Path) -> None:
        """Make ``partial`` the checkpoint ``final`` in one rename; drop older ones beyond ``keep``."""
        if final.exists():  # saved again after a restart: the new one replaces it
            stale = final.with_name(f"{_PARTIAL}old-{final.name}")
            shutil.rmtree(stale, ignore_errors=True)
            final.rename(stale)
            shutil.rmtree(stale, ignore_errors=True)
        partial.rename(final)
        _fsync_dir(self.directory)
        for old in self.checkpoints()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        for entry in self.directory.iterdir():
            if entry.name.startswith(_PARTIAL):  # a crash's leftovers: never read, never resumed from
                shutil.rmtree(entry, ignore_errors=True)

    # ------------------------------------------------------------------ loading
    def load(
        self,
        modules: Modules,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        path: str | os.PathLike[str] | None = None,
    ) -> Resumed:
        """Restore the newest complete checkpoint (or ``path``) into ``modules`` and ``optimizer``.

        Loads whatever parameters this rank holds, however the saving job had placed them. Each
        rank gets back the RNG state its rank had when saving (kept as it is on a rank the saving
        job did not have). Returns ``Resumed(step=0)`` when there is nothing to resume from.
        """
        rank, distributed = self._rank()
        chosen = Path(path) if path is not None else self.latest()
        if distributed:  # rank 0's choice: a checkpoint published meanwhile must not split the ranks
            box: list[Any] = [None if chosen is None else str(chosen)]
            dist.broadcast_object_list(box, group=self.group, group_src=0)
            chosen = None if box[0] is None else Path(box[0])
        if chosen is None:
            return Resumed()
        if not (chosen / ".metadata").is_file():
            raise PipelineError(f"{chosen} is not a complete checkpoint (no .metadata)")
        state: dict[str, Any] = {}
        with self._all_or_none(distributed):
            saved = FileSystemReader(str(chosen)).read_metadata().state_dict_metadata
            mods = _modules(modules)
            missing = []
            for name, tensor in _model_state(mods).items():
                if f"model.{name}" not in saved:
                    missing.append(name)
                state[f"model.{name}"] = tensor
            if missing:
                raise PipelineError(
                    f"{chosen} holds no {', '.join(missing[:3])}{' …' if len(missing) > 3 else ''}: "
                    "was it saved from another model? (keys are the whole model's parameter names)"
                )
            if optimizer is not None:
                state.update(_optimizer_placeholders(mods, optimizer, saved))
        rng_key = f"rng.{rank}"
        if rng_key in saved:
            state[rng_key] = b""
        state[_META] = b""
        with _single_process_quiet(), _as_pipeline_error(f"loading checkpoint {chosen} failed", None):
            dcp_load(state, storage_reader=FileSystemReader(str(chosen)), process_group=self.group)
        if optimizer is not None:
            _load_optimizer(mods, optimizer, state)
        if rng_key in saved:
            _set_rng_state(state[rng_key])
        meta = pickle.loads(state[_META])
        return Resumed(step=int(meta["step"]), extra=dict(meta["extra"]), path=chosen)

    # ------------------------------------------------------------------ helpers
    def _rank(self) -> tuple[int, bool]:
        distributed = dist.is_available() and dist.is_initialized()
        return (dist.get_rank(self.group) if distributed else 0), distributed

    def _world(self, distributed: bool) -> int:
        return dist.get_world_size(self.group) if distributed else 1

    @contextlib.contextmanager
    def _all_or_none(self, distributed: bool) -> Iterator[None]:
        """Raise on every rank if the block raised on any: a rank that stopped before DCP's
        collectives would leave the others waiting there."""
        error: Exception | None = None
        try:
            yield
        except Exception as exc:
            error = exc
        if distributed:
            told: list[Any] = [None] * self._world(distributed)
            dist.all_gather_object(
                told, None if error is None else f"{type(error).__name__}: {error}", group=self.group
            )
            failed = [(r, e) for r, e in enumerate(told) if e is not None]
            if failed and error is None:
                raise PipelineError("; ".join(f"rank {r}: {e}" for r, e in failed))
        if error is not None:
            raise error

    def _barrier(self, distributed: bool) -> None:
        """``dist.barrier``, its work kept until the next one: save() ends with it, often right
        before the program exits, and gloo's worker thread must not drop its last reference then.

        A gloo barrier holds (weakly) the works still in progress when it starts, here DCP's last
        broadcast, and the tensors of those die with it. Dropped last by the worker thread while
        the interpreter finalizes, they take the GIL there, Python ends that thread, and the
        process aborts ("terminate called without an active exception": torch 2.13, 1 run in 40
        of tests/runtime/test_restart_torchrun.py under load). Held here, they die on the main thread.
        """
        if distributed:
            work = dist.barrier(group=self.group, async_op=True)
            if work is not None:
                work.wait()
            _LAST_BARRIER[:] = [work]


@contextlib.contextmanager
def _as_pipeline_error(what: str, previous: Path | None) -> Iterator[None]:
    """DCP's CheckpointException (a BaseException, which ``except Exception`` misses) as a
    PipelineError naming each failed rank's error, on every rank."""
    try:
        yield
    except CheckpointException as err:
        failures = "; ".join(
            f"rank {r}: {type(exc[0] if isinstance(exc, tuple) else exc).__name__}: {exc[0] if isinstance(exc, tuple) else exc}"
            for r, exc in sorted(err.failures.items())
        )
        kept = f" ({previous} is still the latest checkpoint)" if previous is not None else ""
        raise PipelineError(f"{what}: {failures}{kept}") from err


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every call without a process group; one process is a use this module supports."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def attempt_store(timeout: float | timedelta = 300.0) -> Store:
    """torchrun's store, seen through a prefix naming this restart attempt.

    torch's elastic agent keeps one TCP store for the whole job, across restarts: the keys that
    the process group's rendezvous, its barriers and pipetrain's failure agreement wrote in the
    attempt that failed are still there, and a restarted group reads them (gloo connects to a
    dead rank's address and times out). Under a prefix per ``TORCHELASTIC_RESTART_COUNT`` every
    attempt starts from a clean store. Reads torchrun's environment (``MASTER_ADDR``, ...).
    """
    wait = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
    store, _, _ = next(rendezvous("env://", timeout=wait))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return store if attempt is None else PrefixStore(f"pipetrain/attempt{attempt}/", store)


def init_process_group(backend: str | None = None, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group`` that works again after torchrun restarts the job.

    Under torchrun (``TORCHELASTIC_RESTART_COUNT`` set, no ``store`` or ``init_method`` given) the
    group is made on :func:`attempt_store`; anywhere else this is torch's function as it is.
    """
    if (
        "TORCHELASTIC_RESTART_COUNT" in os.environ
        and "store" not in kwargs
        and kwargs.get("init_method") in (None, "env://")
    ):
        kwargs.pop("init_method", None)
        kwargs.update(
            store=attempt_store(kwargs.get("timeout", 300.0)),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
        )
    dist.init_process_group(backend, **kwargs)


def _writer(path: Path) -> StorageWriter:
    """The storage writer for one checkpoint (one file per rank; a seam for tests)."""
    return FileSystemWriter(str(path), single_file_per_rank=True, sync_files=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _modules(modules: Modules) -> list[nn.Module]:
    """The modules behind ``modules`` (stages give their submodule; DDP its wrapped module)."""
    items = list(modules) if isinstance(modules, Sequence) else [modules]
    out = []
    for item in items:
        module = getattr(item, "submodule", item)  # a PipelineStage
        module = getattr(module, "module", module) if type(module).__name__ == "DistributedDataParallel" else module
        if not isinstance(module, nn.Module):
            raise PipelineError(f"expected modules or PipelineStages, got {type(item).__name__}")
        out.append(module)
    return out


def _model_state(modules: list[nn.Module]) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for module in modules:
        state.update(module.state_dict())
    return state


def _param_names(modules: list[nn.Module], optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Per parameter group, the whole-model name of each of its parameters."""
    names = {id(p): n for m in modules for n, p in m.named_parameters()}
    out = []
    for group in optimizer.param_groups:
        try:
            out.append([names[id(p)] for p in group["params"]])
        except KeyError:
            raise PipelineError("the optimizer holds a parameter that none of the given modules has") from None
    return out


def _optimizer_state(modules: list[nn.Module], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name: ``optim.state.<name>.<key>`` (tensors and
    values) and ``optim.group.<name>.<hyperparameter>``, so any regrouping loads it."""
    saved = optimizer.state_dict()
    out: dict[str, Any] = {}
    for names, group in zip(_param_names(modules, optimizer), saved["param_groups"], strict=True):
        hyper = {k: v for k, v in group.items() if k != "params"}
        for name, index in zip(names, group["params"], strict=True):
            out[f"optim.group.{name}"] = pickle.dumps(hyper)
            for key, value in saved["state"].get(index, {}).items():
                out[f"optim.state.{name}.{key}"] = value if isinstance(value, torch.Tensor) else pickle.dumps(value)
    return out


def _optimizer_placeholders(
    modules: list[nn.Module], optimizer: torch.optim.Optimizer, saved: dict[str, Any]
) -> dict[str, Any]:
    """Tensors shaped as saved (DCP loads into them) and slots for the pickled values.

    A state tensor shaped like its parameter is made like it (device, and the sharding of an
    FSDP2 parameter, so DCP loads just this rank's shard); others (Adam's step) as saved.
    """
    by_name: dict[str, list[tuple[str, Any]]] = {}
    for key, meta in saved.items():
        if key.startswith("optim.state."):
            by_name.setdefault(key[len("optim.state.") :].rsplit(".", 1)[0], []).append((key, meta))
    out: dict[str, Any] = {}
    for names, group in zip(_param_names(modules, optimizer), optimizer.param_groups, strict=True):
        for name, param in zip(names, group["params"], strict=True):
            for key, meta in by_name.get(name, []):
                if not isinstance(meta, TensorStorageMetadata):
                    out[key] = b""
                elif tuple(meta.size) == tuple(param.shape):
                    out[key] = torch.empty_like(param, dtype=meta.properties.dtype)
                else:
                    out[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
            if f"optim.group.{name}" in saved:
                out[f"optim.group.{name}"] = b""
    return out


def _load_optimizer(modules: list[nn.Module], optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    current = optimizer.state_dict()
    current["state"] = {}
    by_name: dict[str, dict[str, Any]] = {}
    for key, value in state.items():
        if key.startswith("optim.state."):
            name, leaf = key[len("optim.state.") :].rsplit(".", 1)
            by_name.setdefault(name, {})[leaf] = value if isinstance(value, torch.Tensor) else pickle.loads(value)
    for names, group in zip(_param_names(modules, optimizer), current["param_groups"], strict=True):
        for name, index in zip(names, group["params"], strict=True):
            if name in by_name:
                current["state"][index] = by_name[name]
        hyper_key = next((f"optim.group.{n}" for n in names if f"optim.group.{n}" in state), None)
        if hyper_key is not None:  # regrouped parameters take their group's first parameter's values
            group.update({k: v for k, v in pickle.loads(state[hyper_key]).items() if k != "params"})
    optimizer.load_state_dict(current)


def _rng_state() -> bytes:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _set_rng_state(raw: bytes) -> None:
    state = torch.load(io.BytesIO(raw), weights_only=False)
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
