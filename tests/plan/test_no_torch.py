"""The planning layer and its CLI commands work where torch is not installed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

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
        plan.auto_schedule(4, 8, plan.Costs.per_rank(f=1, b=2), memory_limit=4)
        assert "LocalPipeline" in dir(pipetrain)  # listed without importing it
        assert issubclass(plan.ScheduleError, pipetrain.PipelineError)
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


def _cli_without(blocked: str, *argv: str, cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI in a fresh interpreter where the packages named in ``blocked`` (comma-separated) cannot load."""
    code = textwrap.dedent(
        f"""
        import sys
        class _Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {blocked.split(",")!r}:
                    raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)", name=name)
                return None
        sys.meta_path.insert(0, _Block())
        from pipetrain.cli import main
        sys.exit(main({list(argv)!r}))
        """
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_pictures_without_matplotlib_name_the_plot_extra(tmp_path: Path) -> None:
    for argv in (
        ("simulate", "1F1B", "-p", "2", "-m", "2", "--png", str(tmp_path / "t.png")),
        ("simulate", "1F1B", "-p", "2", "-m", "2", "--svg", str(tmp_path / "t.svg")),
        ("compare", "-p", "2", "-m", "2", "--png", str(tmp_path / "c.png")),
    ):
        proc = _cli_without("torch,matplotlib", *argv)
        assert proc.returncode == 1, (argv, proc.stderr)
        assert "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.count("\n") == 1, proc.stderr  # one line
        assert "needs matplotlib" in proc.stderr and "pip install 'pipetrain[plot]'" in proc.stderr, proc.stderr
        assert f"pipetrain {argv[0]}: error: --" in proc.stderr, proc.stderr  # names the option
    assert not list(tmp_path.iterdir())  # checked before anything is written


def test_simulate_without_pictures_needs_neither(tmp_path: Path) -> None:
    trace = tmp_path / "t.json"
    proc = _cli_without("torch,matplotlib", "simulate", "ZBVZeroBubble", "-p", "2", "-m", "4", "--trace", str(trace))
    assert proc.returncode == 0, proc.stderr
    assert "makespan" in proc.stdout and trace.exists()
    proc = _cli_without("torch,matplotlib", "--version")
    assert proc.returncode == 0 and proc.stdout.startswith("pipetrain "), proc.stderr


def test_train_without_torch_names_the_train_extra(tmp_path: Path) -> None:
    proc = _cli_without("torch,matplotlib", "train", "--steps", "1", "--out", str(tmp_path / "run"))
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "needs torch" in proc.stderr and "pip install 'pipetrain[train]'" in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


def test_an_optional_package_missing_deep_inside_a_command_names_its_extra() -> None:
    # The catch-all in main: a ModuleNotFoundError for an optional package, wherever it arises.
    from pipetrain.cli.common import missing_extra

    err = ModuleNotFoundError("No module named 'matplotlib.pyplot'", name="matplotlib.pyplot")
    found = missing_extra(err, "simulate")
    assert found is not None and "pip install 'pipetrain[plot]'" in str(found)
    found = missing_extra(ModuleNotFoundError("x", name="torch"), "train")
    assert found is not None and "pipetrain[train]" in str(found)
    assert missing_extra(ModuleNotFoundError("x", name="numpyy"), "simulate") is None  # not ours: re-raised


def test_drawing_from_python_without_matplotlib_names_the_extra(tmp_path: Path) -> None:
    proc = _run(
        f"""
        class _NoPlot:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "matplotlib":
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
                return None
        sys.meta_path.insert(0, _NoPlot())
        from pipetrain.plan import Costs, build_schedule, simulate
        from pipetrain.plan.render import render_timeline
        timeline = simulate(build_schedule("1F1B", 2, 2), Costs()).timeline
        try:
            render_timeline(timeline, {str(tmp_path / "t.png")!r})
        except ModuleNotFoundError as err:
            assert err.name == "matplotlib", err.name
            print(err)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'pipetrain[plot]'" in proc.stdout
