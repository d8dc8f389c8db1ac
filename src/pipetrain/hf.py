"""Hugging Face decoder models as pipeline layers, as they are: no wrappers to write.

:func:`decoder_layers` lists a causal LM's layers in the order its ``forward`` runs them (the
embedding, each decoder layer, the final norm, the head) under the model's own names. A decoder
layer is called as the model calls it: with the rotary embeddings, the causal mask and the
position ids the model makes from the hidden states (a :class:`~pipetrain.split.CalledLayer`), so
:func:`pipetrain.profile_layers`, :func:`pipetrain.plan.plan_pipeline`'s names and
:func:`pipetrain.split_by_names` take the list unchanged, and the stages' parameter names are the
model's (a stage's ``state_dict`` loads into the unsplit model).

Covers two layouts of transformers 5:

- ``model.embed_tokens`` → ``model.layers`` (each given ``position_embeddings`` from
  ``model.rotary_emb``) → ``model.norm`` → ``lm_head``: Llama, Qwen2/3, Mistral and their kin;
- ``transformer.wte`` (+ ``transformer.wpe`` positions, ``transformer.drop``) → ``transformer.h``
  → ``transformer.ln_f`` → ``lm_head``: GPT-2.

Every token attends causally; a padding mask (the tokenizer's ``attention_mask``, 1 for a token, 0
for padding) is a step keyword: ``schedule.step(ids, attention_mask=mask, target=labels)`` gives it
to every stage, split into microbatches, and each decoder layer makes its mask from it as the model
does (no cache: the training case). A head tied to the
embedding (``tie_word_embeddings``, GPT-2's default) stays one weight: on one rank (a V schedule)
autograd sums its gradient; on two, the runtime sums the copies' gradients after each step
(:mod:`pipetrain.runtime.tied`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from pipetrain.errors import PipelineError
from pipetrain.split import CalledLayer

__all__ = ["decoder_layers"]


def _part(model: nn.Module, path: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise PipelineError(
            f"decoder_layers: {type(model).__name__} has no {path!r}; it reads causal LMs laid out as "
            "model.embed_tokens, model.layers, model.rotary_emb, model.norm, lm_head (Llama, Qwen, Mistral) "
            "or transformer.wte, transformer.wpe, transformer.h, transformer.ln_f, lm_head (GPT-2)"
        ) from None


def _positions(hidden: torch.Tensor) -> torch.Tensor:
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def _mask_maker(config: Any) -> Any:
    from transformers.masking_utils import create_causal_mask

    accepted = inspect.signature(create_causal_mask).parameters

    def mask(hidden: torch.Tensor, position_ids: torch.Tensor, padding: torch.Tensor | None) -> Any:
        given: dict[str, Any] = {
            "config": config,
            "inputs_embeds": hidden,
            "input_embeds": hidden,
            "attention_mask": padding,
            "cache": None,
            "past_key_values": None,
            "position_ids": position_ids,
            "cache_position": position_ids[0],
        }
        return create_causal_mask(**{k: v for k, v in given.items() if k in accepted})

    return mask


def decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, layer)`` of a Hugging Face causal LM in run order: the embedding (token ids in;
    GPT-2's adds its position embeddings and dropout), each decoder layer (a
    :class:`~pipetrain.split.CalledLayer` that makes the position ids, causal mask and rotary
    embeddings from its input as the model does), the final norm, ``lm_head`` (logits out; the
    loss is yours, e.g. cross-entropy on shifted labels)."""
    config = getattr(model, "config", None)
    if config is None:
        raise PipelineError(f"decoder_layers: {type(model).__name__} has no config; give a transformers model")
    if hasattr(model, "transformer") and not hasattr(model, "model"):
        return _gpt2_layers(model, config)
    return _llama_layers(model, config)


def _blocks(container: nn.Module, config: Any) -> list[nn.Module]:
    blocks = list(container.children())
    return blocks[: getattr(config, "num_hidden_layers", len(blocks))]


def _llama_layers(model: nn.Module, config: Any) -> list[tuple[str, nn.Module]]:
    embed, layers, norm = _part(model, "model.embed_tokens"), _part(model, "model.layers"), _part(model, "model.norm")
    rotary, head = _part(model, "model.rotary_emb"), _part(model, "lm_head")
    mask = _mask_maker(config)

    def call(layer: nn.Module, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        position_ids = _positions(hidden)
        out = layer(
            hidden,
            attention_mask=mask(hidden, position_ids, attention_mask),
            position_embeddings=rotary(hidden, position_ids=position_ids),
            position_ids=position_ids,
        )
        result: torch.Tensor = out[0] if isinstance(out, tuple) else out
        return result

    named: list[tuple[str, nn.Module]] = [("model.embed_tokens", embed)]
    for i, layer in enumerate(_blocks(layers, config)):
        named.append((f"model.layers.{i}", CalledLayer(layer, call, {"model.rotary_emb": rotary})))
    named += [("model.norm", norm), ("lm_head", head)]
    return named


def _gpt2_layers(model: nn.Module, config: Any) -> list[tuple[str, nn.Module]]:
    wte, wpe, drop = _part(model, "transformer.wte"), _part(model, "transformer.wpe"), _part(model, "transformer.drop")
    blocks, ln_f, head = _part(model, "transformer.h"), _part(model, "transformer.ln_f"), _part(model, "lm_head")
    mask = _mask_maker(config)

    def embed(layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        tokens = layer(ids)
        out: torch.Tensor = drop(tokens + wpe(_positions(tokens)))
        return out

    def call(layer: nn.Module, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        position_ids = _positions(hidden)
        out = layer(hidden, None, mask(hidden, position_ids, attention_mask), position_ids=position_ids)
        result: torch.Tensor = out[0] if isinstance(out, tuple) else out
        return result

    shared = {"transformer.wpe": wpe, "transformer.drop": drop}
    named: list[tuple[str, nn.Module]] = [("transformer.wte", CalledLayer(wte, embed, shared))]
    named += [(f"transformer.h.{i}", CalledLayer(block, call)) for i, block in enumerate(_blocks(blocks, config))]
    named += [("transformer.ln_f", ln_f), ("lm_head", head)]
    return named
