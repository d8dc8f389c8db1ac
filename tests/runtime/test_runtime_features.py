"""Structured stage boundaries, kwargs, uneven microbatches and changing shapes on real gloo ranks."""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from support.dist import run_ranks
from support.models import assert_grads_equal

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

            def counting(mb: int, _orig: Any = original, _freed: list[int] = freed) -> int:
                released: int = _orig(mb)
                _freed.append(released)
                return released

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
            # step()'s keywords would go to every stage of the rank (torch's rule); scale is stage 0's alone.
            out = sched.step(
                *((x,) if first else ()), target=y if last else None, losses=losses, stage_kwargs={0: {"scale": scale}}
            )
            if last:
                assert out.shape == y.shape and len(losses) == m
            else:
                assert out is None
            assert not any(st.has_state() for st in stages)
        case = f"{name} {sizes}"
        assert_grads_equal({s: mods[s] for s in mine}, ref, case)
        assert freed, f"{case}: no sent output was released"
        split = any(
            p.kind.value in ("I", "W") for acts in sched.pipeline_order.values() for a in acts if a for p in a.parts
        )
        if split:  # stages tracking what autograd saved count the bytes they release (see track=)
            assert sum(freed) > 0, f"{case}: no sent output was freed ({freed})"
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


def _early(name: str, ranks: int, v: int) -> tuple[Any, dict[int, list[Any]]]:
    from pipetrain.plan import build_schedule
    from pipetrain.plan.passes.early_recv import early_receives

    schedule = build_schedule(name, ranks, 8, v).lower()
    early = {r: early_receives(schedule.actions[r], schedule.stage_to_rank) for r in range(ranks)}
    return schedule, early


@pytest.mark.parametrize(("name", "v"), [("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2)])
def test_early_receives_keep_the_order_per_peer(name: str, v: int) -> None:
    """Receives posted early are all of a peer's, in program order: gloo matches per peer and tag."""
    from pipetrain.plan import ActionKind

    schedule, early = _early(name, 2, v)
    for r, ahead in early.items():
        recvs = [a for a in schedule.actions[r] if a is not None and a.kind in (ActionKind.RECV_F, ActionKind.RECV_B)]
        grads = any(a.kind is ActionKind.RECV_B for a in recvs)  # 2 ranks: one peer
        assert ahead == (recvs if grads else []), (name, r)


@pytest.mark.parametrize(("name", "v"), [("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2)])
@pytest.mark.parametrize("ahead", [0, 1, 4, 100])
def test_early_receives_are_a_lowering_option_visible_in_the_schedule(name: str, v: int, ahead: int) -> None:
    """The pass only moves receives earlier, by at most ``ahead``, keeping every peer's order."""
    from pipetrain.plan import ActionKind
    from pipetrain.plan.passes.early_recv import post_receives_early

    schedule, early = _early(name, 2, v)
    moved = post_receives_early(schedule, ahead)
    if ahead == 0:
        assert moved is schedule
    recv = (ActionKind.RECV_F, ActionKind.RECV_B)
    for r in range(2):
        before, after = schedule.actions[r], moved.actions[r]
        assert sorted(map(str, before)) == sorted(map(str, after))
        # Everything but the moved receives keeps its order; receives keep theirs.
        assert [a for a in after if a not in early[r]] == [a for a in before if a not in early[r]]
        assert [a for a in after if a.kind in recv] == [a for a in before if a.kind in recv] or early[r]
        assert [a for a in after if a in early[r]] == early[r]
        for a in early[r]:
            assert after.index(a) <= before.index(a) + 0, (name, r, a)
        if ahead and early[r]:
            assert after[: min(ahead, len(early[r]))] == early[r][:ahead]  # posted before the first action


def test_early_receives_only_from_peers_sending_gradients() -> None:
    """1F1B: the first rank gets gradients (posted early), the last only activations (in place)."""
    _, early = _early("1F1B", 2, 1)
    assert len(early[0]) == 8 and not early[1]


def test_one_tensor_messages_travel_in_their_dtype() -> None:
    """A one-tensor message is received into a buffer of its dtype and read back as one view."""
    from pipetrain.runtime.transport.wire import _SAME, _pack, _recv_buffer, _unpack, layout_of

    for t in [torch.randn(3, 5, requires_grad=True), torch.arange(7, dtype=torch.int64), torch.randn(0, 4)]:
        layout, tensors = layout_of(t)
        sent = _pack(_SAME, 0, 0, layout, [x.detach() for x in tensors], torch.device("cpu"))
        buf = _recv_buffer(layout, torch.device("cpu"))
        assert buf.dtype is t.dtype and buf.nbytes == sent.nbytes
        buf.view(torch.uint8).copy_(sent.view(torch.uint8))  # what the transport delivers
        (got,) = _unpack(buf, layout)
        torch.testing.assert_close(got, t.detach())
        # a message packed under another layout arrives as bytes and still unpacks
        (again,) = _unpack(sent.view(torch.uint8).clone(), layout)
        torch.testing.assert_close(again, t.detach())


def test_receive_window_comes_from_the_keyword_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipetrain.errors import PipelineError
    from pipetrain.runtime.prepare import DEFAULT_RECV_AHEAD, recv_window

    monkeypatch.delenv("PIPETRAIN_RECV_AHEAD", raising=False)
    assert recv_window(None) == DEFAULT_RECV_AHEAD == 4
    assert recv_window(2) == 2
    monkeypatch.setenv("PIPETRAIN_RECV_AHEAD", "3")
    assert recv_window(None) == 3
    assert recv_window(0) == 0  # the keyword wins
    monkeypatch.setenv("PIPETRAIN_RECV_AHEAD", "many")
    with pytest.raises(PipelineError, match="PIPETRAIN_RECV_AHEAD must be an integer >= 0, got 'many'"):
        recv_window(None)
    with pytest.raises(PipelineError, match=r"recv_ahead \(the receive window\) must be >= 0, got -1"):
        recv_window(-1)


def _receive_times(rank: int, world: int) -> dict[Any, tuple[list[float], float]]:
    """Per receive window: when rank 0's RECV_B actions were posted, and when its first compute ended."""
    from pipetrain import PipelineStage, Schedule1F1B

    out = {}
    for ahead in (None, 0, 100):
        torch.manual_seed(0)
        stage = PipelineStage(nn.Linear(4, 4), rank, world, "cpu")
        sched = Schedule1F1B(stage, 8, loss_fn=nn.functional.mse_loss, recv_ahead=ahead)
        x, y = torch.randn(16, 4), torch.randn(16, 4)
        for _ in range(2):  # the second step runs with the layouts known
            sched.step(*((x,) if rank == 0 else ()), target=y if rank == world - 1 else None)
        timeline = sched.last_timeline
        assert timeline is not None
        recvs = sorted(e.start for e in timeline.events if e.kind == "RECV_B")
        first_compute = min(e.end for e in timeline.events if e.kind in ("F", "B"))
        out[ahead] = (recvs, first_compute)
    return out


def test_gradient_receives_are_posted_ahead_within_the_window() -> None:
    """The first stage posts its first 4 gradient receives (the default window) before its first
    compute ends and the others later; ``recv_ahead=0`` leaves them where the program places them
    (none before a compute ended), a large window posts all 8 at the start."""
    results = run_ranks(_receive_times, 2)
    recvs, first = results[0][None]
    assert len(recvs) == 8 and sum(t < first for t in recvs) == 4, (recvs, first)
    recvs, first = results[0][0]
    assert len(recvs) == 8 and not any(t < first for t in recvs), (recvs, first)
    recvs, first = results[0][100]
    assert len(recvs) == 8 and all(t < first for t in recvs), (recvs, first)


def _weighted_mse(out: torch.Tensor, y: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
    return nn.functional.mse_loss(out, y) * weight


def _torch_call_patterns(rank: int, world: int, name: str) -> dict[str, Any]:
    """What a script written for torch.distributed.pipelining does beyond step(x, target=y)."""
    import pipetrain
    from pipetrain.plan import build_schedule

    plan = build_schedule(name, world, 4)
    mine = plan.stages_of(rank)
    torch.manual_seed(0)
    layers = [nn.Linear(WIDTH, WIDTH) for _ in range(plan.num_stages)]
    stages = [pipetrain.PipelineStage(layers[s], s, plan.num_stages, "cpu") for s in mine]
    cls = pipetrain.get_schedule_class(name)
    first, last = 0 in mine, plan.num_stages - 1 in mine
    x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    args, target = ((x,) if first else ()), (y if last else None)
    out: dict[str, Any] = {}

    # torch's extra constructor keywords are accepted
    sched = cls(
        stages if len(stages) > 1 else stages[0],
        4,
        loss_fn=_weighted_mse,
        defer_pp_recv=True,
        use_full_backward=None,
        backward_requires_autograd=True,
    )
    losses: list[torch.Tensor] = []
    sched.step(*args, target=target, losses=losses, loss_kwargs={"weight": 3.0})
    out["step losses"] = [float(v) for v in losses]
    out["grads"] = {s: layers[s].weight.grad.tolist() for s in mine}  # plain values: ranks exit after returning
    for layer in layers:
        layer.zero_grad(set_to_none=True)

    losses = []
    result = sched.eval(*args, target=target, losses=losses, loss_kwargs={"weight": 3.0})
    out["eval losses"] = [float(v) for v in losses]
    out["eval output"] = None if result is None else result.tolist()
    out["eval grads"] = [layers[s].weight.grad for s in mine]
    out["eval, return_outputs=False"] = sched.eval(*args, target=target, return_outputs=False)

    try:
        with torch.no_grad():
            sched.step(*args, target=target)
        out["no_grad"] = "no error"
    except RuntimeError as err:  # torch raises RuntimeError here; PipelineError is one
        out["no_grad"] = str(err)

    forward = cls(stages if len(stages) > 1 else stages[0], 4)
    out["forward, return_outputs=False"] = forward.step(*args, return_outputs=False)
    result = forward.step(*args)
    out["forward"] = None if result is None else result.tolist()
    return out


@pytest.mark.parametrize("name", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
def test_torch_call_patterns_loss_kwargs_eval_losses_and_no_grad(name: str) -> None:
    results = run_ranks(_torch_call_patterns, 2, name, timeout=180)
    from pipetrain.plan import build_schedule

    plan = build_schedule(name, 2, 4)
    torch.manual_seed(0)
    layers = [nn.Linear(WIDTH, WIDTH) for _ in range(plan.num_stages)]
    x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    h = x
    for layer in layers:
        h = layer(h)
    expected = [_weighted_mse(h[i : i + 2], y[i : i + 2], 3.0) for i in range(0, 8, 2)]
    torch.stack(expected).mean().backward()
    last_rank = plan.stage_to_rank[plan.num_stages - 1]
    for rank, res in enumerate(results):
        for s, grad in res["grads"].items():
            torch.testing.assert_close(torch.tensor(grad), layers[s].weight.grad)
        assert res["eval grads"] == [None] * len(res["eval grads"]), "eval must not touch gradients"
        assert "torch.no_grad()" in res["no_grad"] and "eval()" in res["no_grad"], res["no_grad"]
        assert res["forward, return_outputs=False"] is None and res["eval, return_outputs=False"] is None
        if rank == last_rank:
            torch.testing.assert_close(torch.tensor(res["step losses"]), torch.stack(expected).detach())
            torch.testing.assert_close(torch.tensor(res["eval losses"]), torch.stack(expected).detach())
            torch.testing.assert_close(torch.tensor(res["eval output"]), h.detach())
            torch.testing.assert_close(torch.tensor(res["forward"]), h.detach())
        else:
            assert res["step losses"] == [] and res["eval losses"] == [] and res["forward"] is None
