"""LocalPipeline: every schedule in one process gives the gradients of plain training."""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from pipetrain import LocalPipeline
from pipetrain.errors import PipelineError
from pipetrain.plan import Schedule, build_schedule, schedule_names
from support.models import make_batch, make_layers, reference, stages_per_rank


@pytest.mark.parametrize("name", schedule_names())
@pytest.mark.parametrize("ranks", [2, 4])
def test_local_pipeline_matches_plain_training(name: str, ranks: int) -> None:
    v = stages_per_rank(name)
    m = 2 * ranks
    layers = make_layers("mlp", ranks * v)
    x, y = make_batch("mlp", 2 * m + 1)  # uneven microbatches too
    ref_layers, ref_losses, ref_out = reference(layers, x, y, m)
    pipe = LocalPipeline(layers, name, n_microbatches=m, loss_fn=nn.functional.mse_loss, num_ranks=ranks)
    assert pipe.num_ranks == ranks
    losses: list[torch.Tensor] = []
    out = pipe.step(x, target=y, losses=losses)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
    torch.testing.assert_close(out, ref_out)
    if name != "ForwardOnly":
        for layer, ref in zip(layers, ref_layers, strict=True):
            for p, q in zip(layer.parameters(), ref.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad)
    else:
        assert all(p.grad is None for layer in layers for p in layer.parameters())
    assert not any(st.has_state() for st in pipe.stages)
    torch.testing.assert_close(pipe.eval(x), ref_out)
    timeline = pipe.last_timeline
    assert timeline is not None and {e.rank for e in timeline.events} == set(range(ranks))


def test_custom_csv_schedule_and_default_ranks() -> None:
    text = build_schedule("1F1B", 2, 4).to_csv_text()
    schedule = Schedule.from_csv_text(text)
    layers = make_layers("mlp", 2)
    x, y = make_batch("mlp", 8)
    ref_layers, _, _ = reference(layers, x, y, 4)
    LocalPipeline(layers, schedule, loss_fn=nn.functional.mse_loss).step(x, target=y)
    for layer, ref in zip(layers, ref_layers, strict=True):
        for p, q in zip(layer.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)
    # without num_ranks, a V schedule puts two stages on each rank
    assert LocalPipeline(make_layers("mlp", 4), "ZBVZeroBubble", 4).num_ranks == 2


@pytest.mark.parametrize("how", ["lower_options", "lowered"])
@pytest.mark.parametrize("name", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
def test_early_receives_run_locally(name: str, how: str) -> None:
    """A schedule with receives posted early (lower(recv_ahead=2), valid under gloo's matching,
    which the in-process mailboxes follow) runs and gives plain training's gradients, whether
    asked for in lower_options or handed over lowered."""
    v = stages_per_rank(name)
    layers = make_layers("mlp", 2 * v)
    x, y = make_batch("mlp", 8)
    ref_layers, _, _ = reference(layers, x, y, 4)
    schedule = build_schedule(name, 2, 4, v)
    if how == "lowered":
        pipe = LocalPipeline(layers, schedule.lower(recv_ahead=2), loss_fn=nn.functional.mse_loss)
    else:
        pipe = LocalPipeline(layers, schedule, loss_fn=nn.functional.mse_loss, lower_options={"recv_ahead": 2})
    pipe.step(x, target=y)
    for layer, ref in zip(layers, ref_layers, strict=True):
        for p, q in zip(layer.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)


def test_early_receives_are_refused_under_the_strict_model_with_the_reason() -> None:
    """On a backend pairing messages in posting order (NCCL), early receives are refused saying
    why, both as a lowering option and in a lowered schedule."""
    from pipetrain.runtime.prepare import prepare_for
    from pipetrain.stage import PipelineStage

    stages = [PipelineStage(nn.Linear(8, 8), i, 2, "cpu") for i in range(2)]
    schedule = build_schedule("1F1B", 2, 4)
    with pytest.raises(PipelineError, match=r"recv_ahead \(early receives\) needs a backend that matches"):
        prepare_for(schedule, {"recv_ahead": 2}, stages, 0, 0, "nccl")
    with pytest.raises(PipelineError, match="it runs under gloo's matching, per peer and tag"):
        prepare_for(schedule.lower(recv_ahead=2), {}, stages, 0, 0, "nccl")
    # gloo's runtime takes it, and a recv_ahead among the lowering options is the window itself
    prepared = prepare_for(schedule, {"recv_ahead": 2}, stages, 0, 4, "gloo")
    assert prepared.recv_ahead == 2 and prepared.matching == "gloo"
    assert prepare_for(schedule.lower(recv_ahead=2), {}, stages, 0, 4, "gloo").matching == "gloo"
    with pytest.raises(PipelineError, match="recv_ahead must be an integer >= 0, got -1"):
        prepare_for(schedule, {"recv_ahead": -1}, stages, 0, 0, "nccl")
    with pytest.raises(PipelineError, match="recv_ahead moves receives: it needs comms=True"):
        prepare_for(schedule, {"recv_ahead": 2, "comms": False}, stages, 0, 0)
    # prepare_schedule alone keeps its meaning: early receives asked for are lowered in
    from pipetrain.runtime import prepare_schedule

    assert prepare_schedule(schedule, recv_ahead=2) == schedule.lower(recv_ahead=2)


def test_errors_name_rank_step_and_action() -> None:
    class Broken(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("broken module")

    pipe = LocalPipeline([nn.Linear(4, 4), Broken()], "GPipe", 2, loss_fn=nn.functional.mse_loss)
    with pytest.raises(PipelineError, match=r"rank 1, step 0, action 1F0: ValueError: broken module"):
        pipe.step(torch.randn(4, 4), target=torch.randn(4, 4))
    assert not any(st.has_state() for st in pipe.stages)
    with pytest.raises(PipelineError, match="no target"):
        pipe.step(torch.randn(4, 4))
    with pytest.raises(PipelineError, match="args\\[0\\]"):
        LocalPipeline([nn.Linear(4, 4), nn.Linear(4, 4)], "GPipe", 4).eval(torch.randn(3, 4))


def test_nothing_of_the_microbatches_is_kept_after_step() -> None:
    layers = make_layers("mlp", 4)
    seen: list[weakref.ref[torch.Tensor]] = []
    layers[1].register_forward_hook(lambda mod, args, out: seen.append(weakref.ref(out)))
    layers[1].register_forward_hook(lambda mod, args, out: seen.append(weakref.ref(args[0])))
    pipe = LocalPipeline(layers, "ZBVZeroBubble", 4, loss_fn=nn.functional.mse_loss)
    x, y = make_batch("mlp", 8)
    pipe.step(x, target=y)
    gc.collect()
    assert len(seen) == 8 and all(ref() is None for ref in seen)


def test_gradient_shape_mismatch_names_both_stages() -> None:
    pipe = LocalPipeline(make_layers("mlp", 2), "GPipe", 2, loss_fn=nn.functional.mse_loss)
    original = pipe.stages[1].backward_one_chunk

    def wrong(mb: int, **kw: object) -> list[torch.Tensor | None]:
        return [None if g is None else g[:, :3] for g in original(mb, **kw)]  # type: ignore[arg-type]

    pipe.stages[1].backward_one_chunk = wrong  # type: ignore[method-assign]
    x, y = make_batch("mlp", 4)
    with pytest.raises(PipelineError, match=r"stage 0 output 0 .* \[2, 8\], but stage 1 .* \[2, 3\]"):
        pipe.step(x, target=y)


def test_every_action_is_labelled_for_the_profiler_and_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    # Labels are checked where they are made: torch 2.13's profiler drops some names such as "2F0".
    names: set[str] = set()
    real = torch.profiler.record_function

    def recording(name: str, *args: object) -> object:
        names.add(name)
        return real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.profiler, "record_function", recording)
    pipe = LocalPipeline(make_layers("mlp", 4), "Interleaved1F1B", 4, loss_fn=nn.functional.mse_loss, num_ranks=2)
    x, y = make_batch("mlp", 8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        pipe.step(x, target=y)
    expected = {str(a) for program in pipe.schedule.actions.values() for a in program if a is not None}
    assert expected <= names, sorted(expected - names)
    timeline = pipe.last_timeline
    assert timeline is not None and timeline.source == "measured" and timeline.unit == "s"
    assert sorted(e.action for e in timeline.events) == sorted(expected)
    assert all(e.end >= e.start for e in timeline.events)


def test_torch_call_patterns_loss_kwargs_eval_losses_and_no_grad() -> None:
    from pipetrain import LocalPipeline
    from pipetrain.errors import PipelineError

    torch.manual_seed(0)
    layers = [nn.Linear(4, 4) for _ in range(4)]
    x, y = torch.randn(8, 4), torch.randn(8, 4)

    def loss_fn(out: torch.Tensor, target: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
        return nn.functional.mse_loss(out, target) * weight

    pipe = LocalPipeline(layers, "Interleaved1F1B", n_microbatches=4, loss_fn=loss_fn, num_ranks=2)
    losses: list[torch.Tensor] = []
    pipe.step(x, target=y, losses=losses, loss_kwargs={"weight": 2.0})
    h = x
    for layer in layers:
        h = layer(h)
    expected = torch.stack([loss_fn(h[i : i + 2], y[i : i + 2], 2.0) for i in range(0, 8, 2)]).detach()
    torch.testing.assert_close(torch.stack(losses), expected)
    evaluated: list[torch.Tensor] = []
    out = pipe.eval(x, target=y, losses=evaluated, loss_kwargs={"weight": 2.0})
    torch.testing.assert_close(torch.stack(evaluated), expected)
    torch.testing.assert_close(out, h.detach())
    with torch.no_grad(), pytest.raises(PipelineError, match="eval"):
        pipe.step(x, target=y)
    forward = LocalPipeline(layers, "Interleaved1F1B", n_microbatches=4, num_ranks=2)
    assert forward.step(x, return_outputs=False) is None
    torch.testing.assert_close(forward.step(x), h.detach())


@pytest.mark.parametrize("name", ["GPipe", "ZBVZeroBubble"])
def test_gradients_accumulate_across_steps_as_in_plain_autograd(name: str) -> None:
    """Two steps without zeroing: the sum of two steps' gradients (torch's schedules divide the
    whole accumulated ``.grad`` by the number of microbatches at every step instead)."""
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4) for _ in range(4 if name == "ZBVZeroBubble" else 2)]
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    plain = nn.Sequential(*[copy.deepcopy(layer) for layer in layers])
    for _ in range(2):
        torch.stack(
            [nn.functional.mse_loss(plain(a), b) for a, b in zip(x.tensor_split(4), y.tensor_split(4), strict=True)]
        ).mean().backward()
    pipe = LocalPipeline(layers, name, n_microbatches=4, loss_fn=nn.functional.mse_loss, num_ranks=2)
    for _ in range(2):
        pipe.step(x, target=y)
    for p, q in zip([p for layer in layers for p in layer.parameters()], plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_eval_keeps_per_sample_losses_and_step_needs_a_scalar() -> None:
    """As in torch, eval fills ``losses`` with whatever loss_fn returns; backward needs a scalar."""
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4) for _ in range(2)]
    x, y = torch.randn(8, 4), torch.randn(8, 4)

    def per_sample(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out, target, reduction="none").mean(-1)

    pipe = LocalPipeline(layers, "1F1B", n_microbatches=4, loss_fn=per_sample)
    losses: list[torch.Tensor] = []
    pipe.eval(x, target=y, losses=losses)
    with torch.no_grad():
        want = per_sample(layers[1](layers[0](x)), y)
    torch.testing.assert_close(torch.cat(losses), want)
    assert [tuple(t.shape) for t in losses] == [(2,)] * 4
    with pytest.raises(PipelineError, match="rank 1, step 1, action 1F0: loss_fn must return a scalar tensor"):
        pipe.step(x, target=y)


def test_uneven_microbatches_give_whole_batch_gradients_with_a_summed_loss() -> None:
    """The guide's recipe: with 10 rows in 3, 3, 2, 2, a mean per microbatch weighs rows unevenly;
    summing and dividing by the batch size, with scale_grads=False, is whole-batch training."""
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4) for _ in range(4)]
    x, y = torch.randn(10, 4), torch.randn(10, 4)

    def summed(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out, target, reduction="sum") / y.numel()  # the whole batch's count

    pipe = LocalPipeline(layers, "1F1B", n_microbatches=4, loss_fn=summed, num_ranks=4, scale_grads=False)
    pipe.step(x, target=y)
    grads = [layer.weight.grad.clone() for layer in layers]
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    h = x
    for layer in layers:
        h = layer(h)
    nn.functional.mse_loss(h, y).backward()
    for layer, grad in zip(layers, grads, strict=True):
        torch.testing.assert_close(grad, layer.weight.grad)


@pytest.mark.parametrize(("name", "tracked"), [("1F1B", False), ("Interleaved1F1B", False), ("ZBVZeroBubble", True)])
def test_saved_tensors_are_tracked_only_where_the_backward_is_split(
    name: str, tracked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full B frees what autograd saved by itself; the hooks are for I/W (and cost time)."""
    from pipetrain.stage import PipelineStage

    seen: list[bool] = []
    original = PipelineStage.forward_one_chunk

    def recording(self: PipelineStage, mb: int, args: Any, kwargs: Any = None, *, track: bool = True) -> Any:
        seen.append(track)
        return original(self, mb, args, kwargs, track=track)

    monkeypatch.setattr(PipelineStage, "forward_one_chunk", recording)
    torch.manual_seed(0)
    mods = [nn.Linear(4, 4) for _ in range(4)]
    pipe = LocalPipeline(
        mods, name, n_microbatches=4, loss_fn=nn.functional.mse_loss, num_ranks=2 if name != "1F1B" else 4
    )
    pipe.step(torch.randn(8, 4), target=torch.randn(8, 4))
    assert seen and set(seen) == {tracked}


def test_every_error_a_user_is_told_about_is_a_pipeline_error() -> None:
    """DESIGN §3: ``except PipelineError`` catches every error a user is told to catch, the
    planning layer's ScheduleError (still a ValueError) included."""
    from pipetrain import PipelineError as TopLevel
    from pipetrain.plan import ScheduleError

    assert (
        TopLevel is PipelineError and issubclass(ScheduleError, PipelineError) and issubclass(ScheduleError, ValueError)
    )
    layers = make_layers("mlp", 2)
    for bad in ({"schedule": "NoSuchSchedule"}, {"schedule": "1F1B", "n_microbatches": 0}):
        kwargs: dict[str, Any] = {"n_microbatches": 4, "loss_fn": nn.functional.mse_loss, "num_ranks": 2, **bad}
        with pytest.raises(PipelineError, match=r"NoSuchSchedule|microbatch"):
            LocalPipeline(layers, kwargs.pop("schedule"), **kwargs)
    with pytest.raises(PipelineError, match="cannot parse action"):
        Schedule.from_csv_text("0F0,0X0\n")
