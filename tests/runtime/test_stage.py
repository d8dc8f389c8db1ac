"""PipelineStage: F, B, I and W for one microbatch give exactly plain autograd's gradients."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from pipetrain.errors import PipelineError
from pipetrain.stage import PipelineStage

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- modules
def mlp(width: int = 8, layers: int = 3, act: type[nn.Module] = nn.GELU) -> nn.Module:
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), act()]
    return nn.Sequential(*mods)


class Block(nn.Module):
    """A small pre-norm transformer block (attention + MLP, residuals)."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Embed(nn.Module):
    """A first stage: token ids (no grad) → embeddings + learned positions → block."""

    def __init__(self, vocab: int = 20, d: int = 16, seq: int = 6) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.1)
        self.block = Block(d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.block(self.tok(ids) + self.pos[: ids.shape[1]])


class Checkpointed(nn.Module):
    """Two blocks under activation checkpointing (reentrant: I falls back to the full backward)."""

    def __init__(self, reentrant: bool = False) -> None:
        super().__init__()
        self.b1 = Block()
        self.b2 = Block()
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = checkpoint(self.b1, x, use_reentrant=self.reentrant)
        return checkpoint(self.b2, x, use_reentrant=self.reentrant)


class TiedTwice(nn.Module):
    """One Linear applied twice along a path: its weight is reached from two chained entries."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


class Hooked(nn.Module):
    """A gradient hook on an intermediate (gradient scaling, gradient reversal): applied once."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.requires_grad:
            h.register_hook(lambda g: g * 0.5)
        return self.b(torch.tanh(h))


class SharedParallel(nn.Module):
    """One weight used by two sibling branches, plus a weight-only term in the output."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) * 0.3)
        self.b = nn.Parameter(torch.randn(d))
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w + torch.sin(x) @ self.w + torch.exp(self.scale) * self.b


class MultiOut(nn.Module):
    """Several outputs: a tuple with a tensor that needs no grad, a non-tensor and a weight-only output."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.only_w = nn.Parameter(torch.randn(d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> Any:
        h = self.a(x)
        return h, torch.relu(self.b(h)) * mask, "tag", mask.sum(), self.only_w * 3.0


class OddOutputs(nn.Module):
    """The same tensor twice, a parameter returned as is, and an input the outputs do not use."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.w = nn.Parameter(torch.randn(d))

    def forward(self, x: torch.Tensor, unused: torch.Tensor) -> Any:
        h = torch.tanh(self.lin(x))
        return h, h, self.w


class DictOut(nn.Module):
    """Dict outputs and keyword inputs; a passthrough input comes back as an output."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, *, skip: torch.Tensor, scale: float = 1.0) -> dict[str, Any]:
        h = self.norm(self.lin(x)) * scale
        return {"h": h + skip, "skip": skip, "n": 3}


# ----------------------------------------------------------------------------- helpers
def _leaf_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Fresh leaves for every floating tensor input (each run gets its own)."""

    def fresh(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.detach().clone().requires_grad_(True)
        return t

    return pytree.tree_map(fresh, (args, kwargs))


def _grad_leaves(out: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]


def _make_grads(module: nn.Module, batches: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> list[list[torch.Tensor]]:
    """Random output gradients, one per output tensor that requires grad."""
    grads = []
    for a, k in batches:
        a2, k2 = _leaf_inputs(a, k)
        grads.append([torch.randn_like(t) for t in _grad_leaves(module(*a2, **k2))])
    return grads


def _reference(module: nn.Module, batches: list[Any], grads: list[list[torch.Tensor]]) -> tuple[list[Any], list[Any]]:
    """Plain autograd: per microbatch forward + backward; returns param grads and input grads."""
    ref = copy.deepcopy(module)
    input_grads = []
    for (a, k), g in zip(batches, grads, strict=True):
        a2, k2 = _leaf_inputs(a, k)
        torch.autograd.backward(_grad_leaves(ref(*a2, **k2)), g)
        input_grads.append(
            [t.grad for t in pytree.tree_leaves((a2, k2)) if isinstance(t, torch.Tensor) and t.requires_grad]
        )
    return [p.grad for p in ref.parameters()], input_grads


def _run_stage(
    module: nn.Module,
    batches: list[Any],
    grads: list[list[torch.Tensor]],
    order: list[str],
    *,
    stage_index: int = 1,
    free_outputs: bool = False,
    track: bool = True,
    split: bool = True,
) -> tuple[PipelineStage, list[Any], list[Any]]:
    """Run a stage with ``order`` as actions after all forwards, e.g. ["I0", "I1", "W1", "W0"]."""
    mod = copy.deepcopy(module)
    stage = PipelineStage(mod, stage_index, 3, "cpu", track_saved_tensors=track, split_backward=split)
    for mb, (a, k) in enumerate(batches):
        a2, k2 = _leaf_inputs(a, k)
        stage.forward_one_chunk(mb, a2, k2)
        if free_outputs:
            stage.free_output_storage(mb)
    input_grads: list[Any] = [None] * len(batches)
    for action in order:
        kind, mb = action[0], int(action[1:])
        if kind == "W":
            stage.backward_weight_one_chunk(mb)
        else:
            input_grads[mb] = stage.backward_one_chunk(mb, grad_outputs=grads[mb], full=kind == "B")
    return stage, [p.grad for p in mod.parameters()], input_grads


def _check(module: nn.Module, batches: list[Any], order: list[str], **kw: Any) -> PipelineStage:
    grads = _make_grads(module, batches)
    ref_params, ref_inputs = _reference(module, batches, grads)
    stage, params, inputs = _run_stage(module, batches, grads, order, **kw)
    torch.testing.assert_close(params, ref_params)
    torch.testing.assert_close(inputs, ref_inputs)
    assert not stage.has_state()
    return stage


def _mlp_batches(n: int = 3, width: int = 8) -> list[Any]:
    return [((torch.randn(4 + mb, width),), {}) for mb in range(n)]


def _block_batches(n: int = 3) -> list[Any]:
    return [((torch.randn(2, 5, 16),), {}) for _ in range(n)]


ORDERS = {
    "B": ["B0", "B1", "B2"],
    "IW": ["I0", "W0", "I1", "W1", "I2", "W2"],
    "I-all-then-W": ["I0", "I1", "I2", "W0", "W1", "W2"],
    "W-reversed": ["I0", "I1", "W1", "I2", "W2", "W0"],
}


# ----------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize(
    ("name", "factory", "batches"),
    [
        ("mlp", mlp, _mlp_batches),
        ("mlp-relu", lambda: mlp(act=nn.ReLU), _mlp_batches),
        ("block", Block, _block_batches),
        ("checkpointed", Checkpointed, _block_batches),
        ("checkpointed-reentrant", lambda: Checkpointed(reentrant=True), _block_batches),
        ("tied-twice", TiedTwice, _mlp_batches),
        ("shared-parallel", SharedParallel, _mlp_batches),
        ("hooked", Hooked, _mlp_batches),
    ],
)
def test_gradients_match_autograd(name: str, factory: Callable[[], nn.Module], batches: Any, order: str) -> None:
    torch.manual_seed(0)
    _check(factory(), batches(), ORDERS[order])


@pytest.mark.parametrize("order", ["B", "I-all-then-W"])
def test_compiled_module_and_no_split(order: str) -> None:
    """torch.compile'd regions cannot be split: I does the full backward, W nothing; still exact."""
    torch.manual_seed(0)
    compiled = torch.compile(mlp(), backend="aot_eager")
    _check(compiled, _mlp_batches(), ORDERS[order])
    stage = _check(mlp(), _mlp_batches(), ORDERS[order], split=False)
    assert not stage.split_backward


@pytest.mark.parametrize("order", ["B", "I-all-then-W"])
@pytest.mark.parametrize("track", [True, False])
def test_free_output_storage_keeps_backward_correct(order: str, track: bool) -> None:
    torch.manual_seed(0)
    _check(Block(), _block_batches(), ORDERS[order], free_outputs=True, track=track)
    _check(mlp(act=nn.ReLU), _mlp_batches(), ORDERS[order], free_outputs=True, track=track)


@pytest.mark.parametrize("full", [True, False])
def test_in_memory_handover_between_stages(full: bool) -> None:
    """V placement: a stage's output goes to the next stage as is (no detach by the caller), and
    may be freed after the handover; the chain still gives plain autograd's gradients."""
    torch.manual_seed(0)
    first, second = mlp(), Block(d=8, heads=2)
    whole = nn.Sequential(copy.deepcopy(first), copy.deepcopy(second))
    xs = [torch.randn(2, 3, 8) for _ in range(2)]
    gs = [torch.randn(2, 3, 8) for _ in range(2)]
    for x, g in zip(xs, gs, strict=True):
        whole(x).backward(g)
    a, b = PipelineStage(first, 0, 2, "cpu"), PipelineStage(second, 1, 2, "cpu")
    for mb, x in enumerate(xs):
        b.forward_one_chunk(mb, (a.forward_one_chunk(mb, (x,)),))
        a.free_output_storage(mb)
    for mb, g in enumerate(gs):
        (grad_in,) = b.backward_one_chunk(mb, grad_outputs=[g], full=full)
        assert a.backward_one_chunk(mb, grad_outputs=[grad_in], full=full) == []
    if not full:
        for mb in (1, 0):
            b.backward_weight_one_chunk(mb)
            a.backward_weight_one_chunk(mb)
    got = [p.grad for p in first.parameters()] + [p.grad for p in second.parameters()]
    torch.testing.assert_close(got, [p.grad for p in whole.parameters()])
    assert not a.has_state() and not b.has_state()


def test_free_output_storage_frees_unsaved_outputs_only() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    linear_last = PipelineStage(nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)), 1, 3, "cpu")
    out = linear_last.forward_one_chunk(0, (x,))
    held = linear_last.forward_one_chunk(1, (x,))
    nbytes = out.untyped_storage().nbytes()
    out_ref = weakref.ref(out)
    del out  # as the runtime holds it after sending: not at all
    assert linear_last.free_output_storage(0) == nbytes
    assert out_ref() is None  # nothing saved it, nothing holds it: gone
    # A tensor someone else holds (here the caller; a custom Function's ctx, a hook) is kept.
    assert linear_last.free_output_storage(1) == 0 and held.untyped_storage().nbytes() == nbytes
    # ReLU saves its result for backward, so that output must keep its data.
    relu_last = PipelineStage(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), 1, 3, "cpu")
    out2 = relu_last.forward_one_chunk(0, (x,))
    before = out2.detach().clone()
    relu_last.free_output_storage(0)
    torch.testing.assert_close(out2.detach(), before)


class _TanhKeepsOutputOnCtx(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(x)
        ctx.y = y  # kept outside autograd's saved tensors
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * (1 - ctx.y * ctx.y)


class _KeepsOutput(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin, self.how = nn.Linear(8, 8), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "ctx":
            return _TanhKeepsOutputOnCtx.apply(self.lin(x))  # type: ignore[no-any-return]
        with torch.autograd.graph.save_on_cpu():  # its own saved-tensor hooks: ours never see tanh's save
            return torch.tanh(self.lin(x))


@pytest.mark.parametrize("how", ["ctx", "save_on_cpu"])
def test_outputs_backward_needs_outside_our_hooks_are_not_freed(how: str) -> None:
    torch.manual_seed(0)
    module = _KeepsOutput(how)
    plain = copy.deepcopy(module)
    x = torch.randn(4, 8, requires_grad=True)
    stage = PipelineStage(module, 1, 3, "cpu")
    out = stage.forward_one_chunk(0, (x,))
    grad = torch.randn_like(out)
    del out  # sent: only the stage (and whatever the module keeps) holds it
    assert stage.free_output_storage(0) == 0
    stage.backward_one_chunk(0, grad_outputs=[grad])
    plain(x).backward(grad)
    torch.testing.assert_close([p.grad for p in module.parameters()], [p.grad for p in plain.parameters()])


@pytest.mark.parametrize("order", list(ORDERS))
def test_several_outputs_non_tensors_and_inputs_without_grad(order: str) -> None:
    torch.manual_seed(0)
    batches = [((torch.randn(3, 8), torch.rand(3, 8) > 0.3), {}) for _ in range(3)]

    class MaskAsBool(MultiOut):
        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> Any:  # type: ignore[override]
            return super().forward(x, mask.float())

    _check(MaskAsBool(), batches, ORDERS[order])


@pytest.mark.parametrize("order", list(ORDERS))
def test_repeated_outputs_parameter_output_and_unused_input(order: str) -> None:
    torch.manual_seed(0)
    batches = [((torch.randn(3, 8), torch.randn(3, 8)), {}) for _ in range(3)]
    stage = _check(OddOutputs(), batches, ORDERS[order])
    assert not stage.has_state()


@pytest.mark.parametrize("full", [True, False])
def test_no_output_gradient_is_a_no_op(full: bool) -> None:
    stage = PipelineStage(mlp(), 1, 3, "cpu")
    stage.forward_one_chunk(0, (torch.randn(4, 8, requires_grad=True),))
    assert stage.backward_one_chunk(0, grad_outputs=[None], full=full) == [None]
    if not full:
        stage.backward_weight_one_chunk(0)
    assert all(p.grad is None for p in stage.submodule.parameters())
    assert not stage.has_state()


@pytest.mark.parametrize("order", list(ORDERS))
def test_dict_outputs_kwargs_and_passthrough(order: str) -> None:
    torch.manual_seed(0)
    batches = [((torch.randn(3, 8),), {"skip": torch.randn(3, 8), "scale": 0.5}) for _ in range(3)]
    _check(DictOut(), batches, ORDERS[order])


@pytest.mark.parametrize("order", list(ORDERS))
def test_first_stage_without_input_grads(order: str) -> None:
    torch.manual_seed(0)
    batches = [((torch.randint(0, 20, (2, 6)),), {}) for _ in range(3)]
    stage = _check(Embed(), batches, ORDERS[order], stage_index=0)
    assert stage.is_first and not stage.is_last


@given(perm=st.permutations(list(range(4))), split=st.lists(st.booleans(), min_size=4, max_size=4))
@settings(max_examples=12, deadline=None)
def test_any_order_of_backwards(perm: list[int], split: list[bool]) -> None:
    """Any mix of B and I…W over microbatches, W in any order after its I, matches autograd."""
    torch.manual_seed(1)
    order = [("I" if split[mb] else "B") + str(mb) for mb in range(4)]
    order += [f"W{mb}" for mb in perm if split[mb]]
    _check(Block(), _block_batches(4), order)


class RandomGraph(nn.Module):
    """A random DAG of ops over a small pool of (possibly shared) weights, for fuzzing the split."""

    def __init__(self, recipe: list[tuple[str, int, int, int]], outputs: list[int], d: int = 4) -> None:
        super().__init__()
        self.mats = nn.ParameterList([nn.Parameter(torch.randn(d, d) * 0.5) for _ in range(3)])
        self.vecs = nn.ParameterList([nn.Parameter(torch.randn(d) * 0.5) for _ in range(2)])
        self.recipe = recipe
        self.outputs = outputs

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        vals = [x, y]
        for op, a, b, p in self.recipe:
            u, v = vals[a % len(vals)], vals[b % len(vals)]
            if op == "matmul":
                vals.append(u @ self.mats[p % 3])
            elif op == "tanh":
                vals.append(torch.tanh(u))
            elif op == "add":
                vals.append(u + v)
            elif op == "mul":
                vals.append(u * v)
            elif op == "scale":
                vals.append(u * self.vecs[p % 2])
            else:  # weight-only value
                vals.append(torch.exp(self.vecs[p % 2]).expand_as(x) @ self.mats[p % 3])
        return tuple(vals[i % len(vals)] for i in self.outputs)


_op = st.tuples(
    st.sampled_from(["matmul", "tanh", "add", "mul", "scale", "weights"]),
    st.integers(0, 20),
    st.integers(0, 20),
    st.integers(0, 5),
)


@given(
    recipe=st.lists(_op, min_size=1, max_size=9),
    outputs=st.lists(st.integers(2, 30), min_size=1, max_size=3),
    y_needs_grad=st.booleans(),
    order=st.sampled_from(list(ORDERS)),
)
@settings(max_examples=40, deadline=None)
def test_random_graphs_match_autograd(
    recipe: list[tuple[str, int, int, int]], outputs: list[int], y_needs_grad: bool, order: str
) -> None:
    """Shared weights, weight-only outputs, repeated outputs, skip paths: B and I/W stay exact."""
    torch.manual_seed(2)
    module = RandomGraph(recipe, outputs)
    batches = [((torch.randn(3, 4), torch.randn(3, 4)), {}) for _ in range(3)]
    if not y_needs_grad:  # y as an integer tensor: an input that needs no grad
        batches = [((x, (y * 3).long()), k) for (x, y), k in batches]
        module.forward = _with_float_y(module.forward)  # type: ignore[method-assign]
    if not any(t.requires_grad for t in _grad_leaves(module(*_leaf_inputs(*batches[0])[0]))):
        return  # nothing to differentiate
    _check(module, batches, ORDERS[order])


def _with_float_y(forward: Callable[..., Any]) -> Callable[..., Any]:
    return lambda x, y: forward(x, y.float())


def test_last_stage_backward_from_loss_accumulates() -> None:
    torch.manual_seed(0)
    module = mlp()
    xs = [torch.randn(4, 8) for _ in range(3)]
    ys = [torch.randn(4, 8) for _ in range(3)]
    ref = copy.deepcopy(module)
    for x, y in zip(xs, ys, strict=True):
        nn.functional.mse_loss(ref(x), y).backward()
    for split in (False, True):
        mod = copy.deepcopy(module)
        stage = PipelineStage(mod, 2, 3, "cpu")
        assert stage.is_last
        for mb, (x, y) in enumerate(zip(xs, ys, strict=True)):
            loss = nn.functional.mse_loss(stage.forward_one_chunk(mb, (x.clone().requires_grad_(),)), y)
            stage.backward_one_chunk(mb, loss=loss, full=not split)
        for mb in range(3):
            if split:
                stage.backward_weight_one_chunk(mb)
        stage.scale_grads(3)
        torch.testing.assert_close([p.grad for p in mod.parameters()], [p.grad / 3 for p in ref.parameters()])
        assert not stage.has_state()


def test_input_and_output_grads_needed() -> None:
    stage = PipelineStage(MultiOut(), 1, 3, "cpu")
    x = torch.randn(3, 8, requires_grad=True)
    stage.forward_one_chunk(0, (x, torch.ones(3, 8)))
    assert stage.input_grads_needed(0) == [True, False]
    # h, relu(...)*mask, mask.sum() (no grad), only_w*3 — "tag" is not a tensor.
    assert stage.output_grads_needed(0) == [True, True, False, True]
    grads = stage.backward_one_chunk(0, grad_outputs=[torch.ones(3, 8), None, torch.ones(8)], full=False)
    assert len(grads) == 1 and grads[0] is not None
    stage.backward_weight_one_chunk(0)


@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("full", [True, False])
def test_weight_accumulate_hooks_fire_once_per_backward(first: bool, full: bool) -> None:
    """Post-accumulate-grad hooks (what optimizer-in-backward and FSDP-style code register) fire
    once per parameter and backward: I's for the biases, W's for the matmul weights it deferred
    (a first stage's W: all of them)."""
    module = mlp(width=4, layers=2)
    fired: list[str] = []
    for name, p in module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, name=name: fired.append(name))
    stage = PipelineStage(module, 0 if first else 1, 3, "cpu")
    stage.forward_one_chunk(0, (torch.randn(2, 4, requires_grad=not first),))
    stage.backward_one_chunk(0, grad_outputs=[torch.ones(2, 4)], full=full)
    if not full:
        # A first stage's I has nothing to give anyone: its whole backward waits for W.
        want = [] if first else sorted(n for n, _ in module.named_parameters() if n.endswith("bias"))
        assert sorted(fired) == want
        stage.backward_weight_one_chunk(0)
    assert sorted(fired) == sorted(n for n, _ in module.named_parameters())


# ----------------------------------------------------------------------------- work split
def _flops(fn: Callable[[], Any]) -> int:
    """Matmul FLOPs, W's in-place accumulating GEMMs (addmm_, baddbmm_) included."""

    def addmm_(_c: Any, a: Any, b: Any, *_args: Any, **_kw: Any) -> int:
        return 2 * a[0] * a[1] * b[1]

    def baddbmm_(_c: Any, a: Any, b: Any, *_args: Any, **_kw: Any) -> int:
        return 2 * a[0] * a[1] * a[2] * b[2]

    inplace = {torch.ops.aten.addmm_: addmm_, torch.ops.aten.baddbmm_: baddbmm_}
    counter = FlopCounterMode(display=False, custom_mapping=inplace)
    with counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize(
    ("factory", "batches", "first"),
    [(mlp, _mlp_batches, False), (Block, _block_batches, False), (Embed, None, True)],
)
def test_split_does_not_redo_work(factory: Callable[[], nn.Module], batches: Any, first: bool) -> None:
    """Matmul FLOPs: I + W equals B (W redoes none of I); a first stage's I computes nothing."""
    torch.manual_seed(0)
    module = factory()
    ((a, k),) = (((torch.randint(0, 20, (2, 6)),), {}),) if first else batches(1)
    grads = _make_grads(module, [(a, k)])[0]
    stage = PipelineStage(module, 0 if first else 1, 3, "cpu")
    stage.forward_one_chunk(0, *_leaf_inputs(a, k))
    flops_b = _flops(lambda: stage.backward_one_chunk(0, grad_outputs=grads))
    stage.forward_one_chunk(1, *_leaf_inputs(a, k))
    flops_i = _flops(lambda: stage.backward_one_chunk(1, grad_outputs=grads, full=False))
    flops_w = _flops(lambda: stage.backward_weight_one_chunk(1))
    assert flops_b > 0
    assert flops_i + flops_w == flops_b
    if first:
        assert flops_i == 0
    else:
        assert 0 < flops_i < flops_b and 0 < flops_w < flops_b


def test_between_i_and_w_a_microbatch_holds_only_what_w_reads() -> None:
    """After I the graph and every saved tensor are gone; W keeps each Linear's input and output
    gradient (3 layers: 3 + 3 tensors of 4 x 8), nothing else."""
    torch.manual_seed(0)
    stage = PipelineStage(mlp(), 1, 3, "cpu")
    x = torch.randn(4, 8, requires_grad=True)
    stage.forward_one_chunk(0, (x,))
    saved = stage._mbs[0].saved
    assert saved is not None and len(saved.holders) > 0
    stage.backward_one_chunk(0, grad_outputs=[torch.randn(4, 8)], full=False)
    assert saved.holders == []
    plan = stage._mbs[0].plan
    assert plan is not None and len(plan.gemms) == 3
    assert all(g.a is not None and g.g is not None and g.a.shape == g.g.shape == (4, 8) for g in plan.gemms)
    assert plan.nbytes() <= 6 * 4 * 8 * 4
    stage.backward_weight_one_chunk(0)
    assert not stage.has_state()


# ----------------------------------------------------------------------------- state & errors
def test_eval_under_no_grad_keeps_no_state() -> None:
    module = Block()
    stage = PipelineStage(module, 1, 3, "cpu")
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        out = stage.forward_one_chunk(0, (x,))
        torch.testing.assert_close(out, module(x))
    assert not stage.has_state()


def test_clear_drops_state_and_released_tensors_are_not_reused() -> None:
    stage = PipelineStage(mlp(), 1, 3, "cpu")
    for mb in range(2):
        stage.forward_one_chunk(mb, (torch.randn(4, 8, requires_grad=True),))
    stage.backward_one_chunk(0, grad_outputs=[torch.randn(4, 8)], full=False)
    assert stage.has_state()
    stage.clear()
    assert not stage.has_state()
    with pytest.raises(PipelineError, match="microbatch 0"):
        stage.backward_weight_one_chunk(0)


@pytest.mark.parametrize("track", [True, False])
def test_in_place_change_of_a_saved_tensor_is_an_error(track: bool) -> None:
    class InPlaceBug(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            y = h * h  # saves h
            h.add_(1)  # ...which then changes
            return y

    stage = PipelineStage(InPlaceBug(), 1, 3, "cpu", track_saved_tensors=track)
    stage.forward_one_chunk(0, (torch.randn(2, 4, requires_grad=True),))
    with pytest.raises(PipelineError, match=r"action 1B0: backward failed: .*modified by an in-?place operation"):
        stage.backward_one_chunk(0, grad_outputs=[torch.ones(2, 4)])


def test_scale_grads_divides_once() -> None:
    stage = PipelineStage(nn.Linear(4, 4), 1, 3, "cpu")
    stage.submodule.weight.grad = torch.full((4, 4), 6.0)
    stage.scale_grads(3)
    torch.testing.assert_close(stage.submodule.weight.grad, torch.full((4, 4), 2.0))
    assert stage.submodule.bias.grad is None


def test_errors_name_stage_microbatch_and_action() -> None:
    stage = PipelineStage(mlp(), 1, 3, "cpu")
    with pytest.raises(PipelineError, match=r"stage 1, microbatch 5, action 1B5"):
        stage.backward_one_chunk(5, grad_outputs=[torch.ones(4, 8)])
    stage.forward_one_chunk(0, (torch.randn(4, 8, requires_grad=True),))
    with pytest.raises(PipelineError, match="ran again"):
        stage.forward_one_chunk(0, (torch.randn(4, 8, requires_grad=True),))
    with pytest.raises(PipelineError, match=r"action 1W0: .*\(I\) first"):
        stage.backward_weight_one_chunk(0)
    with pytest.raises(PipelineError, match="got 2 output gradients for 1 outputs"):
        stage.backward_one_chunk(0, grad_outputs=[torch.ones(4, 8), torch.ones(4, 8)])
    with pytest.raises(PipelineError, match=r"action 1I0: backward failed: .*shape"):
        stage.backward_one_chunk(0, grad_outputs=[torch.ones(5, 8)], full=False)
    with pytest.raises(PipelineError, match="outside"):
        PipelineStage(mlp(), 3, 3, "cpu")


@pytest.mark.parametrize("full", [True, False])
def test_first_stage_by_hand_gives_input_gradients(full: bool) -> None:
    """Leaf inputs get their gradient at once; inputs a graph made wait for backward_into_inputs
    (one backward through a graph the microbatches share), so nothing piles up across steps."""
    torch.manual_seed(0)
    module = nn.Linear(4, 4)
    stage = PipelineStage(module, 0, 2, "cpu")
    leaf = torch.randn(2, 4, requires_grad=True)
    made_from = torch.randn(4, 4, requires_grad=True)
    made = made_from * 2  # a graph both microbatches share
    for mb, x in enumerate((leaf, made[:2])):
        out = stage.forward_one_chunk(mb, (x,))
        stage.backward_one_chunk(mb, grad_outputs=[torch.ones_like(out)], full=full)
        if not full:
            stage.backward_weight_one_chunk(mb)
    want = torch.ones(2, 4) @ module.weight
    torch.testing.assert_close(leaf.grad, want)
    assert made_from.grad is None  # waits for the end of the step
    stage.backward_into_inputs()
    torch.testing.assert_close(made_from.grad[:2], 2 * want)
    assert not stage._origin_grads


def test_torchs_extra_arguments_are_accepted_or_refused_clearly() -> None:
    """A PipelineStage call written for torch keeps working: its positional input_args too."""
    mod = torch.nn.Linear(4, 4)
    example = torch.randn(2, 4)
    stage = PipelineStage(mod, 0, 2, torch.device("cpu"), example)  # torch's fifth: input_args
    assert stage.group is None and stage.submod is mod
    stage = PipelineStage(mod, 1, 2, "cpu", input_args=(example,), output_args=mod(example), get_mesh=None)
    assert stage.group is None and stage.is_last
    stage = PipelineStage(mod, 0, 2, "cpu", example, mod(example), None, None, None)  # torch's whole order
    assert stage.group is None
    with pytest.raises(TypeError, match=r"group must be a torch\.distributed ProcessGroup, got str"):
        PipelineStage(mod, 0, 2, "cpu", group="pp")
    with pytest.raises(TypeError, match="got multiple values for argument 'input_args'"):
        PipelineStage(mod, 0, 2, "cpu", example, input_args=example)
    with pytest.raises(TypeError, match="takes at most 11 positional arguments"):
        PipelineStage(mod, 0, 2, "cpu", *([None] * 8))
    with pytest.raises(TypeError, match="dw_builder must be callable"):
        PipelineStage(mod, 0, 2, "cpu", dw_builder=3)
