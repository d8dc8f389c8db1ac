"""The one abstract execution of rank programs, which validate, simulate and lowering drive.

Every rank runs its program in order; an action runs once what it needs is there, and a rank that
waits resumes when it is. :class:`Walk` holds that machinery: the programs (idle steps dropped),
where each rank stands (``pc``), who waits for what (``waiting``: key -> ranks), the ranks to run
(``queue``), which ranks never finish, and the way back from a position to a step. A driver takes
the ranks :meth:`Walk.ranks` hands it and runs each from where it stands until an action waits
(it adds the rank to ``waiting`` under the key and stores its position); when it makes a key,
the ranks waiting for it go back in ``queue``. (The drivers touch ``waiting`` and ``queue``
directly rather than through methods: a call per action would cost about a fifth of a run.)

What an action needs is the dependency core's (:mod:`pipetrain.plan.dependencies`); what "runs"
means is the driver's: a start time in unit time (lowering), under a cost model (simulate), or the
strict or loose communication model (validate). The outcome does not depend on the order in which
ranks are picked up. The drivers keep their per-action loops themselves: the loop is the hot path
of planning. (validate's fast path, which only accepts, runs the same loop on flat tables without
a Walk: one waiter per key, since a run that ends never has two; see ``validate._fast_execute``.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

from pipetrain.plan.actions import Action

__all__ = ["Walk"]

T = TypeVar("T")


class Walk(Generic[T]):
    """One abstract execution of rank programs.

    ``programs[r]`` is rank r's program: the actions of ``actions[r]`` that ``keep`` keeps (by
    default all but idle steps), or the driver's own encoding of them (validate runs integers);
    ``pc[r]`` is the position the driver stopped at, and :meth:`step` turns a position back into
    the schedule's step. ``first=0`` picks rank 0 up first rather than the last rank (which changes
    nothing but the order of the run).
    """

    __slots__ = ("_steps", "actions", "keep", "pc", "programs", "queue", "waiting")

    def __init__(
        self,
        programs: list[list[T]],
        actions: Mapping[int, list[Action | None]],
        keep: Callable[[Action], bool] | None = None,
        *,
        first: int = -1,
    ) -> None:
        self.actions = actions
        self.keep = keep
        self.programs = programs
        num_ranks = len(programs)
        self.pc = [0] * num_ranks
        # Ranks are popped from the end: by default the last rank starts (``first=0``: rank 0).
        self.queue = list(range(num_ranks - 1, -1, -1)) if first == 0 else list(range(num_ranks))
        self.waiting: dict[int, list[int]] = {}
        self._steps: dict[int, list[int]] = {}

    @staticmethod
    def of(actions: Mapping[int, list[Action | None]], num_ranks: int, *, first: int = -1) -> Walk[Action]:
        """A walk over the schedule's actions themselves, idle steps dropped."""
        programs = [[a for a in actions[r] if a is not None] for r in range(num_ranks)]
        return Walk(programs, actions, first=first)

    def ranks(self) -> Iterator[int]:
        """The ranks to run, each time one is (re)started; ends when no rank can go on."""
        queue = self.queue
        while queue:
            yield queue.pop()

    def stuck(self) -> list[int]:
        """The ranks that did not run their whole program."""
        return [r for r, program in enumerate(self.programs) if self.pc[r] < len(program)]

    def step(self, rank: int, position: int) -> int:
        """The schedule's step of the action at ``position`` in ``programs[rank]``."""
        steps = self._steps.get(rank)
        if steps is None:
            keep = self.keep
            steps = self._steps[rank] = [
                i for i, a in enumerate(self.actions[rank]) if a is not None and (keep is None or keep(a))
            ]
        return steps[position] if position < len(steps) else len(self.actions[rank])
