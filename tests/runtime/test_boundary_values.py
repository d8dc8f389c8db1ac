"""Unusual values at stage boundaries and in step()'s inputs: each arrives, and gets its gradient,
as plain autograd would give them (nested containers, complex activations, a leaf handed over
twice, learnable inputs, plain values changed in place or changing type)."""

from __future__ import annotations

import copy
import types
from typing import Any

import pytest
import torch
from torch import nn

from pipetrain import LocalPipeline, PipelineStage, get_schedule_class
from pipetrain.microbatch import REPLICATE
from pipetrain.runtime.transport.wire import _fingerprint, _same, layout_of, rebuild
from support.dist import run_ranks
from support.models import assert_grads_equal

# ------------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("extras", ["tuple", "list", "dict"])
def test_a_container_nested_in_a_tuple_keeps_its_nesting(extras: str) -> None:
    h, m = torch.ones(2, 3), torch.zeros(2, 3)
    inner: Any = {"tuple": (m,), "list": [m], "dict": {"m": m}}[extras]
    layout, tensors = layout_of((h, inner))
    assert layout.simple is None  # not a flat tuple of tensors, although it has 2 entries and 2 tensors
    back = rebuild(layout, [t.clone() for t in tensors])
    assert isinstance(back, tuple) and type(back[1]) is type(inner)


def test_a_complex_activation_that_needs_grad_arrives_needing_grad() -> None:
    z = torch.complex(torch.ones(2), torch.ones(2)).requires_grad_()
    layout, _ = layout_of(z * 2)
    assert rebuild(layout, [torch.zeros(2, dtype=torch.complex64)]).requires_grad


def test_a_plain_value_changed_in_place_after_sending_is_a_new_layout() -> None:
    cfg = types.SimpleNamespace(scale=1.0)  # not a pytree node: travels as a plain value
    t = torch.zeros(2)
    sent, _ = layout_of({"x": t, "cfg": cfg})
    _fingerprint(sent)  # what the sender does when it sends a new layout
    cfg.scale = 3.0
    assert not _same(sent, layout_of({"x": t, "cfg": cfg})[0])


def test_a_dict_key_of_another_type_is_a_new_layout() -> None:
    t = torch.zeros(2)
    assert not _same(layout_of({1: t})[0], layout_of({True: t})[0])
    assert _same(layout_of({1: t})[0], layout_of({1: t})[0])


# ---------------------------------------------------------------------- in one process


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class _ParamTwice(_Plain):
    """Returns one of its parameters twice: the next stage's two uses must each count once."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.linspace(-1, 1, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return torch.tanh(self.lin(x)), self.p, self.p


class _UseTwice(_Plain):
    def forward(self, h: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.lin(h * p + q)


def _run_plain(mods: list[nn.Module], x: torch.Tensor, y: torch.Tensor, m: int, *extra: Any) -> None:
    """Plain autograd over the same microbatches: the mean of the microbatch losses."""
    losses = []
    for xi, yi in zip(x.tensor_split(m), y.tensor_split(m), strict=True):
        h: Any = mods[0](xi, *extra)
        for mod in mods[1:]:
            h = mod(*h) if isinstance(h, tuple) else mod(h)
        losses.append(nn.functional.mse_loss(h, yi))
    torch.stack(losses).mean().backward()


@pytest.mark.parametrize("name", ["ZBVZeroBubble", "DualPipeV", "1F1B"])
def test_a_leaf_handed_over_twice_gets_its_gradient_once(name: str) -> None:
    torch.manual_seed(0)
    base = [_Plain(), _ParamTwice(), _UseTwice(), _Plain()]
    ref, mods = copy.deepcopy(base), copy.deepcopy(base)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    _run_plain(ref, x, y, 2)
    ranks = 4 if name == "1F1B" else 2
    LocalPipeline(mods, name, 2, loss_fn=nn.functional.mse_loss, num_ranks=ranks).step(x, target=y)
    for a, b in zip(mods, ref, strict=True):
        for (pname, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda e, n=pname: f"{name} {n}: {e}")


class _Scaled(_Plain):
    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.lin(x) * s


@pytest.mark.parametrize("name", ["1F1B", "ZBH1", "ZBVZeroBubble"])
def test_inputs_given_to_step_that_require_grad_get_their_gradients(name: str) -> None:
    """A batch made by a layer outside the pipeline from inputs that require grad (saliency,
    adversarial inputs), and a learnable scale given whole to every microbatch: all get plain
    autograd's gradients; the graph shared by the microbatches is traversed once (a second
    traversal would fail: its saved tensors are freed). The zero-bubble ones split I and W."""
    torch.manual_seed(0)
    num = 4 if name == "ZBVZeroBubble" else 2
    base: list[nn.Module] = [_Scaled()] + [_Plain() for _ in range(num - 1)]
    ref, mods = copy.deepcopy(base), copy.deepcopy(base)
    embed = nn.Linear(4, 4)
    embed_ref = copy.deepcopy(embed)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    x_ref, x_in = x.clone().requires_grad_(), x.clone().requires_grad_()
    s_ref, s_in = torch.tensor(1.5, requires_grad=True), torch.tensor(1.5, requires_grad=True)
    _run_plain(ref, embed_ref(x_ref), y, 4, s_ref)
    pipe = LocalPipeline(mods, name, 4, loss_fn=nn.functional.mse_loss, args_chunk_spec=(None, REPLICATE))
    pipe.step(embed(x_in), s_in, target=y)
    torch.testing.assert_close(s_in.grad, s_ref.grad)
    torch.testing.assert_close(x_in.grad, x_ref.grad)
    for a, b in zip([embed, *mods], [embed_ref, *ref], strict=True):
        for p, q in zip(a.parameters(), b.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad)


# ------------------------------------------------------------------------- over gloo


class _Nested(_Plain):
    cfg = types.SimpleNamespace(scale=1.0)  # shared by every copy; the test changes it in place

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor], types.SimpleNamespace]:  # type: ignore[override]
        return self.lin(x), ((x > 0).float(),), self.cfg


class _Pass(_Plain):
    def forward(  # type: ignore[override]
        self, h: torch.Tensor, extras: tuple[torch.Tensor], cfg: types.SimpleNamespace
    ) -> tuple[torch.Tensor, tuple[torch.Tensor], types.SimpleNamespace]:
        assert isinstance(extras, tuple), type(extras)
        return torch.tanh(self.lin(h)), extras, cfg


class _Complex(_Plain):
    def forward(  # type: ignore[override]
        self, h: torch.Tensor, extras: tuple[torch.Tensor], cfg: types.SimpleNamespace
    ) -> torch.Tensor:
        assert isinstance(extras, tuple), type(extras)
        return torch.complex(self.lin(h), h * extras[0]) * cfg.scale  # complex, needs grad


class _Real(_Plain):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.lin(z.real * z.imag)


class _ComplexThenReal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _Complex(), _Real()

    def forward(self, h: torch.Tensor, extras: tuple[torch.Tensor], cfg: types.SimpleNamespace) -> torch.Tensor:
        return self.b(self.a(h, extras, cfg))


def _over_gloo(rank: int, world: int) -> list[str]:
    """Stage 0 sends (h, (mask,), cfg) across ranks; under ZBV stage 2 sends a complex tensor
    needing grad across ranks. The same schedule runs two steps, cfg.scale changed in between."""
    done = []
    for name, v in (("1F1B", 1), ("ZBVZeroBubble", 2)):
        torch.manual_seed(0)
        base: list[nn.Module] = [_Nested(), _ComplexThenReal()] if v == 1 else [_Nested(), _Pass(), _Complex(), _Real()]
        num = len(base)
        placement = {0: 0, 1: 1} if v == 1 else {0: 0, 3: 0, 1: 1, 2: 1}
        mine = sorted(s for s, r in placement.items() if r == rank)
        ref, mods = copy.deepcopy(base), [copy.deepcopy(base[s]) for s in mine]
        stages = [PipelineStage(mod, s, num, "cpu") for mod, s in zip(mods, mine, strict=True)]
        sched = get_schedule_class(name)(stages if v > 1 else stages[0], 4, loss_fn=nn.functional.mse_loss)
        x, y = torch.randn(8, 4), torch.randn(8, 4)
        for scale in (1.0, 3.0):
            _Nested.cfg.scale = scale
            for mod in [*ref, *mods]:
                mod.zero_grad(set_to_none=True)
            x_ref, x_in = x.clone().requires_grad_(), x.clone().requires_grad_()
            _run_plain(ref, x_ref, y, 4)
            sched.step(*((x_in,) if 0 in mine else ()), target=y if num - 1 in mine else None)
            case = f"{name} scale {scale}"
            if 0 in mine:
                torch.testing.assert_close(x_in.grad, x_ref.grad, msg=lambda e, c=case: f"{c} x.grad: {e}")
            assert_grads_equal(dict(zip(mine, mods, strict=True)), ref, case)
            done.append(case)
    return done


@pytest.mark.slow
def test_over_gloo_nested_complex_changed_plain_values_and_input_gradients() -> None:
    results = run_ranks(_over_gloo, 2)
    assert all(len(r) == 4 for r in results), results
