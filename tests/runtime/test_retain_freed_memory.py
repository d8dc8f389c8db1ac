"""retain_freed_memory: large CPU tensors freed stay in the process (no page faults on the next step)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from pipetrain.memory import _MALLINFO

# In a fresh interpreter: the setting is process-wide, and glibc's thresholds adapt as a process runs.
_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    from pipetrain.memory import allocated_bytes, retain_freed_memory

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    if sys.argv[1] == "retain":
        assert retain_freed_memory()
    before = allocated_bytes()
    x = torch.ones(16 << 20 >> 2)  # 16 MiB, touched (under glibc's largest mmap threshold, 32 MiB)
    during = resident()
    del x
    print(resident() - during, allocated_bytes() - before)
    """
)


@pytest.mark.skipif(_MALLINFO is None or not os.path.exists("/proc/self/statm"), reason="needs glibc and /proc")
def test_freed_memory_stays_in_the_process_only_when_retained() -> None:
    def run(mode: str) -> tuple[int, int]:
        out = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, check=True)
        dropped, held = out.stdout.split()
        return int(dropped), int(held)

    default_drop, default_held = run("default")
    retained_drop, retained_held = run("retain")
    # glibc's default hands the 16 MiB back at once; retained, the process keeps it ...
    assert default_drop < -8 << 20
    assert retained_drop > -1 << 20
    # ... and the bytes in use, what the memory promise is checked against, are the same either way.
    assert abs(default_held) < 1 << 20 and abs(retained_held) < 1 << 20
