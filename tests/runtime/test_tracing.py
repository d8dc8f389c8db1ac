"""torch's tracing frontend on pipetrain: ``pipeline`` / ``pipe_split`` / ``SplitPoint`` / ``build_stage``.

Each gloo test runs several cases in one process group: a tiny GPT-2 from ``transformers`` (built
from a config, nothing downloaded), a model whose skip connection crosses stages, keyword inputs,
forward-only (as Accelerate runs it) and training against the unsplit model, a ``Pipe`` made by
torch's own ``pipeline()``, and Accelerate's real ``prepare_pippy`` with only its imports changed.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from pipetrain import Pipe, SplitPoint, build_stage, pipe_split, pipeline
from pipetrain.errors import PipelineError
from support.dist import run_ranks

WIDTH = 8
M = 2  # microbatches
MB = 2  # rows per microbatch: traced shapes are fixed, as with torch.export


class SkipNet(nn.Module):
    """Four blocks; block 0's output is added back at the end (a skip across every later stage),
    and the keyword input ``mask`` is used only there."""

    def __init__(self, marked: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("scale", torch.full((WIDTH,), 0.5))
        self.register_buffer("offset", torch.zeros(WIDTH), persistent=False)
        self.marked = marked

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h0 = self.blocks[0](x)
        if self.marked:
            pipe_split()  # the same cut as split_spec={"blocks.1": BEGINNING}
        h = self.blocks[3](self.blocks[2](self.blocks[1](h0)))
        if mask is not None:
            h = h * mask
        return self.head(h + h0 * self.scale + self.offset)


def skipnet(marked: bool = False) -> SkipNet:
    torch.manual_seed(0)
    return SkipNet(marked)


def skip_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(M * MB, WIDTH, generator=g)
    mask = (torch.rand(M * MB, WIDTH, generator=g) > 0.3).float()
    return x, mask, torch.randn(M * MB, WIDTH, generator=g)


def split_at(*names: str) -> dict[str, SplitPoint]:
    return dict.fromkeys(names, SplitPoint.BEGINNING)


def gpt2(layers: int = 4) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    cfg = GPT2Config(
        vocab_size=48,
        n_positions=16,
        n_embd=16,
        n_layer=layers,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg)


def gpt2_data(rows: int = M * MB, seq: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 48, (rows, seq), generator=g)
    attention = torch.ones(rows, seq, dtype=torch.long)
    attention[1, :3] = 0  # a padded row: the mask matters
    return ids, attention, torch.randint(0, 48, (rows, seq), generator=g)


def lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def reference_grads(
    model: nn.Module, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor, **kw: Any
) -> dict[str, torch.Tensor]:
    """Gradients of the unsplit model: the mean of the microbatch losses, one backward."""
    ref = copy.deepcopy(model)
    losses = []
    for i in range(M):
        rows = slice(i * MB, (i + 1) * MB)
        losses.append(loss_fn(ref(x[rows], **{k: v[rows] for k, v in kw.items()}), y[rows]))
    torch.stack(losses).mean().backward()
    return {name: p.grad for name, p in ref.named_parameters() if p.grad is not None}


def check_stage_grads(stage_module: nn.Module, expected: dict[str, torch.Tensor], case: str) -> None:
    """The stage's parameters, by the model's names, got the unsplit model's gradients."""
    names = [name for name, _ in stage_module.named_parameters()]
    assert names, case
    for name, p in stage_module.named_parameters():
        assert p.grad is not None, f"{case}: {name} got no gradient"
        torch.testing.assert_close(p.grad, expected[name], msg=lambda m, n=name: f"{case}: {n}: {m}")


# ------------------------------------------------------------------------------- in one process
def test_pipe_runs_the_model_and_keeps_its_names() -> None:
    torch.set_num_threads(1)
    model = skipnet()
    x, mask, _ = skip_data()
    pipe = pipeline(model, (x[:MB],), {"mask": mask[:MB]}, split_spec=split_at("blocks.1", "blocks.2", "blocks.3"))
    assert isinstance(pipe, Pipe) and pipe.num_stages == 4 and pipe.info().num_stages == 4
    torch.testing.assert_close(pipe(x[:MB], mask=mask[:MB])[0], model(x[:MB], mask=mask[:MB]))
    # Stage modules share the model's tensors under the model's names: a checkpoint maps back.
    own = dict(model.named_parameters())
    keys: list[str] = []
    for s in range(pipe.num_stages):
        sub = pipe.get_stage_module(s)
        for name, p in sub.named_parameters():
            assert p is own[name], name
        keys += list(sub.state_dict())
    assert sorted(keys) == sorted(model.state_dict()), "stage state_dict keys are the model's, each once"
    fresh = SkipNet()
    fresh.load_state_dict({k: v for s in range(4) for k, v in pipe.get_stage_module(s).state_dict().items()})
    torch.testing.assert_close(fresh(x, mask=mask), model(x, mask=mask))
    assert "offset" not in keys  # a non-persistent buffer stays out of checkpoints
    # A stage between the skip's ends forwards h0 and the mask without using them.
    # (Then the model's input names, accepted and ignored: those values come along the chain.)
    middle = [n.target for n in pipe.get_stage_module(2).graph.nodes if n.op == "placeholder"]
    assert middle[3:] == ["x", "mask"] and len(middle) == 5, middle
    # pipe_split() inside forward cuts where split_spec would, and runs eagerly as a no-op.
    marked = skipnet(marked=True)
    torch.testing.assert_close(marked(x, mask=mask), model(x, mask=mask))
    pipe2 = pipeline(marked, (x[:MB],), {"mask": mask[:MB]})
    assert pipe2.num_stages == 2
    assert [n for n, _ in pipe2.get_stage_module(0).named_parameters()] == ["blocks.0.0.weight", "blocks.0.0.bias"]
    # END splits after the module; a torch-style SplitPoint given by name is the same point.
    from torch.distributed.pipelining import SplitPoint as TorchSplitPoint

    for point in (SplitPoint.END, TorchSplitPoint.END):
        pipe3 = pipeline(model, (x[:MB],), split_spec={"blocks.0": point})
        assert [n for n, _ in pipe3.get_stage_module(0).named_parameters()] == ["blocks.0.0.weight", "blocks.0.0.bias"]
    # No split point: one stage, the whole model.
    whole = pipeline(model, (x[:MB],), {"mask": mask[:MB]})
    assert whole.num_stages == 1
    torch.testing.assert_close(whole.get_stage_module(0)(x[:MB], mask=mask[:MB]), model(x[:MB], mask=mask[:MB]))


def test_stage_on_another_device_than_the_trace() -> None:
    """The example's device baked into the graph (GPT-2's ``arange(device=cpu)``) follows the
    stage to its device, as it must for Accelerate, which traces on the CPU and runs on GPUs.
    The meta device stands in for a GPU here: a CPU tensor made inside the stage would fail."""
    torch.set_num_threads(1)
    model = gpt2()
    ids, attention, _ = gpt2_data()
    pipe = pipeline(model, (ids[:MB],), {"attention_mask": attention[:MB]}, split_spec=split_at("transformer.h.2"))
    stage = pipe.build_stage(0, "meta")
    assert "cpu" not in stage.submod.code
    out = stage.submod(ids[:MB].to("meta"), attention_mask=attention[:MB].to("meta"))
    assert all(t.device.type == "meta" for t in out)
    assert {p.device.type for p in stage.submod.parameters()} == {"meta"}


def test_clear_errors_for_bad_input() -> None:
    torch.set_num_threads(1)
    model = skipnet()
    x, _, _ = skip_data()
    with pytest.raises(PipelineError, match=r"split point 'blocks\.7' names no module of SkipNet; did you mean"):
        pipeline(model, (x[:MB],), split_spec=split_at("blocks.7"))
    with pytest.raises(PipelineError, match=r"split point 'decoder' names no module of SkipNet; its modules include"):
        pipeline(model, (x[:MB],), split_spec=split_at("decoder"))
    with pytest.raises(PipelineError, match=r"split_spec\['head'\] is 'BEGINNING'; use SplitPoint"):
        pipeline(model, (x[:MB],), split_spec={"head": "BEGINNING"})  # type: ignore[dict-item]
    with pytest.raises(PipelineError, match=r"names '' \(the whole model\)"):
        pipeline(model, (x[:MB],), split_spec=split_at(""))
    with pytest.raises(PipelineError, match=r"stage 0 of 2 would compute nothing"):
        pipeline(model, (x[:MB],), split_spec=split_at("blocks.0"))
    with pytest.raises(PipelineError, match=r"mb_kwargs must be a dict of keyword inputs, got tuple"):
        pipeline(model, (x[:MB],), (x[:MB],))  # type: ignore[arg-type]
    with pytest.raises(PipelineError, match=r"module must be a torch.nn.Module, got function"):
        pipeline(lambda t: t, (x[:MB],))  # type: ignore[arg-type]

    class Unused(SkipNet):
        def __init__(self) -> None:
            super().__init__()
            self.spare = nn.Linear(WIDTH, WIDTH)

    with pytest.raises(PipelineError, match=r"split point\(s\) \['spare'\] never ran"):
        pipeline(Unused(), (x[:MB],), split_spec=split_at("spare"))

    class Nested(nn.Module):
        def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return pair[0] + pair[1]

    with pytest.raises(PipelineError, match=r"input 'pair' is a tuple of values"):
        pipeline(Nested(), ((x, x),))

    class Untraceable(nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return t * 2 if t.sum().item() > 0 else t  # data-dependent control flow

    with pytest.raises(PipelineError, match=r"torch.export could not trace Untraceable"):
        pipeline(Untraceable(), (x[:MB],))
    # The model is left as it was: its forwards are no longer wrapped.
    assert "forward" not in model.blocks[1].__dict__
    pipe = pipeline(model, (x[:MB],), split_spec=split_at("blocks.2"))
    with pytest.raises(PipelineError, match=r"stage index 2 is outside 0\.\.1"):
        pipe.build_stage(2, "cpu")
    with pytest.raises(PipelineError, match=r"pipe_info must be a Pipe's info\(\)"):
        build_stage(pipe.get_stage_module(0), 0, {"num_stages": 2}, "cpu")


# ---------------------------------------------------------------------------------- gloo ranks
def _train_and_eval(
    stages: list[Any],
    model: nn.Module,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    case: str,
    **kw: torch.Tensor,
) -> None:
    """Training (gradients of the unsplit model) then forward-only (its outputs): 1F1B and GPipe
    for one stage per rank, Interleaved1F1B for several."""
    from pipetrain import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    held: Any = stages[0] if len(stages) == 1 else stages
    train, forward_only = (Schedule1F1B, ScheduleGPipe) if len(stages) == 1 else (ScheduleInterleaved1F1B,) * 2
    model.zero_grad(set_to_none=True)  # the stages share the model's parameters
    expected = reference_grads(model, loss_fn, x, y, **kw)
    losses: list[torch.Tensor] = []
    # Keyword inputs go to step() on the first stage's rank, as Accelerate does.
    train(held, M, loss_fn=loss_fn).step(
        *((x,) if first else ()), **(kw if first else {}), target=y if last else None, losses=losses
    )
    for stage in stages:
        check_stage_grads(stage.submod, expected, f"{case}, stage {stage.stage_index}")
    with torch.no_grad():
        out = forward_only(held, M).step(*((x,) if first else ()), **(kw if first else {}))
        if last:
            want = model(x, **kw)
            got, ref = (out.logits, want.logits) if hasattr(want, "logits") else (out, want)
            torch.testing.assert_close(got, ref, msg=lambda m: f"{case}: output: {m}")
            assert len(losses) == M
        else:
            assert out is None


def _accelerate_gpt2(rank: int, world: int) -> None:
    """Accelerate's own prepare_pippy, its torch.distributed.pipelining names pointed at pipetrain."""
    import accelerate.inference
    import torch.distributed.pipelining as torch_pipelining
    from accelerate import PartialState

    import pipetrain

    for name in ("pipeline", "SplitPoint", "ScheduleGPipe"):  # what accelerate.inference imports
        setattr(torch_pipelining, name, getattr(pipetrain, name))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    state = PartialState(cpu=True)
    assert state.num_processes == world and state.process_index == rank
    model = gpt2().eval()
    ref = copy.deepcopy(model)
    ids, attention, _ = gpt2_data()
    # Accelerate traces with the example as one microbatch and cuts the batch in num_chunks.
    accelerate.inference.prepare_pippy(
        model,
        split_points=["transformer.h.2"],
        example_args=(ids[:MB],),
        example_kwargs={"attention_mask": attention[:MB]},
        num_chunks=M,
    )
    assert type(model.pippy_stage).__module__.startswith("pipetrain")
    with torch.no_grad():
        out = model(ids, attention_mask=attention) if rank == 0 else model()
        if state.is_last_process:
            torch.testing.assert_close(out.logits, ref(ids, attention_mask=attention).logits)
        else:
            assert out is None


def _two_ranks(rank: int, world: int) -> list[str]:
    torch.set_num_threads(1)
    done = []
    # Accelerate's prepare_pippy on a GPT-2, a keyword input (attention_mask) on the first stage.
    _accelerate_gpt2(rank, world)
    done.append("accelerate gpt2")
    # A skip connection across the split, keyword input used on the last stage.
    model = skipnet()
    x, mask, y = skip_data()
    pipe = pipeline(model, (x[:MB],), {"mask": mask[:MB]}, split_spec=split_at("blocks.2"))
    stage = pipe.build_stage(rank, "cpu")
    assert stage.submod is pipe.get_stage_module(rank)
    _train_and_eval([stage], model, nn.functional.mse_loss, x, y, "skipnet", mask=mask)
    done.append("skipnet")
    # Two stages per rank: the keyword input reaches stage 2 on rank 0 through step() too, and
    # comes to it along the chain from stage 1 on rank 1.
    pipe = pipeline(model, (x[:MB],), {"mask": mask[:MB]}, split_spec=split_at("blocks.1", "blocks.2", "blocks.3"))
    stages = [pipe.build_stage(s, "cpu") for s in (rank, rank + world)]
    _train_and_eval(stages, model, nn.functional.mse_loss, x, y, "skipnet interleaved", mask=mask)
    done.append("skipnet interleaved")
    # A Pipe made by torch's own pipeline(), through pipetrain's build_stage.
    from torch.distributed.pipelining import SplitPoint as TorchSplitPoint
    from torch.distributed.pipelining import pipeline as torch_pipeline

    model = skipnet()
    tpipe = torch_pipeline(model, (x[:MB],), {"mask": mask[:MB]}, split_spec={"blocks.2": TorchSplitPoint.BEGINNING})
    tmod = tpipe.get_stage_module(rank)
    stage = build_stage(tmod, rank, tpipe.info(), "cpu")
    assert set(stage.submod.state_dict()) == set(tmod.state_dict()), "names kept through the rewrite"
    _train_and_eval([stage], model, nn.functional.mse_loss, x, y, "torch-built pipe", mask=mask)
    done.append("torch pipe")
    return done


def _four_ranks(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    torch.set_num_threads(1)
    done = []
    # A GPT-2 split at two blocks: three stages, on a group of ranks 0-2.
    group = dist.new_group([0, 1, 2])
    if rank < 3:
        model = gpt2()
        ids, attention, target = gpt2_data()
        pipe = pipeline(
            model,
            (ids[:MB],),
            {"attention_mask": attention[:MB]},
            split_spec=split_at("transformer.h.1", "transformer.h.3"),
        )
        assert pipe.num_stages == 3
        stage = pipe.build_stage(rank, "cpu", group=group)
        _train_and_eval([stage], model, lm_loss, ids, target, "gpt2", attention_mask=attention)
        done.append("gpt2")
    # Four stages: the skip travels through two stages between; the mask through three.
    model = skipnet()
    x, mask, y = skip_data()
    pipe = pipeline(model, (x[:MB],), {"mask": mask[:MB]}, split_spec=split_at("blocks.1", "blocks.2", "blocks.3"))
    stage = pipe.build_stage(rank, "cpu")
    _train_and_eval([stage], model, nn.functional.mse_loss, x, y, "skipnet x4", mask=mask)
    done.append("skipnet")
    return done


@pytest.mark.slow
def test_two_gloo_ranks() -> None:
    assert run_ranks(_two_ranks, 2) == [["accelerate gpt2", "skipnet", "skipnet interleaved", "torch pipe"]] * 2


@pytest.mark.slow
def test_four_gloo_ranks() -> None:
    assert run_ranks(_four_ranks, 4) == [["gpt2", "skipnet"]] * 3 + [["skipnet"]]
