"""Failure agreement: every rank learns of a failure anywhere, and ranks agree on the schedule.

The first rank that fails leaves its story in the process group's store (:class:`FailureChannel`);
ranks waiting for data poll it, so a failure anywhere becomes an error everywhere instead of a
hang. Before the first step of a schedule, neighbours check they run the same one
(:func:`agree`). A group on which a step failed is never used again in this process
(:func:`dead_group_story`): messages of the failed step may still be in flight on it.

Generations. Every first step of a schedule on a group is one *round*, and so is a schedule
refused while being built: ranks run the same sequence of them, so they count alike without
talking. Failure stories live under their round, so a refusal before any message was exchanged
(a bad constructor argument) stops that round on every rank and no later one: the next correct
schedule on the same group trains. Keys are also scoped to torchrun's restart attempt
(``TORCHELASTIC_RESTART_COUNT``): torch's elastic agent keeps one store across restarts.
"""

from __future__ import annotations

import hashlib
import os
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from pipetrain.errors import PipelineError
from pipetrain.plan import Schedule

__all__ = ["FailureChannel", "RemoteFailureError", "agree", "announce_failure", "refuse"]


class RemoteFailureError(PipelineError):
    """This rank stopped because another rank failed (the message tells which, where and why)."""


class FailureChannel:
    """A side channel (a ``torch.distributed`` Store) where the first failing rank leaves its story.

    Ranks waiting for data poll it, so a failure anywhere turns into an error everywhere instead
    of a hang. Keys are namespaced per process group, restart attempt and round (``generation``),
    so a fresh group, a restarted job and a schedule after a refused one all start clean.
    """

    def __init__(self, store: Any, namespace: str, rank: int, generation: int | None = None) -> None:
        self.store = store
        self.rank = rank
        self.namespace = namespace
        # The round whose story is read and written: the next one until this runtime's first step.
        self.generation = _ROUNDS.get(namespace, 0) + 1 if generation is None else generation

    @property
    def _count(self) -> str:
        return f"pipetrain/{self.namespace}/{self.generation}/failures"

    @property
    def _message(self) -> str:
        return f"pipetrain/{self.namespace}/{self.generation}/failure"

    def report(self, message: str) -> None:
        """Record ``message`` unless another rank already reported a failure."""
        try:
            if self.store.add(self._count, 1) == 1:
                self.store.set(self._message, message)
        except Exception:  # the store may be gone when the job is torn down; the raise still happens
            pass

    def check(self) -> str | None:
        """The story of a failure some rank reported, or None. A report is never empty: an empty
        value is a store that answers for keys nobody set (torch 2.15's ``FakeStore``)."""
        try:
            if self.store.check([self._message]):
                return bytes(self.store.get(self._message)).decode() or None
        except Exception:
            return None
        return None


def failure_channel(group: dist.ProcessGroup | None, rank: int) -> FailureChannel | None:
    """The store where ranks of ``group`` leave the story of a failure (None without a default store)."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None
    return FailureChannel(store, _namespace(group), rank)


def _namespace(group: dist.ProcessGroup | None) -> str:
    group_obj = group if group is not None else dist.group.WORLD
    name = str(getattr(group_obj, "group_name", "world"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return name if attempt is None else f"{name}@attempt{attempt}"


def _next_round(namespace: str) -> int:
    """Count one more round on the group (a first step, or a schedule refused while built)."""
    _ROUNDS[namespace] = _ROUNDS.get(namespace, 0) + 1
    return _ROUNDS[namespace]


def refuse(failure: FailureChannel, message: str) -> None:
    """A schedule refused while being built on this rank: its peers' next round stops with
    ``message`` (they read it while waiting to agree), and no round after it."""
    failure.generation = _next_round(failure.namespace)
    failure.report(message)


def dead_group(story: str) -> str:
    return (
        f"the pipeline's process group already failed ({story}). Messages of the failed step may still be in "
        "flight on its connections, so it is not reused: build the stages on a new group (dist.new_group()) "
        "or restart the job"
    )


def announce_failure(group: dist.ProcessGroup | None, message: str) -> None:
    """Leave ``message`` as the story of the group's next round: for a rank that fails before its
    runtime exists (a schedule class refusing its arguments). The other ranks read it at their
    next first step, while they wait for the ranks they exchange messages with (see ``agree``)."""
    if dist.is_available() and dist.is_initialized():
        channel = failure_channel(group, dist.get_rank(group))
        if channel is not None:
            refuse(channel, message)


_ROUNDS: dict[str, int] = {}  # per group namespace: the rounds (first steps, refusals) this process ran


def _neighbours(schedule: Schedule, rank: int) -> list[int]:
    """The ranks that exchange messages with ``rank`` under ``schedule`` (sorted)."""
    where = schedule.stage_to_rank
    out: set[int] = set()
    for s, r in where.items():
        if r == rank:
            out.update(where[t] for t in (s - 1, s + 1) if t in where)
    out.discard(rank)
    return sorted(out)


def _summary(schedule: Schedule) -> str:
    return (
        f"{schedule.name or 'a custom schedule'} with {schedule.num_ranks} ranks, {schedule.num_stages} stages "
        f"and {schedule.num_microbatches} microbatches"
    )


def _messages_hash(schedule: Schedule, rank: int) -> str:
    """A digest of the SEND/RECV actions of ``rank``'s program, in order: what must match between
    neighbours (compute, FSDP and gradient-reduction actions may differ per rank)."""
    text = ",".join(str(a) for a in schedule.actions[rank] if a is not None and a.kind.is_comm)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


# Process groups on which a step failed in this process, with the story: no schedule object runs
# on them again (messages of the failed step may be in flight). Weak keys: a group name may be
# reused by a later group after destroy_process_group.
DEAD_GROUPS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class StoreWait:
    """How a rank waits in the store for its peers before a first step: the failure channel it
    watches (None: no store, nothing to wait for), how long and how often it looks, and how it
    names itself in errors."""

    failure: FailureChannel | None
    timeout: float
    poll: float
    where: Callable[[], str]

    def values(self, failure: FailureChannel, keys: list[str]) -> list[str]:
        """The values of ``keys`` once all are in ``failure``'s store; raises if a rank failed or
        after the timeout."""
        deadline = time.monotonic() + self.timeout
        store = failure.store
        pause = 0.0005  # doubled up to `poll`: peers usually arrive within milliseconds
        while keys and not store.check(keys):  # (store.wait would log a warning at each expiry)
            story = failure.check()
            if story is not None:
                raise RemoteFailureError(f"{self.where()}: stopped before the first step because {story}")
            if time.monotonic() > deadline:
                raise PipelineError(
                    f"{self.where()}: timed out after {self.timeout:g} s waiting for ranks to start the schedule "
                    "(no rank reported a failure)"
                )
            time.sleep(pause)
            pause = min(2 * pause, self.poll)
        return [bytes(store.get(k)).decode() for k in keys]


def agree(wait: StoreWait, schedule: Schedule, rank: int) -> None:
    """Check, before the first step of ``schedule``, that ``rank``'s neighbours run the same one.

    Ranks that built different schedules (say, different ``n_microbatches``) would post
    operations that do not match: gloo then aborts the process on a size mismatch, or a rank
    waits forever. Each rank leaves in the store a summary of the schedule and a hash of its
    program's sends and receives; each checks its neighbours' against its own copy of the
    schedule. Skipped on a store that cannot hold keys.
    """
    peers = _neighbours(schedule, rank)
    failure = wait.failure
    if failure is None or not peers:
        return
    # The n-th round on a group is collective, so every rank counts alike; this step's failures
    # are told under it.
    failure.generation = _next_round(failure.namespace)
    prefix = f"pipetrain/{failure.namespace}/plan/{failure.generation}/"
    mine = _summary(schedule)
    # Sizes and messages must agree; names may not (the same CSV saved under two names).
    sizes = f"{schedule.num_ranks},{schedule.num_stages},{schedule.num_microbatches}"
    try:
        failure.store.set(f"{prefix}{rank}", f"{mine}#{sizes}#{_messages_hash(schedule, rank)}")
        ready = failure.store.check([f"{prefix}{rank}"])
    except Exception:  # a store without set/check (a fake backend's): nothing to compare with
        ready = False
    if not ready:
        return
    theirs = wait.values(failure, [f"{prefix}{p}" for p in peers])
    for peer, value in zip(peers, theirs, strict=True):
        summary, their_sizes, digest = value.rsplit("#", 2)
        if their_sizes != sizes:
            raise PipelineError(
                f"{wait.where()}: the ranks built different schedules: this rank runs {mine}, rank {peer} runs {summary}"
            )
        if digest != _messages_hash(schedule, peer):
            raise PipelineError(
                f"{wait.where()}: the ranks built different schedules: rank {peer}'s sends and receives "
                f"differ from those this rank's schedule ({mine}) gives it"
            )
