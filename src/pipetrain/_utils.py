"""torch's ``pipelining._utils`` names that user code and torch's tests import: the stage ↔ rank
layouts (pipetrain's placements), the metadata error, argument flattening, ``PipeInfo``."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from pipetrain.errors import PipeliningMetadataError
from pipetrain.tracing import PipeInfo

__all__ = [
    "PipeInfo",
    "PipeliningMetadataError",
    "flatten_args",
    "flatten_args_detach",
    "generate_rank_to_stage_mapping",
    "generate_stage_to_rank_mapping",
]


def generate_stage_to_rank_mapping(pp_size: int, num_stages: int, style: str = "loop") -> dict[int, int]:
    """Stage → rank: ``"loop"`` puts stage s on rank s mod ``pp_size``; ``"v"`` zig-zags (ranks
    0..P-1, then P-1..0, ...), so the last stage of one pass and the first of the next share a rank."""
    if style == "loop":
        return {s: s % pp_size for s in range(num_stages)}
    if style == "v":
        if pp_size <= 0 or num_stages % pp_size:
            raise ValueError(f"num_stages {num_stages} must be a multiple of pp_size {pp_size} for a V layout")
        return {s: (s % pp_size if (s // pp_size) % 2 == 0 else pp_size - 1 - s % pp_size) for s in range(num_stages)}
    raise ValueError(f"style must be 'loop' or 'v', not {style!r}")


def generate_rank_to_stage_mapping(pp_size: int, num_stages: int, style: str = "loop") -> dict[int, list[int]]:
    """Rank → its stages in pipeline order (the inverse of :func:`generate_stage_to_rank_mapping`)."""
    ranks: dict[int, list[int]] = {}
    for stage, rank in generate_stage_to_rank_mapping(pp_size, num_stages, style).items():
        ranks.setdefault(rank, []).append(stage)
    return ranks


def flatten_args(args: Any, *, detach: bool = False) -> Any:
    """The leaves of ``args``; with ``detach``, ``(args with each tensor detached keeping its
    requires_grad, those leaves)``, as a stage's inputs are cut from the sender's graph."""
    leaves, spec = pytree.tree_flatten(args)
    if not detach:
        return leaves
    cut = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in leaves]
    return pytree.tree_unflatten(cut, spec), cut


def flatten_args_detach(args: Any) -> Any:
    """``flatten_args(args, detach=True)`` (torch's older name)."""
    return flatten_args(args, detach=True)
