"""pipetrain: pipeline-parallel training for PyTorch.

``pipetrain.plan`` (schedules, validation, simulation) is pure Python. The runtime names below
need torch and are imported lazily, so ``import pipetrain.plan`` works where torch is absent.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "PipelineStage": "pipetrain.stage",
    "PipelineStageInfo": "pipetrain.stage",
    "PipelineActivationLiveness": "pipetrain.liveness",
    "analyze_pipeline_activation_liveness": "pipetrain.liveness",
    "PipelineScheduleRuntime": "pipetrain.runtime",
    "PipelineScheduleSingle": "pipetrain.schedules",
    "PipelineScheduleMulti": "pipetrain.schedules",
    "ScheduleGPipe": "pipetrain.schedules",
    "Schedule1F1B": "pipetrain.schedules",
    "ScheduleInterleaved1F1B": "pipetrain.schedules",
    "ScheduleFlexibleInterleaved1F1B": "pipetrain.schedules",
    "ScheduleLoopedBFS": "pipetrain.schedules",
    "ScheduleInterleavedZeroBubble": "pipetrain.schedules",
    "ScheduleZBVZeroBubble": "pipetrain.schedules",
    "ScheduleDualPipeV": "pipetrain.schedules",
    "ScheduleZBH1": "pipetrain.schedules",
    "ScheduleZBH2": "pipetrain.schedules",
    "ScheduleForwardOnly": "pipetrain.schedules",
    "get_schedule_class": "pipetrain.schedules",
    "LocalPipeline": "pipetrain.runtime",
    "clip_grad_norm_": "pipetrain.grads",
    "grad_norm": "pipetrain.grads",
    "split_args_kwargs_into_chunks": "pipetrain.microbatch",
    "merge_chunks": "pipetrain.microbatch",
    "TensorChunkSpec": "pipetrain.microbatch",
    "REPLICATE": "pipetrain.microbatch",
    "split_into_chunks": "pipetrain.microbatch",
    "pipeline": "pipetrain.tracing",
    "pipe_split": "pipetrain.tracing",
    "SplitPoint": "pipetrain.tracing",
    "Pipe": "pipetrain.tracing",
    "build_stage": "pipetrain.tracing",
    "Checkpointer": "pipetrain.checkpoint",
    "profile_layers": "pipetrain.layer_profile",
    "PipelineError": "pipetrain.errors",
    "ScheduleError": "pipetrain.plan.errors",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None and name.startswith("Schedule"):
        module = "pipetrain.schedules"  # the class of a schedule family registered later (schedules.py)
        if not hasattr(importlib.import_module(module), name):
            module = None
    if module is None:
        raise AttributeError(f"module 'pipetrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The lazily imported names too (``dir(pipetrain)``, tab completion)."""
    return sorted({*globals(), *_LAZY})
