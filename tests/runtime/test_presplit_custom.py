"""The pre-split step form (torchtitan's trainer) and register_custom_function (torch 2.13's hook).

Microbatches of different lengths (packed documents) through every schedule in one process give
the losses and gradients of plain training; an OVERLAP_F_B replaced by a function that runs the
pair's forward in a thread while its backward runs does too.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
from torch import nn

from pipetrain import LocalPipeline
from pipetrain.errors import PipelineError
from pipetrain.plan import ActionKind
from pipetrain.schedules import FORWARD, OVERLAP_F_B, _Action, _PipelineContext
from support.models import stages_per_rank

VOCAB, DIM = 32, 16


class _Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)

    def forward(self, tokens: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.emb(tokens) * scale


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return h + torch.tanh(self.lin(h)) * scale


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, VOCAB)

    def forward(self, h: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.lin(h * scale)


def _modules(n: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [_Embed(), *(_Block() for _ in range(n - 2)), _Head()]


def _loss(out: torch.Tensor, target: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
    return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten(), reduction="sum") * weight


def _packed(m: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``m`` microbatches of 2 rows each, of lengths 3, 4, 5, ... tokens (packed documents)."""
    g = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, VOCAB, (2, 3 + i), generator=g) for i in range(m)]
    ys = [torch.randint(0, VOCAB, (2, 3 + i), generator=g) for i in range(m)]
    return xs, ys


def _plain(modules: list[nn.Module], xs: list[torch.Tensor], ys: list[torch.Tensor], **kw: Any) -> list[Any]:
    """Plain training on a copy, microbatch by microbatch: (losses, outputs, grads)."""
    ref = copy.deepcopy(modules)
    losses, outs = [], []
    for x, y in zip(xs, ys, strict=True):
        h = x
        for mod in ref:
            h = mod(h, **kw)
        loss = _loss(h, y)
        loss.backward()
        losses.append(loss.detach())
        outs.append(h.detach())
    return [losses, outs, [p.grad for mod in ref for p in mod.parameters()]]


def _grads(modules: list[nn.Module]) -> list[torch.Tensor | None]:
    return [p.grad for mod in modules for p in mod.parameters()]


@pytest.mark.parametrize("name", ["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV", "ZBH1"])
def test_presplit_step_of_different_lengths_matches_plain_training(name: str) -> None:
    m = 4
    modules = _modules(2 * stages_per_rank(name))
    xs, ys = _packed(m)
    ref_losses, ref_outs, ref_grads = _plain(modules, xs, ys, scale=0.5)
    pipe = LocalPipeline(modules, name, n_microbatches=m, loss_fn=_loss, num_ranks=2, scale_grads=False)
    losses: list[torch.Tensor] = []
    out = pipe.step(
        arg_mbs=[(x,) for x in xs],
        kwarg_mbs=[{"scale": 0.5} for _ in xs],
        target_mbs=ys,
        losses=losses,
        loss_kwargs={"weight": 1.0},
        return_outputs=True,
    )
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
    assert isinstance(out, list) and [o.shape for o in out] == [o.shape for o in ref_outs]
    for got, want in zip(out, ref_outs, strict=True):
        torch.testing.assert_close(got, want)
    for got, want in zip(_grads(modules), ref_grads, strict=True):
        torch.testing.assert_close(got, want)
    assert pipe.step(arg_mbs=[(x,) for x in xs], target_mbs=ys, return_outputs=False) is None
    # eval in the same form: losses of each microbatch, no gradient touched
    before = [g.clone() for g in _grads(modules) if g is not None]
    eval_losses: list[torch.Tensor] = []
    pipe.eval(arg_mbs=[(x,) for x in xs], kwarg_mbs=[{"scale": 0.5}] * m, target_mbs=ys, losses=eval_losses)
    torch.testing.assert_close(torch.stack(eval_losses), torch.stack(ref_losses))
    for got, want in zip([g for g in _grads(modules) if g is not None], before, strict=True):
        torch.testing.assert_close(got, want)


def test_presplit_errors_say_what_is_wrong() -> None:
    pipe = LocalPipeline(_modules(4), "1F1B", n_microbatches=4, loss_fn=_loss, num_ranks=4)
    xs, ys = _packed(4)
    args = [(x,) for x in xs]
    with pytest.raises(PipelineError, match=r"arg_mbs has 3 microbatches, but this schedule was built with n_micro"):
        pipe.step(arg_mbs=args[:3], target_mbs=ys)
    with pytest.raises(PipelineError, match=r"target_mbs has 5 microbatches"):
        pipe.step(arg_mbs=args, target_mbs=[*ys, ys[0]])
    with pytest.raises(PipelineError, match=r"both the pre-split form .* and whole-batch positional inputs"):
        pipe.step(xs[0], arg_mbs=args, target_mbs=ys)
    with pytest.raises(PipelineError, match=r"whole-batch target"):
        pipe.step(arg_mbs=args, target=ys[0])
    with pytest.raises(PipelineError, match=r"arg_mbs\[1\] is a Tensor; each item of arg_mbs is the tuple"):
        pipe.step(arg_mbs=[args[0], xs[1], args[2], args[3]], target_mbs=ys)
    with pytest.raises(PipelineError, match=r"kwarg_mbs\[0\] is a tuple"):
        pipe.step(arg_mbs=args, kwarg_mbs=[()] * 4, target_mbs=ys)
    with pytest.raises(PipelineError, match=r"kwarg_mbs must be a list with one item per microbatch, got dict"):
        pipe.step(arg_mbs=args, kwarg_mbs={"scale": 1.0}, target_mbs=ys)
    with pytest.raises(PipelineError, match=r"loss_fn is set, but step\(\) got no target_mbs"):
        pipe.step(arg_mbs=args)
    with pytest.raises(PipelineError, match=r"holds stage 0 but step\(\) was given no inputs"):
        pipe.step(target_mbs=ys)
    # after all that, a good call still trains
    losses: list[torch.Tensor] = []
    pipe.step(arg_mbs=args, target_mbs=ys, losses=losses)
    assert len(losses) == 4


def test_register_custom_function_checks_its_kind() -> None:
    pipe = LocalPipeline(_modules(4), "DualPipeV", n_microbatches=4, loss_fn=_loss, num_ranks=2)
    for bad in ("SEND_F", ActionKind.RECV_B, "X"):
        with pytest.raises(ValueError, match="not one of B, F, I, OVERLAP_F_B, REDUCE_GRAD, RESHARD, UNSHARD, W"):
            pipe.register_custom_function(bad, lambda a, c: None)
    with pytest.raises(TypeError, match="not callable"):
        pipe.register_custom_function(FORWARD, 3)  # type: ignore[arg-type]
    action = _Action.from_str("(0F1;3B0)OVERLAP_F_B")
    assert action.computation_type is OVERLAP_F_B and action.stage_index == 0 and action.microbatch_index is None
    assert [(a.stage_index, a.computation_type.value, a.microbatch_index) for a in action.sub_actions or ()] == [
        (0, "F", 1),
        (3, "B", 0),
    ]


def _overlapped_f_b(calls: list[str]) -> Any:
    """An OVERLAP_F_B that runs the forward in a second thread while the backward runs here,
    through the stages' public methods and the context's hand-over of inputs and outputs."""

    def run(action: _Action, ctx: _PipelineContext) -> None:
        assert isinstance(ctx, _PipelineContext) and ctx.schedule_ref is not None
        f, b = action.sub_actions or ()
        assert f.computation_type is FORWARD and b.computation_type in (ActionKind.B, ActionKind.I)
        fs, bs = ctx.stages[f.stage_index], ctx.stages[b.stage_index]
        fmb, bmb = f.microbatch_index, b.microbatch_index
        assert fmb is not None and bmb is not None
        args, kwargs = ctx.forward_inputs(f.stage_index, fmb)
        bwd = ctx.backward_inputs(b.stage_index, bmb)
        result: dict[str, Any] = {}
        started = threading.Event()

        def forward() -> None:
            try:
                with torch.enable_grad():  # grad mode is per thread
                    started.set()
                    result["out"] = fs.forward_one_chunk(fmb, args, kwargs)
            except BaseException as exc:  # re-raised below, on the executor's thread
                result["error"] = exc

        thread = threading.Thread(target=forward)
        thread.start()
        started.wait()
        grads = bs.backward_one_chunk(bmb, **bwd, full=b.computation_type is ActionKind.B)
        thread.join()
        if "error" in result:
            raise result["error"]
        ctx.forward_done(f.stage_index, fmb, result["out"])
        ctx.backward_done(b.stage_index, bmb, grads)
        calls.append(str(action))

    return run


def test_custom_overlap_f_b_on_dualpipev_matches_plain_training() -> None:
    m = 6
    modules = _modules(4)
    xs, ys = _packed(m)
    ref_losses, _, ref_grads = _plain(modules, xs, ys)
    pipe = LocalPipeline(modules, "DualPipeV", n_microbatches=m, loss_fn=_loss, num_ranks=2, scale_grads=False)
    overlaps = [a for acts in pipe.schedule.actions.values() for a in acts if a and a.kind is ActionKind.OVERLAP_F_B]
    assert overlaps, "DualPipeV at 6 microbatches on 2 ranks pairs forwards with backwards"
    calls: list[str] = []
    pipe.register_custom_function(OVERLAP_F_B, _overlapped_f_b(calls))
    seen: list[tuple[int, int]] = []

    def forward(action: _Action, ctx: _PipelineContext) -> None:
        # a plain F replaced too, by pipetrain's own implementation through ctx.run
        seen.append((action.stage_index, action.microbatch_index or 0))
        assert ctx.arg_mbs is None or len(ctx.arg_mbs) == m
        ctx.run(action)

    pipe.register_custom_function("F", forward)
    losses: list[torch.Tensor] = []
    pipe.step(arg_mbs=[(x,) for x in xs], target_mbs=ys, losses=losses)
    assert sorted(calls) == sorted(str(a) for a in overlaps)
    n_plain_f = sum(1 for acts in pipe.schedule.actions.values() for a in acts if a and a.kind is ActionKind.F)
    assert len(seen) == n_plain_f
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
    for got, want in zip(_grads(modules), ref_grads, strict=True):
        torch.testing.assert_close(got, want)
    assert not any(st.has_state() for st in pipe.stages)


def test_register_custom_function_before_a_csv_schedule_is_loaded() -> None:
    """torch's CSV route: _PipelineScheduleRuntime(stages, n, loss_fn), functions registered,
    then _load_csv; the registration is kept for the runtime the load builds."""
    from pipetrain import PipelineStage
    from pipetrain.schedules import _PipelineScheduleRuntime

    sched = _PipelineScheduleRuntime([PipelineStage(nn.Linear(2, 2), 0, 2, "cpu")], 4, loss_fn=_loss)
    fn = _overlapped_f_b([])
    sched.register_custom_function(OVERLAP_F_B, fn)
    with pytest.raises(ValueError, match="not one of"):
        sched.register_custom_function("RECV_F", fn)
    assert sched.__dict__["_custom"] == {ActionKind.OVERLAP_F_B: fn}
