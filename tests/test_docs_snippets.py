"""Every Python snippet of README.md and docs/guide.md runs as it is written.

A document's snippets run in order in one fresh interpreter, as a reader pasting them into one
Python session would (later snippets use what earlier ones defined), inside a temporary
directory, with torchrun's environment for a one-process job (RANK=0, WORLD_SIZE=1, ...), so
``dist.init_process_group("gloo")`` works as under ``torchrun --nproc-per-node 1``. A snippet
right after ``<!-- snippet: skip (reason) -->`` is not run; the reason is required, and skips are
counted below so that they stay few.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/guide.md")
# Snippets that cannot run here, each for a reason the document states (GPUs, several processes).
MAX_SKIPS = {"README.md": 0, "docs/guide.md": 5}

_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
_DIRECTIVE = re.compile(r"<!--\s*snippet:\s*(\w+)\s*(.*?)\s*-->\s*$")


@dataclass
class Snippet:
    line: int  # 1-based line of the snippet's first code line
    code: str
    skip: str | None  # the reason, when skipped


def snippets(text: str) -> list[Snippet]:
    """The ```python blocks of a markdown text, with their skip directives."""
    out = []
    for match in _FENCE.finditer(text):
        before = text[: match.start()].rstrip().splitlines()
        directive = _DIRECTIVE.search(before[-1]) if before else None
        skip = None
        if directive is not None:
            if directive.group(1) != "skip":
                raise ValueError(f"unknown snippet directive {directive.group(0)!r}")
            skip = directive.group(2).strip("() ")
        out.append(Snippet(text.count("\n", 0, match.start(1)) + 1, match.group(1), skip))
    return out


_RUNNER = """
import json, sys, traceback
name, blocks = json.loads(sys.stdin.read())
session = {"__name__": "__main__"}
for line, code in blocks:
    try:
        exec(compile(code, f"{name}:{line}", "exec"), session)
    except BaseException:
        print(f"snippet at {name}:{line} failed:", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
print(f"ran {len(blocks)} snippets")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run_session(name: str, blocks: list[Snippet], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run the snippets not skipped in order in one interpreter; the result names a failing one."""
    env = dict(os.environ)
    env.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        MPLBACKEND="Agg",
        OMP_NUM_THREADS="1",
    )
    payload = json.dumps([name, [(b.line, b.code) for b in blocks if b.skip is None]])
    return subprocess.run(
        [sys.executable, "-c", _RUNNER], input=payload, capture_output=True, text=True, cwd=cwd, env=env, timeout=600
    )


@pytest.mark.parametrize("doc", DOCS)
def test_every_snippet_runs_as_written(doc: str, tmp_path: Path) -> None:
    blocks = snippets((ROOT / doc).read_text(encoding="utf-8"))
    assert blocks, f"no python snippets found in {doc}"
    proc = run_session(doc, blocks, tmp_path)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert f"ran {sum(b.skip is None for b in blocks)} snippets" in proc.stdout


@pytest.mark.parametrize("doc", DOCS)
def test_skips_are_few_and_say_why(doc: str) -> None:
    skipped = [b for b in snippets((ROOT / doc).read_text(encoding="utf-8")) if b.skip is not None]
    assert all(b.skip for b in skipped), [b.line for b in skipped if not b.skip]
    assert len(skipped) <= MAX_SKIPS[doc], [(b.line, b.skip) for b in skipped]


def test_the_harness_reports_a_failing_snippet(tmp_path: Path) -> None:
    text = (
        "Intro.\n\n```python\nx = 1\n```\n\n<!-- snippet: skip (needs a GPU) -->\n```python\nraise SystemExit(3)\n```\n"
        "\n```python\nassert x == 1\nundefined_name\n```\n"
    )
    blocks = snippets(text)
    assert [(b.line, b.skip) for b in blocks] == [(4, None), (9, "needs a GPU"), (13, None)]
    proc = run_session("demo.md", blocks, tmp_path)
    assert proc.returncode == 1
    assert "snippet at demo.md:13 failed" in proc.stderr and "NameError" in proc.stderr
    with pytest.raises(ValueError, match="unknown snippet directive"):
        snippets("<!-- snippet: sometimes -->\n```python\npass\n```\n")


def test_the_readme_planning_commands_run(tmp_path: Path) -> None:
    """The README's command lines, `train` aside (tests/train runs it), in order, as written."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = [line.split("  #")[0].split() for line in readme.splitlines() if line.startswith(".venv/bin/pipetrain ")]
    planning = [argv[1:] for argv in lines if argv[1] != "train"]
    assert {argv[0] for argv in planning} >= {"compare", "show", "export", "simulate", "plan", "validate"}
    for argv in planning:
        proc = subprocess.run(
            [sys.executable, "-m", "pipetrain", *argv], capture_output=True, text=True, cwd=tmp_path, timeout=300
        )
        assert proc.returncode == 0, (argv, proc.stderr)
