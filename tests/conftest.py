"""Puts benchmarks/ on the import path: tests check its scripts and compare with torch through
its ``_torch_reference`` module (the one place that builds torch.distributed.pipelining schedules)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
