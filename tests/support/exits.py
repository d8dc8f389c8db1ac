"""Training runs that must end cleanly: exit code 0 and nothing on stderr (no abort at exit).

Used by tests/runtime/test_helper_threads.py (three runs of each kind) and run by hand for more:

    .venv/bin/python tests/support/exits.py --runs 20 [--launch spawn|torchrun|both]

prints each run's exit code and time, any stderr, and the count of clean runs of each kind.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ARGS = ["train", "--steps", "2", "--model", "tiny", "--batch-size", "8", "--microbatches", "4"]
TIMEOUT = 300


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env = {k: v for k, v in env.items() if not k.startswith("TORCHELASTIC_")}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONFAULTHANDLER="1")
    return env


def _run(cmd: list[str], cwd: Path) -> tuple[int, str]:
    cwd.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT, check=False)
    return done.returncode, done.stderr


def spawned_train(cwd: Path) -> tuple[int, str]:
    """``pipetrain train`` spawning its 2 ranks: (exit code, stderr)."""
    return _run([sys.executable, "-m", "pipetrain", *ARGS, "--out", "out"], cwd)


def torchrun_train(cwd: Path) -> tuple[int, str]:
    """``pipetrain train`` under ``torchrun --standalone --nproc-per-node 2``: (exit code, stderr)."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    return _run([*launch, "-m", "pipetrain", *ARGS, "--out", "out"], cwd)


def main() -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--launch", choices=["spawn", "torchrun", "both"], default="both")
    args = parser.parse_args()
    kinds = ["spawn", "torchrun"] if args.launch == "both" else [args.launch]
    clean = dict.fromkeys(kinds, 0)
    with tempfile.TemporaryDirectory(prefix="pipetrain-exits-") as tmp:
        for i in range(args.runs):
            for kind in kinds:
                t0 = time.monotonic()
                rc, err = (spawned_train if kind == "spawn" else torchrun_train)(Path(tmp) / f"{kind}{i}")
                ok = rc == 0 and err == ""
                clean[kind] += ok
                print(f"{kind} run {i + 1}: exit {rc}, {time.monotonic() - t0:.1f} s{'' if ok else ', NOT CLEAN'}")
                if err:
                    print(err[-4000:])
    for kind in kinds:
        print(f"{kind}: {clean[kind]} of {args.runs} runs exited 0 with nothing on stderr")


if __name__ == "__main__":
    main()
