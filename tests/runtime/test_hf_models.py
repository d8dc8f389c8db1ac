"""A Hugging Face causal LM as it is: profiled, planned, cut under its own parameter names and
trained on 2 gloo ranks with the plan, gradients equal to plain training (issue 36)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from pipetrain import PipelineStage, profile_layers
from pipetrain.errors import PipelineError
from pipetrain.split import split_by_names, stages_for_rank
from support.dist import run_ranks

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

VOCAB, SEQ, BATCH, MICROBATCHES = 256, 16, 8, 4


def _llama(tied: bool = False) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    return transformers.LlamaForCausalLM(config)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_the_layers_run_as_the_model_runs_them_under_its_names() -> None:
    from pipetrain.hf import decoder_layers

    model = _llama()
    x, _ = _data()
    layers = decoder_layers(model)
    assert [n for n, _ in layers] == [
        "model.embed_tokens",
        *(f"model.layers.{i}" for i in range(4)),
        "model.norm",
        "lm_head",
    ]
    h: Any = x
    for _, layer in layers:
        h = layer(h)
    torch.testing.assert_close(h, model(x).logits, rtol=0, atol=0)


def test_tied_embeddings_are_refused_with_what_to_do() -> None:
    from pipetrain.hf import decoder_layers

    with pytest.raises(PipelineError, match="tie_word_embeddings=False"):
        decoder_layers(_llama(tied=True))


def _plan() -> Any:
    from pipetrain.hf import decoder_layers
    from pipetrain.plan import plan_pipeline

    x, y = _data()
    mb = BATCH // MICROBATCHES
    costs = profile_layers(decoder_layers(_llama()), x[:mb], loss_fn=_loss, target=y[:mb])
    return plan_pipeline(costs, 2, MICROBATCHES, None, stages_per_rank=2, time_limit=1)


def _train(rank: int, world: int, stage_layers: list[list[str]], recompute: list[int], schedule: Any) -> dict[str, Any]:
    from pipetrain import PipelineScheduleRuntime
    from pipetrain.hf import decoder_layers

    torch.set_num_threads(1)
    model = _llama()
    x, y = _data()
    modules = split_by_names(decoder_layers(model), stage_layers, recompute=recompute)
    mine = [PipelineStage(m, s, len(modules), "cpu") for s, m in stages_for_rank(modules, schedule, rank)]
    runtime = PipelineScheduleRuntime(mine, schedule, loss_fn=_loss)
    runtime.step(x, target=y)
    # (as arrays: tensors would cross the queue as shared memory the exiting rank takes away)
    return {k: p.grad.numpy().copy() for st in mine for k, p in st.submodule.named_parameters()}


def test_a_planned_llama_trains_on_two_ranks_like_plain_training_with_its_names() -> None:
    from pipetrain.hf import decoder_layers

    plan = _plan()
    modules = split_by_names(decoder_layers(_llama()), plan.stage_layers)
    keys = [k for m in modules for k in m.state_dict()]
    want_model = _llama()
    assert sorted(keys) == sorted(want_model.state_dict())  # every stage key is the model's, each once
    results = run_ranks(_train, 2, plan.stage_layers, sorted(plan.recompute), plan.schedule, timeout=240)
    x, y = _data()
    loss = sum(
        _loss(want_model(xs).logits, ys) for xs, ys in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES), strict=True)
    )
    (loss / MICROBATCHES).backward()
    got = {**results[0], **results[1]}
    assert sorted(got) == sorted(k for k, _ in want_model.named_parameters())
    for k, p in want_model.named_parameters():
        torch.testing.assert_close(torch.from_numpy(got[k]), p.grad, msg=lambda m, k=k: f"{k}: {m}")
