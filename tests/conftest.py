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


def pytest_ignore_collect(collection_path: Path, config: object) -> bool | None:
    """torch's own tests (``torch_conformance/``) switch torch's imports process-wide: they run in
    their own pytest process, only when named (``make test`` does)."""
    if collection_path.name != "torch_conformance":
        return None
    args = getattr(config, "args", [])
    named = any("torch_conformance" in str(Path(a).resolve()) for a in args)
    return None if named else True
