"""torchtitan's decoders (Llama 3 and the models built on its ``Decoder``) as pipeline layers, as
they are: ``tok_embeddings``, each of ``layers`` called as the model's ``forward`` calls it
(``layer(h, attention_masks, positions)``), ``norm``, ``lm_head``, under the model's own names, for
:func:`pipetrain.profile_layers`, :func:`pipetrain.plan.plan_pipeline` and
:func:`pipetrain.split_by_names`. Without keywords the masks and positions are those of
``model(tokens)``: none (SDPA's causal attention). Document masks (FlexAttention's ``BlockMask``,
packed sequences) and positions vary per batch: give them to the step as keywords,
``schedule.step(tokens, attention_masks=masks, target=labels)``; every stage gets them, split into
microbatches, and each layer is called with them.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pipetrain.errors import PipelineError
from pipetrain.split import CalledLayer

__all__ = ["decoder_layers"]


def _call(layer: nn.Module, h: Any, attention_masks: Any = None, positions: Any = None) -> Any:
    return layer(h, attention_masks, positions)  # as the model's forward passes them


def decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, layer)`` of a torchtitan decoder in run order: ``tok_embeddings``, ``layers.<k>``
    (each a :class:`~pipetrain.split.CalledLayer`), ``norm``, ``lm_head``; parts the model does
    not have (None, as torchtitan's pipeline split leaves them) are left out."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (nn.ModuleDict, nn.ModuleList)):
        raise PipelineError(
            f"titan.decoder_layers: {type(model).__name__} has no layers ModuleDict; it reads torchtitan "
            "decoders (tok_embeddings, layers, norm, lm_head)"
        )
    named: list[tuple[str, nn.Module]] = []
    embed = getattr(model, "tok_embeddings", None)
    if embed is not None:
        named.append(("tok_embeddings", embed))
    items = layers.items() if isinstance(layers, nn.ModuleDict) else enumerate(layers)
    named += [(f"layers.{k}", CalledLayer(layer, _call)) for k, layer in items]
    for name in ("norm", "lm_head"):
        part = getattr(model, name, None)
        if part is not None:
            named.append((name, part))
    return named
