"""Structured stage boundaries, kwargs, uneven microbatches and changing shapes on real gloo ranks."""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any

import pytest
import torch
from _dist import run_ranks
from torch import nn

pytestmark = pytest.mark.slow
WIDTH = 6


class First(nn.Module):
    """x (+ keyword ``scale``) -> a tuple of two tensors: two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        if scale is not None:
            h = h * scale
        return torch.tanh(h), h * 0.5


class Second(nn.Module):
    """Two inputs -> a dict with a tensor needing grad, an integer and a mask that needs none."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor, g: torch.Tensor) -> dict[str, Any]:
        return {"a": torch.tanh(self.lin(h) + g), "k": 3, "mask": (h > 0)}


class Third(nn.Module):
    """Keyword inputs from the dict above -> one tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, a: torch.Tensor, k: int, mask: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(a)) * k + mask.to(a.dtype)


class Last(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _modules() -> list[nn.Module]:
    torch.manual_seed(0)
    return [First(), Second(), Third(), Last()]


def _chain(mods: list[nn.Module], x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    h, g = mods[0](x, scale=scale)
    d = mods[1](h, g)
    return mods[3](mods[2](**d))


def _reference(
    mods: list[nn.Module], batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], m: int
) -> list[nn.Module]:
    ref = copy.deepcopy(mods)
    for x, scale, y in batches:
        losses = [
            nn.functional.mse_loss(_chain(ref, xi, si), yi)
            for xi, si, yi in zip(x.tensor_split(m), scale.tensor_split(m), y.tensor_split(m), strict=True)
        ]
        torch.stack(losses).mean().backward()
    return ref


def _batches(sizes: list[tuple[int, int]]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for batch, seq in sizes:
        out.append(
            (
                torch.randn(batch, seq, WIDTH, generator=g),
                torch.rand(batch, 1, 1, generator=g) + 0.5,
                torch.randn(batch, seq, WIDTH, generator=g),
            )
        )
    return out


def _features(rank: int, world: int, single_tag: bool) -> list[str]:
    from pipetrain import PipelineStage, get_schedule_class

    cases = [
        ("ZBVZeroBubble", 4, [(8, 3)]),  # V placement: stages 1 -> 2 handed over in memory
        ("Interleaved1F1B", 4, [(8, 3)]),
        ("ZBVZeroBubble", 4, [(10, 3)]),  # uneven microbatches: 3, 3, 2, 2
        ("Interleaved1F1B", 4, [(8, 3), (8, 5), (6, 2), (8, 3)]),  # sequence length and batch change between steps
        ("DualPipeV", 4, [(9, 4), (8, 2)]),
    ]
    done = []
    for name, m, sizes in cases:
        mods = _modules()
        batches = _batches(sizes)
        ref = _reference(mods, batches, m)
        cls = get_schedule_class(name)
        sched = None
        placement = {0: 0, 3: 0, 1: 1, 2: 1} if name in ("ZBVZeroBubble", "DualPipeV") else {0: 0, 2: 0, 1: 1, 3: 1}
        mine = sorted(s for s, r in placement.items() if r == rank)
        stages = [PipelineStage(mods[s], s, 4, "cpu") for s in mine]
        freed: list[int] = []
        for st in stages:
            original = st.free_output_storage

            def counting(mb: int, _orig: Any = original, _freed: list[int] = freed) -> None:
                _freed.append(mb)
                _orig(mb)

            st.free_output_storage = counting  # type: ignore[method-assign]
        sched = cls(stages, m, loss_fn=nn.functional.mse_loss)
        assert sched._transport.single_tag is single_tag
        seen: list[weakref.ref[torch.Tensor]] = []
        if 1 in mine:  # activations of a middle stage: received input and sent output
            mods[1].register_forward_hook(
                lambda mod, args, out, _s=seen: _s.extend([weakref.ref(args[0]), weakref.ref(out["a"])])
            )
        for x, scale, y in batches:
            losses: list[torch.Tensor] = []
            first, last = rank == placement[0], rank == placement[3]
            kwargs = {"scale": scale} if first else {}
            out = sched.step(*((x,) if first else ()), target=y if last else None, losses=losses, **kwargs)
            if last:
                assert out.shape == y.shape and len(losses) == m
            else:
                assert out is None
            assert not any(st.has_state() for st in stages)
        case = f"{name} {sizes}"
        for s in mine:
            for (pname, p), q in zip(mods[s].named_parameters(), ref[s].parameters(), strict=True):
                torch.testing.assert_close(
                    p.grad, q.grad, msg=lambda e, c=case, s=s, n=pname: f"{c}: stage {s} {n}: {e}"
                )
        assert freed, f"{case}: no sent output was freed"
        gc.collect()
        assert all(ref() is None for ref in seen), f"{case}: a microbatch tensor outlived its step"
        done.append(case)
    return done


@pytest.mark.parametrize("single_tag", [False, True], ids=["tags", "single_tag"])
def test_structured_boundaries_kwargs_uneven_and_changing_shapes(
    single_tag: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shape changes need follow-up messages: ``single_tag`` checks they match by order alone (NCCL)."""
    monkeypatch.setenv("PIPETRAIN_SINGLE_TAG", "1" if single_tag else "0")
    results = run_ranks(_features, 2, single_tag)
    assert len(results[0]) == len(results[1]) == 5
