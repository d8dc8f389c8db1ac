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


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)  # its head is its embedding (tied, GPT-2's default)


@pytest.mark.parametrize("make", [_gpt2, lambda: _llama(tied=True)], ids=["gpt2", "llama-tied"])
def test_gpt2_and_a_tied_llama_run_as_the_model_runs_them(make: Any) -> None:
    from pipetrain.hf import decoder_layers

    model = make()
    x, _ = _data()
    layers = decoder_layers(model)
    h: Any = x
    for _, layer in layers:
        h = layer(h)
    torch.testing.assert_close(h, model(x).logits, rtol=0, atol=0)
    assert layers[-1][1].weight is model.get_input_embeddings().weight  # still one weight


def _train_tied(rank: int, world: int, name: str, perturb: bool) -> dict[str, Any]:
    from pipetrain import PipelineScheduleRuntime, clip_grad_norm_
    from pipetrain.hf import decoder_layers
    from pipetrain.plan import build_schedule

    torch.set_num_threads(1)
    model = _gpt2()
    x, y = _data()
    cut = [["transformer.wte"], ["transformer.h.0"], ["transformer.h.1"], ["transformer.ln_f", "lm_head"]]
    modules = split_by_names(decoder_layers(model), cut)
    schedule = build_schedule(name, 2, MICROBATCHES, stages_per_rank=2)
    mine = [PipelineStage(m, s, len(modules), "cpu") for s, m in stages_for_rank(modules, schedule, rank)]
    if perturb and rank == 1:
        with torch.no_grad():
            model.lm_head.weight[0, 0] += 1.0  # this rank's copy of the tied weight now differs
    runtime = PipelineScheduleRuntime(mine, schedule, loss_fn=_loss)
    try:
        runtime.step(x, target=y)
    except PipelineError as exc:
        return {"error": str(exc)}
    params = list(dict.fromkeys(p for st in mine for p in st.submodule.parameters()))
    grads = {k: p.grad.numpy().copy() for st in mine for k, p in st.submodule.named_parameters()}
    norm = float(clip_grad_norm_(params, 1e-3, group=mine[0].group))
    torch.optim.SGD(params, lr=1.0).step()
    weights = {k: p.detach().numpy().copy() for st in mine for k, p in st.submodule.named_parameters()}
    return {"grads": grads, "norm": norm, "weights": weights}


@pytest.mark.parametrize("name", ["Interleaved1F1B", "ZBVZeroBubble"])
def test_gpt2_with_its_tied_head_trains_like_plain_training(name: str) -> None:
    """Interleaved 1F1B puts the embedding (stage 0) on rank 0 and the head (stage 3) on rank 1:
    two copies whose gradients the runtime sums; ZB-V puts both on rank 0: one tensor."""
    results = run_ranks(_train_tied, 2, name, False, timeout=240)
    want = _gpt2()
    x, y = _data()
    loss = sum(_loss(want(xs).logits, ys) for xs, ys in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES), strict=True))
    (loss / MICROBATCHES).backward()
    expected = {k: p.grad for k, p in want.named_parameters(remove_duplicate=False)}
    for r in results:
        for k, g in r["grads"].items():
            torch.testing.assert_close(torch.from_numpy(g), expected[k], msg=lambda m, k=k: f"{name}, {k}: {m}")
    # The norm counts the tied weight once, as plain training does; the clipped update keeps it one weight.
    plain_norm = float(torch.nn.utils.clip_grad_norm_(list(want.parameters()), 1e-3))
    assert [r["norm"] for r in results] == pytest.approx([plain_norm, plain_norm], rel=1e-5)
    torch.optim.SGD(want.parameters(), lr=1.0).step()
    copies = [
        r["weights"][k] for r in results for k in ("transformer.wte.weight", "lm_head.weight") if k in r["weights"]
    ]
    assert len(copies) == 2
    assert (copies[0] == copies[1]).all()  # bit for bit, on both ranks
    torch.testing.assert_close(torch.from_numpy(copies[0]), want.lm_head.weight.detach())


def test_copies_of_a_tied_weight_that_differ_are_refused_naming_both() -> None:
    results = run_ranks(_train_tied, 2, "Interleaved1F1B", True, timeout=240)
    for r in results:
        assert "error" in r, r
        assert "'transformer.wte.weight'" in r["error"] and "'lm_head.weight'" in r["error"], r["error"]
        assert "differs" in r["error"] and "same seed" in r["error"], r["error"]


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


def _padded() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, a padding mask (the last 1-5 tokens of each row are padding) and labels that
    ignore the padding (-100), as a tokenizer and a collator give them."""
    x, y = _data()
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    for row, pad in enumerate([1, 3, 0, 5, 2, 0, 4, 1]):
        if pad:
            mask[row, SEQ - pad :] = 0
    return x, mask, y.masked_fill(mask == 0, -100)


@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_a_padding_mask_reaches_every_decoder_layer_as_the_model_passes_it(make: Any) -> None:
    from pipetrain.hf import decoder_layers

    model = make()
    x, mask, _ = _padded()
    (stage,) = split_by_names(decoder_layers(model), [[n for n, _ in decoder_layers(model)]])
    want = model(x, attention_mask=mask).logits
    torch.testing.assert_close(stage(x, attention_mask=mask), want, rtol=0, atol=0)
    assert not torch.equal(stage(x), want)  # (the mask changes what the padded rows attend to)


def _train_padded(rank: int, world: int, make_name: str) -> dict[str, Any]:
    from pipetrain import PipelineScheduleRuntime
    from pipetrain.hf import decoder_layers
    from pipetrain.plan import build_schedule

    torch.set_num_threads(1)
    model = {"llama": _llama, "gpt2": _gpt2}[make_name]()
    x, mask, y = _padded()
    names = [n for n, _ in decoder_layers(model)]
    modules = split_by_names(decoder_layers(model), [names[:3], names[3:]])
    schedule = build_schedule("1F1B", 2, MICROBATCHES)
    mine = [PipelineStage(m, s, len(modules), "cpu") for s, m in stages_for_rank(modules, schedule, rank)]
    PipelineScheduleRuntime(mine, schedule, loss_fn=_loss).step(x, attention_mask=mask, target=y)
    return {k: p.grad.numpy().copy() for st in mine for k, p in st.submodule.named_parameters()}


@pytest.mark.parametrize("make_name", ["llama", "gpt2"])
def test_padded_batches_train_on_two_ranks_like_plain_training(make_name: str) -> None:
    results = run_ranks(_train_padded, 2, make_name, timeout=240)
    want = {"llama": _llama, "gpt2": _gpt2}[make_name]()
    x, mask, y = _padded()
    chunks = zip(x.chunk(MICROBATCHES), mask.chunk(MICROBATCHES), y.chunk(MICROBATCHES), strict=True)
    (sum(_loss(want(a, attention_mask=m).logits, b) for a, m, b in chunks) / MICROBATCHES).backward()
    expected = dict(want.named_parameters(remove_duplicate=False))
    got = {**results[0], **results[1]}
    for k, g in got.items():
        torch.testing.assert_close(torch.from_numpy(g), expected[k].grad, msg=lambda m, k=k: f"{k}: {m}")
