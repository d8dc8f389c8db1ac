"""Training text that every machine has offline: the Python standard library's own source.

Byte-level tokens by default (vocabulary 256, no tokenizer to ship); the ``bpe`` model's tokens
come from a BPE learnt offline from this same text (:mod:`pipetrain.train.tokenizer`). Batches are a pure function of
``(seed, step)``, so every rank, and the non-pipelined reference run, draws the same batch
without communicating.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["TOKENIZERS", "TextData", "decode", "encode", "load_text", "text_files"]

TOKENIZERS = ("bytes", "bpe")
"""How text becomes tokens: raw bytes (vocabulary 256) or the BPE learnt from the text."""

DEFAULT_MAX_BYTES = 4 * 1024 * 1024


def text_files(root: str | Path | None = None) -> list[Path]:
    """Sorted ``.py`` files under ``root`` (default: the standard library, else pipetrain's own source)."""
    candidates = (
        [Path(root)] if root is not None else [Path(sysconfig.get_paths()["stdlib"]), Path(__file__).parents[1]]
    )
    for directory in candidates:
        if directory.is_dir():
            files = sorted(p for p in directory.rglob("*.py") if "site-packages" not in p.parts and p.is_file())
            if files:
                return files
    raise FileNotFoundError(f"no .py files found under {', '.join(map(str, candidates))}")


def load_text(root: str | Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """Concatenated source files, at most ``max_bytes``; the same bytes on every run of one Python."""
    chunks = []
    total = 0
    for path in text_files(root):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


def encode(text: bytes | str) -> torch.Tensor:
    """Bytes → int64 token ids in [0, 256)."""
    raw = text.encode("utf-8") if isinstance(text, str) else text
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.long)


def decode(tokens: torch.Tensor) -> str:
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


@dataclass
class TextData:
    """A token stream cut into a training part and a held-out part (the last ``eval_fraction``)."""

    tokens: torch.Tensor
    eval_fraction: float = 0.05

    @classmethod
    def from_stdlib(
        cls, max_bytes: int = DEFAULT_MAX_BYTES, *, tokenizer: str = "bytes", vocab_size: int = 256
    ) -> TextData:
        """The standard library's source as bytes, or (``tokenizer="bpe"``) as the ids of the
        ``vocab_size``-token BPE learnt from it (learnt and encoded once, then read from the cache)."""
        if tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer must be one of {', '.join(TOKENIZERS)}, got {tokenizer!r}")
        text = load_text(max_bytes=max_bytes)
        if tokenizer == "bytes":
            return cls(encode(text))
        from pipetrain.train.tokenizer import bpe_tokens

        return cls(bpe_tokens(text, vocab_size))

    def _part(self, split: str) -> torch.Tensor:
        cut = int(len(self.tokens) * (1.0 - self.eval_fraction))
        if split == "train":
            return self.tokens[:cut]
        if split == "eval":
            return self.tokens[cut:]
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")

    def batch(
        self, step: int, batch_size: int, seq_len: int, *, seed: int = 0, split: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of shape ``(batch_size, seq_len)``; targets are inputs shifted by one."""
        part = self._part(split)
        if len(part) <= seq_len + 1:
            raise ValueError(f"{split} text has {len(part)} tokens, too few for seq_len {seq_len}")
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 7919 + (0 if split == "train" else 1))
        starts = torch.randint(0, len(part) - seq_len - 1, (batch_size,), generator=gen)
        offsets = torch.arange(seq_len + 1)
        window = part[starts[:, None] + offsets[None, :]]
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()
