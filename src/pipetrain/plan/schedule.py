"""Schedule: which rank runs which action at which step, plus the layout of stages on ranks.

The same object describes a compute-only schedule (F, B, I, W, OVERLAP_F_B) as produced by a
generator and a lowered one (with SEND/RECV, UNSHARD/RESHARD and REDUCE_GRAD added by passes).
It reads and writes torch.distributed.pipelining's CSV format and a JSON form of its own.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from operator import itemgetter
from typing import Any, cast

from pipetrain.plan._csvio import csv_text, parse_csv_text
from pipetrain.plan._jsonio import (
    is_json_text,
    parse_json_text,
    read_json,
    read_json_file,
    read_text,
    write_json,
)
from pipetrain.plan._text import align_columns, count
from pipetrain.plan.actions import Action, ActionKind
from pipetrain.plan.errors import ScheduleError

__all__ = ["Schedule", "is_schedule_file"]

_PLAIN_ROW = {Action}
_NO_SUB_ACTIONS = {None}
_STAGE, _SUB_ACTIONS, _MICROBATCH = itemgetter(0), itemgetter(3), itemgetter(2)

_JSON_FORMAT = "pipetrain.schedule"
_JSON_VERSION = 1


def is_schedule_file(source: str) -> bool:
    """Whether a schedule given as text (a CLI argument, a config value) names a file rather than a
    generator: it ends in .csv / .json or holds a path separator. One rule for every command."""
    return source.lower().endswith((".csv", ".json")) or "/" in source or os.sep in source


_LISTED = 8  # missing stages named one by one in an error message before "and N more"
_EAGER_GAP_CHECK = 1 << 16
"""Stages × microbatches above which a schedule with too few actions to cover them is refused at
construction (below it, tables are cheap and validate() explains the gap better)."""


def _check_stages_placed(placement: Mapping[int, int], num_stages: int) -> None:
    """Raise unless every stage 0..num_stages-1 is placed; costs O(len(placement)), not O(num_stages)
    (a stray "99999999999F0" makes num_stages huge)."""
    placed = sum(1 for s in placement if 0 <= s < num_stages)
    if placed >= num_stages:
        return
    missing: list[int] = []
    stage = 0
    while len(missing) < _LISTED and stage < num_stages:  # ends within len(placement) + _LISTED steps
        if stage not in placement:
            missing.append(stage)
        stage += 1
    more = num_stages - placed - len(missing)
    listed = f"{missing} and {more} more" if more else f"{missing}"
    raise ScheduleError(
        f"stages {listed} are not placed on any rank (no action names them); "
        f"stages must be numbered 0..{num_stages - 1} without gaps"
    )


def first_naming(actions: Mapping[int, Sequence[Action | None]], microbatch: int) -> str:
    """``rank R, step K, action A`` of the first action naming ``microbatch``, or "" (O(actions);
    for error messages only)."""
    for rank in sorted(actions):
        for step, action in enumerate(actions[rank]):
            if action is not None and any(part.microbatch == microbatch for part in action.parts):
                return f"rank {rank}, step {step}, action {action}"
    return ""


def _microbatch_gap(
    actions: Mapping[int, Sequence[Action | None]], num_stages: int, num_microbatches: int, max_mb: int
) -> str:
    """The message for a schedule with too few actions for its microbatches: the first
    (stage, microbatch) without an F, and the action that names the largest microbatch.

    Runs only when the schedule is already known to be broken; O(actions)."""
    forwards: dict[int, set[int]] = {}
    for rank in sorted(actions):
        for action in actions[rank]:
            if action is None:
                continue
            for part in action.parts:
                if part.kind is ActionKind.F and part.microbatch is not None:
                    forwards.setdefault(part.stage, set()).add(part.microbatch)
    named = first_naming(actions, max_mb)
    largest = f"{named}: " if named else ""
    rule = "microbatches must be numbered 0..M-1 without gaps, with an F on every stage for each"
    for stage in range(num_stages):
        have = forwards.get(stage, set())
        m = 0
        while m in have:  # stops within len(have) + 1 steps
            m += 1
        if m < num_microbatches:
            if largest and max_mb + 1 == num_microbatches:
                return (
                    f"{largest}microbatch {max_mb} implies {count(num_microbatches, 'microbatches')}, but stage {stage} "
                    f"has no forward {stage}F{m}; {rule}"
                )
            return f"the schedule has {count(num_microbatches, 'microbatches')}, but stage {stage} has no forward {stage}F{m}; {rule}"
    # Unreachable: fewer action slots than (stage, microbatch) pairs leaves some pair without an F.
    return f"the schedule has {count(num_microbatches, 'microbatches')} on {count(num_stages, 'stages')}, more than its actions cover; {rule}"


class Schedule:
    """Per-rank action lists and the stage placement they imply.

    ``actions[rank][step]`` is an :class:`Action` or None (an idle step). Sizes that are not
    given are inferred: ``num_ranks`` from the keys, ``num_stages`` and ``num_microbatches``
    from the largest indices used, ``stage_to_rank`` from the rank that names each stage.
    A stage named on two ranks is rejected at once (its placement would be undefined), and so is
    a schedule whose stages × microbatches (over 65536) exceed its action slots: it cannot be
    complete, and the checkers' tables of that size would cost memory for nothing.
    """

    __slots__ = ("_actions", "name", "num_microbatches", "num_ranks", "num_stages", "planned", "stage_to_rank")

    def __init__(
        self,
        actions: Mapping[int, Sequence[Action | None]],
        *,
        num_stages: int | None = None,
        num_microbatches: int | None = None,
        stage_to_rank: Mapping[int, int] | None = None,
        name: str = "",
    ) -> None:
        ranks = sorted(actions)
        if ranks != list(range(len(ranks))):
            raise ScheduleError(f"ranks must be numbered 0..{len(ranks) - 1} without gaps, got {ranks}")
        if not ranks:
            raise ScheduleError("a schedule needs at least one rank")
        self._actions: dict[int, list[Action | None]] = {r: list(actions[r]) for r in ranks}
        self.num_ranks: int = len(ranks)
        self.name: str = name
        # Made by a timed planner (auto_schedule, plan_pipeline): ranks that each planned may hold
        # different orders of the same actions, so the runtime runs rank 0's (runtime.sharing).
        self.planned: bool = False

        seen: dict[int, int] = {}
        max_stage = -1
        max_mb = -1
        extra_parts = 0  # OVERLAP_F_B sub-actions beyond the first (counted off the hot path)
        for rank in ranks:
            row = self._actions[rank]
            # A row of plain actions on stages no other rank names (a generator's): the same
            # facts from C-level passes; any other row takes the loop below, which words errors.
            plain = cast("list[Action]", row)
            if set(map(type, row)) == _PLAIN_ROW and set(map(_SUB_ACTIONS, plain)) == _NO_SUB_ACTIONS:
                stages = dict.fromkeys(map(_STAGE, plain))  # (in order of first use, as the loop adds them)
                if all(seen.setdefault(s, rank) == rank for s in stages):
                    max_stage = max(max_stage, *stages)
                    mbs = set(map(_MICROBATCH, plain))
                    mbs.discard(None)
                    max_mb = max(max_mb, *mbs) if mbs else max_mb
                    continue
            # Plain loops and comparisons: schedules hold hundreds of thousands of actions.
            last_stage = -1
            for step, action in enumerate(row):
                if action is None:
                    continue
                if type(action) is not Action and not isinstance(action, Action):
                    raise ScheduleError(
                        f"rank {rank}, step {step}: expected an Action or None, got {type(action).__name__} {action!r}"
                    )
                subs = action.sub_actions
                if subs is None:
                    # The common case, inline: a plain action on the rank's current stage.
                    s = action.stage
                    m = action.microbatch
                    if s == last_stage:
                        if m is not None and m > max_mb:
                            max_mb = m
                        continue
                    subs = (action,)
                else:
                    extra_parts += len(subs) - 1
                for part in subs:
                    s = part.stage
                    if s != last_stage:
                        owner = seen.get(s)
                        if owner is None:
                            seen[s] = rank
                        elif owner != rank:
                            raise ScheduleError(
                                f"rank {rank}, step {step}, action {action}: stage {s} already runs on rank {owner}; "
                                "each stage lives on exactly one rank"
                            )
                        last_stage = s
                        if s > max_stage:
                            max_stage = s
                    m = part.microbatch
                    if m is not None and m > max_mb:
                        max_mb = m

        if stage_to_rank is not None:
            placement = {int(s): int(r) for s, r in stage_to_rank.items()}
            for stage, rank in seen.items():
                if placement.get(stage) != rank:
                    raise ScheduleError(
                        f"stage {stage} appears on rank {rank} but stage_to_rank places it on rank {placement.get(stage)}"
                    )
            for stage, rank in placement.items():
                if not 0 <= rank < self.num_ranks:
                    raise ScheduleError(
                        f"stage_to_rank places stage {stage} on rank {rank}, but there are {self.num_ranks} ranks"
                    )
        else:
            placement = dict(seen)
        if num_stages is None:
            num_stages = max(max(placement, default=-1), max_stage) + 1
        if num_microbatches is None:
            num_microbatches = max_mb + 1
        if max_stage >= num_stages:
            raise ScheduleError(f"an action names stage {max_stage}, but the schedule has {num_stages} stages")
        if max_mb >= num_microbatches:
            named = first_naming(self._actions, max_mb)  # "rank R, step K, action A"
            has = count(num_microbatches, "microbatches")
            if num_microbatches:
                raise ScheduleError(
                    f"{named}: microbatch {max_mb} is outside 0..{num_microbatches - 1} (the schedule has {has})"
                )
            raise ScheduleError(f"{named}: microbatch {max_mb} is named, but the schedule has {has}")
        _check_stages_placed(placement, num_stages)
        extra = [s for s in placement if not 0 <= s < num_stages]
        if extra:
            raise ScheduleError(f"stage_to_rank names stages {extra} outside 0..{num_stages - 1}")
        # Every (stage, microbatch) needs an F, so a schedule with fewer action slots than that can
        # never run. validate, simulate and lower allocate tables of num_stages * num_microbatches
        # entries, so such a schedule is refused here when those tables would be large: a stray
        # "0F30000000" must not cost gigabytes. A small one is left to validate(), whose message
        # names the rank and step (and which lower() must repeat word for word).
        cells = num_stages * num_microbatches
        if cells > _EAGER_GAP_CHECK:
            num_parts = sum(len(program) for program in self._actions.values()) + extra_parts
            if cells > num_parts:
                raise ScheduleError(_microbatch_gap(self._actions, num_stages, num_microbatches, max_mb))
        self.num_stages: int = num_stages
        self.num_microbatches: int = num_microbatches
        self.stage_to_rank: dict[int, int] = dict(sorted(placement.items()))

    # ------------------------------------------------------------------ views
    @property
    def actions(self) -> dict[int, list[Action | None]]:
        """``{rank: [Action | None, ...]}`` in execution order."""
        return self._actions

    @property
    def num_steps(self) -> int:
        """Length of the longest rank program (the number of CSV columns)."""
        return max((len(a) for a in self._actions.values()), default=0)

    @property
    def is_lowered(self) -> bool:
        """True when any rank program holds SEND/RECV, UNSHARD/RESHARD or REDUCE_GRAD."""
        return any(a is not None and not a.kind.is_compute for a in self.iter_actions())

    @property
    def has_backward(self) -> bool:
        """True when any compute action (or part of one) is not a forward: running it trains."""
        return any(
            p.kind is not ActionKind.F
            for a in self.iter_actions()
            if a is not None and a.kind.is_compute
            for p in a.parts
        )

    def stages_of(self, rank: int) -> list[int]:
        """Stages held by ``rank``, in increasing order."""
        return [s for s, r in self.stage_to_rank.items() if r == rank]

    def iter_actions(self) -> Iterator[Action | None]:
        for rank in range(self.num_ranks):
            yield from self._actions[rank]

    def __len__(self) -> int:
        return sum(1 for a in self.iter_actions() if a is not None)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schedule):
            return NotImplemented
        return (
            self.num_ranks == other.num_ranks
            and self.num_stages == other.num_stages
            and self.num_microbatches == other.num_microbatches
            and self.stage_to_rank == other.stage_to_rank
            and self._actions == other._actions
        )

    __hash__ = None  # type: ignore[assignment]  # mutable lists inside

    def __repr__(self) -> str:
        label = f"{self.name} " if self.name else ""
        return (
            f"<Schedule {label}ranks={self.num_ranks} stages={self.num_stages} "
            f"microbatches={self.num_microbatches} steps={self.num_steps}{' lowered' if self.is_lowered else ''}>"
        )

    def replace(self, actions: Mapping[int, Sequence[Action | None]], *, name: str | None = None) -> Schedule:
        """A schedule with the same sizes and placement but other rank programs (used by passes)."""
        return Schedule(
            actions,
            num_stages=self.num_stages,
            num_microbatches=self.num_microbatches,
            stage_to_rank=self.stage_to_rank,
            name=self.name if name is None else name,
        )

    def _derived(self, actions: dict[int, list[Action | None]], *, name: str | None = None) -> Schedule:
        """Like :meth:`replace` without re-reading every action: for passes, which only add actions
        of stages that this schedule already places on the same rank."""
        out = Schedule.__new__(Schedule)
        out._actions = actions
        out.num_ranks = self.num_ranks
        out.num_stages = self.num_stages
        out.num_microbatches = self.num_microbatches
        out.stage_to_rank = dict(self.stage_to_rank)
        out.name = self.name if name is None else name
        return out

    # ------------------------------------------------------------- checking
    # validate() and lower() are shorthands for the functions of pipetrain.plan.validate and
    # pipetrain.plan.lower. Those modules (and the passes under lower) sit above this one: they
    # import Schedule, this module imports none of them. So these two methods import on call, the
    # one deferred import in pipetrain.plan; everywhere else a module imports what it uses at the top.
    def validate(self) -> None:
        """Raise :class:`ScheduleError` naming rank, step, action and rule if this cannot run."""
        from pipetrain.plan.validate import validate  # deferred: see above

        validate(self)

    def lower(self, **options: Any) -> Schedule:
        """Return the lowered schedule (SEND/RECV, optional FSDP and grad-reduction actions).

        See :func:`pipetrain.plan.lower.lower` for the options.
        """
        from pipetrain.plan.lower import lower  # deferred: see above

        return lower(self, **options)

    # ------------------------------------------------------------ text grid
    def format(self, *, max_steps: int | None = None) -> str:
        """A steps × ranks grid, one row per step, one column per rank."""
        steps = self.num_steps if max_steps is None else min(self.num_steps, max_steps)
        header = ["step"] + [f"rank {r}" for r in range(self.num_ranks)]
        rows = [header]
        for step in range(steps):
            row = [str(step)]
            for rank in range(self.num_ranks):
                program = self._actions[rank]
                action = program[step] if step < len(program) else None
                row.append("" if action is None else str(action))
            rows.append(row)
        lines = align_columns(rows, "  ")
        if steps < self.num_steps:
            lines.append(f"... {self.num_steps - steps} more steps")
        return "\n".join(lines)

    # ------------------------------------------------------------------ CSV
    def to_csv_text(self, *, torch_waits: bool = False) -> str:
        """The text :meth:`to_csv` writes."""
        programs = [self._actions[rank] for rank in range(self.num_ranks)]
        return csv_text(programs, torch_waits=torch_waits and self.is_lowered)

    def to_csv(self, path: str | os.PathLike[str], *, torch_waits: bool = False) -> None:
        """Write torch's CSV format: one row per rank, one cell per step, empty = idle.

        ``torch_waits``: a lowered schedule in torch 2.15's lowered ("compute_comms") format,
        which torch 2.15 requires and torch 2.13 cannot read: with the WAIT_SEND_F, WAIT_SEND_B
        and WAIT_REDUCE_GRAD that torch's lowering places (see
        :func:`~pipetrain.plan._csvio._with_torch_waits`), and without idle cells (torch 2.15
        refuses them there). A compute-only schedule has nothing to wait for: it is written the
        same either way. :meth:`from_csv` reads both forms.
        """
        with open(path, "w", newline="", encoding="utf-8") as fh:
            fh.write(self.to_csv_text(torch_waits=torch_waits))

    @classmethod
    def from_csv_text(cls, text: str, *, name: str = "") -> Schedule:
        """Parse torch's CSV format; sizes and placement are inferred (waits: see :meth:`from_csv`)."""
        return cls(parse_csv_text(text), name=name)

    @classmethod
    def from_csv(cls, path: str | os.PathLike[str]) -> Schedule:
        """Read a CSV written by :meth:`to_csv` or by torch's ``_dump_csv``.

        torch 2.15's waits (``0WAIT_SEND_F3``, ``1WAIT_REDUCE_GRAD``) are dropped with their cells
        (a lowered file has no idle cells to keep in line); the other actions keep their order. Each
        must follow, on its rank, the send or REDUCE_GRAD it waits for, as torch requires.

        Errors name the file once: "FILE: rank 0, step 3: ..." or "cannot read FILE: ...".
        """
        name = os.fspath(path)
        text = read_text(path, newline="")
        try:
            return cls.from_csv_text(text, name=os.path.splitext(os.path.basename(name))[0])
        except ScheduleError as err:
            raise ScheduleError(f"{name}: {err}") from None

    # ----------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": _JSON_FORMAT,
            "version": _JSON_VERSION,
            "name": self.name,
            "num_ranks": self.num_ranks,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "stage_to_rank": {str(s): r for s, r in self.stage_to_rank.items()},
            "actions": {
                str(r): [None if a is None else str(a) for a in self._actions[r]] for r in range(self.num_ranks)
            },
        }

    def to_json(self, path: str | os.PathLike[str] | None = None, *, indent: int | None = None) -> str:
        """The JSON text; also written to ``path`` when one is given."""
        return write_json(self.to_dict(), path, indent)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Schedule:
        """Build a schedule from :meth:`to_dict`'s form.

        ``version`` must be one this code writes (a missing one counts as the current). A declared
        ``num_ranks`` is kept, also for ranks that have no actions, and bounds the ranks named.
        """
        if isinstance(data, Mapping) and "traceEvents" in data:
            raise ScheduleError(
                "not a pipetrain schedule but a Chrome trace (open it in https://ui.perfetto.dev); "
                "schedules are written by `pipetrain export` and `pipetrain plan --csv/--json`"
            )
        if not isinstance(data, Mapping) or data.get("format") != _JSON_FORMAT:
            raise ScheduleError(f'not a pipetrain schedule: expected an object with "format": "{_JSON_FORMAT}"')
        version = data.get("version", _JSON_VERSION)
        if type(version) is not int or version != _JSON_VERSION:
            raise ScheduleError(
                f"unsupported schedule JSON version {version!r}: this pipetrain reads version {_JSON_VERSION}"
            )
        num_ranks = _json_count(data, "num_ranks", least=1, most=_MAX_DECLARED_RANKS)
        num_stages = _json_count(data, "num_stages", least=0)
        num_microbatches = _json_count(data, "num_microbatches", least=0)
        try:
            raw_actions = data["actions"]
            if not isinstance(raw_actions, Mapping):
                raise ScheduleError(
                    f'"actions" must map rank numbers to lists of actions, not {type(raw_actions).__name__}'
                )
            actions: dict[int, list[Action | None]] = {}
            for rank_text, cells in raw_actions.items():
                rank = _json_rank(rank_text, num_ranks)
                if isinstance(cells, str | bytes) or not isinstance(cells, Sequence):
                    raise ScheduleError(f"rank {rank}: expected a list of actions, not {type(cells).__name__}")
                parsed: list[Action | None] = []
                for step, cell in enumerate(cells):
                    if cell is None:
                        parsed.append(None)
                        continue
                    try:
                        parsed.append(Action.parse(cell))
                    except ScheduleError as err:
                        raise ScheduleError(f"rank {rank}, step {step}: {err}") from None
                actions[rank] = parsed
            if num_ranks is not None:
                for rank in range(num_ranks):  # declared ranks without actions stay, idle
                    actions.setdefault(rank, [])
            placement = data.get("stage_to_rank")
            return cls(
                actions,
                num_stages=num_stages,
                num_microbatches=num_microbatches,
                stage_to_rank=None if placement is None else {int(s): int(r) for s, r in placement.items()},
                name=str(data.get("name", "")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            if isinstance(err, ScheduleError):
                raise
            raise ScheduleError(f"malformed schedule JSON: {err!r}") from None

    @classmethod
    def from_json_text(cls, text: str) -> Schedule:
        """Read a schedule from JSON text (as :meth:`to_json` returns it)."""
        return cls.from_dict(parse_json_text(text, "schedule"))

    @classmethod
    def from_json(cls, source: str | os.PathLike[str]) -> Schedule:
        """Read a schedule from a JSON file.

        For older callers a string that names no existing file and starts with '{' is parsed as
        JSON text; :meth:`from_json_text` says so explicitly. Errors about the content of a file
        name the file.
        """
        if is_json_text(source):
            return cls.from_dict(read_json(source, "schedule"))
        return cls._from_json_file(source)

    @classmethod
    def _from_json_file(cls, path: str | os.PathLike[str]) -> Schedule:
        """Read the JSON file at ``path`` (never JSON text); content errors name the file."""
        data = read_json_file(path, "schedule")
        try:
            return cls.from_dict(data)
        except ScheduleError as err:
            raise ScheduleError(f"{os.fspath(path)}: {err}") from None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Schedule:
        """Read a ``.json`` or ``.csv`` schedule file by its extension (a path, whatever its name)."""
        return cls._from_json_file(path) if os.fspath(path).lower().endswith(".json") else cls.from_csv(path)


_MAX_DECLARED_RANKS = 1 << 20
"""More ranks than any pipeline has: a declared num_ranks beyond it is a typo, and each rank costs a list."""


def _json_count(data: Mapping[str, Any], key: str, *, least: int, most: int | None = None) -> int | None:
    """A size field of the JSON form: absent (None, inferred) or an integer in range."""
    value = data.get(key)
    if value is None:
        return None
    if type(value) is not int or value < least or (most is not None and value > most):
        bound = f">= {least}" if most is None else f"in {least}..{most}"
        raise ScheduleError(f"{key} must be an integer {bound}, got {value!r}")
    return value


def _json_rank(key: object, num_ranks: int | None) -> int:
    """A rank number from a key of the JSON "actions" object, checked against ``num_ranks``."""
    text = str(key)
    if not text.isdecimal():
        raise ScheduleError(f'"actions" has a key {text[:20]!r} that is not a rank number')
    if len(text) > 9 or int(text) >= _MAX_DECLARED_RANKS:
        raise ScheduleError(f"actions are given for rank {text[:20]}, more than any pipeline has")
    rank = int(text)
    if num_ranks is not None and rank >= num_ranks:
        raise ScheduleError(f"actions are given for rank {rank}, but num_ranks is {num_ranks}")
    return rank
