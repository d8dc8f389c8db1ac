"""Gradient norms and clipping across a pipeline.

Each rank holds only its stages' gradients, so ``torch.nn.utils.clip_grad_norm_`` on a rank's
parameters measures that rank's share and clips every rank by a different factor: the update
no longer points where plain training's does. Here each rank computes the norm of its share,
the ranks of the pipeline exchange those (one small all-gather), and every rank combines them
in the same order, so all get the same total, bit for bit, and clip by the same factor.

Gradients that are DTensors (FSDP2) are measured whole (their data-parallel shards are
combined first); DDP gradients are already equal across replicas. So ``group`` is the
pipeline's group, the one given to :class:`~pipetrain.PipelineStage`, never the whole world of
a data-parallel × pipeline job.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from pipetrain.errors import PipelineError

__all__ = ["clip_grad_norm_", "grad_norm"]


def _local_norm(
    grads: list[torch.Tensor], norm_type: float, foreach: bool | None, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """The ``norm_type`` norm of this rank's gradients, as a plain float32 tensor (0 without any)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=_group_device(group))
    norm = torch.nn.utils.get_total_norm(grads, norm_type, False, foreach)
    full_tensor = getattr(norm, "full_tensor", None)  # a DTensor: combine the data-parallel shards
    if full_tensor is not None:
        norm = full_tensor()
    return norm.detach().to(torch.float32)


def _group_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a collective of ``group`` wants its tensors: the CPU for gloo, else the current accelerator."""
    if not (dist.is_available() and dist.is_initialized()) or str(dist.get_backend(group)) == "gloo":
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, getattr(torch, accelerator.type).current_device())


def _shares(local: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Every pipeline rank's norm, in group rank order (just ``local`` without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [local]
    size = dist.get_world_size(group)
    if size == 1:
        return [local]
    out = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(out, local.contiguous(), group=group)
    return out


def _combine(shares: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    stacked = torch.stack(shares)
    if math.isinf(norm_type):
        return stacked.max()
    if norm_type == 0:  # the "norm" counts non-zero entries: the counts add up
        return stacked.sum()
    total: torch.Tensor = torch.linalg.vector_norm(stacked, norm_type)
    return total


def _grads(parameters: torch.Tensor | Iterable[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The parameters, each once, and the gradients this rank counts in the norm. A weight tied
    between two stages of one rank (embedding and head under a V placement) comes twice from the
    stages' ``parameters()``; counted twice it would weigh double in the norm and be scaled twice.
    A weight tied across ranks has a copy on each (:mod:`pipetrain.runtime.tied`): only the rank
    of its lowest stage counts it; every copy is scaled."""
    from pipetrain.runtime.tied import is_mirror  # (the runtime imports torch.distributed's pieces)

    params = [parameters] if isinstance(parameters, torch.Tensor) else list(dict.fromkeys(parameters))
    return params, [p.grad for p in params if p.grad is not None and not is_mirror(p)]


@torch.no_grad()
def grad_norm(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    norm_type: float = 2.0,
    *,
    group: dist.ProcessGroup | None = None,
    foreach: bool | None = None,
) -> torch.Tensor:
    """The ``norm_type`` norm of the whole pipeline's gradients, the same on every rank of ``group``.

    ``parameters`` are this rank's (its stages'); every rank of the pipeline group must call it,
    as for any collective. Without a process group it is the local norm.
    """
    _, grads = _grads(parameters)
    norm_type = float(norm_type)
    return _combine(_shares(_local_norm(grads, norm_type, foreach, group), group), norm_type)


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a pipeline: scale this rank's gradients so that the
    norm of the whole model's gradients is at most ``max_norm``; returns that norm (before clipping).

    Call it on every rank of the pipeline group, after ``step()`` and before the optimizer step.
    With ``error_if_nonfinite`` every rank raises (they share the total, so none is left waiting),
    naming the ranks whose gradients are not finite.
    """
    params, grads = _grads(parameters)
    norm_type = float(norm_type)
    shares = _shares(_local_norm(grads, norm_type, foreach, group), group)
    total = _combine(shares, norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        bad = [str(r) for r, share in enumerate(shares) if not bool(torch.isfinite(share))]
        why = (
            f"the gradients of rank{'s' if len(bad) > 1 else ''} {', '.join(bad)} of the pipeline group are not finite"
            if bad
            else "every rank's share is finite, but together they overflow float32"
        )
        raise PipelineError(
            f"the total norm of order {norm_type:g} of the pipeline's gradients is {float(total)}: {why}; "
            "set error_if_nonfinite=False to clip anyway"
        )
    held = [p.grad for p in params if p.grad is not None]  # (mirrors of tied weights too: every copy scales)
    if held:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total.to(held[0].device), foreach)
    return total
