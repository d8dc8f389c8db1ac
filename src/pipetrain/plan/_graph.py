"""Short names for the action kinds, and a collector pause, shared by validation and the passes.

(The numbering of the dependency graph lives in :mod:`pipetrain.plan.dependencies`.)
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

from pipetrain.plan.actions import ActionKind

F = ActionKind.F
B = ActionKind.B
I = ActionKind.I  # noqa: E741 - the token torch and the papers use
W = ActionKind.W
SEND_F = ActionKind.SEND_F
RECV_F = ActionKind.RECV_F
SEND_B = ActionKind.SEND_B
RECV_B = ActionKind.RECV_B
UNSHARD = ActionKind.UNSHARD
RESHARD = ActionKind.RESHARD
REDUCE_GRAD = ActionKind.REDUCE_GRAD
OVERLAP = ActionKind.OVERLAP_F_B


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while building large acyclic structures.

    Validation and lowering allocate hundreds of thousands of small objects and no cycles; with
    the collector running, its full passes over every live object make the work superlinear.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
