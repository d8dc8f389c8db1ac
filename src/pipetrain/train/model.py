"""A small GPT-style language model whose layers are a flat list, so it cuts into stages.

Layer list: ``[Embedding, Block × n_layers, Head]``. Every layer maps one tensor to one tensor
(token ids → hidden states → logits), which is what a pipeline stage hands to the next.

Presets (``MODEL_SIZES``): ``tiny`` keeps tests fast, ``small`` is the demo's default, ``base`` is
wider and deeper, all three on bytes (vocabulary 256), so their head is cheap. ``bpe`` has a real
vocabulary, 8,192 tokens of a BPE learnt offline from the training text, and is sized (d_model
224, 8 blocks) so that its head and loss cost what a Llama-3's do, 2 to 3 transformer blocks: on
one CPU thread, F+I+W of a microbatch of 2 sequences, 2.2 blocks by the fastest of 40 runs and 2.4
by the medians ``--schedule auto`` profiles (benchmarks/plan_pipeline_real.py prints it), while
its embedding costs a third of a block in time but holds as many parameters as the head (1.8M).
Where the cut falls matters for it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import cast

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from pipetrain.split import partition_balanced, split_by_names, split_sequential

__all__ = ["CUTS", "GPT", "MODEL_SIZES", "Block", "Embedding", "GPTConfig", "Head", "even_cut", "lm_loss"]


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the model. ``vocab_size`` 256 fits the byte-level tokenizer; ``tokenizer="bpe"``
    learns a ``vocab_size``-token BPE from the training text (:mod:`pipetrain.train.tokenizer`)."""

    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 4
    mlp_ratio: int = 4
    tokenizer: str = "bytes"

    def __post_init__(self) -> None:
        if self.tokenizer not in ("bytes", "bpe"):
            raise ValueError(f"tokenizer must be 'bytes' or 'bpe', got {self.tokenizer!r}")
        if self.tokenizer == "bytes" and self.vocab_size < 256:
            raise ValueError(f"byte tokens need vocab_size >= 256, got {self.vocab_size}")

    def to_dict(self) -> dict[str, int | str]:
        return asdict(self)


# Named sizes for the command line: "tiny" keeps tests fast, "small" is the demo's default,
# "bpe" has a real vocabulary and a head costing 2 to 3 blocks (see the module's docstring).
MODEL_SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(seq_len=32, d_model=32, n_heads=2, n_layers=2),
    "small": GPTConfig(),
    "base": GPTConfig(seq_len=128, d_model=256, n_heads=8, n_layers=8),
    "bpe": GPTConfig(vocab_size=8192, tokenizer="bpe", seq_len=64, d_model=224, n_heads=7, n_layers=8),
}

CUTS = ("even", "params", "time")
"""How :meth:`GPT.split` cuts: equal blocks per stage (the embedding with the first, the head with
the last), equal parameter counts, or equal measured forward+backward time."""


def even_cut(n_blocks: int, num_stages: int) -> list[int]:
    """Layers per stage of ``[Embedding, Block × n_blocks, Head]`` cut into ``num_stages`` stages with
    equal numbers of blocks (what torchtitan and Megatron do unless told otherwise): the embedding
    rides with the first stage and the head with the last; blocks left over go to the middle stages
    first. With fewer blocks than stages, equal numbers of layers."""
    layers = n_blocks + 2
    if num_stages < 1 or num_stages > layers:
        raise ValueError(f"cannot cut {layers} layers into {num_stages} non-empty stages")
    if n_blocks < num_stages:
        return partition_balanced([1.0] * layers, num_stages)
    blocks = [n_blocks // num_stages] * num_stages
    order = [*range(1, num_stages - 1), 0, num_stages - 1] if num_stages > 2 else list(range(num_stages))
    for k in order[: n_blocks % num_stages]:
        blocks[k] += 1
    sizes = list(blocks)
    sizes[0] += 1
    sizes[-1] += 1
    return sizes


class Embedding(nn.Module):
    """Token embedding plus learned positions: ``(batch, seq)`` int64 → ``(batch, seq, d_model)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.positions = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        out: torch.Tensor = self.tokens(idx) + self.positions(pos)
        return out


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention then an MLP, each with a residual."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ValueError(f"d_model {cfg.d_model} is not divisible by n_heads {cfg.n_heads}")
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class Head(nn.Module):
    """Final LayerNorm and the projection to vocabulary logits."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.out(self.ln(x))
        return logits


class GPT(nn.Sequential):
    """``GPT(cfg)(tokens) -> logits``; an ``nn.Sequential``, so :meth:`split` can cut it anywhere.

    Its layers are named ``embed``, ``block0`` … ``block{n-1}``, ``head`` (``model[0]`` still
    indexes them): the names a layer profile and a plan's ``stage_layers`` use, and from which the
    planner tells the embedding and the head from the blocks (as in Megatron's layout string).
    """

    def __init__(self, cfg: GPTConfig) -> None:
        layers: list[tuple[str, nn.Module]] = [("embed", Embedding(cfg))]
        layers += [(f"block{k}", Block(cfg)) for k in range(cfg.n_layers)]
        layers.append(("head", Head(cfg)))
        super().__init__(OrderedDict(layers))
        self.cfg = cfg
        self.apply(_init_weights)

    def layer_names(self) -> list[str]:
        """The layers' names in run order: ``embed``, ``block0`` …, ``head``."""
        return [name for name, _ in self.named_children()]

    def split(self, num_stages: int, *, by: str = "even") -> list[nn.Sequential]:
        """The model cut into ``num_stages`` stages; the stages share this model's parameters.

        ``by``: one of :data:`CUTS` (default ``"even"``: equal blocks per stage, see :func:`even_cut`).
        """
        if num_stages > len(self):
            raise ValueError(
                f"a GPT with {self.cfg.n_layers} blocks has {len(self)} layers, too few for {num_stages} stages"
            )
        if by == "even":
            return self.stages_of(even_cut(self.cfg.n_layers, num_stages))
        if by not in CUTS:
            raise ValueError(f"by must be one of {', '.join(CUTS)}, got {by!r}")
        sample = torch.zeros(1, self.cfg.seq_len, dtype=torch.long) if by == "time" else None
        return split_sequential(self, num_stages, by=by, sample_input=sample)

    def stages_of(self, sizes: list[int]) -> list[nn.Sequential]:
        """Consecutive stages of ``sizes`` layers each, named as in this model (built by
        :func:`~pipetrain.split.split_by_names`, so the runtime checks that the ranks cut alike)."""
        if sum(sizes) != len(self) or min(sizes, default=0) < 1:
            raise ValueError(f"stage sizes {sizes} do not cut the {len(self)} layers into non-empty stages")
        names = self.layer_names()
        cut = []
        start = 0
        for size in sizes:
            cut.append(names[start : start + size])
            start += size
        return [cast(nn.Sequential, stage) for stage in split_by_names(self, cut)]


def _init_weights(module: nn.Module) -> None:
    # GPT-2's initialisation: small normal weights, zero biases.
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; the pipeline's ``loss_fn(output, target)``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
