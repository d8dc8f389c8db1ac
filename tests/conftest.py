"""Import paths for the tests.

``tests/`` itself is on the path (pytest puts a root conftest's folder there), so shared test
helpers are imported from the ``support`` package (``from support.dist import run_ranks``).
``benchmarks/`` is added too, only for the tests of the benchmark scripts themselves and for
``_torch_reference`` (the one place that builds torch.distributed.pipelining schedules, shared by
the benchmarks and the comparisons in ``tests/plan``).
"""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
