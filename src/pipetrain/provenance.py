"""What a stage module built by pipetrain's splitters remembers of the cut it came from.

Ranks compare these before their first step (:mod:`pipetrain.runtime.agreement`): stages cut
from one model must come from one cut. The record also names the parameters several stages share
(a tied embedding and head), which the runtime keeps one weight across ranks
(:mod:`pipetrain.runtime.tied`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["StageCut", "TiedParameter", "digest", "stage_cut", "tied_parameters", "unwrapped"]


@dataclass(frozen=True)
class StageCut:
    """The whole cut a stage module was built from (what ranks compare before their first step).

    ``layers``: the layer names of every stage of the cut, in order; ``index``: which of them
    this module is; ``digests``: per stage, a digest of its parameters' and buffers' names,
    shapes and dtypes as this process built the model; ``tied``: the parameters that several
    stages share (a tied embedding and head), see :class:`TiedParameter`.
    """

    layers: tuple[tuple[str, ...], ...]
    index: int
    digests: tuple[str, ...]
    tied: tuple[TiedParameter, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "layers": [list(x) for x in self.layers],
            "index": self.index,
            "digests": list(self.digests),
            "tied": [t.to_dict() for t in self.tied],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StageCut:
        tied = tuple(TiedParameter.from_dict(t) for t in data.get("tied", ()))
        return cls(tuple(tuple(x) for x in data["layers"]), int(data["index"]), tuple(data["digests"]), tied)


@dataclass(frozen=True)
class TiedParameter:
    """One parameter that several stages of a cut hold (a GPT-2's ``transformer.wte.weight``, which
    is also its ``lm_head.weight``): each ``(stage index, name in that stage's module)``, and the
    shape and dtype, so that a rank holding none of those stages can still tell what it is."""

    members: tuple[tuple[int, str], ...]
    shape: tuple[int, ...]
    dtype: str

    def to_dict(self) -> dict[str, Any]:
        return {"members": [list(m) for m in self.members], "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TiedParameter:
        members = tuple((int(s), str(name)) for s, name in data["members"])
        return cls(members, tuple(int(n) for n in data["shape"]), str(data["dtype"]))


def tied_parameters(stages: Sequence[nn.Module]) -> tuple[TiedParameter, ...]:
    """The parameters held by more than one of ``stages`` (the same tensor object), each with the
    first name each stage gives it."""
    held: dict[int, tuple[torch.Tensor, dict[int, str]]] = {}
    for index, stage in enumerate(stages):
        for name, p in stage.named_parameters(remove_duplicate=False):
            held.setdefault(id(p), (p, {}))[1].setdefault(index, name)
    return tuple(
        TiedParameter(tuple(sorted(names.items())), tuple(p.shape), str(p.dtype).removeprefix("torch."))
        for p, names in held.values()
        if len(names) > 1
    )


def digest(named: Sequence[tuple[str, nn.Module]]) -> str:
    h = hashlib.sha1()
    for name, layer in named:
        for kind, items in (("p", layer.named_parameters()), ("b", layer.named_buffers())):
            for key, t in items:
                h.update(f"{kind} {name}.{key} {tuple(t.shape)} {t.dtype};".encode())
    return h.hexdigest()[:16]


WRAPPED = ("module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
"""Where wrappers keep the module they wrap: DDP, torch.compile, checkpoint_wrapper, FSDP1."""


def stage_cut(module: nn.Module) -> StageCut | None:
    """The :class:`StageCut` of a stage module built by this module, also through a wrapper that
    holds it (DDP, ``torch.compile``, ``checkpoint_wrapper``); None for a module built otherwise
    (a container of several such stages, say: it is not one stage of their cut)."""
    seen = 0
    while module is not None and seen < 8:
        cut = module.__dict__.get("_pipetrain_cut")
        if isinstance(cut, StageCut):
            return cut
        inner = next((module._modules.get(name) for name in WRAPPED if module._modules.get(name) is not None), None)
        if inner is None:
            return None
        module, seen = inner, seen + 1
    return None


def unwrapped(layer: nn.Module) -> nn.Module:
    """The layer inside the wrappers pipetrain and torch put around one (checkpointing, compile)."""
    for _ in range(8):
        inner = next((layer._modules[n] for n in WRAPPED if layer._modules.get(n) is not None), None)
        if inner is None:
            return layer
        layer = inner
    return layer
