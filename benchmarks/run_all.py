"""Run every benchmark in benchmarks/ and write one markdown report with the date and machine.

``make bench`` runs ``python benchmarks/run_all.py --out benchmarks/RESULTS.md``. Each benchmark
is a script that prints its results (markdown tables or plain lines); this runner starts each in
its own process (so one crash or timeout does not stop the others), records its wall time and
exit status, and puts its output under its own heading.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def benchmark_scripts(only: list[str] | None = None) -> list[Path]:
    """Every ``benchmarks/*.py`` except this runner and private helpers, in name order."""
    scripts = sorted(p for p in HERE.glob("*.py") if p.name != Path(__file__).name and not p.name.startswith("_"))
    if only:
        scripts = [p for p in scripts if p.stem in only]
    return scripts


def machine() -> str:
    """A one-line description of where the numbers come from."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch

        torch_version = torch.__version__
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    except ImportError:
        torch_version, gpu = "not installed", "no GPU"
    return (
        f"{platform.system()} {platform.release()}, {cpu}, {os.cpu_count()} CPUs, {gpu}; "
        f"Python {platform.python_version()}, torch {torch_version}"
    )


def run(script: Path, timeout: float) -> tuple[int | str, float, str]:
    """(exit status or "timeout", seconds, combined output) of one benchmark script."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=HERE.parent,
            check=False,
        )
        status: int | str = proc.returncode
        output = proc.stdout + (f"\n[stderr]\n{proc.stderr}" if proc.returncode and proc.stderr else "")
    except subprocess.TimeoutExpired as err:
        status = "timeout"
        out = err.stdout.decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        output = out + f"\n[stopped after {timeout:g} s]"
    return status, time.perf_counter() - t0, output.strip()


def report(results: list[tuple[Path, int | str, float, str]], when: datetime.datetime, where: str) -> str:
    lines = [
        "# pipetrain benchmarks",
        "",
        f"Run {when:%Y-%m-%d %H:%M} UTC on {where}.",
        "Produced by `make bench` (`python benchmarks/run_all.py`); each section is one script's output.",
        "",
        "| benchmark | status | wall time |",
        "|---|---|---|",
    ]
    for script, status, seconds, _ in results:
        verdict = "ok" if status == 0 else (f"exit {status}" if isinstance(status, int) else str(status))
        lines.append(f"| [{script.stem}](#{script.stem}) | {verdict} | {seconds:.1f} s |")
    for script, _, _, output in results:
        doc = _first_doc_line(script)
        lines += ["", f"## {script.stem}", ""]
        if doc:
            lines += [doc, ""]
        # Output holding a markdown table is kept as markdown; anything else goes into a code block.
        if _looks_like_table(output):
            lines.append(output)
        else:
            lines += ["```", output, "```"]
    return "\n".join(lines) + "\n"


def _looks_like_table(output: str) -> bool:
    return any(line.startswith("|---") for line in output.splitlines())


def _first_doc_line(script: Path) -> str:
    text = script.read_text(encoding="utf-8")
    for quote in ('"""', "'''"):
        if text.lstrip().startswith(quote):
            body = text.lstrip()[3:]
            return body.split(quote, 1)[0].strip().splitlines()[0]
    return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"), help="markdown file to write")
    parser.add_argument("--only", nargs="*", help="benchmark names (file stems) to run")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per benchmark")
    args = parser.parse_args()
    scripts = benchmark_scripts(args.only)
    if not scripts:
        print("no benchmarks found", file=sys.stderr)
        return 1
    when = datetime.datetime.now(datetime.timezone.utc)
    results = []
    for script in scripts:
        print(f"running {script.name} ...", flush=True)
        status, seconds, output = run(script, args.timeout)
        print(f"  {status} in {seconds:.1f} s", flush=True)
        results.append((script, status, seconds, output))
    Path(args.out).write_text(report(results, when, machine()), encoding="utf-8")
    print(f"wrote {args.out}")
    return 0 if all(status == 0 for _, status, _, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
