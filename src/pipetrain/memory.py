"""What a step really holds: each rank's measured peak memory, beside the plan's promise.

The planner promises memory (:func:`pipetrain.plan.simulate`'s ``peak_memory_bytes``, whose
model :mod:`pipetrain.plan.memory` states); this module measures it on a real rank so the two
can be put side by side:

- on a GPU, ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``: exact;
- on the CPU, the bytes glibc's allocator has handed out (``mallinfo2``: every thread and arena,
  mmapped blocks included), read after every action of the step and by a sampling thread in
  between. Readings are points, so a peak inside an action can be missed: the measure is a
  lower bound of the true peak, tight at action boundaries, where the model's peaks lie.

``measure_step(schedule, *args, **kwargs)`` runs one ``step`` and returns its output with the
peak bytes above those allocated when it began; :func:`stage_bytes` measures the per-stage byte
costs (activations, what a split backward keeps for W, the output message, an action's
transient) that :class:`~pipetrain.plan.Costs` takes, the same way.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from pipetrain.errors import PipelineError

__all__ = ["MemoryMeter", "StepMemory", "allocated_bytes", "measure_step", "retain_freed_memory", "stage_bytes"]


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _load_mallinfo() -> Callable[[], _MallInfo2] | None:
    fn: Callable[[], _MallInfo2] | None = getattr(_libc(), "mallinfo2", None)
    if fn is not None:
        fn.restype = _MallInfo2  # type: ignore[attr-defined]
    return fn


_MALLINFO = _load_mallinfo()

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_MMAP_THRESHOLD_MAX = 32 << 20  # the largest glibc takes on a 64-bit machine
_TRIM_THRESHOLD = 1 << 30


def retain_freed_memory() -> bool:
    """Keep the memory that large CPU tensors free in this process instead of giving it back to
    the operating system (glibc: mmap threshold 32 MiB, trim threshold 1 GiB), as torch's caching
    allocator does on a GPU. False where the C library is not glibc (nothing changed).

    By default glibc maps each large block afresh and trims the heap's free top, so a tensor
    allocated again every step page-faults its memory in every time. Measured on the bpe preset:
    a head's backward (4 MiB logits gradients) took 1.4x longer timed in a profile, one microbatch
    at a time, than in a pipeline, whose live activations keep the heap from shrinking; with
    freed memory retained both agree, and ZB-V's training step ran 3-4 % faster. The bytes in use
    (:func:`allocated_bytes`) do not change; the process's resident size stays at its peak.
    Blocks over 32 MiB (the most glibc allows) are still mapped afresh each time.
    Process-wide: ``pipetrain train`` and :func:`pipetrain.profile_layers` set it on the CPU."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None or _MALLINFO is None:  # (mallinfo2 tells glibc from other C libraries)
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))


def allocated_bytes(device: torch.device | str = "cpu") -> int:
    """Bytes allocated now: by torch's caching allocator on a GPU, by glibc's ``malloc`` (every
    thread) on the CPU. Raises where the CPU has no ``mallinfo2`` (not glibc ≥ 2.33)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    if _MALLINFO is None:
        raise PipelineError("measuring CPU memory needs glibc's mallinfo2 (glibc 2.33 or later), not found here")
    info = _MALLINFO()
    return int(info.uordblks + info.hblkhd)


class MemoryMeter:
    """Peak bytes allocated while it is entered, above those allocated when it was entered.

    ``observe()`` takes a reading (the runtimes call it after every action while a meter is
    attached with :meth:`attached`); on the CPU a thread also reads every ``interval`` seconds.
    """

    def __init__(self, device: torch.device | str = "cpu", interval: float = 0.0005) -> None:
        self.device = torch.device(device)
        self.interval = interval
        self.start_bytes = 0
        self.peak_bytes = 0  # above start_bytes
        self._high = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def observe(self) -> None:
        if self.device.type != "cuda":
            now = allocated_bytes(self.device)
            if now > self._high:
                self._high = now

    def __enter__(self) -> MemoryMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_bytes = self._high = allocated_bytes(self.device)
            return self
        self.start_bytes = self._high = allocated_bytes(self.device)
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True, name="pipetrain-memory")
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.observe()

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._high = int(torch.cuda.max_memory_allocated(self.device))
        else:
            self._stop.set()
            if self._thread is not None:
                self._thread.join()
            self.observe()
        self.peak_bytes = max(0, self._high - self.start_bytes)

    @contextmanager
    def attached(self, schedule: Any) -> Iterator[MemoryMeter]:
        """Enter the meter with ``schedule``'s executors reading it after every action."""
        executors = _executors(schedule)
        for executor in executors:
            executor.observe = self.observe
        try:
            with self:
                yield self
        finally:
            for executor in executors:
                executor.observe = None


def _executors(schedule: Any) -> list[Any]:
    """The executors of a distributed schedule (its one) or of a LocalPipeline (every rank's)."""
    one = getattr(schedule, "_executor", None)
    return [one] if one is not None else list(getattr(schedule, "_executors", []))


@dataclass
class StepMemory:
    """One measured step: its output and its peak bytes above those allocated when it began."""

    output: Any
    peak_bytes: int
    start_bytes: int


def measure_step(schedule: Any, *args: Any, device: torch.device | str | None = None, **kwargs: Any) -> StepMemory:
    """Run ``schedule.step(*args, **kwargs)`` and measure this rank's peak memory over it.

    ``device`` defaults to the device of the schedule's first stage. Compare ``peak_bytes`` with
    ``simulate(schedule.schedule, costs).peak_memory_bytes[rank]`` for costs with byte sizes
    (static bytes left out: they were allocated before the step began).
    """
    if device is None:
        stages = getattr(schedule, "_stage_list", None) or list(getattr(schedule, "stages", {}).values())
        device = stages[0].device if stages else "cpu"
    meter = MemoryMeter(device)
    with meter.attached(schedule):
        output = schedule.step(*args, **kwargs)
    return StepMemory(output, meter.peak_bytes, meter.start_bytes)


def stage_bytes(
    module: torch.nn.Module,
    example: torch.Tensor,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
    device: torch.device | str = "cpu",
    first: bool = False,
) -> dict[str, int]:
    """Bytes one microbatch of ``example`` makes a stage running ``module`` hold, measured by the
    allocator as the runtime runs the stage; the keys are :class:`~pipetrain.plan.Costs`' fields:

    - ``activation_bytes``: what its forward leaves allocated, its output included (with
      ``loss_fn`` the stage is a last stage and what the loss keeps counts too);
    - ``weight_grad_bytes``: what stays from the forward's start once its input-gradient backward
      (I) ran, until W: W's inputs and output gradients. ``first``: the pipeline's first stage,
      whose input (the step's data, or any input that is not floating point) takes no gradient:
      its I has nothing to compute and W runs the whole backward, so it holds the activations and
      the output gradient it was given;
    - ``message_bytes``: its output;
    - ``transient_bytes``: the most one of its F (with the loss), I or W allocates beyond what is
      held before and after it, freed by its end (the model adds it to what the rank holds while
      one of these runs);
    - ``b_transient_bytes``: the same for the backward in one pass, B (the model adds it while a
      B runs): it makes the input and the weight gradients together, so its temporaries exceed
      I's (Linear + Tanh stages: 148 KB against 66 KB a 64 KB microbatch; with an MSE loss 262 KB
      against 66 KB), and a schedule that runs only I and W is not charged them.

    Held bytes are growth: what one and then three microbatches held together make the allocator
    hand out, per microbatch (a single microbatch's reading misses the small blocks the allocator
    reuses, about 3 % of a Linear + Tanh stage's activations, and a process's first backward's
    one-off allocations, which doubled it), after one microbatch run whole to warm up. The input
    is not counted: on a first stage it is the caller's data, elsewhere the received message,
    which the memory model holds as a buffer. The module's gradients are restored."""
    from pipetrain.layer_profile import _Workspace
    from pipetrain.stage import PipelineStage

    device = torch.device(device)
    first = first or not example.is_floating_point()
    index, count = (0 if first else 1, 3) if loss_fn is None else ((0, 1) if first else (2, 3))
    grads = {p: p.grad for p in module.parameters()}
    for p in grads:  # gradients are static memory: made before the measurement, not counted in it
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    workspace, b_workspace = _Workspace(device), _Workspace(device)

    def run(k: int, timed: bool = False, whole: bool = False) -> tuple[int, int, int]:
        """(held after k forwards, held after their I, the output's bytes); ``whole``: each
        backward in one pass (B) instead of I then W (what is held after it is then 0);
        ``timed``: each action's workspace noted (``whole``: only B's, in ``b_workspace``)."""
        stage = PipelineStage(module, index, count, device)
        xs = [example.detach().to(device) for _ in range(k)]
        xs = xs if first else [x.clone().requires_grad_() for x in xs]

        backward_into = b_workspace if whole else workspace  # B's workspace, or I's

        def call(fn: Callable[..., Any], *args: Any, into: Any = workspace) -> Any:
            return into.run(fn, *args) if timed else fn(*args)

        def forward(mb: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            out = stage.forward_one_chunk(mb, (x,), {})
            if not isinstance(out, torch.Tensor):
                raise PipelineError("stage_bytes measures a module whose output is one tensor")
            return out, (loss_fn(out, target) if loss_fn is not None else None)

        def backward(mb: int, grad: torch.Tensor | None, loss: torch.Tensor | None) -> None:
            if loss is not None:
                stage.backward_one_chunk(mb, loss=loss, full=whole)
            else:
                stage.backward_one_chunk(mb, grad_outputs=[grad], full=whole)

        with torch.enable_grad():
            before = allocated_bytes(device)
            made = [call(forward, mb, x) for mb, x in enumerate(xs)]
            held = allocated_bytes(device) - before
            message = made[0][0].untyped_storage().nbytes()
            # The output gradient arrives before I (a message): not I's workspace; held after it
            # only where W keeps it (a first stage's).
            given = [None if loss is not None else torch.ones_like(out) for out, loss in made]
            for mb, ((_, loss), grad) in enumerate(zip(made, given, strict=True)):
                call(backward, mb, grad, loss, into=backward_into)
            del made, given, loss, grad
            kept = allocated_bytes(device) - before
            for mb in range(k if not whole else 0):
                call(stage.backward_weight_one_chunk, mb)
        return held, kept, message

    try:
        run(1)  # warm up: a process's first forward and backward allocate for good
        run(1, timed=True)
        run(1, timed=True, whole=True)
        one, three = run(1), run(3)
    finally:
        for p, g in grads.items():
            p.grad = g
    return {
        "activation_bytes": max(0, (three[0] - one[0]) // 2),
        "weight_grad_bytes": max(0, (three[1] - one[1]) // 2),
        "message_bytes": one[2],
        "transient_bytes": int(workspace.bytes or 0),
        "b_transient_bytes": int(b_workspace.bytes or 0),
    }
