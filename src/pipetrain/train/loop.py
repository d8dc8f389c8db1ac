"""The training loop run on every rank of ``pipetrain train``.

Every rank builds the same model from the same seed, keeps the stages the schedule places on it,
and draws the same batch each step (a pure function of seed and step), so nothing but the
pipeline's own activations and gradients crosses ranks. The rank holding the last stage sees the
losses; it reports progress, writes the timelines and, with ``check``, replays the run without
pipelining to compare losses.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.checkpoint import Checkpointer, Resumed
from pipetrain.errors import PipelineError
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.generators import build_schedule
from pipetrain.plan.schedule import Schedule, is_schedule_file
from pipetrain.plan.timeline import TimelineEvent
from pipetrain.train.auto import PROFILE_STEPS, LayerPlan, is_auto, write_profile
from pipetrain.train.data import TextData
from pipetrain.train.launch import DistEnv, init_process_group
from pipetrain.train.layout import MemoryCheck, layout
from pipetrain.train.model import GPT, MODEL_SIZES, GPTConfig, lm_loss
from pipetrain.train.progress import StepReporter

__all__ = [
    "CHECK_RTOL",
    "KILL_HOOK",
    "TrainConfig",
    "TrainResult",
    "load_data",
    "plan_for",
    "reference_losses",
    "run_rank",
]

CHECK_RTOL = 1e-4
# Test hook: "RANK:STEP" makes that rank SIGKILL itself before that step, on torchrun's first
# attempt only (TORCHELASTIC_RESTART_COUNT unset or 0), to show that a restart resumes exactly.
KILL_HOOK = "PIPETRAIN_TEST_KILL_AT"


@dataclass
class TrainConfig:
    """Everything one run needs; the same object goes to every rank."""

    ranks: int = 2
    stages_per_rank: int | None = None
    schedule: str = "ZBVZeroBubble"
    microbatches: int = 8
    steps: int = 40
    batch_size: int = 16
    device: str = "cpu"
    out: str | None = None
    seed: int = 0
    check: bool = False
    model: str = "small"
    lr: float = 3e-3
    clip_grad_norm: float | None = None  # max norm of the whole model's gradients; None: no clipping
    max_text_bytes: int = 4 * 1024 * 1024
    timeout_s: float = 300.0
    checkpoint_dir: str | None = None  # save there and resume from the latest complete checkpoint in it
    checkpoint_every: int = 10  # steps between checkpoints (one is written after the last step too)
    costs_out: str | None = None  # `pipetrain profile`: write the measured steps' costs there
    layers_out: str | None = None  # `pipetrain profile`: write the layer profile (the planner's layers file) there
    plan_time_limit: float = 5.0  # --schedule auto: seconds rank 0 spends planning
    placement: str | None = None  # --schedule auto: "loop" or "v" (None: the planner chooses)
    memory_limit: float | None = None  # --schedule auto: bytes per rank (None: the machine's memory per rank)
    json: bool = False  # print the summary as JSON on stdout (everything else goes to stderr)
    activation_checkpointing: bool = False  # every block recomputes its activations in backward

    @property
    def model_config(self) -> GPTConfig:
        try:
            return MODEL_SIZES[self.model]
        except KeyError:
            raise PipelineError(f"unknown model size {self.model!r}; choose one of {', '.join(MODEL_SIZES)}") from None

    def model_config_for(self, num_stages: int) -> GPTConfig:
        """The model size, with blocks added when there are more stages than layers (one layer each at least)."""
        base = self.model_config
        return replace(base, n_layers=max(base.n_layers, num_stages - 2))

    def auto_model_config(self, world_size: int) -> GPTConfig:
        """The model ``--schedule auto`` plans for: grown (as :meth:`model_config_for`) only so that each
        rank can hold ``stages_per_rank`` stages (one if not given) of one layer at least."""
        return self.model_config_for(world_size * (self.stages_per_rank or 1))


@dataclass
class TrainResult:
    """What the reporting rank learned: per-step losses, and the reference's when checked."""

    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    reference: list[float] | None = None
    grad_norms: list[float] = field(default_factory=list)  # before clipping, when clipping
    reference_grad_norms: list[float] | None = None
    eval_loss: float = float("nan")
    files: list[str] = field(default_factory=list)
    plan_summary: str | None = None  # --schedule auto: the line that says what was planned
    plan: dict[str, Any] | None = None  # --schedule auto: the plan (cut, recompute, schedule, simulated step, peaks)
    memory: dict[str, Any] | None = None  # one step's measured peak bytes per rank, beside the simulated ones
    time: dict[str, Any] | None = None  # the measured median step beside the simulated one, term by term


def load_data(cfg: TrainConfig) -> TextData:
    """The training text in the model's tokens (the ``bpe`` model's are learnt once, then cached)."""
    mcfg = cfg.model_config
    return TextData.from_stdlib(cfg.max_text_bytes, tokenizer=mcfg.tokenizer, vocab_size=mcfg.vocab_size)


def plan_for(cfg: TrainConfig, world_size: int) -> Schedule:
    """The compute-only schedule this run follows: built by name, or read from a CSV/JSON file
    (``--schedule auto`` plans it in the run: see :func:`pipetrain.train.auto.plan_layers`)."""
    source = cfg.schedule
    if is_auto(source):
        raise PipelineError("--schedule auto is planned by the run (rank 0 profiles the layers and plans)")
    from_file = is_schedule_file(source)
    if from_file:
        schedule = Schedule.load(source)
        if schedule.num_ranks != world_size:
            raise PipelineError(f"{source} is a schedule for {schedule.num_ranks} ranks, but {world_size} ranks run")
    else:
        schedule = build_schedule(source, world_size, cfg.microbatches, cfg.stages_per_rank)
    try:
        schedule.validate()
    except ScheduleError as err:
        raise ScheduleError(f"{source}: {err}" if from_file else str(err)) from None
    if not schedule.has_backward:
        raise PipelineError(
            f"{source} has no backward, so it cannot train (a forward-only schedule is for inference: "
            "run it with the schedule's eval())"
        )
    return schedule


def run_rank(env: DistEnv, cfg: TrainConfig) -> TrainResult | None:
    """One rank's whole run: join the group, train, report. Returns the result on the reporting rank."""
    device = init_process_group(env, cfg.device, cfg.timeout_s)
    try:
        if cfg.json:  # stdout carries only the summary
            with contextlib.redirect_stdout(sys.stderr):
                return _train(env, cfg, device)
        return _train(env, cfg, device)
    finally:
        dist.destroy_process_group()


def _train(env: DistEnv, cfg: TrainConfig, device: torch.device) -> TrainResult | None:
    import pipetrain  # the runtime names load lazily

    data = load_data(cfg)
    lay = layout(env, cfg, device, data)
    schedule, mcfg, parts = lay.schedule, lay.model_config, lay.parts
    num_stages = schedule.num_stages
    last_stage = num_stages - 1
    mine = [s for s in range(num_stages) if schedule.stage_to_rank[s] == env.rank]
    stages = [pipetrain.PipelineStage(parts[s].to(device), s, num_stages, device) for s in mine]
    sched = _make_schedule(pipetrain, cfg, schedule, stages)
    params = [p for s in mine for p in parts[s].parameters()]
    optimizer = torch.optim.Adam(params, lr=cfg.lr)
    ckpt = Checkpointer(cfg.checkpoint_dir, keep=2) if cfg.checkpoint_dir else None
    resumed = _resume(ckpt, stages, optimizer)
    start = min(resumed.step, cfg.steps)

    reporting = last_stage in mine
    has_first = 0 in mine
    result = _announce(cfg, mcfg, num_stages, lay.plan, resumed, start) if reporting else None
    memory = MemoryCheck(lay, start, cfg.steps, device, params)
    kill_at = _kill_step(env.rank)
    reporter = (
        StepReporter(
            cfg.steps,
            title=f"{schedule.name or 'schedule'} × {_count(env.world_size, 'rank')}, {_count(num_stages, 'stage')}, "
            f"{_count(schedule.num_microbatches, 'microbatch')}, batch {cfg.batch_size}, model {cfg.model} on "
            f"{cfg.device}" + (" (planned by --schedule auto)" if is_auto(cfg.schedule) else ""),
        )
        if reporting
        else None
    )
    tokens = cfg.batch_size * mcfg.seq_len
    measured = None
    origin = 0.0
    measures = _measures(cfg)
    profile: list[Any] = []
    optimizer_times: list[float] = []  # this rank's optimizer step and zero_grad, per step
    step_times: list[float] = []  # this rank's whole step
    try:
        for step in range(start, cfg.steps):
            if step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = data.batch(step, cfg.batch_size, mcfg.seq_len, seed=cfg.seed)
            args = (x.to(device),) if has_first else ()
            kwargs: dict[str, Any] = {"target": y.to(device), "losses": []} if reporting else {}
            profiling = _line_up(measures, profile, step, cfg.steps)
            # A measured step (profiled, or the last) times its compute on the GPU, not its launches.
            sched.device_timing = profiling or step == cfg.steps - 1
            t0 = time.perf_counter()
            origin = t0
            with memory.around(step, sched):
                # (training reads the losses only: the last stage keeps no output, as planned)
                sched.step(*args, return_outputs=False, **kwargs)
            norm = pipetrain.clip_grad_norm_(params, cfg.clip_grad_norm) if cfg.clip_grad_norm is not None else None
            t_opt = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            optimizer_times.append(dt - (t_opt - t0))
            step_times.append(dt)
            if reporting and result is not None and reporter is not None:
                loss = float(torch.stack([torch.as_tensor(v).detach().float() for v in kwargs["losses"]]).mean())
                result.losses.append(loss)
                if norm is not None:
                    result.grad_norms.append(float(norm))
                result.step_times.append(dt)
                reporter.update(step, loss, tokens / dt)
            if profiling:
                _profiled(_gather_timeline(sched, env, origin), profile, schedule, cfg)
            memory.after(step, result)
            if ckpt is not None and ((step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps):
                _save(ckpt, step + 1, stages, optimizer, result, schedule.stage_to_rank[last_stage], cfg)
        measured = _gather_timeline(sched, env, origin)
        sched.device_timing = False
        # Held-out loss: a forward-only pass of the same schedule (eval works on every schedule).
        xe, ye = data.batch(0, cfg.batch_size, mcfg.seq_len, seed=cfg.seed, split="eval")
        out = sched.eval(xe.to(device)) if has_first else sched.eval()
        if reporting and result is not None:
            result.eval_loss = float(lm_loss(out, ye.to(device)))
    finally:
        if reporter is not None:
            reporter.close()

    timing = _gather_times(step_times, optimizer_times)
    if result is not None:
        result.time = _time_check(lay.promise, timing)
        _conclude(cfg, result, start, schedule, measured, tokens, device, mcfg)
    dist.barrier()
    if reporting and result is not None and result.reference is not None and not _agrees(result):
        raise PipelineError(_mismatch(result))
    return result


def _conclude(
    cfg: TrainConfig,
    result: TrainResult,
    start: int,
    schedule: Schedule,
    measured: Any,
    tokens: int,
    device: torch.device,
    mcfg: GPTConfig,
) -> None:
    """On the reporting rank: the final line, the outputs, and the --check reference."""
    num_stages = schedule.num_stages
    if start == cfg.steps:
        print(f"nothing left to train: the checkpoint is at step {start} of {cfg.steps}", flush=True)
    else:
        print(
            f"final loss {result.losses[-1]:.4f} (first {result.losses[0]:.4f}) after {cfg.steps} steps; "
            f"held-out loss {result.eval_loss:.4f}",
            flush=True,
        )
        if result.memory is not None:
            from pipetrain.train.layout import memory_line

            print(memory_line(result.memory), flush=True)
        if result.time is not None:
            print(time_line(result.time), flush=True)
        if cfg.out:
            from pipetrain.train.outputs import write_outputs

            result.files = write_outputs(Path(cfg.out), schedule, measured, result, cfg, tokens)
            _report_outputs(Path(cfg.out), result.files)
            if cfg.json and sys.__stdout__ is not None:
                sys.__stdout__.write((Path(cfg.out) / "summary.json").read_text(encoding="utf-8"))
                sys.__stdout__.flush()
        if cfg.check:
            result.reference_grad_norms = []
            result.reference = reference_losses(
                cfg,
                device,
                schedule.num_microbatches,
                num_stages,
                grad_norms=result.reference_grad_norms,
                model_config=mcfg,
            )
            _report_check(result)


def _gather_times(step_times: list[float], optimizer_times: list[float]) -> dict[str, dict[str, float]]:
    """Every rank's median step and optimizer step (after the first 2 steps), on every rank (a collective)."""
    from pipetrain.train.time_promise import measured_step

    mine = {"step_s": measured_step(step_times), "optimizer_s": measured_step(optimizer_times)}
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {str(rank): part for rank, part in enumerate(parts)}


def _time_check(promise: dict[str, Any] | None, timing: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The measured median step (the slowest rank's) beside the promise, and each rank's optimizer step."""
    measured = max(t["step_s"] for t in timing.values())
    out: dict[str, Any] = {"measured_step_s": measured, "ranks": timing}
    if promise is not None and "step_s" in promise:
        out["promise"] = promise
        out["ratio"] = measured / promise["step_s"] if promise["step_s"] > 0 else float("nan")
    elif promise is not None:
        out["promise_error"] = promise.get("error")
    return out


def time_line(time_check: dict[str, Any]) -> str:
    """``time promise: measured 271 ms a step (median), simulated 262 ms (1.03x): layers and latency 240 ms, ...``."""
    measured = time_check["measured_step_s"] * 1e3
    promise = time_check.get("promise")
    if promise is None:
        return f"time promise: measured {measured:.1f} ms a step (median after 2 steps); no simulated step (no profile)"
    terms = promise["terms"]
    ms = {k: promise[k] * 1e3 for k in ("compute_s", "optimizer_s", "step_s")}
    return (
        f"time promise: measured {measured:.1f} ms a step (median after 2 steps), simulated {ms['step_s']:.1f} ms "
        f"({time_check['ratio']:.2f}x): layers and latency {ms['compute_s']:.1f} ms, with the optimizer step "
        f"{ms['optimizer_s']:.1f} ms, with message posts ({terms['send_s'] * 1e6:.0f}+{terms['recv_s'] * 1e6:.0f} us "
        f"a message) {ms['step_s']:.1f} ms; not priced: " + "; ".join(promise["left_out"])
    )


def _announce(
    cfg: TrainConfig, mcfg: GPTConfig, num_stages: int, layer_plan: LayerPlan | None, resumed: Resumed, start: int
) -> TrainResult:
    """On the reporting rank: say how the model grew and what was planned; the result so far."""
    if mcfg.n_layers > cfg.model_config.n_layers:
        print(
            f"model {cfg.model!r} grown to {mcfg.n_layers} blocks: one layer at least for each of {num_stages} stages"
        )
    result = _result_so_far(resumed, start, cfg)
    if layer_plan is not None:
        print(layer_plan.line, flush=True)
        result.plan_summary = layer_plan.line
        result.plan = layer_plan.summary
    return result


def _resume(ckpt: Checkpointer | None, stages: list[Any], optimizer: Any) -> Resumed:
    """The latest complete checkpoint loaded into this rank's stages and optimizer (step 0 without one)."""
    return ckpt.load(stages, optimizer) if ckpt is not None else Resumed()


def _what_shapes_the_run(cfg: TrainConfig) -> dict[str, Any]:
    """The settings that decide the batches and updates (not the layout, which may change on resume)."""
    return {"seed": cfg.seed, "model": cfg.model, "batch_size": cfg.batch_size, "lr": cfg.lr}


def _result_so_far(resumed: Resumed, start: int, cfg: TrainConfig) -> TrainResult:
    """The reporting rank's result, holding the losses of the steps a checkpoint already covers."""
    result = TrainResult()
    steps = cfg.steps
    saved = resumed.extra.get("run", {})
    changed = {k: (saved[k], v) for k, v in _what_shapes_the_run(cfg).items() if k in saved and saved[k] != v}
    if changed:
        print(
            "note: resuming a run made with "
            + ", ".join(f"{k} {old} (now {new})" for k, (old, new) in changed.items())
            + ": the steps from here differ from those of an uninterrupted run",
            flush=True,
        )
    if resumed.path is not None:
        result.losses = list(resumed.extra.get("losses", []))[:start]
        result.grad_norms = list(resumed.extra.get("grad_norms", []))[:start]
        print(f"resumed from {resumed.path} after {start} of {steps} steps", flush=True)
    return result


def _kill_step(rank: int) -> int | None:
    """The step before which this rank kills itself (the test hook ``KILL_HOOK``), else None."""
    hook = os.environ.get(KILL_HOOK)
    if not hook or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    who, _, when = hook.partition(":")
    return int(when) if int(who) == rank else None


def _save(
    ckpt: Checkpointer,
    step: int,
    stages: list[Any],
    optimizer: Any,
    result: TrainResult | None,
    src: int,
    cfg: TrainConfig,
) -> None:
    """Save after ``step`` steps; the losses so far (on the last stage's rank) go with it, through rank 0."""
    box: list[Any] = [
        None
        if result is None
        else {"losses": result.losses, "grad_norms": result.grad_norms, "run": _what_shapes_the_run(cfg)}
    ]
    dist.broadcast_object_list(box, src=src)
    ckpt.save(step, stages, optimizer, extra=box[0])


def _report_outputs(out: Path, files: list[str]) -> None:
    import json

    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    if "simulated_step_s" in summary:
        print(
            f"last step: measured {summary['measured_step_s'] * 1e3:.1f} ms (bubble {summary['measured_bubble']:.1%}), "
            f"simulated {summary['simulated_step_s'] * 1e3:.1f} ms (bubble {summary['simulated_bubble']:.1%})",
            flush=True,
        )
    picture = " (timelines.png: measured above simulated)" if str(out / "timelines.png") in files else ""
    print(f"wrote {len(files)} files to {out}{picture}", flush=True)


def _measures(cfg: TrainConfig) -> bool:
    """Whether this run measures its first steps for a costs file (``pipetrain profile`` does)."""
    return cfg.costs_out is not None


def _line_up(auto: bool, profile: list[Any], step: int, steps: int) -> bool:
    """Barrier before a recorded step (the last one, and those ``pipetrain profile`` measures) so it
    starts together on every rank; whether ``step`` is one that is measured for the costs file."""
    measuring = auto and len(profile) < PROFILE_STEPS and step < steps - 1
    if measuring or step == steps - 1:
        dist.barrier()
    return measuring


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "es" if noun.endswith("h") else "s")


def _profiled(measured: Any, profile: list[Any], schedule: Schedule, cfg: TrainConfig) -> None:
    """``pipetrain profile``: keep a measured step's timeline; after the last one, write the costs file."""
    if measured is not None:
        profile.append(measured)
    if len(profile) == min(PROFILE_STEPS, cfg.steps - 1) and cfg.costs_out is not None:
        write_profile(cfg.costs_out, schedule, profile)


def _make_schedule(pipetrain: Any, cfg: TrainConfig, schedule: Schedule, stages: list[Any]) -> Any:
    if is_schedule_file(cfg.schedule) or is_auto(cfg.schedule):
        return pipetrain.PipelineScheduleRuntime(stages, schedule, loss_fn=lm_loss)
    cls = pipetrain.get_schedule_class(cfg.schedule)
    single = isinstance(cls, type) and issubclass(cls, pipetrain.PipelineScheduleSingle)
    return cls(stages[0] if single else stages, schedule.num_microbatches, loss_fn=lm_loss)


def _gather_timeline(sched: Any, env: DistEnv, origin: float) -> Any:
    """Every rank's recorded events of the last step on one time axis, on every rank (None if not recorded).

    ``origin`` is this rank's ``perf_counter`` right after the barrier that started the step
    together on all ranks. Ranks on one machine share that clock, so they are measured from the
    earliest of their origins and keep their true offsets (a message's latency is read across
    ranks); machines, whose clocks do not agree, are put on one axis by their barrier exits (to
    within the barrier's skew).
    """
    from pipetrain.plan.timeline import Timeline

    local = getattr(sched, "last_timeline", None)
    mine = None
    relative = False
    if local is not None:
        mine = [e for e in local.events if e.rank == env.rank]
        # Times already relative to the step's start (smaller than the barrier's clock reading) stay.
        relative = bool(mine) and min(e.start for e in mine) < origin - 1.0
    gathered: list[Any] = [None] * env.world_size
    dist.all_gather_object(gathered, (_machine(), origin, relative, mine))
    if any(part[3] is None for part in gathered):
        return None
    return Timeline(env.world_size, on_one_axis(gathered), source="measured", unit="s")


def on_one_axis(parts: list[tuple[str, float, bool, list[TimelineEvent]]]) -> list[TimelineEvent]:
    """Every rank's events from (machine, barrier exit, already relative, events): ranks of one
    machine from the earliest exit among them, each other rank from its own (see _gather_timeline;
    exits further apart than a second are not one clock, whatever the machine names say)."""
    host_origin: dict[str, float] = {}
    for host, rank_origin, rank_relative, _ in parts:
        if not rank_relative:
            host_origin[host] = min(host_origin.get(host, rank_origin), rank_origin)
    events: list[TimelineEvent] = []
    for host, rank_origin, rank_relative, part in parts:
        shift = 0.0 if rank_relative else host_origin[host]
        if not rank_relative and rank_origin - shift > 1.0:
            shift = rank_origin
        events.extend(
            TimelineEvent(e.rank, e.action, e.kind, e.stage, e.microbatch, e.start - shift, e.end - shift) for e in part
        )
    return events


def _machine() -> str:
    """This machine, as far as its monotonic clock goes: host name and boot id (containers and
    cloned images may share a host name)."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            boot = handle.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def reference_losses(
    cfg: TrainConfig,
    device: torch.device,
    n_microbatches: int | None = None,
    num_stages: int = 1,
    grad_norms: list[float] | None = None,
    model_config: GPTConfig | None = None,
) -> list[float]:
    """The same model, init, data and optimizer trained without pipelining; one loss per step.

    The loss is the mean of the microbatch losses over the same split the pipeline uses, which
    equals the whole-batch mean when the batch divides evenly. With clipping, ``grad_norms``
    (when given) receives each step's gradient norm before clipping.
    """
    mcfg = model_config or cfg.model_config_for(num_stages)
    torch.manual_seed(cfg.seed)
    model: nn.Module = GPT(mcfg).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    data = load_data(cfg)
    schedule_mb = n_microbatches or cfg.microbatches
    losses = []
    for step in range(cfg.steps):
        x, y = data.batch(step, cfg.batch_size, mcfg.seq_len, seed=cfg.seed)
        logits = model(x.to(device))
        y = y.to(device)
        chunks = list(zip(torch.tensor_split(logits, schedule_mb), torch.tensor_split(y, schedule_mb), strict=True))
        loss = torch.stack([lm_loss(lo, ta) for lo, ta in chunks if ta.numel()]).mean()
        loss.backward()  # type: ignore[no-untyped-call]  # torch's stubs leave Tensor.backward untyped
        if cfg.clip_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm)
            if grad_norms is not None:
                grad_norms.append(float(norm))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _pairs(result: TrainResult) -> list[tuple[str, list[float], list[float]]]:
    """What --check compares: losses, and gradient norms when clipping."""
    out = [("loss", result.losses, result.reference or [])]
    if result.grad_norms or result.reference_grad_norms:
        out.append(("gradient norm", result.grad_norms, result.reference_grad_norms or []))
    return out


def _agrees(result: TrainResult) -> bool:
    return all(
        len(ours) == len(ref)
        and all(math.isclose(a, b, rel_tol=CHECK_RTOL, abs_tol=0.0) for a, b in zip(ours, ref, strict=True))
        for _, ours, ref in _pairs(result)
    )


def _report_check(result: TrainResult) -> None:
    ref = result.reference or []
    worst = max(
        (
            abs(a - b) / max(abs(b), 1e-12)
            for _, ours, theirs in _pairs(result)
            for a, b in zip(ours, theirs, strict=False)
        ),
        default=0.0,
    )
    verdict = "agree" if _agrees(result) else "DISAGREE"
    what = "losses and gradient norms" if len(_pairs(result)) > 1 else "losses"
    print(
        f"check: pipelined final loss {result.losses[-1]:.6f}, plain final loss {ref[-1]:.6f}; "
        f"largest relative difference of the {what} over {len(ref)} steps {worst:.2e} "
        f"(tolerance {CHECK_RTOL:.0e}): {verdict}",
        flush=True,
    )


def _mismatch(result: TrainResult) -> str:
    for what, ours, ref in _pairs(result):
        for step, (a, b) in enumerate(zip(ours, ref, strict=False)):
            if not math.isclose(a, b, rel_tol=CHECK_RTOL, abs_tol=0.0):
                return f"--check failed at step {step + 1}: pipelined {what} {a:.6f} vs plain {b:.6f} (rtol {CHECK_RTOL:.0e})"
        if len(ours) != len(ref):
            return f"--check failed: {len(ours)} pipelined values of the {what} vs {len(ref)} plain ones"
    return "--check failed"
