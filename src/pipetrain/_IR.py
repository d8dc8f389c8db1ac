# ruff: noqa: N999  (torch's module name)
"""torch's ``pipelining._IR``: tracing a model into a :class:`Pipe` (pipetrain's is
:mod:`pipetrain.tracing`; this module names it as torch does)."""

from __future__ import annotations

from pipetrain.tracing import Pipe, PipeInfo, SplitPoint, build_stage, pipe_split, pipeline

__all__ = ["Pipe", "PipeInfo", "SplitPoint", "build_stage", "pipe_split", "pipeline"]
