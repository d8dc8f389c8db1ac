"""The split backward is a split of work: W is the weight GEMMs alone, with no autograd engine call,
one recompute per microbatch under activation checkpointing (pipetrain's, torch's wrapper, selective),
and gradients equal to B's and plain training's on the ways people build blocks."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from pipetrain import PipelineStage
from pipetrain import recompute as rc
from support.models import TransformerBlock

torch.set_num_threads(1)


class Block(TransformerBlock):
    """The shared transformer block."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__(d, heads, up_bias=False)


class Calls(nn.Module):
    """Counts its forwards (to see how often a checkpointed block is rebuilt)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out: torch.Tensor = self.inner(x)
        return out


class TorchCheckpointed(nn.Module):
    """A forward that calls torch.utils.checkpoint itself (nothing pipetrain can adopt)."""

    def __init__(self, inner: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.inner, self.reentrant = inner, reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(self.inner, x, use_reentrant=self.reentrant)
        return out


class PipetrainCheckpointed(TorchCheckpointed):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = rc.checkpoint(self.inner, x, use_reentrant=False)
        return out


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _sac(block: nn.Module) -> nn.Module:
    return checkpoint_wrapper(block, context_fn=partial(create_selective_checkpoint_contexts, _save_matmuls))


WRAPS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "eager": lambda b: b,
    "pipetrain.recompute": rc.recompute,
    "pipetrain.checkpoint": lambda b: PipetrainCheckpointed(b, False),
    "checkpoint_wrapper": checkpoint_wrapper,
    "checkpoint_wrapper-selective": _sac,
    "torch.utils.checkpoint": lambda b: TorchCheckpointed(b, False),
    "torch.utils.checkpoint-reentrant": lambda b: TorchCheckpointed(b, True),
}


def _stage_of(wrap: str, n_blocks: int = 2) -> tuple[nn.Module, list[Calls]]:
    torch.manual_seed(0)
    counted = [Calls(Block()) for _ in range(n_blocks)]
    return nn.Sequential(*[WRAPS[wrap](c) for c in counted]), counted


def _run(module: nn.Module, how: str, n_mb: int = 2, first: bool = False) -> tuple[list[Any], list[torch.Tensor]]:
    """Gradients of parameters and inputs after every microbatch's backward (B, or I then W)."""
    stage = PipelineStage(module, 0 if first else 1, 3, "cpu")
    torch.manual_seed(1)
    xs = [torch.randn(2, 5, 16, requires_grad=not first) for _ in range(n_mb)]
    gs = [torch.randn(2, 5, 16) for _ in range(n_mb)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for m, x in enumerate(xs):
            stage.forward_one_chunk(m, (x,))
        input_grads = []
        for m in reversed(range(n_mb)):
            input_grads += stage.backward_one_chunk(m, grad_outputs=[gs[m]], full=how == "B")
        if how == "IW":
            for m in range(n_mb):
                stage.backward_weight_one_chunk(m)
    assert not stage.has_state()
    return [p.grad for p in module.parameters()], input_grads


def _plain(module: nn.Module, n_mb: int = 2) -> list[Any]:
    torch.manual_seed(1)
    xs = [torch.randn(2, 5, 16) for _ in range(n_mb)]
    gs = [torch.randn(2, 5, 16) for _ in range(n_mb)]
    for x, g in zip(xs, gs, strict=True):
        module(x).backward(g)
    return [p.grad for p in module.parameters()]


@pytest.mark.parametrize("wrap", list(WRAPS))
def test_split_gradients_equal_b_and_plain_training(wrap: str) -> None:
    plain_grads = _plain(_stage_of("eager")[0])
    b_grads, b_inputs = _run(_stage_of(wrap)[0], "B")
    iw_grads, iw_inputs = _run(_stage_of(wrap)[0], "IW")
    torch.testing.assert_close(iw_grads, b_grads)
    torch.testing.assert_close(iw_inputs, b_inputs)
    torch.testing.assert_close(iw_grads, plain_grads)


@pytest.mark.parametrize(
    ("wrap", "forwards"),
    [
        ("eager", 1),
        ("pipetrain.recompute", 2),
        ("pipetrain.checkpoint", 2),
        ("checkpoint_wrapper", 2),
        ("checkpoint_wrapper-selective", 2),
        ("torch.utils.checkpoint", 2),
        ("torch.utils.checkpoint-reentrant", 2),
    ],
)
def test_a_checkpointed_block_runs_its_forward_twice_per_microbatch_under_a_split(wrap: str, forwards: int) -> None:
    module, counted = _stage_of(wrap)
    _run(module, "IW", n_mb=3)
    assert [c.calls for c in counted] == [3 * forwards] * len(counted)


def _count_engine_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    runs = [0]
    real = torch.autograd.graph._engine_run_backward

    def counting(*args: Any, **kwargs: Any) -> Any:
        runs[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.autograd.graph, "_engine_run_backward", counting)
    return runs


@pytest.mark.parametrize("wrap", ["eager", "pipetrain.recompute", "checkpoint_wrapper-selective"])
def test_w_makes_no_autograd_engine_call_and_holds_the_weight_gemms(monkeypatch: pytest.MonkeyPatch, wrap: str) -> None:
    module, _ = _stage_of(wrap, n_blocks=3)
    stage = PipelineStage(module, 1, 3, "cpu")
    stage.forward_one_chunk(0, (torch.randn(2, 5, 16, requires_grad=True),))
    runs = _count_engine_runs(monkeypatch)
    stage.backward_one_chunk(0, grad_outputs=[torch.randn(2, 5, 16)], full=False)
    assert runs[0] == 1  # I: one engine run
    plan = stage._mbs[0].plan
    assert plan is not None
    # Every Linear's weight waits for W (qkv, proj, up, down per block); biases and norms did not.
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    assert {id(g.weight) for g in plan.gemms} == {id(m.weight) for m in linears}
    assert all(m.weight.grad is None for m in linears)
    assert all(p.grad is not None for n, p in module.named_parameters() if not n.endswith("weight") or "ln" in n)
    stage.backward_weight_one_chunk(0)
    assert runs[0] == 1  # W: none
    assert all(m.weight.grad is not None for m in linears)


class Shapes(nn.Module):
    """Weights used as GEMMs in the less common ways: as the left operand, in a batched matmul
    (experts), twice in one stage, transposed by hand, and one frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Parameter(torch.randn(16, 16) * 0.2)
        self.experts = nn.Parameter(torch.randn(4, 16, 16) * 0.2)
        self.twice = nn.Linear(16, 16)
        self.by_hand = nn.Parameter(torch.randn(16, 16) * 0.2)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (4, n, 16)
        h = torch.matmul(self.left, x.transpose(1, 2)).transpose(1, 2)  # left @ x^T
        h = torch.bmm(h, self.experts)  # one expert per batch row
        h = self.twice(torch.tanh(self.twice(h)))
        h = h @ self.by_hand.T
        return self.frozen(h)


class TiedHeadOnOneStage(nn.Module):
    """An embedding and a head sharing one weight on the same stage: its gradient stays with autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 16)
        self.head = nn.Linear(16, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids)))


class Scale(torch.autograd.Function):
    """A custom Function with its own weight gradient (computed once, in I)."""

    calls = 0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        Scale.calls += 1
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(dim=tuple(range(g.dim() - 1)))


class WithCustom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.w = nn.Parameter(torch.rand(16) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(Scale.apply(x, self.w))  # type: ignore[no-any-return]


def _b_and_split(factory: Callable[[], nn.Module], make: Callable[[], tuple[Any, ...]], first: bool) -> None:
    torch.manual_seed(0)
    base = factory()
    grads = {}
    for how in ("B", "IW"):
        module = copy.deepcopy(base)
        stage = PipelineStage(module, 0 if first else 1, 3, "cpu")
        torch.manual_seed(2)
        args = make()
        out = stage.forward_one_chunk(0, args)
        g = torch.randn_like(out)
        inp = stage.backward_one_chunk(0, grad_outputs=[g], full=how == "B")
        if how == "IW":
            stage.backward_weight_one_chunk(0)
        grads[how] = ([p.grad for p in module.parameters()], inp)
        plain = copy.deepcopy(base)
        torch.manual_seed(2)
        plain(*make()).backward(g)
        torch.testing.assert_close(grads[how][0], [p.grad for p in plain.parameters()])
    torch.testing.assert_close(grads["IW"], grads["B"])


def test_left_operand_batched_repeated_transposed_and_frozen_weights() -> None:
    _b_and_split(Shapes, lambda: (torch.randn(4, 3, 16, requires_grad=True),), first=False)


def test_a_tied_embedding_and_head_on_one_stage() -> None:
    _b_and_split(TiedHeadOnOneStage, lambda: (torch.randint(0, 10, (2, 5)),), first=True)


def test_a_custom_function_computes_its_weight_gradient_once() -> None:
    Scale.calls = 0
    _b_and_split(WithCustom, lambda: (torch.randn(3, 16, requires_grad=True),), first=False)
    assert Scale.calls == 4  # B, its plain reference, I, its plain reference: W never reruns it


def test_autocast_bf16_weights_reach_their_gemm_through_a_cast() -> None:
    """Under autocast each weight is cast before its GEMM: W still holds it, gradients equal B's."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    out = {}
    for how in ("B", "IW"):
        module = copy.deepcopy(base)
        stage = PipelineStage(module, 1, 3, "cpu")
        torch.manual_seed(1)
        x = torch.randn(8, 16, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = stage.forward_one_chunk(0, (x,))
        stage.backward_one_chunk(0, grad_outputs=[torch.ones_like(y)], full=how == "B")
        if how == "IW":
            assert len(stage._mbs[0].plan.gemms) == 2  # type: ignore[union-attr]
            stage.backward_weight_one_chunk(0)
        out[how] = [p.grad for p in module.parameters()]
        assert all(g is not None and g.dtype == torch.float32 for g in out[how])
    torch.testing.assert_close(out["IW"], out["B"])


def test_what_cannot_wait_for_w_is_said_once_naming_the_module() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(Block(), TorchCheckpointed(Block(), reentrant=False))
    stage = PipelineStage(module, 1, 3, "cpu")
    with pytest.warns(UserWarning, match=r"stage 1: the weight gradients of 1\.inner\.qkv, 1\.inner\.proj"):
        for m in range(2):
            stage.forward_one_chunk(m, (torch.randn(2, 5, 16, requires_grad=True),))
            stage.backward_one_chunk(m, grad_outputs=[torch.randn(2, 5, 16)], full=False)
            stage.backward_weight_one_chunk(m)
    # The eager block's weights still waited for W.
    stage.forward_one_chunk(2, (torch.randn(2, 5, 16, requires_grad=True),))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: no second warning
        stage.backward_one_chunk(2, grad_outputs=[torch.randn(2, 5, 16)], full=False)
    deferred = {id(g.weight) for g in stage._mbs[2].plan.gemms}  # type: ignore[union-attr]
    assert deferred == {
        id(module[0].qkv.weight),
        id(module[0].proj.weight),
        id(module[0].up.weight),
        id(module[0].down.weight),
    }


def test_torchs_checkpoint_wrapper_is_adopted_and_reentrant_ones_are_left() -> None:
    block = Block()
    wrapped = nn.Sequential(checkpoint_wrapper(copy.deepcopy(block)), _sac(copy.deepcopy(block)))
    reentrant = checkpoint_wrapper(copy.deepcopy(block), checkpoint_impl=CheckpointImpl.REENTRANT)
    PipelineStage(nn.Sequential(wrapped, reentrant), 1, 3, "cpu")
    assert all(w.checkpoint_fn.func is rc.checkpoint for w in wrapped)  # type: ignore[union-attr]
    assert "context_fn" in wrapped[1].checkpoint_fn.keywords  # type: ignore[union-attr,operator]
    assert reentrant.checkpoint_fn.func is not rc.checkpoint  # type: ignore[union-attr]
    stage = PipelineStage(nn.Linear(2, 2), 0, 2, "cpu")
    later = checkpoint_wrapper(copy.deepcopy(block))
    stage.submod = later  # torchtitan applies AC after building its stages
    assert later.checkpoint_fn.func is rc.checkpoint  # type: ignore[union-attr]


def test_compiled_block_is_computed_in_i_and_said_once() -> None:
    torch.manual_seed(0)
    base = Block()
    compiled = nn.Sequential(torch.compile(copy.deepcopy(base), backend="aot_eager"))
    stage = PipelineStage(compiled, 1, 3, "cpu")
    x, g = torch.randn(2, 5, 16, requires_grad=True), torch.randn(2, 5, 16)
    stage.forward_one_chunk(0, (x,))
    with pytest.warns(UserWarning, match="torch.compile'd region"):
        (gx,) = stage.backward_one_chunk(0, grad_outputs=[g], full=False)
    assert stage._mbs[0].plan is not None and stage._mbs[0].plan.gemms == []
    stage.backward_weight_one_chunk(0)
    x2 = x.detach().requires_grad_()
    base(x2).backward(g)
    torch.testing.assert_close([p.grad for p in compiled.parameters()], [p.grad for p in base.parameters()])
    torch.testing.assert_close(gx, x2.grad)


def test_dw_builder_runs_the_users_weight_step_at_w() -> None:
    """torch's hook: I is autograd's whole backward, W calls the runner dw_builder made at I."""
    calls: list[str] = []

    def builder() -> Callable[[], None]:
        calls.append("built")
        return lambda: calls.append("ran")

    module = nn.Linear(4, 4)
    stage = PipelineStage(module, 1, 3, "cpu", dw_builder=builder)
    stage.forward_one_chunk(0, (torch.randn(2, 4, requires_grad=True),))
    stage.backward_one_chunk(0, grad_outputs=[torch.ones(2, 4)], full=False)
    assert calls == ["built"] and module.weight.grad is not None
    stage.backward_weight_one_chunk(0)
    assert calls == ["built", "ran"]
    stage.forward_one_chunk(1, (torch.randn(2, 4, requires_grad=True),))
    stage.backward_one_chunk(1, grad_outputs=[torch.ones(2, 4)], full=True)
    assert calls == ["built", "ran", "built", "ran"]


def test_compiling_between_the_linears_keeps_their_gemms_for_w() -> None:
    """The route the guide gives for compiled stages: compile what lies between the linear layers
    (norms, activations); the Linear GEMMs stay eager and wait for W; gradients equal B's."""
    torch.manual_seed(0)

    class Mid(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.gelu(self.norm(x)) * 1.5

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), torch.compile(Mid(), backend="aot_eager"), nn.Linear(32, 16))

    grads = {}
    for how in ("B", "IW"):
        module = build()
        stage = PipelineStage(module, 1, 3, "cpu")
        torch.manual_seed(1)
        stage.forward_one_chunk(0, (torch.randn(4, 16, requires_grad=True),))
        stage.backward_one_chunk(0, grad_outputs=[torch.ones(4, 16)], full=how == "B")
        if how == "IW":
            plan = stage._mbs[0].plan
            assert plan is not None and {id(g.weight) for g in plan.gemms} == {
                id(module[0].weight),
                id(module[2].weight),
            }
            stage.backward_weight_one_chunk(0)
        grads[how] = [p.grad for p in module.parameters()]
    torch.testing.assert_close(grads["IW"], grads["B"])


def test_compile_for_split_linears_leaves_the_linears_to_w() -> None:
    from pipetrain import PipelineError
    from pipetrain.compiled import compile_for_split

    torch.manual_seed(0)
    base = Block()
    compiled = compile_for_split(copy.deepcopy(base), split="linears", backend="aot_eager")
    assert {n for n, _ in compiled.named_parameters()} == {"_orig_mod." + n for n, _ in base.named_parameters()}
    stage = PipelineStage(compiled, 1, 3, "cpu")
    x, g = torch.randn(2, 5, 16, requires_grad=True), torch.randn(2, 5, 16)
    stage.forward_one_chunk(0, (x,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to say: every weight GEMM waits for W
        (gx,) = stage.backward_one_chunk(0, grad_outputs=[g], full=False)
    plan = stage._mbs[0].plan
    assert plan is not None and len(plan.gemms) == 4  # qkv, proj, up, down
    stage.backward_weight_one_chunk(0)
    x2 = x.detach().requires_grad_()
    base(x2).backward(g)
    torch.testing.assert_close([p.grad for p in compiled.parameters()], [p.grad for p in base.parameters()])
    torch.testing.assert_close(gx, x2.grad)
    with pytest.raises(PipelineError, match="fullgraph=True cannot hold"):
        compile_for_split(Block(), split="linears", fullgraph=True)


@pytest.mark.parametrize("first", [False, True])
def test_torchs_stage_backward_functions_give_torchs_gradients(first: bool) -> None:
    """pipetrain._backward.stage_backward / stage_backward_input / stage_backward_weight, called as
    torch's tests and DualPipe-style code call torch's, leave the gradients torch's leave. With
    inputs that need no gradient torch's pair leaves the weights without any (its stage calls
    stage_backward for stage 0 instead): there pipetrain's pair is held to plain autograd."""
    from torch.distributed.pipelining import _backward as theirs

    from pipetrain import _backward as ours

    got = {}
    for name, impl in (("torch", theirs), ("pipetrain", ours)):
        torch.manual_seed(0)
        module = Block()
        x = torch.randn(2, 5, 16, requires_grad=not first)
        g = torch.randn(2, 5, 16)
        out = module(x)
        dinputs, groups = impl.stage_backward_input([out], [g], [x], module.parameters())
        impl.stage_backward_weight(module.parameters(), groups)
        split = ([None if p.grad is None else p.grad.clone() for p in module.parameters()], dinputs[0], x.grad)
        for p in module.parameters():
            p.grad = None
        x2 = x.detach().requires_grad_(not first)
        whole = impl.stage_backward(module(x2), g, [x2])
        got[name] = (split, [p.grad for p in module.parameters()], whole[0], x2.grad)
    if not first:
        torch.testing.assert_close(got["pipetrain"], got["torch"])
    else:  # torch's split leaves None; the whole backward agrees
        (split, whole_grads, _, _) = got["pipetrain"]
        torch.testing.assert_close(split[0], whole_grads)
        torch.testing.assert_close(whole_grads, got["torch"][1])
        assert any(grad is None for grad in got["torch"][0][0])


def test_hugging_face_gradient_checkpointing_is_adopted() -> None:
    """A Hugging Face Llama with gradient checkpointing on (use_reentrant=False, its default): the
    stage moves its layers onto pipetrain.recompute.checkpoint; each layer's attention runs twice a
    microbatch under I then W, and the gradients are B's and plain training's."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.llama = transformers.LlamaForCausalLM(config)
            self.llama.gradient_checkpointing_enable()
            self.llama.train()

        def forward(self, embeds: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.llama(inputs_embeds=embeds).logits
            return out

    torch.manual_seed(1)
    embeds, g = torch.randn(2, 6, 32), torch.randn(2, 6, 64)
    plain = Logits()
    x = embeds.clone().requires_grad_()
    plain(x).backward(g)
    for how in ("B", "IW"):
        module = Logits()
        stage = PipelineStage(module, 1, 3, "cpu")
        layers = module.llama.model.layers
        assert all(layer._gradient_checkpointing_func.func is rc.checkpoint for layer in layers)
        calls = [0]
        layers[0].self_attn.register_forward_pre_hook(lambda *_, n=calls: n.__setitem__(0, n[0] + 1))
        stage.forward_one_chunk(0, (embeds.clone().requires_grad_(),))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # every weight GEMM can wait for W: nothing to say
            (gx,) = stage.backward_one_chunk(0, grad_outputs=[g], full=how == "B")
        if how == "IW":
            assert stage._mbs[0].plan is not None and len(stage._mbs[0].plan.gemms) >= 2 * 7
            stage.backward_weight_one_chunk(0)
        assert calls[0] == 2
        torch.testing.assert_close(gx, x.grad)
        torch.testing.assert_close([p.grad for p in module.parameters()], [p.grad for p in plain.parameters()])
