"""pipetrain.recompute: a stage's activations rebuilt in backward, B and split I/W, gradients exact."""

from __future__ import annotations

import copy
import ctypes
import gc
from typing import Any

import pytest
import torch
from torch import nn

from pipetrain import LocalPipeline, PipelineError, PipelineStage
from pipetrain.plan import build_schedule
from pipetrain.recompute import is_recomputed, recompute
from pipetrain.split import split_by_names
from support.dist import run_ranks


def _block(d: int = 8, dropout: float = 0.0) -> nn.Module:
    return nn.Sequential(nn.Linear(d, 2 * d), nn.Dropout(dropout), nn.Tanh(), nn.Linear(2 * d, d), nn.GELU())


def _stage_grads(module: nn.Module, x: torch.Tensor, g: torch.Tensor, mode: str, seed: int) -> Any:
    """Output, input grad and parameter grads of one microbatch through a stage (B, or I then W)."""
    stage = PipelineStage(module, 1, 3, "cpu")
    leaf = x.detach().requires_grad_()
    torch.manual_seed(seed)
    out = stage.forward_one_chunk(0, (leaf,))
    if mode == "B":
        (gx,) = stage.backward_one_chunk(0, grad_outputs=[g], full=True)
    else:
        (gx,) = stage.backward_one_chunk(0, grad_outputs=[g], full=False)
        stage.backward_weight_one_chunk(0)
    assert not stage.has_state()
    return out.detach(), gx, [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("weight_grads", ["recompute", "keep"])
@pytest.mark.parametrize("mode", ["B", "IW"])
def test_gradients_equal_plain_training(mode: str, weight_grads: str) -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(_block(dropout=0.3), _block(dropout=0.3))
    rebuilt = recompute(copy.deepcopy(plain), weight_grads=weight_grads)
    x, g = torch.randn(4, 8), torch.randn(4, 8)
    want = _stage_grads(plain, x, g, mode, seed=7)
    got = _stage_grads(rebuilt, x, g, mode, seed=7)  # dropout draws the same masks when rebuilt
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _count_forwards(module: nn.Module) -> list[int]:
    calls = [0]
    first = next(m for m in module.modules() if isinstance(m, nn.Linear))
    first.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("weight_grads", ["recompute", "keep"])
@pytest.mark.parametrize("mode", ["B", "IW"])
def test_the_forward_runs_twice_under_b_and_under_i_then_w(mode: str, weight_grads: str) -> None:
    # Once in F, once in the first backward pass; W (four Linear layers' GEMMs) rebuilds nothing.
    module = recompute(nn.Sequential(_block(), _block()), weight_grads=weight_grads)
    calls = _count_forwards(module)
    _stage_grads(module, torch.randn(4, 8), torch.randn(4, 8), mode, seed=0)
    assert calls[0] == 2


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def _heap_bytes() -> int:
    """Bytes glibc's malloc has handed out (the CPU allocator's tensors among them)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def test_what_a_recomputed_stage_holds_between_its_backwards() -> None:
    try:
        _heap_bytes()
    except (OSError, AttributeError):
        pytest.skip("needs glibc's mallinfo2 to count allocated bytes")
    torch.manual_seed(0)
    unit = 64 * 256 * 4  # one activation: 64 x 256 fp32

    def held(module: nn.Module) -> tuple[float, float, float]:
        stage = PipelineStage(module, 1, 3, "cpu")
        x, g = torch.randn(64, 256, requires_grad=True), torch.randn(64, 256)
        for mb in range(2):  # the second is measured (the first warms the allocator up)
            gc.collect()
            base = _heap_bytes()
            out = stage.forward_one_chunk(mb, (x,))
            stage.free_output_storage(mb)
            del out
            after_f = _heap_bytes() - base
            (gx,) = stage.backward_one_chunk(mb, grad_outputs=[g], full=False)
            del gx
            after_i = _heap_bytes() - base
            stage.backward_weight_one_chunk(mb)
            for p in module.parameters():
                p.grad = None
            after_w = _heap_bytes() - base
        return after_f / unit, after_i / unit, after_w / unit

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(4)])

    plain = held(model())
    rebuilt = held(recompute(model()))
    # After F: plain holds the 4 Tanh outputs, a recomputed stage nothing beyond its input.
    assert plain[0] == pytest.approx(4, abs=0.3) and rebuilt[0] == pytest.approx(0, abs=0.3)
    # After I: both hold what W reads, the 4 Linear layers' output gradients and the 3 Linear
    # inputs that are not the stage input (the rebuild's, for the recomputed stage).
    assert plain[1] == pytest.approx(7, abs=0.4) and rebuilt[1] == pytest.approx(7, abs=0.4)
    assert max(plain[2], rebuilt[2]) < 0.2  # nothing left after W


def test_the_module_keeps_its_names_and_can_be_made_plain_again() -> None:
    module = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    keys = list(module.state_dict())
    recompute(module)
    assert is_recomputed(module) and isinstance(module, nn.Sequential)
    assert list(module.state_dict()) == keys
    copied = copy.deepcopy(module)
    assert is_recomputed(copied) and copied[0] is not module[0]
    recompute(module, enabled=False)
    assert type(module) is nn.Sequential and not is_recomputed(module)
    with torch.no_grad():  # without grad the forward just runs
        assert recompute(module)(torch.ones(1, 3)).shape == (1, 3)
    with pytest.raises(ValueError, match="weight_grads"):
        recompute(module, weight_grads="later")


class _Flaky(nn.Module):
    """A forward that does something else the second time."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = self.lin(x)
        return y.tanh() if self.calls == 1 else y


def test_a_forward_that_changes_when_rebuilt_is_an_error() -> None:
    stage = PipelineStage(recompute(_Flaky()), 1, 3, "cpu")
    out = stage.forward_one_chunk(0, (torch.randn(2, 4, requires_grad=True),))
    with pytest.raises(PipelineError, match="saved 2 tensors for backward where the first run saved 3"):
        stage.backward_one_chunk(0, grad_outputs=[torch.ones_like(out)])


def test_an_input_changed_in_place_is_an_error() -> None:
    module = recompute(nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    x = torch.randn(2, 4)
    out = module(x)
    x.add_(1.0)
    with pytest.raises(PipelineError, match="modified in place after its forward"):
        out.sum().backward()


# ---------------------------------------------------------------- in a pipeline


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Dropout(0.2), nn.GELU(), nn.Linear(16, 16), nn.Linear(16, 4)
    )


_CUT = [["0", "1"], ["2", "3", "4"], ["5"], ["6"]]


def _reference(x: torch.Tensor, y: torch.Tensor, n_mb: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Plain training's losses and gradients (mean of the microbatch losses), dropout drawn in order."""
    model = _model()
    losses = []
    torch.manual_seed(11)
    for xm, ym in zip(x.tensor_split(n_mb), y.tensor_split(n_mb), strict=True):
        loss = nn.functional.mse_loss(model(xm), ym) / n_mb
        loss.backward()
        losses.append(loss.detach() * n_mb)
    return losses, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "ZBVZeroBubble", "InterleavedZeroBubble"])
def test_a_plan_with_recompute_trains_like_plain_training_in_one_process(schedule: str) -> None:
    # Interleaved1F1B runs full backwards (B); the zero bubble schedules split them into I and W.
    # Stage 1's dropout draws in microbatch order, as plain training does, and is replayed when rebuilt.
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    model = _model()
    stages = split_by_names(model, _CUT, recompute={0, 1, 3})
    assert [is_recomputed(s) for s in stages] == [True, True, False, True]
    pipe = LocalPipeline(stages, build_schedule(schedule, 2, 4, 2), loss_fn=nn.functional.mse_loss)
    losses: list[torch.Tensor] = []
    torch.manual_seed(11)
    pipe.step(x, target=y, losses=losses)
    want_losses, want_grads = _reference(x, y, 4)
    torch.testing.assert_close([loss.detach() for loss in losses], want_losses)
    torch.testing.assert_close([p.grad for p in model.parameters()], want_grads)


def _distributed(rank: int, world: int) -> dict[str, Any]:
    """ZBV (split backward) and 1F1B (full backward) on 2 ranks with recomputed stages."""
    from pipetrain import PipelineScheduleRuntime
    from pipetrain.split import stages_for_rank

    out: dict[str, Any] = {}
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    for name, stages_per_rank, recomputed in (("ZBVZeroBubble", 2, {0, 1, 3}), ("1F1B", 1, {0})):
        model = _model()
        cut = _CUT if stages_per_rank == 2 else [["0", "1", "2", "3"], ["4", "5", "6"]]
        modules = split_by_names(model, cut, recompute=recomputed)
        sched = build_schedule(name, world, 4, stages_per_rank)
        pairs = stages_for_rank(modules, sched.stage_to_rank, rank)
        mine = [PipelineStage(m, s, len(modules), "cpu") for s, m in pairs]
        runtime = PipelineScheduleRuntime(mine, sched, loss_fn=nn.functional.mse_loss)
        torch.manual_seed(11)
        runtime.step(x, target=y)
        _, want = _reference(x, y, 4)
        held = {k for st in mine for k, _ in st.submodule.named_parameters()}
        for (k, p), q in zip(model.named_parameters(), want, strict=True):
            if k in held:
                torch.testing.assert_close(p.grad, q, msg=lambda m, k=k, name=name: f"{name}, {k}: {m}")
        out[name] = sorted(held)
    return out


def test_a_plan_with_recompute_trains_like_plain_training_on_two_ranks() -> None:
    results = run_ranks(_distributed, 2, timeout=180)
    for name in ("ZBVZeroBubble", "1F1B"):
        assert sorted(results[0][name] + results[1][name]) == sorted(k for k, _ in _model().named_parameters())


@pytest.mark.parametrize("memory_limit", [500, 300])
def test_a_planned_run_with_recompute_trains_like_plain_training(memory_limit: int) -> None:
    """plan_pipeline's cut, recompute and (constructed or named) schedule, run on real layers (no
    dropout: stages draw in schedule order, plain training layer by layer)."""
    from pipetrain.plan import LayerCost, plan_pipeline

    def model() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(8)])

    costs = [
        LayerCost(
            str(k),
            f=1.0,
            i=1.0,
            w=1.0,
            activation_bytes=100.0,
            output_bytes=5.0,
            static_bytes=10.0,
            weight_grad_bytes=5.0,
        )
        for k in range(8)
    ]
    plan = plan_pipeline(costs, num_ranks=2, num_microbatches=4, memory_limit=memory_limit, time_limit=1)
    assert plan.recompute  # the budget makes it recompute
    net = model()
    stages = split_by_names(net, plan.stage_layers, recompute=plan.recompute)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    losses: list[torch.Tensor] = []
    torch.manual_seed(3)
    LocalPipeline(stages, plan.schedule, loss_fn=nn.functional.mse_loss).step(x, target=y, losses=losses)
    ref = model()
    torch.manual_seed(3)
    want = []
    for xm, ym in zip(x.tensor_split(4), y.tensor_split(4), strict=True):
        loss = nn.functional.mse_loss(ref(xm), ym)
        (loss / 4).backward()
        want.append(loss.detach())
    torch.testing.assert_close([loss.detach() for loss in losses], want)
    torch.testing.assert_close([p.grad for p in net.parameters()], [p.grad for p in ref.parameters()])
