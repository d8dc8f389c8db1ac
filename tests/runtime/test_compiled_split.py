"""A region compiled by compile_for_split has its compiled backward split: I runs the input part,
W the weight part. Gradients equal B's (bit for bit: the same compiled kernels) and plain eager
training's; several microbatches wait for W at once; one compiled frame serves several blocks;
and a split schedule on 2 gloo ranks trains as plain training does."""

from __future__ import annotations

import copy
import shutil
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from pipetrain import PipelineError, PipelineStage
from pipetrain.compiled import compile_for_split
from support.dist import run_ranks
from support.models import TransformerBlock, reference

torch.set_num_threads(1)

_HAS_CC = shutil.which("cc") is not None or shutil.which("gcc") is not None
BACKENDS = [
    "aot_eager",
    pytest.param("inductor", marks=pytest.mark.skipif(not _HAS_CC, reason="inductor on CPU needs a C compiler")),
]


class Block(TransformerBlock):
    """The shared transformer block, its MLP's first Linear with a bias."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__(d, heads, up_bias=True)


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()  # (each test's compiles count from zero, below dynamo's recompile limit)
    yield
    torch._dynamo.reset()


def _inputs(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 16, generator=g)) for _ in range(n)]


def _grads(module: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in module.parameters()]


def _zero(module: nn.Module) -> None:
    for p in module.parameters():
        p.grad = None


def _eager(module: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list[Any], list[Any]]:
    """Plain eager training: parameter gradients summed over the microbatches, and input gradients."""
    module = copy.deepcopy(module)
    gxs = []
    for x, g in batches:
        leaf = x.clone().requires_grad_()
        module(leaf).backward(g)
        gxs.append(leaf.grad)
    return _grads(module), gxs


@pytest.mark.parametrize("backend", BACKENDS)
def test_i_leaves_the_weight_part_to_w_and_gradients_equal_b_and_eager(backend: str) -> None:
    torch.manual_seed(0)
    base = Block()
    compiled = compile_for_split(copy.deepcopy(base), backend=backend)
    stage = PipelineStage(compiled, 1, 3, "cpu")
    [(x, g)] = _inputs(1)
    want, [want_gx] = _eager(base, [(x, g)])

    stage.forward_one_chunk(0, (x.clone().requires_grad_(),))
    (b_gx,) = stage.backward_one_chunk(0, grad_outputs=[g], full=True)
    b_grads = _grads(compiled)
    torch.testing.assert_close(b_grads, want)
    torch.testing.assert_close(b_gx, want_gx)

    _zero(compiled)
    stage.forward_one_chunk(0, (x.clone().requires_grad_(),))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to say: the region's weight gradients wait for W
        (i_gx,) = stage.backward_one_chunk(0, grad_outputs=[g], full=False)
    assert all(p.grad is None for p in compiled.parameters())  # I computed no weight gradient
    plan = stage._mbs[0].plan
    assert plan is not None and len(plan.regions) == 1 and plan.nbytes() > 0
    stage.backward_weight_one_chunk(0)
    assert torch.equal(i_gx, b_gx)
    for got, b in zip(_grads(compiled), b_grads, strict=True):
        assert got is not None and b is not None and torch.equal(got, b)


def test_two_microbatches_wait_for_w_at_once() -> None:
    """I0, I1, W1, W0 and I0, I1, W0, W1 give what B, B gives (and what eager training gives)."""
    torch.manual_seed(0)
    base = Block()
    compiled = compile_for_split(copy.deepcopy(base), backend="aot_eager")
    stage = PipelineStage(compiled, 1, 3, "cpu")
    batches = _inputs(2)
    want, want_gx = _eager(base, batches)

    def forwards() -> None:
        for mb, (x, _) in enumerate(batches):
            stage.forward_one_chunk(mb, (x.clone().requires_grad_(),))

    forwards()
    b_gx = [stage.backward_one_chunk(mb, grad_outputs=[g], full=True)[0] for mb, (_, g) in enumerate(batches)]
    b_grads = _grads(compiled)
    torch.testing.assert_close(b_grads, want)
    torch.testing.assert_close(b_gx, want_gx)
    for w_order in ([1, 0], [0, 1]):
        _zero(compiled)
        forwards()
        i_gx = [stage.backward_one_chunk(mb, grad_outputs=[g], full=False)[0] for mb, (_, g) in enumerate(batches)]
        assert all(p.grad is None for p in compiled.parameters())
        stage.backward_weight_one_chunk(w_order[0])
        assert all(p.grad is not None for p in compiled.parameters())
        stage.backward_weight_one_chunk(w_order[1])
        assert all(torch.equal(a, b) for a, b in zip(i_gx, b_gx, strict=True))
        for got, b in zip(_grads(compiled), b_grads, strict=True):
            assert got is not None and b is not None and torch.equal(got, b), w_order


def test_one_compiled_frame_serves_two_blocks_and_w_fills_each_blocks_parameters() -> None:
    """Blocks compiled one by one share dynamo's compiled frame (parameters are graph inputs):
    W must accumulate into the parameters of the call that I split, not of the first call."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    base = nn.Sequential(Block(), Block())
    module = nn.Sequential(*(compile_for_split(copy.deepcopy(b), backend="aot_eager") for b in base))
    stage = PipelineStage(module, 1, 3, "cpu")
    [(x, g)] = _inputs(1)
    want, [want_gx] = _eager(base, [(x, g)])
    counters.clear()
    stage.forward_one_chunk(0, (x.clone().requires_grad_(),))
    assert counters["stats"]["unique_graphs"] == 1  # the second block ran the first one's compiled code
    (gx,) = stage.backward_one_chunk(0, grad_outputs=[g], full=False)
    plan = stage._mbs[0].plan
    assert plan is not None and len(plan.regions) == 2
    assert all(p.grad is None for p in module.parameters())
    stage.backward_weight_one_chunk(0)
    torch.testing.assert_close(_grads(module), want)
    torch.testing.assert_close(gx, want_gx)


def test_a_plain_backward_outside_a_pipeline_computes_everything() -> None:
    torch.manual_seed(0)
    base = Block()
    compiled = compile_for_split(copy.deepcopy(base), backend="aot_eager")
    batches = _inputs(2)
    want, want_gx = _eager(base, batches)
    for (x, g), wgx in zip(batches, want_gx, strict=True):
        leaf = x.clone().requires_grad_()
        compiled(leaf).backward(g)
        torch.testing.assert_close(leaf.grad, wgx)
    torch.testing.assert_close(_grads(compiled), want)


def test_a_first_stage_runs_the_whole_region_in_w() -> None:
    """Inputs that need no gradient: I has nothing to give, W is the whole backward (as eager)."""
    torch.manual_seed(0)
    base = Block()
    compiled = compile_for_split(copy.deepcopy(base), backend="aot_eager")
    stage = PipelineStage(compiled, 0, 3, "cpu")
    [(x, g)] = _inputs(1)
    stage.forward_one_chunk(0, (x,))
    stage.backward_one_chunk(0, grad_outputs=[g], full=False)
    assert all(p.grad is None for p in compiled.parameters())
    stage.backward_weight_one_chunk(0)
    ref = copy.deepcopy(base)
    ref(x).backward(g)
    torch.testing.assert_close(_grads(compiled), _grads(ref))


def test_what_the_graph_split_cannot_take_falls_back_to_the_linears_and_says_so() -> None:
    with pytest.warns(UserWarning, match=r"compile_for_split\(Block\).*backend 'eager'.*split='linears'"):
        compiled = compile_for_split(Block(), backend="eager")
    assert "forward" in compiled._orig_mod.qkv.__dict__  # type: ignore[union-attr,operator]  # left eager
    with pytest.raises(PipelineError, match="fullgraph=True"):
        compile_for_split(Block(), backend="eager", fullgraph=True)
    with pytest.raises(PipelineError, match="fullgraph=True cannot hold"):
        compile_for_split(Block(), split="linears", fullgraph=True)
    with pytest.raises(PipelineError, match="split='nope'"):
        compile_for_split(Block(), split="nope")  # type: ignore[arg-type]
    graph = compile_for_split(Block(), backend="aot_eager", fullgraph=True)  # no graph break needed
    assert "forward" not in graph._orig_mod.qkv.__dict__  # type: ignore[union-attr,operator]


# ------------------------------------------------------------------ a split schedule on 2 ranks
_STAGES = 4


def _blocks() -> list[nn.Module]:
    torch.manual_seed(0)
    return [Block() for _ in range(_STAGES)]


def _pipelined(rank: int, world: int) -> list[int]:
    from pipetrain import PipelineScheduleRuntime
    from pipetrain.plan import build_schedule

    torch.set_num_threads(1)
    blocks = _blocks()
    x = torch.randn(8, 5, 16, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 5, 16, generator=torch.Generator().manual_seed(2))
    ref, _, _ = reference(blocks, x, y, 4)

    schedule = build_schedule("ZBVZeroBubble", world, 4, 2)
    mine = sorted(s for s, r in schedule.stage_to_rank.items() if r == rank)
    compiled = {s: compile_for_split(blocks[s], backend="aot_eager") for s in mine}
    stages = [PipelineStage(compiled[s], s, _STAGES, "cpu") for s in mine]
    runtime = PipelineScheduleRuntime(stages, schedule, loss_fn=nn.functional.mse_loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no region's weight gradients computed in I
        runtime.step(*((x,) if 0 in mine else ()), target=y if _STAGES - 1 in mine else None)
    for s in mine:
        for (name, p), q in zip(blocks[s].named_parameters(), ref[s].parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, n=f"stage {s} {name}": f"{n}: {m}")
    return mine


def test_a_zero_bubble_schedule_on_two_ranks_trains_like_plain_training() -> None:
    results = run_ranks(_pipelined, 2, timeout=240)
    assert sorted(results[0] + results[1]) == list(range(_STAGES))
