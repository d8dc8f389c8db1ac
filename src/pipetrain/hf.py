"""Hugging Face decoder models as pipeline layers, as they are: no wrappers to write.

:func:`decoder_layers` lists a causal LM's layers in the order its ``forward`` runs them (the
embedding, each decoder layer, the final norm, the head) under the model's own names. A decoder
layer is called as the model calls it: with the rotary embeddings, the causal mask and the
position ids the model makes from the hidden states (a :class:`~pipetrain.split.CalledLayer`), so
:func:`pipetrain.profile_layers`, :func:`pipetrain.plan.plan_pipeline`'s names and
:func:`pipetrain.split_by_names` take the list unchanged, and the stages' parameter names are the
model's (a stage's ``state_dict`` loads into the unsplit model).

Covers the models whose ``forward`` is ``model.embed_tokens`` → ``model.layers`` (each given
``position_embeddings`` from ``model.rotary_emb``) → ``model.norm`` → ``lm_head``: Llama, Qwen2/3,
Mistral and their kin in transformers 5. Every token attends causally (no padding mask, no cache):
the training case.
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
            "model.embed_tokens, model.layers, model.rotary_emb, model.norm, lm_head (Llama, Qwen, Mistral)"
        ) from None


def _mask_maker(config: Any) -> Any:
    from transformers.masking_utils import create_causal_mask

    accepted = inspect.signature(create_causal_mask).parameters

    def mask(hidden: torch.Tensor, position_ids: torch.Tensor) -> Any:
        given: dict[str, Any] = {
            "config": config,
            "inputs_embeds": hidden,
            "input_embeds": hidden,
            "attention_mask": None,
            "cache": None,
            "past_key_values": None,
            "position_ids": position_ids,
            "cache_position": position_ids[0],
        }
        return create_causal_mask(**{k: v for k, v in given.items() if k in accepted})

    return mask


def decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, layer)`` of a Hugging Face causal LM in run order: ``model.embed_tokens`` (token
    ids in), ``model.layers.0`` … (each a :class:`~pipetrain.split.CalledLayer` that makes the
    position ids, causal mask and rotary embeddings from its input as the model does),
    ``model.norm``, ``lm_head`` (logits out; the loss is yours, e.g. cross-entropy on shifted
    labels). Refuses tied input/output embeddings: the two ends of the pipeline would hold one
    weight (set ``tie_word_embeddings=False``)."""
    config = getattr(model, "config", None)
    if config is None:
        raise PipelineError(f"decoder_layers: {type(model).__name__} has no config; give a transformers model")
    embed, layers, norm = _part(model, "model.embed_tokens"), _part(model, "model.layers"), _part(model, "model.norm")
    rotary, head = _part(model, "model.rotary_emb"), _part(model, "lm_head")
    if getattr(head, "weight", None) is getattr(embed, "weight", None):
        raise PipelineError(
            "decoder_layers: the head and the embedding share one weight (tie_word_embeddings); a pipeline "
            "puts them on the first and the last stage: build the model with tie_word_embeddings=False"
        )
    mask = _mask_maker(config)

    def call(layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        out = layer(
            hidden,
            attention_mask=mask(hidden, position_ids),
            position_embeddings=rotary(hidden, position_ids=position_ids),
            position_ids=position_ids,
        )
        result: torch.Tensor = out[0] if isinstance(out, tuple) else out
        return result

    named: list[tuple[str, nn.Module]] = [("model.embed_tokens", embed)]
    blocks = list(layers.children())
    count = getattr(config, "num_hidden_layers", len(blocks))
    for i, layer in enumerate(blocks[:count]):
        named.append((f"model.layers.{i}", CalledLayer(layer, call, {"model.rotary_emb": rotary})))
    named += [("model.norm", norm), ("lm_head", head)]
    return named
