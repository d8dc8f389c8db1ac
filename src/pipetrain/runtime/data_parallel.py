"""Data-parallel glue: what UNSHARD, RESHARD and REDUCE_GRAD do on DDP and FSDP2 modules.

A stage's module may be wrapped for data parallelism across replicas of the pipeline. The
schedule says when to gather (UNSHARD), free (RESHARD) and reduce gradients (REDUCE_GRAD); this
module only carries those actions out, and holds the per-backward reduction both wrappers would
otherwise do, so that gradients accumulate over the microbatches and are reduced once.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.errors import PipelineError
from pipetrain.plan import ActionKind, Schedule
from pipetrain.plan.lower import add_grad_reduction
from pipetrain.stage import PipelineStage

__all__ = ["default_lowering", "dp_kind", "hold_grad_sync", "reduce_grad", "reshard", "unshard", "with_grad_reduction"]


def dp_kind(module: torch.nn.Module) -> str | None:
    """ "fsdp" for an FSDP2 (fully_shard) module, "ddp" for DistributedDataParallel, else None.

    FSDP is looked up, not imported: a module can be an FSDPModule only once torch.distributed.fsdp
    is imported, and importing it after init_process_group pins the default group in
    torch.distributed.nn.functional's defaults (gloo's threads then outlive destroy_process_group)."""
    from torch.nn.parallel import DistributedDataParallel

    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None and isinstance(module, fsdp.FSDPModule):
        return "fsdp"
    if isinstance(module, DistributedDataParallel):
        return "ddp"
    return None


def default_lowering(stages: Sequence[PipelineStage]) -> dict[str, Any]:
    """The lowering options for ``stages`` when the caller gave none: with data-parallel modules,
    one REDUCE_GRAD per stage and step, and FSDP's gathers planned by the schedule."""
    kinds = {dp_kind(st.submodule) for st in stages} - {None}
    return {"grad_reduce": True, "fsdp": "fsdp" in kinds} if kinds else {}


def with_grad_reduction(schedule: Schedule, stages: Sequence[PipelineStage], rank: int) -> Schedule:
    """``schedule`` with REDUCE_GRAD added if it has none and a data-parallel stage trains.

    Without one, a data-parallel stage would never reduce its gradients; adding it here (rather
    than reducing behind the schedule's back) keeps it visible in ``pipeline_order_with_comms``.
    """
    dp = [st.stage_index for st in stages if dp_kind(st.submodule) is not None]
    if not dp or not schedule.has_backward:
        return schedule
    reduced = {
        a.stage
        for r in range(schedule.num_ranks)
        for a in schedule.actions[r]
        if a is not None and a.kind is ActionKind.REDUCE_GRAD
    }
    if not reduced:
        return add_grad_reduction(schedule)
    missing = sorted(set(dp) - reduced)
    if missing:
        raise PipelineError(
            f"rank {rank}: stages {missing} are data parallel, but the schedule reduces the gradients of stages "
            f"{sorted(reduced)} only; give every data-parallel stage a REDUCE_GRAD (or none, to have them added)"
        )
    return schedule


def unshard(stage: PipelineStage) -> None:
    module: Any = stage.submodule  # an FSDPModule mixed into the user's class: its type is dynamic
    if dp_kind(module) == "fsdp":
        module.unshard()


def reshard(stage: PipelineStage) -> None:
    module: Any = stage.submodule
    if dp_kind(module) == "fsdp":
        module.reshard()


def _sync(module: Any, kind: str | None, on: bool) -> None:
    """Whether the wrapper reduces (and FSDP reshards) at the end of a backward."""
    if kind == "fsdp":
        module.set_is_last_backward(on)
        module.set_reshard_after_backward(on)
        module.set_requires_gradient_sync(on)
    elif kind == "ddp":
        module.require_backward_grad_sync = on


def hold_grad_sync(stage: PipelineStage) -> None:
    """Accumulate gradients locally over the microbatches: no data-parallel reduction per backward."""
    _sync(stage.submodule, dp_kind(stage.submodule), False)


def fsdp_param_groups(state: Any) -> list[Any]:
    """One FSDP state's parameter groups: torch 2.13 keeps a list, torch 2.11 at most one group."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def reduce_grad(stage: PipelineStage) -> None:
    """REDUCE_GRAD: the one data-parallel gradient reduction of the step for this stage."""
    module: Any = stage.submodule
    kind = dp_kind(module)
    _sync(module, kind, True)
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        # torch adds fully_shard.state through a decorator its stubs do not show
        state = fully_shard.state(module)  # type: ignore[attr-defined]
        for sub in state._state_ctx.all_states:
            for group in fsdp_param_groups(sub):
                group.post_backward()  # reduce-scatter what the microbatches accumulated
        state._root_post_backward_final_callback()
    elif kind == "ddp":
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        if grads:
            group = module.process_group
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group)
            flat /= dist.get_world_size(group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
