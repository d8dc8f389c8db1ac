"""The ``bpe`` preset: a BPE vocabulary learnt offline from the training text, cached, and a model
whose head costs what a language model's does."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from pipetrain.train.data import TextData, load_text
from pipetrain.train.loop import TrainConfig, load_data, reference_losses
from pipetrain.train.model import GPT, MODEL_SIZES, even_cut

pytest.importorskip("tokenizers")

from pipetrain.train.tokenizer import bpe_tokens, load_bpe, train_bpe

TEXT_BYTES = 150_000


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("PIPETRAIN_CACHE_DIR", str(folder))
    return folder


def test_bpe_is_learnt_deterministically_cached_and_decodes_back(cache: Path) -> None:
    text = load_text(max_bytes=TEXT_BYTES)
    first, second = train_bpe(text, 1024), train_bpe(text, 1024)
    assert first.to_str() == second.to_str()  # the same merges on every rank and every run
    assert first.get_vocab_size() == 1024
    ids = bpe_tokens(text, 1024)
    assert ids.dtype == torch.long and 0 <= int(ids.min()) and int(ids.max()) < 1024
    assert len(ids) < len(text) / 2.5  # a real vocabulary: several bytes per token
    assert load_bpe(text, 1024).decode(ids.tolist()) == text.decode("utf-8")
    cached = sorted(p.suffix for p in cache.iterdir())
    assert cached == [".json", ".tokens"]
    assert torch.equal(bpe_tokens(text, 1024), ids)  # read back from the cache
    # A damaged cache is learnt again, not trusted.
    next(cache.glob("*.tokens")).write_bytes(b"x")
    assert torch.equal(bpe_tokens(text, 1024), ids)


def test_bpe_preset_builds_and_trains_a_few_steps(cache: Path) -> None:
    cfg = TrainConfig(model="bpe", steps=4, batch_size=4, microbatches=2, max_text_bytes=TEXT_BYTES)
    mcfg = cfg.model_config
    assert mcfg.vocab_size >= 8192 and mcfg.tokenizer == "bpe"
    data = load_data(cfg)
    assert int(data.tokens.max()) < mcfg.vocab_size
    x, _ = data.batch(0, 2, mcfg.seq_len)
    assert x.shape == (2, mcfg.seq_len)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs (several threads on 2 busy cores are 10x slower)
    try:
        losses = reference_losses(cfg, torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
    assert all(math.isfinite(v) for v in losses)
    assert abs(losses[0] - math.log(mcfg.vocab_size)) < 0.5  # starts at chance over the vocabulary
    assert losses[-1] < losses[0]


def test_bytes_stay_the_default_and_unknown_tokenizers_are_refused() -> None:
    assert MODEL_SIZES["small"].tokenizer == "bytes" and MODEL_SIZES["small"].vocab_size == 256
    with pytest.raises(ValueError, match="tokenizer must be"):
        TextData.from_stdlib(1000, tokenizer="words")


def test_even_cut_puts_equal_blocks_on_each_stage() -> None:
    assert even_cut(8, 4) == [3, 2, 2, 3]  # [embedding + 2 blocks] [2] [2] [2 blocks + head]
    assert even_cut(6, 4) == [2, 2, 2, 2]
    assert even_cut(5, 4) == [2, 2, 1, 2]  # the block left over goes to a middle stage
    assert even_cut(2, 4) == [1, 1, 1, 1]  # fewer blocks than stages: one layer each
    assert even_cut(0, 1) == [2]
    with pytest.raises(ValueError, match="non-empty stages"):
        even_cut(2, 5)
    model = GPT(MODEL_SIZES["bpe"])
    stages = model.split(4)
    assert [len(s) for s in stages] == [3, 2, 2, 3]
    assert [k for s in stages for k in s.state_dict()] == list(model.state_dict())
    assert model.layer_names() == ["embed", *(f"block{k}" for k in range(8)), "head"]
