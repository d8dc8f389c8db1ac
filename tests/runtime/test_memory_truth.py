"""A step holds what the plan says (issue 28): measured on 2 gloo ranks against simulate's promise.

The model is the issue's: each stage four Linear(64, 64) + Tanh on microbatches of 256 rows, so
saved activations (about 260 KB per stage and microbatch) dominate. Each rank's peak allocated
bytes over a step (glibc's allocator, every thread, read after every action and in between) must
stay within ``simulate(schedule, costs).peak_memory_bytes`` of the schedule the runtime runs,
costs measured by :func:`pipetrain.memory.stage_bytes`, plus one action's temporaries.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from support.dist import run_ranks

pytestmark = pytest.mark.slow

ROWS, WIDTH = 256, 64


def _stage_module(out_width: int = WIDTH) -> nn.Module:
    layers: list[nn.Module] = []
    for k in range(4):
        layers += [nn.Linear(WIDTH, out_width if k == 3 else WIDTH), nn.Tanh()]
    return nn.Sequential(*layers)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _measure(rank: int, schedule: Any, modules: list[nn.Module], n_mb: int, keep: bool, steps: int = 2) -> int:
    """This rank's peak over the last of ``steps`` steps (the first ones allocate the gradients)."""
    from pipetrain.memory import measure_step

    plan = schedule.schedule
    x, y = torch.randn(n_mb * ROWS, WIDTH), torch.randn(n_mb * ROWS, modules[-1][-2].out_features)
    last = plan.num_stages - 1
    peak = 0
    for _ in range(steps):
        args = (x,) if plan.stage_to_rank[0] == rank else ()
        kwargs: dict[str, Any] = {"return_outputs": keep}
        if plan.stage_to_rank[last] == rank:
            kwargs.update(target=y, losses=[])
        dist.barrier()
        peak = measure_step(schedule, *args, **kwargs).peak_bytes
    return peak


def _promised(rank: int, schedule: Any, modules: list[nn.Module], keep: bool) -> tuple[float, float]:
    """simulate's peak for this rank, and one action's temporaries: a stage's backward holds the
    gradient it was given, the one of the layer it is differentiating and that layer's result,
    each a message's size here."""
    from pipetrain.memory import stage_bytes
    from pipetrain.plan import Costs, simulate

    target = torch.randn(ROWS, modules[-1][-2].out_features)
    sizes = [stage_bytes(m, torch.randn(ROWS, WIDTH)) for m in modules[:-1]]
    sizes.append(stage_bytes(modules[-1], torch.randn(ROWS, WIDTH), loss_fn=_mse, target=target))
    costs = Costs(
        f=1,
        b=2,
        comm=0.05,
        **{key: [s[key] for s in sizes] for key in ("activation_bytes", "weight_grad_bytes", "message_bytes")},
    )
    promised = simulate(schedule.schedule, costs, keep_outputs=keep).peak_memory_bytes
    assert promised is not None
    # + 2 messages of timing: over 11 repeats of this test the same case's peak moved by up to 4
    # messages between runs (GPipe's last rank 3.26-3.53 MB against 3.26 promised; which buffers
    # are alive together depends on how far the peer ran ahead), the rest of the time within 3.
    temporaries = 5 * max(s["message_bytes"] for s in sizes)
    return promised[rank], temporaries


def _named_cases(rank: int, world: int) -> list[tuple[str, bool, int, float, float]]:
    from pipetrain import PipelineScheduleRuntime, PipelineStage
    from pipetrain.plan import Costs, auto_schedule, build_schedule

    torch.manual_seed(0)
    out = []
    cases: list[tuple[str, int]] = [
        ("GPipe", 1),
        ("1F1B", 1),
        ("ZBH1", 1),
        ("ZBH2", 1),
        ("Interleaved1F1B", 2),
        ("LoopedBFS", 2),
        ("InterleavedZeroBubble", 2),
        ("ZBVZeroBubble", 2),
        ("DualPipeV", 2),
        ("auto", 2),
    ]
    for name, v in cases:
        modules = [_stage_module() for _ in range(world * v)]
        if name == "auto":  # under a tight limit: 1F1B's activations on a rank's share
            costs = Costs.per_rank(f=1, b=2, activation_bytes=1.0)
            plan = auto_schedule(world, 8, costs.cut_into(v), memory_limit=world * 1.0, stages_per_rank=v, time_limit=1)
        else:
            plan = build_schedule(name, num_ranks=world, num_microbatches=8, stages_per_rank=v)
        stages = [PipelineStage(modules[s], s, len(modules), torch.device("cpu")) for s in plan.stages_of(rank)]
        for keep in (False, True):
            runtime = PipelineScheduleRuntime(stages, plan, loss_fn=_mse)
            measured = _measure(rank, runtime, modules, 8, keep)
            promised, temporaries = _promised(rank, runtime, modules, keep)
            out.append((plan.name or name, keep, measured, promised, temporaries))
    return out


def test_every_schedule_holds_what_simulate_promises() -> None:
    results = run_ranks(_named_cases, 2, timeout=600)
    over = []
    for rank, cases in enumerate(results):
        for name, keep, measured, promised, temporaries in cases:
            if measured > promised + temporaries:
                over.append(
                    f"{name} return_outputs={keep} rank {rank}: measured {measured / 1e3:.0f} KB > promised "
                    f"{promised / 1e3:.0f} KB + {temporaries / 1e3:.0f} KB"
                )
    assert not over, "\n".join(over)
    # The promise is not loose either: measured reaches most of it somewhere.
    ratios = [m / p for cases in results for _, _, m, p, _ in cases]
    assert max(ratios) > 0.8, ratios


def _growth(rank: int, world: int) -> list[int]:
    from pipetrain import PipelineStage, Schedule1F1B

    torch.manual_seed(0)
    modules = [_stage_module(), _stage_module(out_width=4 * WIDTH)]  # the last stage emits 4x its input
    out = []
    for n_mb in (16, 64):
        stage = PipelineStage(modules[rank], rank, 2, torch.device("cpu"))
        out.append(_measure(rank, Schedule1F1B(stage, n_mb, loss_fn=_mse), modules, n_mb, keep=False))
    return out


def test_last_stage_peak_does_not_grow_with_microbatches() -> None:
    results = run_ranks(_growth, 2, timeout=300)
    few, many = results[1]
    output = ROWS * 4 * WIDTH * 4
    # 48 more microbatches, each with a 256 KB output (and a 64 KB gradient sent back): kept until
    # the step's end, they would add 12 MB (3 MB of sent gradients before issue 28's fix). One
    # output more or less is timing: which of a microbatch's buffers are freed first. (Measured from
    # 16 on: with a few microbatches the peak itself depends on timing, 0.93-1.59 MB at 4; at 16,
    # 1.07-1.85 MB over 11 runs, at 64 1.85 MB: up to 3 outputs apart, well under the 3-12 MB it guards.)
    assert many - few < 4 * output, (few, many)


def _split_orders(rank: int, world: int) -> float:
    """Rank 0 plans 1F1B, rank 1 GPipe (as two timed searches could): both run rank 0's order."""
    import copy

    from pipetrain import PipelineScheduleRuntime, PipelineStage
    from pipetrain.plan import build_schedule

    torch.manual_seed(0)
    modules = [_stage_module() for _ in range(world)]
    plain = nn.Sequential(*copy.deepcopy(modules))
    x, y = torch.randn(4 * ROWS, WIDTH), torch.randn(4 * ROWS, WIDTH)
    _mse(plain(x), y).backward()
    plan = build_schedule("1F1B" if rank == 0 else "GPipe", num_ranks=world, num_microbatches=4)
    plan.planned = True  # as auto_schedule marks what it returns
    runtime = PipelineScheduleRuntime(
        PipelineStage(modules[rank], rank, world, torch.device("cpu")), plan, loss_fn=_mse
    )
    runtime.step(*((x,) if rank == 0 else ()), **({"target": y} if rank == world - 1 else {}))
    assert runtime.schedule.name == plan.name  # (rank 0's order, under this rank's name)
    pairs = zip(modules[rank].parameters(), plain[rank].parameters(), strict=True)
    return max(float((a.grad - b.grad).abs().max()) for a, b in pairs)  # type: ignore[operator]


def test_ranks_that_planned_different_orders_run_rank_0s() -> None:
    assert max(run_ranks(_split_orders, 2)) < 1e-6


def _auto_on_every_rank(rank: int, world: int) -> list[float]:
    from pipetrain import PipelineScheduleRuntime, PipelineStage
    from pipetrain.plan import Costs, auto_schedule

    torch.manual_seed(0)
    modules = [_stage_module() for _ in range(2 * world)]
    # A different seed per rank stands for two machines' timed searches ending in different places.
    plan = auto_schedule(
        world, 8, Costs(f=1, b=2, comm=0.1), memory_limit=3, stages_per_rank=2, time_limit=0.5, seed=rank
    )
    stages = [PipelineStage(modules[s], s, 2 * world, torch.device("cpu")) for s in plan.stages_of(rank)]
    runtime = PipelineScheduleRuntime(stages, plan, loss_fn=_mse)
    x, y = torch.randn(8 * ROWS, WIDTH), torch.randn(8 * ROWS, WIDTH)
    out: list[float] = []
    for _ in range(2):
        losses: list[Any] = []
        kwargs: dict[str, Any] = {"target": y, "losses": losses} if plan.stage_to_rank[2 * world - 1] == rank else {}
        runtime.step(*((x,) if plan.stage_to_rank[0] == rank else ()), **kwargs)
        out += [float(v) for v in losses]
    return out


def test_auto_schedule_called_on_every_rank_trains() -> None:
    losses = [v for r in run_ranks(_auto_on_every_rank, 2) for v in r]
    assert len(losses) == 16 and all(torch.isfinite(torch.tensor(losses)))


SCRATCH = 2 * 2**20  # bytes the _Scratch layer's backward allocates and frees


class _ScratchFn(torch.autograd.Function):
    """The identity, whose backward allocates (and frees) SCRATCH bytes: a backward temporary."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        scratch = torch.ones(SCRATCH // 4)
        time.sleep(0.02)  # long enough for the meter's sampling thread to see it, however busy the machine
        return grad * scratch[0]


class _Scratch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ScratchFn.apply(x)  # type: ignore[no-any-return]


def _workspace_case(rank: int, world: int) -> list[tuple[str, int, float, float, float]]:
    """(schedule, measured, promised, promised without workspaces, a message) on this rank, with
    per-stage costs made from profile_layers as the planner makes them (the promise
    ``pipetrain train`` prints): the first stage's backward allocates SCRATCH bytes it frees."""
    from pipetrain import PipelineScheduleRuntime, PipelineStage, profile_layers
    from pipetrain.memory import measure_step
    from pipetrain.plan import build_schedule, simulate
    from pipetrain.plan.pipeline.model import Profile, StageValues

    torch.manual_seed(0)
    first = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), _Scratch(), nn.Linear(WIDTH, WIDTH))
    last = nn.Sequential(nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
    whole = nn.Sequential(*first, *last)
    n_mb = 4
    x, y = torch.randn(n_mb * ROWS, WIDTH), torch.randn(n_mb * ROWS, WIDTH)
    layers = profile_layers(whole, x[:ROWS], loss_fn=_mse, target=y[:ROWS], repeats=1)
    values = StageValues.of(Profile(layers), (0, len(first), len(whole)))
    costs = values.costs(frozenset(), 0.05)
    bare_layers = [replace(c, workspace_bytes=0.0, i_workspace_bytes=0.0, i_saved_bytes=0.0) for c in layers]
    no_work = StageValues.of(Profile(bare_layers), (0, len(first), len(whole)))
    static = sum(c.static_bytes for c in (layers[:4] if rank == 0 else layers[4:]))
    out = []
    for name in ("1F1B", "ZBH1"):
        plan = build_schedule(name, num_ranks=world, num_microbatches=n_mb)
        stage = PipelineStage((first, last)[rank], rank, world, torch.device("cpu"))
        runtime = PipelineScheduleRuntime(stage, plan, loss_fn=_mse)
        measured = 0
        for _ in range(2):  # the first step makes the gradients; the second adds into them
            kwargs: dict[str, Any] = {"target": y, "losses": []} if rank == world - 1 else {}
            dist.barrier()
            measured = measure_step(runtime, *((x,) if rank == 0 else ()), **kwargs).peak_bytes
        peaks = simulate(runtime.schedule, costs).peak_memory_bytes
        bare = simulate(runtime.schedule, no_work.costs(frozenset(), 0.05)).peak_memory_bytes
        assert peaks is not None and bare is not None
        out.append((name, measured, peaks[rank] - static, bare[rank] - static, float(values.msg[0])))
    return out


def test_a_backward_temporary_is_measured_by_the_profile_and_kept_within_the_promise() -> None:
    """The first stage's backward allocates 2 MiB it frees by its end: the layer profile's
    workspace counts it, the promise adds it, and each rank's measured peak stays within that
    promise (its static bytes aside: allocated before the step) plus two messages; without the
    workspace the promise would be short of what the first rank really held."""
    results = run_ranks(_workspace_case, 2, timeout=300)
    for rank, cases in enumerate(results):
        for name, measured, promised, bare, message in cases:
            assert measured <= promised + 2 * message, (name, rank, measured, promised)
            if rank == 0:
                assert measured > bare + SCRATCH / 2, (name, measured, bare)
                assert promised >= bare + SCRATCH


def _recompute_case(rank: int, world: int) -> list[tuple[str, int, float, float, float]]:
    """(schedule, measured, promised, promised without recompute, a message) on this rank, every
    stage recomputed (pipetrain.recompute), costs from profile_layers as the planner makes them:
    one rebuild per microbatch, the input held until I, W's operands from I to W."""
    from pipetrain import PipelineScheduleRuntime, PipelineStage, profile_layers
    from pipetrain.memory import measure_step
    from pipetrain.plan import build_schedule, simulate
    from pipetrain.plan.pipeline.model import Profile, StageValues
    from pipetrain.recompute import recompute

    torch.manual_seed(0)
    first, last = _stage_module(), _stage_module()
    whole = nn.Sequential(*first, *last)
    n_mb = 4
    x, y = torch.randn(n_mb * ROWS, WIDTH), torch.randn(n_mb * ROWS, WIDTH)
    layers = profile_layers(whole, x[:ROWS], loss_fn=_mse, target=y[:ROWS], repeats=1)
    values = StageValues.of(Profile(layers), (0, len(first), len(whole)))
    static = sum(c.static_bytes for c in (layers[: len(first)] if rank == 0 else layers[len(first) :]))
    module = recompute((first, last)[rank])
    out = []
    for name in ("1F1B", "ZBH1"):
        plan = build_schedule(name, num_ranks=world, num_microbatches=n_mb)
        runtime = PipelineScheduleRuntime(PipelineStage(module, rank, world, torch.device("cpu")), plan, loss_fn=_mse)
        measured = 0
        for _ in range(2):
            kwargs: dict[str, Any] = {"target": y, "losses": []} if rank == world - 1 else {}
            dist.barrier()
            measured = measure_step(runtime, *((x,) if rank == 0 else ()), **kwargs).peak_bytes
        peaks = simulate(runtime.schedule, values.costs(frozenset({0, 1}), 0.05)).peak_memory_bytes
        plain = simulate(runtime.schedule, values.costs(frozenset(), 0.05)).peak_memory_bytes
        assert peaks is not None and plain is not None
        out.append((name, measured, peaks[rank] - static, plain[rank] - static, float(values.msg[0])))
    return out


def test_recomputed_stages_hold_what_the_promise_says_split_or_not() -> None:
    results = run_ranks(_recompute_case, 2, timeout=300)
    for rank, cases in enumerate(results):
        for name, measured, promised, _without, message in cases:
            assert measured <= promised + 2 * message, (name, rank, measured, promised)
        one_f_one_b = dict((c[0], c) for c in cases)["1F1B"]
        if rank == 0:  # the first rank holds 2 microbatches in flight: recompute must show (the last
            # holds one, and a recomputed stage's rebuild plus its input is more than that one)
            assert one_f_one_b[2] < 0.8 * one_f_one_b[3], one_f_one_b


def _mlp_family(rank: int, world: int) -> list[tuple[str, int, float, float, float]]:
    """Issue 37's trial: every byte cost from stage_bytes alone (the first stage's measured as
    one), ``Costs(f=1, i=1, w=1, comm=0.05, **bytes)``; (schedule, measured, promised, a message,
    the promise without transients: what it says is held between actions)."""
    from pipetrain import PipelineScheduleRuntime, PipelineStage
    from pipetrain.memory import stage_bytes
    from pipetrain.plan import Costs, build_schedule, simulate

    out = []
    for name, v in (("GPipe", 1), ("1F1B", 1), ("ZBH1", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2)):
        torch.manual_seed(0)
        modules = [_stage_module() for _ in range(world * v)]
        plan = build_schedule(name, num_ranks=world, num_microbatches=8, stages_per_rank=v)
        stages = [PipelineStage(modules[s], s, len(modules), torch.device("cpu")) for s in plan.stages_of(rank)]
        runtime = PipelineScheduleRuntime(stages, plan, loss_fn=_mse)
        measured = _measure(rank, runtime, modules, 8, keep=False)
        example, target = torch.randn(ROWS, WIDTH), torch.randn(ROWS, WIDTH)
        sizes = [stage_bytes(modules[0], example, first=True)]
        sizes += [stage_bytes(m, example) for m in modules[1:-1]]
        sizes.append(stage_bytes(modules[-1], example, loss_fn=_mse, target=target))
        costs = Costs(f=1, i=1, w=1, comm=0.05, **{k: [s[k] for s in sizes] for k in sizes[0]})
        promised = simulate(runtime.schedule, costs).peak_memory_bytes
        held = simulate(runtime.schedule, replace(costs, transient_bytes=None, b_transient_bytes=None))
        assert promised is not None and held.peak_memory_bytes is not None
        out.append((name, measured, promised[rank], float(sizes[0]["message_bytes"]), held.peak_memory_bytes[rank]))
    return out


def test_costs_from_stage_bytes_alone_promise_what_every_rank_holds() -> None:
    """Measured peaks against promises made from stage_bytes alone, on every rank of GPipe, 1F1B,
    ZBH1, Interleaved1F1B and ZB-V, within issue 37's 1.05. Before issue 37 the second rank held
    up to 1.07-1.13x its promise (ZBH1, Interleaved1F1B, 1F1B: the actions' transients were not
    measured); then up to 1.07-1.12x on GPipe's and 1F1B's last rank (stage_bytes measured I's
    temporaries, 66 KB, not those of the backward in one pass those schedules run, 262 KB). Each
    action's transient counts at its own time, so where a rank's peak falls between actions the
    promise is what it holds (1F1B's and ZBH1's first rank: 0.87 of the promise before, 0.92-0.94
    now); a temporary lasting well under a millisecond is rarely caught by a sampled CPU reading,
    so a rank whose peak falls inside an action measures at least what it holds between actions
    (0.98-1.09 of that over 3 runs), not always the promise (0.63-0.91 on 1F1B's last rank)."""
    results = run_ranks(_mlp_family, 2, timeout=300)
    for rank, cases in enumerate(results):
        for name, measured, promised, message, held in cases:
            assert measured <= 1.05 * promised, (name, rank, measured, promised, message)
            # Not loose: at least 0.9 of what the promise says is held between actions (the
            # actions' transients aside, which a sample may miss).
            assert measured >= 0.9 * held, (name, rank, measured, held, promised)
            assert held <= promised


def test_stage_bytes_measures_a_first_stage_as_the_runtime_runs_it() -> None:
    """A first stage's input takes no gradient: its I leaves everything to W, which holds the
    activations and the output gradient (not a middle stage's W operands and input gradient);
    held bytes are per-microbatch growth, so a second call measures what the first did."""
    from pipetrain.memory import stage_bytes

    torch.manual_seed(0)
    module, example = _stage_module(), torch.randn(ROWS, WIDTH)
    first, middle = stage_bytes(module, example, first=True), stage_bytes(module, example)
    again = stage_bytes(module, example)
    message = ROWS * WIDTH * 4
    assert first["message_bytes"] == middle["message_bytes"] == message
    assert abs(first["weight_grad_bytes"] - (first["activation_bytes"] + message)) < 0.1 * message, first
    assert middle["weight_grad_bytes"] > first["weight_grad_bytes"] + message, (first, middle)
    # four Tanh outputs of 64 KB saved (the input is the caller's); growth within 10 %
    assert 4 * message <= middle["activation_bytes"] < 4.4 * message, middle
    assert abs(again["activation_bytes"] - middle["activation_bytes"]) < 0.1 * message, (middle, again)
    assert middle["transient_bytes"] > 0 and first["transient_bytes"] > 0
    # A last stage's backward in one pass (B) makes the loss's gradients and each Linear's input
    # and weight gradients together: about 4 messages of temporaries where its I makes 1. B runs
    # in 1F1B and GPipe, priced by its own transient (an I/W-only schedule is not charged it).
    last = stage_bytes(module, example, loss_fn=_mse, target=torch.randn(ROWS, WIDTH))
    assert last["b_transient_bytes"] >= 3 * message, last
    assert last["b_transient_bytes"] > 2 * last["transient_bytes"], last
    assert all(p.grad is None for p in module.parameters())
