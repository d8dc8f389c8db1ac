"""The demo model (a GPT that cuts into stages) and its offline text data."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from pipetrain.train.data import TextData, decode, encode, load_text, text_files
from pipetrain.train.model import GPT, MODEL_SIZES, GPTConfig, lm_loss

TINY = MODEL_SIZES["tiny"]


def test_gpt_shapes_and_split_compose_exactly() -> None:
    torch.manual_seed(0)
    model = GPT(TINY)
    x = torch.randint(0, TINY.vocab_size, (3, TINY.seq_len))
    logits = model(x)
    assert logits.shape == (3, TINY.seq_len, TINY.vocab_size)
    for n in range(1, len(model) + 1):
        y = x
        stages = model.split(n)
        assert len(stages) == n
        for stage in stages:
            y = stage(y)
        torch.testing.assert_close(y, logits, rtol=0, atol=0)


def test_gpt_split_by_measured_time() -> None:
    model = GPT(TINY)
    stages = model.split(3, by="time")
    assert [k for s in stages for k in s.state_dict()] == list(model.state_dict())


def test_gpt_too_many_stages_is_a_clear_error() -> None:
    model = GPT(TINY)
    with pytest.raises(ValueError, match=f"too few for {len(model) + 1} stages"):
        model.split(len(model) + 1)


def test_gpt_is_causal() -> None:
    torch.manual_seed(0)
    model = GPT(TINY)
    x = torch.randint(0, 256, (1, TINY.seq_len))
    changed = x.clone()
    changed[0, -1] = (x[0, -1] + 1) % 256
    torch.testing.assert_close(model(x)[:, :-1], model(changed)[:, :-1])
    assert not torch.equal(model(x)[:, -1], model(changed)[:, -1])


def test_same_seed_same_model() -> None:
    torch.manual_seed(5)
    a = GPT(TINY)
    torch.manual_seed(5)
    b = GPT(TINY)
    for (ka, pa), (kb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert ka == kb
        assert torch.equal(pa, pb)


def test_lm_loss_is_token_mean_cross_entropy() -> None:
    logits = torch.randn(2, 5, 7)
    targets = torch.randint(0, 7, (2, 5))
    expected = F.cross_entropy(logits.permute(0, 2, 1), targets)
    torch.testing.assert_close(lm_loss(logits, targets), expected)


def test_bad_head_count_is_rejected() -> None:
    with pytest.raises(ValueError, match="divisible"):
        GPT(GPTConfig(d_model=30, n_heads=4))


def test_text_is_offline_python_source() -> None:
    files = text_files()
    assert files and all(p.suffix == ".py" for p in files)
    text = load_text(max_bytes=20_000)
    assert len(text) == 20_000
    assert load_text(max_bytes=20_000) == text
    assert decode(encode("héllo")) == "héllo"


def test_text_files_from_a_given_root(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "b.py").write_text("b = 2\n")
    (tmp_path / "a.py").write_text("a = 1\n")
    assert [p.name for p in text_files(tmp_path)] == ["a.py", "b.py"]
    assert load_text(tmp_path) == b"a = 1\nb = 2\n"
    with pytest.raises(FileNotFoundError):
        text_files(tmp_path / "missing")


def test_batches_are_a_function_of_seed_and_step() -> None:
    data = TextData(encode(bytes(range(256)) * 40))
    x, y = data.batch(3, 4, 16, seed=1)
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    torch.testing.assert_close(x[:, 1:], y[:, :-1])
    x2, y2 = data.batch(3, 4, 16, seed=1)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(data.batch(4, 4, 16, seed=1)[0], x)
    assert not torch.equal(data.batch(3, 4, 16, seed=2)[0], x)


def test_eval_batches_come_from_the_held_out_tail() -> None:
    tokens = torch.arange(1000) % 256
    data = TextData(tokens, eval_fraction=0.1)
    x, _ = data.batch(0, 8, 10, split="eval")
    # Held-out tokens are positions 900..999, whose values are (900..999) % 256.
    allowed = set((torch.arange(900, 1000) % 256).tolist())
    assert set(x.flatten().tolist()) <= allowed
    with pytest.raises(ValueError, match="split"):
        data.batch(0, 1, 4, split="test")
    with pytest.raises(ValueError, match="too few"):
        TextData(torch.arange(10)).batch(0, 1, 20)


def test_stage_checkpoints_reassemble_the_whole_model() -> None:
    torch.manual_seed(0)
    model = GPT(TINY)
    merged: dict[str, torch.Tensor] = {}
    for stage in model.split(3):
        state = stage.state_dict()
        assert not merged.keys() & state.keys()
        merged.update(state)
    torch.manual_seed(1)
    fresh = GPT(TINY)
    fresh.load_state_dict(merged, strict=True)
    x = torch.randint(0, 256, (2, TINY.seq_len))
    torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)
