"""A byte-level BPE vocabulary learnt from the training text itself, offline, once.

The ``bpe`` model preset needs a real vocabulary (8,192 tokens) so that its head and loss cost
what a language model's do. Nothing is downloaded: the ``tokenizers`` package learns the merges
from the same standard-library source the model trains on (about 3 s for 4 MB on one core), and
the tokenizer and the encoded text are kept in a cache folder keyed by the text's hash, the
vocabulary size and the ``tokenizers`` version, so later runs (and the other ranks) read them in
a moment. Learning is deterministic: the same text gives the same merges, so a cache built
anywhere holds the same tokens.

The cache folder is ``$PIPETRAIN_CACHE_DIR``, else ``$XDG_CACHE_HOME/pipetrain``, else
``~/.cache/pipetrain`` (a temporary folder when none of these can be written). Files are written
under a temporary name and renamed into place, so ranks that build them at once do not clash.
"""

from __future__ import annotations

import array
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pipetrain.errors import PipelineError

__all__ = ["BPE_VOCAB_SIZE", "bpe_tokens", "cache_dir", "load_bpe", "train_bpe"]

BPE_VOCAB_SIZE = 8192
_CACHE_ENV = "PIPETRAIN_CACHE_DIR"
_FORMAT = 1  # bump when what is cached changes


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise PipelineError(
            "the bpe model learns its vocabulary with the tokenizers package: pip install 'pipetrain[train]' "
            "(or pip install tokenizers)"
        ) from None
    return tokenizers


def cache_dir() -> Path:
    """Where learnt vocabularies and encoded text are kept (see the module's docstring)."""
    explicit = os.environ.get(_CACHE_ENV)
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "pipetrain"


def _writable(folder: Path) -> Path:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=folder, delete=True)
        probe.close()
        return folder
    except OSError:
        fallback = Path(tempfile.gettempdir()) / f"pipetrain-cache-{os.getuid() if hasattr(os, 'getuid') else 0}"
        fallback.mkdir(parents=True, exist_ok=True)
        return fallback


def _key(text: bytes, vocab_size: int) -> str:
    version = _tokenizers().__version__
    digest = hashlib.sha256(text).hexdigest()[:16]
    return f"bpe{vocab_size}-{digest}-tok{version}-v{_FORMAT}"


def _lines(text: bytes) -> list[str]:
    """The units learnt from and encoded: each line with its newline (the last without one)."""
    lines = text.decode("utf-8", errors="replace").split("\n")
    return [line + "\n" for line in lines[:-1]] + lines[-1:]


def _chunks(lines: list[str], size: int = 1000) -> Iterator[list[str]]:
    for start in range(0, len(lines), size):
        yield lines[start : start + size]


def train_bpe(text: bytes, vocab_size: int = BPE_VOCAB_SIZE) -> Any:
    """A byte-level BPE tokenizer (a ``tokenizers.Tokenizer``) with ``vocab_size`` tokens learnt from ``text``.

    Byte-level: every byte is a token before any merge, so any text encodes and decodes exactly.
    """
    tk = _tokenizers()
    if vocab_size < 257:
        raise PipelineError(f"a byte-level BPE vocabulary needs more than 256 tokens, got {vocab_size}")
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        special_tokens=[],
    )
    lines = _lines(text)
    tokenizer.train_from_iterator(_chunks(lines), trainer=trainer, length=len(lines))
    return tokenizer


def _write_atomically(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as a plain open() would (mkstemp makes it private)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_bpe(text: bytes, vocab_size: int = BPE_VOCAB_SIZE) -> Any:
    """The tokenizer learnt from ``text``: read from the cache, else learnt now and cached."""
    tk = _tokenizers()
    folder = _writable(cache_dir())
    path = folder / f"{_key(text, vocab_size)}.json"
    if path.is_file():
        try:
            return tk.Tokenizer.from_file(str(path))
        except Exception:  # a damaged cache file is learnt again
            pass
    tokenizer = train_bpe(text, vocab_size)
    _write_atomically(path, tokenizer.to_str().encode("utf-8"))
    return tokenizer


def bpe_tokens(text: bytes, vocab_size: int = BPE_VOCAB_SIZE) -> torch.Tensor:
    """``text`` encoded with the BPE learnt from it: int64 token ids in ``[0, vocab_size)``.

    The ids are cached beside the tokenizer (encoding 4 MB takes seconds; reading them back, milliseconds).
    """
    folder = _writable(cache_dir())
    path = folder / f"{_key(text, vocab_size)}.tokens"
    dtype, code = (torch.int16, "h") if vocab_size <= 2**15 else (torch.int32, "i")
    if path.is_file():
        raw = path.read_bytes()
        if len(raw) % dtype.itemsize == 0 and raw:
            return torch.frombuffer(bytearray(raw), dtype=dtype).to(torch.long)
    tokenizer = load_bpe(text, vocab_size)
    # Line by line, as learnt (a token never spans lines), in parallel: decoding the ids gives the text back.
    encoded = tokenizer.encode_batch(_lines(text))
    flat = [i for enc in encoded for i in enc.ids]
    ids = torch.tensor(flat, dtype=torch.long)
    if ids.numel() and int(ids.max()) >= vocab_size:
        raise PipelineError(f"BPE produced token {int(ids.max())} outside its vocabulary of {vocab_size}")
    _write_atomically(path, array.array(code, flat).tobytes())
    return ids
