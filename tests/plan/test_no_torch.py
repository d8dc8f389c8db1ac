"""The planning layer and its CLI commands work where torch is not installed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_BLOCK_TORCH = textwrap.dedent(
    """
    import sys
    class _NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError("No module named 'torch' (blocked by the test)")
            return None
    sys.meta_path.insert(0, _NoTorch())
    """
)


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _BLOCK_TORCH + textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )


def test_import_plan_without_torch() -> None:
    proc = _run(
        """
        import pipetrain, pipetrain.plan as plan
        s = plan.build_schedule("ZBVZeroBubble", 4, 8)
        s.validate(); s.lower().validate()
        r = plan.simulate(s, plan.Costs(f=1, b=2))
        assert r.makespan > 0
        plan.auto_schedule(4, 8, plan.Costs(f=1, b=2), memory_limit=4)
        assert "torch" not in sys.modules
        print("ok")
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_planning_cli_without_torch() -> None:
    proc = _run(
        """
        from pipetrain.cli import main
        assert main(["show", "1F1B", "-p", "2", "-m", "2"]) == 0
        assert main(["plan", "-p", "2", "-m", "4"]) == 0
        assert "torch" not in sys.modules
        """
    )
    assert proc.returncode == 0, proc.stderr
