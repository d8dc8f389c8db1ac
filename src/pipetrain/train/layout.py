"""Where the layers go, what the plan promises a step holds, and what a step really held.

Every run of ``pipetrain train`` and ``pipetrain profile`` starts with rank 0 measuring every layer of
the model (:func:`pipetrain.profile_layers`; the others wait, then everyone agrees on the message
latency). Under ``--schedule auto`` that profile is what rank 0 plans from (:mod:`pipetrain.train.auto`);
with a named schedule or a schedule file the model is cut evenly (:func:`~pipetrain.train.model.even_cut`)
and the profile only prices that cut. Either way rank 0 simulates the schedule that will run, on
the cut's costs, and so knows the peak bytes each rank should hold (``simulate``'s memory model,
docs/semantics.md). One step is then measured on every rank (:class:`pipetrain.memory.MemoryMeter`:
glibc's allocated bytes on the CPU, ``max_memory_allocated`` on a GPU) and the two are reported
side by side.

What is compared: the meter counts bytes allocated *during* the step, above those held when it
began. At that point a rank already holds its weights and Adam's state (after the first step), not
its gradients (they are set to None after each update), so the promise it is compared with is the
simulated peak less the static bytes plus the gradients: activations, messages, recompute's
rebuild and the gradients, all of which a step allocates.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.errors import PipelineError
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.schedule import Schedule
from pipetrain.train.auto import LayerPlan
from pipetrain.train.data import TextData
from pipetrain.train.launch import DistEnv
from pipetrain.train.model import GPT, GPTConfig, lm_loss

if TYPE_CHECKING:
    from pipetrain.train.loop import TrainConfig

__all__ = ["Layout", "MemoryCheck", "layout"]


@dataclass
class Layout:
    """The run's schedule and model, every stage's module and its layer names; on rank 0 the layer
    profile (empty if it failed: ``profile_error`` says why) and the latency between ranks."""

    schedule: Schedule
    model_config: GPTConfig
    parts: list[nn.Module]
    stage_layers: list[list[str]]
    plan: LayerPlan | None = None
    layers: list[Any] = field(default_factory=list)
    comm: float = 0.0
    profile_error: str | None = None
    promise: dict[str, Any] | None = None  # the simulated step, term by term (time_promise.step_promise)


def layout(env: DistEnv, cfg: TrainConfig, device: torch.device, data: TextData) -> Layout:
    """The schedule, the model's sizes and every stage's module (and, under ``--schedule auto``, the
    plan). A collective: rank 0 profiles the layers while the others wait."""
    from pipetrain.train.auto import is_auto
    from pipetrain.train.loop import plan_for

    if is_auto(cfg.schedule):
        return _auto_layout(env, cfg, device, data)
    schedule = plan_for(cfg, env.world_size)
    mcfg = cfg.model_config_for(schedule.num_stages)
    torch.manual_seed(cfg.seed)
    model = GPT(mcfg)
    parts: list[nn.Module] = list(model.split(schedule.num_stages))
    layers, latency, error = _layer_profile(env, cfg, model, data, device)
    posts = _message_posts(cfg, model, device)
    if cfg.activation_checkpointing:
        from pipetrain.recompute import recompute
        from pipetrain.train.model import Block

        for block in [m for part in parts for m in part.modules() if isinstance(m, Block)]:
            recompute(block)
    model.to("cpu")
    stage_layers = _cut_names(model, parts)
    recomputed = list(range(len(parts))) if cfg.activation_checkpointing else []
    promise = _share_promise(env, schedule, layers, stage_layers, recomputed, latency, posts, error)
    if cfg.layers_out is not None and env.rank == 0:
        from pipetrain.train.auto import write_layers

        if error is not None:
            raise PipelineError(error)
        write_layers(cfg.layers_out, layers, cfg, latency)
    return Layout(schedule, mcfg, parts, stage_layers, None, layers, latency, error, promise)


def _auto_layout(env: DistEnv, cfg: TrainConfig, device: torch.device, data: TextData) -> Layout:
    """``--schedule auto``: rank 0 profiles the model's layers and plans; every rank gets the plan and
    cuts its model by it."""
    from pipetrain.plan.pipeline.layers import with_optimizer
    from pipetrain.train.auto import (
        build_stages,
        machine_memory_per_rank,
        plan_layers,
        share_plan,
    )

    mcfg = cfg.auto_model_config(env.world_size)
    torch.manual_seed(cfg.seed)
    model = GPT(mcfg)
    layers, latency, error = _layer_profile(env, cfg, model, data, device)
    posts = _message_posts(cfg, model, device)
    plan: LayerPlan | str | None = None
    if env.rank == 0:
        if error is not None:
            plan = error
        else:
            if cfg.memory_limit is not None:
                limit, source = cfg.memory_limit, "--memory-limit"
            else:
                limit, source = machine_memory_per_rank(device)
            stages = 2 * env.world_size  # the named schedule to compare with: ZB-V on the default (even) cut
            even = _cut_names(model, list(model.split(stages))) if len(model) >= stages else None
            try:
                timed = with_optimizer(layers, cfg.microbatches)
                plan = plan_layers(
                    timed,
                    env.world_size,
                    cfg.microbatches,
                    limit,
                    source,
                    stages_per_rank=cfg.stages_per_rank,
                    placement=cfg.placement,
                    comm=latency,
                    time_limit=cfg.plan_time_limit,
                    baseline=("ZBVZeroBubble", even) if even is not None else None,
                )
                # The summary keeps the profile as measured, and the optimizer's share planned with.
                plan.summary["layers"] = [layer.to_dict() for layer in layers]
                plan.summary["optimizer_s_per_microbatch"] = {
                    t.name: t.w - layer.w for t, layer in zip(timed, layers, strict=True)
                }
            except (ScheduleError, PipelineError, ValueError) as err:
                plan = str(err)
    shared = share_plan(plan)
    model.to("cpu")
    promise = _share_promise(env, shared.schedule, layers, shared.stage_layers, shared.recompute, latency, posts, None)
    modules = build_stages(model, shared)
    return Layout(shared.schedule, mcfg, modules, shared.stage_layers, shared, layers, latency, None, promise)


def _message_posts(cfg: TrainConfig, model: GPT, device: torch.device) -> tuple[float, float]:
    """Rank time to post a send and a receive of a block's output (a collective)."""
    from pipetrain.train.auto import measure_posts

    rows = -(-cfg.batch_size // cfg.microbatches)
    return measure_posts(rows * model.cfg.seq_len * model.cfg.d_model * 4, device)


def _share_promise(
    env: DistEnv,
    schedule: Schedule,
    layers: list[Any],
    stage_layers: list[list[str]],
    recompute: Sequence[int],
    latency: float,
    posts: tuple[float, float],
    error: str | None,
) -> dict[str, Any] | None:
    """Rank 0's simulated step of the schedule that runs, term by term, on every rank (a
    collective; None without a profile)."""
    box: list[Any] = [None]
    if env.rank == 0 and layers and error is None:
        from pipetrain.train.auto import cut_costs
        from pipetrain.train.time_promise import StepTerms, step_promise

        terms = StepTerms({layer.name: layer.optimizer for layer in layers}, send=posts[0], recv=posts[1])
        try:
            box[0] = step_promise(cut_costs(layers, stage_layers, recompute, latency), schedule, stage_layers, terms)
        except (ScheduleError, ValueError) as err:
            box[0] = {"error": str(err)}
    dist.broadcast_object_list(box, src=0)
    promise: dict[str, Any] | None = box[0]
    return promise


def _cut_names(model: GPT, parts: list[nn.Module]) -> list[list[str]]:
    names = model.layer_names()
    out = []
    k = 0
    for part in parts:
        size = len(list(part.children()))
        out.append(names[k : k + size])
        k += size
    return out


def _layer_profile(
    env: DistEnv, cfg: TrainConfig, model: GPT, data: TextData, device: torch.device
) -> tuple[list[Any], float, str | None]:
    """The per-layer profile of ``model`` on one microbatch of the training data, on rank 0, and the
    message latency between ranks 0 and 1 for a block's output (a collective; other ranks get no
    layers). The error, if profiling failed, as text.

    Every rank profiles at once (each holds the whole model) and rank 0 takes each layer's median
    time over the ranks: the layers are timed as they will run, beside the other ranks' work (on a
    CPU the ranks share memory bandwidth and caches; a layer timed alone runs faster than in a
    pipeline that keeps every rank busy), and one rank's bad luck on a busy machine is outvoted."""
    from pipetrain.train.auto import LATENCY_BUSY_S, measure_latency, profile_model

    rows = -(-cfg.batch_size // cfg.microbatches)
    x, y = data.batch(0, rows, model.cfg.seq_len, seed=cfg.seed)
    # (timed between computing ranks, as a pipeline's messages arrive)
    latency = measure_latency(rows * model.cfg.seq_len * model.cfg.d_model * 4, device, busy=LATENCY_BUSY_S)
    mine: list[Any] = []
    error: str | None = None
    dist.barrier()  # start together, so the ranks run their layers side by side
    try:
        model.to(device)
        mine = profile_model(model, x.to(device), y.to(device), lm_loss)
    except (ScheduleError, PipelineError, ValueError, RuntimeError) as err:
        error = f"profiling the layers failed on rank {env.rank}: {err}"
    everyone: list[Any] = [None] * env.world_size
    dist.all_gather_object(everyone, ([layer.to_dict() for layer in mine], error))
    if env.rank != 0:
        return [], latency, None
    errors = [e for _, e in everyone if e is not None]
    if errors:
        return [], latency, errors[0]
    return _median_layers(mine, [profile for profile, _ in everyone]), latency, None


def _median_layers(own: list[Any], profiles: list[list[dict[str, Any]]]) -> list[Any]:
    """``own`` (rank 0's layers) with each layer's f, i, w and b the median over ``profiles``."""
    import statistics
    from dataclasses import replace

    out = []
    for k, layer in enumerate(own):
        times = {key: statistics.median(p[k][key] for p in profiles) for key in ("f", "i", "w", "b", "optimizer")}
        out.append(replace(layer, **times))
    return out


# ----------------------------------------------------------------------------- memory


def promised_peaks(lay: Layout, runs: Schedule | None = None) -> dict[int, tuple[float, float]] | None:
    """Rank 0: per rank, (simulated peak bytes, static bytes) of the schedule that runs (``runs``:
    the runtime's lowered schedule, its message buffers included; else the planned one), on the
    cut's costs from the layer profile (None without a profile)."""
    if not lay.layers:
        return None
    from pipetrain.plan import simulate
    from pipetrain.train.auto import cut_costs

    recompute = lay.plan.recompute if lay.plan is not None else []
    costs = cut_costs(lay.layers, lay.stage_layers, recompute, lay.comm)
    result = simulate(runs if runs is not None else lay.schedule, costs)
    if result.peak_memory_bytes is None:
        return None
    static = costs.per_stage("static_bytes", lay.schedule.num_stages)
    out = {}
    for rank, peak in result.peak_memory_bytes.items():
        held = sum(static[s] for s in range(lay.schedule.num_stages) if lay.schedule.stage_to_rank[s] == rank)
        out[rank] = (float(peak), float(held))
    return out


class MemoryCheck:
    """Measures one step on every rank and gathers the peaks beside rank 0's promise."""

    def __init__(self, lay: Layout, start: int, steps: int, device: torch.device, params: list[nn.Parameter]) -> None:
        # The second step of the run (the first has no optimizer state yet), or the last of a short one.
        self.step = start + 1 if steps - start >= 3 else steps - 1
        self.device = device
        self.lay = lay
        self.promise = promised_peaks(lay) if dist.get_rank() == 0 else None
        self.grad_bytes = sum(p.numel() * p.element_size() for p in params)
        self.meter: Any = None

    def around(self, step: int, sched: Any) -> AbstractContextManager[Any]:
        """The context to run ``step`` in: the meter attached to ``sched`` on the measured step."""
        if step != self.step:
            return nullcontext()
        if self.promise is not None:
            self.promise = promised_peaks(self.lay, sched.schedule)  # as the runtime runs it
        try:
            from pipetrain.memory import MemoryMeter

            self.meter = MemoryMeter(self.device)
            ctx: AbstractContextManager[Any] = self.meter.attached(sched)
            return ctx
        except PipelineError:  # no way to read this machine's allocator: report nothing
            self.meter = None
            return nullcontext()

    def after(self, step: int, result: Any) -> None:
        """After each step: on the measured one, gather (a collective) into the reporting rank's ``result``."""
        if step == self.step:
            gathered = self.gather()
            if result is not None:
                result.memory = gathered

    def gather(self) -> dict[str, Any]:
        """Every rank's measured peak beside the promise (a collective, after the measured step)."""
        mine = (dist.get_rank(), None if self.meter is None else int(self.meter.peak_bytes), self.grad_bytes)
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (mine, self.promise))
        promise = parts[0][1]
        ranks: dict[str, Any] = {}
        for (rank, peak, grads), _ in parts:
            entry: dict[str, Any] = {"measured_peak_bytes": peak, "gradient_bytes": grads}
            if promise is not None and rank in promise:
                total, static = promise[rank]
                entry.update(
                    promised_peak_bytes=total - static + grads, promised_total_bytes=total, static_bytes=static
                )
            ranks[str(rank)] = entry
        return {
            "step": self.step + 1,
            "device": self.device.type,
            "measure": "torch.cuda.max_memory_allocated" if self.device.type == "cuda" else "glibc mallinfo2",
            "ranks": ranks,
        }


def memory_line(memory: dict[str, Any]) -> str:
    """``memory (step 2): rank 0 measured 3.1 MiB, promised 3.4 MiB; rank 1 ...``."""
    from pipetrain.train.auto import format_bytes

    parts = []
    for rank, entry in sorted(memory["ranks"].items(), key=lambda kv: int(kv[0])):
        measured = entry.get("measured_peak_bytes")
        text = f"rank {rank} measured {'?' if measured is None else format_bytes(measured)}"
        if entry.get("promised_peak_bytes") is not None:
            text += f", promised {format_bytes(entry['promised_peak_bytes'])}"
        parts.append(text)
    return f"memory of step {memory['step']} (above its start): " + "; ".join(parts)
