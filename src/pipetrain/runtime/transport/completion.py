"""Completion: waiting on ``torch.distributed`` work without ever blocking past a failure elsewhere."""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from pipetrain.errors import PipelineError
from pipetrain.runtime.failures import FailureChannel, RemoteFailureError
from pipetrain.runtime.transport.wire import RecvHandle

__all__ = ["Waiter", "keep_alive"]

# Operations abandoned in flight after a failure: kept alive for the life of the process.
_NOTICES: list[Any] = []


def keep_alive(items: Any) -> None:
    """Keep ``items`` (operations, buffers, handles) alive for the life of the process."""
    _NOTICES.extend(items)


def _describe(what: Any) -> str:
    """What an operation carries, for error messages (built only when one is raised)."""
    if isinstance(what, tuple):  # (what, peer) of a send: the item itself would keep its data alive
        return f"{what[0]} to rank {what[1]}"
    if isinstance(what, RecvHandle):
        return f"{what.what} from rank {what.peer}"
    return str(what)


class _OnDevice:
    """A send's buffers with its operations on the device: dropped once those completed (on a
    GPU, a completed operation no longer reads its buffer, so the allocator may reuse it)."""

    __slots__ = ("keep", "works")

    def __init__(self, keep: Any, works: list[Any]) -> None:
        self.keep = keep
        self.works = works


def _completed(work: Any) -> bool:
    """Whether ``work`` is done, without waiting (a joint work: all of its parts)."""
    parts = getattr(work, "works", None)
    if parts is not None:
        return all(_completed(w) for w in parts)
    return bool(work.is_completed())


class _Job:
    __slots__ = ("done", "error", "finished", "keep", "limit", "on_done", "what", "works")

    def __init__(
        self,
        works: list[Any],
        what: str,
        keep: Any = None,
        on_done: Callable[[], None] | None = None,
        limit: timedelta | None = None,
    ) -> None:
        self.works = works
        self.what = what
        self.keep = keep
        self.on_done = on_done
        # A receive watched while it completes (Waiter.watch): waited with this bound, and its
        # error is raised by the thread that waits on `done`, not told through `finished`.
        self.limit = limit
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.finished: deque[_Job] | None = None  # the Waiter's, told the job once it is done


# Helper threads ("lanes"), shared by every Waiter of the process. A thread per Waiter that
# outlived it left one idle thread per schedule a program built; a thread stopped with its
# Waiter woke at interpreter exit to drop its last gloo works, whose destructors take the GIL:
# Python ends a thread that takes the GIL while the interpreter finalizes (pthread_exit), and
# unwinding it through a C++ destructor aborts the process ("terminate called without an active
# exception"). So a lane is never stopped: it is lent to one Waiter while that Waiter has jobs
# on it (they run in the order put), free again, holding nothing, once it finished them, and an
# idle lane sleeps through exit untouched. A process has as many lanes as Waiters had jobs at the
# same time, plus any left waiting on a dead peer after a failure (free again once that wait
# ends: the peer's exit closes the connection, or the wait's bound passes).
_LANES_LOCK = threading.Lock()
_LANES: list[_Lane] = []


def _forget_lanes() -> None:
    """A forked child has none of its parent's threads: it starts lanes of its own."""
    global _LANES_LOCK
    _LANES_LOCK = threading.Lock()
    _LANES.clear()


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=_forget_lanes)


class _Lane:
    """One helper thread and its queue; ``owner`` is the :class:`_Lending` it works for (None: free)."""

    __slots__ = ("current", "jobs", "owner", "unfinished")

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self.owner: _Lending | None = None
        self.unfinished = 0  # jobs put and not finished yet (under _LANES_LOCK)
        self.current: _Job | None = None  # the job it waits on (for _end_abandoned_waits)
        threading.Thread(target=_serve, args=(self,), daemon=True, name="pipetrain-sends").start()


class _Lending:
    """A Waiter's helper thread: the lane it holds while it has jobs pending, else a free one
    (or a new one) for its next job."""

    __slots__ = ("finished", "lane")

    def __init__(self, finished: deque[_Job]) -> None:
        self.finished = finished
        self.lane: _Lane | None = None

    def put(self, job: _Job) -> None:
        job.finished = self.finished
        with _LANES_LOCK:
            lane = self.lane
            if lane is None or lane.owner is not self:  # none yet, or it finished our jobs and was freed
                lane = next((x for x in _LANES if x.owner is None), None)
                if lane is None:
                    lane = _Lane()
                    _LANES.append(lane)
                lane.owner, self.lane = self, lane
            lane.unfinished += 1
        lane.jobs.put(job)


def _serve(lane: _Lane) -> None:
    jobs = lane.jobs
    while True:
        _run(lane, jobs.get())  # no local outlives a job: an idle lane holds no operation


def _run(lane: _Lane, job: _Job) -> None:
    lane.current = job
    _wait_job(job)
    lane.current = None
    if job.finished is not None and job.limit is None:
        job.finished.append(job)
    job.finished = None
    with _LANES_LOCK:  # freed before `done`: the Waiter's next job may take this lane again
        lane.unfinished -= 1
        if lane.unfinished == 0:
            lane.owner = None
    job.done.set()


def _wait_job(job: _Job) -> None:
    """Wait for ``job``'s operations, then drop them and its buffers (a gloo operation holds its tensors)."""
    limit = job.limit
    try:
        for work in job.works:
            if limit is None:
                work.wait()
            else:
                work.wait(limit)
    except BaseException as err:  # reported by the thread that waits on job.done
        job.error = err
    job.keep = None
    job.works = []


def _end_abandoned_waits(bound: float = 2.0) -> None:
    """At exit, before the interpreter finalizes: end the waits lanes were left in by a failure.

    A lane still busy then waits on a peer of a failed step (a send it never received, say). That
    wait ends when the peer's process exits and closes the connection, most likely while this
    interpreter finalizes, and the lane would abort the process there (see above): a rank whose
    step failed while it waited for its sends exited with SIGABRT instead of its own code in 8 of
    8 runs (tests/runtime/test_helper_threads.py). A gloo wait that expires closes its connection
    and wakes every wait on it, so each abandoned operation is waited for a millisecond here (its
    group failed: nothing runs on it again), and the lanes, free again, for up to ``bound``
    seconds. Joint works (NCCL batches) are left alone: an expired NCCL wait may end the process.
    """
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        with _LANES_LOCK:
            busy = [lane for lane in _LANES if lane.owner is not None]
        if not busy:
            return
        for lane in busy:
            job = lane.current
            for work in list(job.works) if job is not None else []:
                if not hasattr(work, "works"):
                    try:
                        work.wait(timedelta(milliseconds=1))
                    except Exception:  # the expected expiry (or the connection already closed)
                        pass
        time.sleep(0.01)


atexit.register(_end_abandoned_waits)


class Waiter:
    """Waits on ``torch.distributed`` work without ever blocking past a failure elsewhere.

    Receives are waited on directly (no thread hand-over on the critical path) with the timeout as
    the bound: a failing rank wakes the ranks waiting for its messages by sending them failure
    notices (:meth:`DistTransport.poison`), a crashed one closes its connections. The sends of a
    step are waited on together at its end by a helper thread while the caller polls the failure
    channel, because a send to a rank that stopped before posting its receive never completes.

    ``watch``: receives too are waited on by the helper thread while the caller polls the failure
    channel. The driver sets it for the first step of a schedule, the one the ranks agree on
    (:func:`~pipetrain.runtime.failures.agree`): a neighbour that fails while agreeing (it heard
    of a failure elsewhere, found the schedules differ, or timed out) has posted nothing, so it
    sends no failure notice, yet this rank may already be past the agreement (the neighbour's key
    was there) and waiting for its messages. Only the round's story then tells this rank.
    """

    def __init__(self, failure: FailureChannel | None, timeout: float, poll: float, where: Callable[[], str]) -> None:
        self.failure = failure
        self.timeout = timeout
        self.poll = poll
        self.where = where
        self._limit = timedelta(seconds=timeout)
        self._finished: deque[_Job] = deque()
        self._bg = _Lending(self._finished)  # the helper thread: a shared lane, lent while in use
        # Sends posted this step (None once confirmed), and where each message's is.
        self._outstanding: list[tuple[list[Any], str, Any, Callable[[], None] | None] | None] = []
        self._pending: dict[Any, int] = {}
        self._device: list[Any] = []  # sends of device data, completed on the stream at drain()
        self.watch = False  # receives waited on by the helper thread, watching the failure channel

    def wait(self, works: list[Any], what: Any) -> None:
        """Wait for ``works``; ``what`` (a string, or a handle or item :func:`_describe` names) is for errors."""
        if self.watch and self.failure is not None:
            self._wait_watching(works, what)
            return
        limit = self._limit
        start = time.monotonic()
        for work in works:
            try:
                work.wait(limit)
            except Exception as err:
                raise self._wait_failed(err, what, start) from err

    def _wait_watching(self, works: list[Any], what: Any) -> None:
        """:meth:`wait` on the helper thread (same bound, same errors), polling the failure channel
        meanwhile: raises as soon as a rank left its story."""
        assert self.failure is not None
        start = time.monotonic()
        job = _Job(works, "", limit=self._limit)
        self._bg.put(job)
        while not job.done.wait(self.poll):
            story = self.failure.check()
            if story is not None:
                # The thread stays on the receive (kept alive with the transport's) until its bound.
                raise RemoteFailureError(f"{self.where()}: stopped while waiting for {_describe(what)} because {story}")
        if job.error is not None:
            raise self._wait_failed(job.error, what, start) from job.error

    def _wait_failed(self, err: BaseException, what: Any, start: float) -> PipelineError:
        """The error for a wait on ``what`` that raised ``err``: the failure that caused it, or the timeout."""
        handle_peer = what.peer if isinstance(what, RecvHandle) else None
        what = _describe(what)
        story = None if self.failure is None else self.failure.check()
        if story is not None:
            return RemoteFailureError(f"{self.where()}: waiting for {what} failed because {story}")
        waited = time.monotonic() - start
        if waited >= self.timeout:
            peer = f"rank {handle_peer}" if handle_peer is not None else "the sender"
            how = (
                f"timed out after {self.timeout:g} s (no rank reported a failure: {peer}, or a rank it "
                "waits for, may be stalled)"
            )
        else:
            how = f"failed after {waited:.2g} s (no rank reported a failure)"
        return PipelineError(f"{self.where()}: waiting for {what} {how}: {err}")

    def wait_stream(self, works: list[Any], what: Any) -> None:
        """Make the current stream wait for ``works`` (NCCL: no host wait; gloo: a plain wait).

        No timeout: with one, NCCL's ``wait`` blocks the host. A dead peer is found by the
        control plane's host waits (which have the timeout) and by NCCL's own watchdog.
        """
        for work in works:
            try:
                work.wait()
            except Exception as err:
                story = None if self.failure is None else self.failure.check()
                if story is not None:
                    raise RemoteFailureError(
                        f"{self.where()}: waiting for {_describe(what)} failed because {story}"
                    ) from err
                raise PipelineError(f"{self.where()}: waiting for {_describe(what)} failed: {err}") from err

    def background(
        self,
        works: list[Any],
        keep: Any,
        on_done: Callable[[], None] | None,
        what: Any,
        device_works: list[Any] | None = None,
        key: Any = None,
    ) -> None:
        """Remember a posted send; :meth:`drain` waits for those not confirmed at the end of the step.

        ``what`` names it in errors: a string, or ``(what, peer)`` of a send (named only when needed).
        ``device_works`` complete on the stream (:meth:`wait_stream`); ``keep`` (the sent buffers)
        is held until then, so their memory is not reused before the send read it. ``key``: the
        message's, for :meth:`confirm`.
        """
        if device_works:
            self._device.extend(device_works)
            keep = _OnDevice(keep, device_works)
        if key is not None:
            self._pending[key] = len(self._outstanding)
        self._outstanding.append((works, what, keep, on_done))

    def confirm(self, keys: list[Any]) -> None:
        """Wait for the sends of ``keys``, known to be delivered (their receiver answered after
        posting the receives: :mod:`pipetrain.plan.delivery`), so the wait is immediate; drop
        their buffers now instead of at the step's end. Sends of device data are left to
        :meth:`release_sent` and the stream (a host wait would block on the device)."""
        out = self._outstanding
        for key in keys:
            index = self._pending.pop(key, None)
            if index is None:
                continue
            job = out[index]
            if job is None or isinstance(job[2], _OnDevice):
                continue
            works, what, _, on_done = job
            out[index] = None
            self.wait(works, what)
            if on_done is not None:
                on_done()

    def release_sent(self) -> None:
        """Drop the buffers of sends whose device operations completed (a non-blocking check)."""
        for job in self._outstanding:
            keep = None if job is None else job[2]
            if isinstance(keep, _OnDevice) and keep.keep is not None and all(_completed(w) for w in keep.works):
                keep.keep = None

    def run_callbacks(self) -> None:
        while self._finished:
            job = self._finished.popleft()
            if job.error is not None:
                raise PipelineError(f"{self.where()}: sending {job.what} failed: {job.error}") from job.error
            if job.on_done is not None:
                job.on_done()

    def drain(self) -> None:
        """Wait for every remembered send: one hand-over to the helper thread per step (device
        data first, on the stream; the buffers are dropped only after both)."""
        if self._device:
            device, self._device = self._device, []
            self.wait_stream(device, "sends of the step")
        self._pending.clear()
        jobs = [job for job in self._outstanding if job is not None]
        self._outstanding.clear()
        if jobs:
            works = [w for job in jobs for w in job[0]]
            what = ", ".join(_describe(job[1]) for job in jobs[:3])
            what += f" and {len(jobs) - 3} more" if len(jobs) > 3 else ""
            batch = _Job(works, f"sends {what}", [job[2] for job in jobs])
            self._bg.put(batch)
            self._block(batch)
            for job_works, job_what, _, on_done in jobs:
                if on_done is not None:
                    self._finished.append(_Job(job_works, _describe(job_what), None, on_done))
        self.run_callbacks()

    def _block(self, job: _Job) -> None:
        deadline = time.monotonic() + self.timeout
        while not job.done.wait(self.poll):
            story = None if self.failure is None else self.failure.check()
            if story is not None:
                raise RemoteFailureError(f"{self.where()}: stopped while waiting for {job.what} because {story}")
            if time.monotonic() > deadline:
                raise PipelineError(
                    f"{self.where()}: timed out after {self.timeout:g} s waiting for {job.what} (no rank reported a failure)"
                )
        if job.error is not None:
            story = None if self.failure is None else self.failure.check()
            because = f" because {story}" if story else ""
            kind = RemoteFailureError if story else PipelineError
            raise kind(f"{self.where()}: waiting for {job.what} failed{because}: {job.error}") from job.error

    def close(self) -> None:
        """Give up the sends not yet waited for (after a failure). The helper lane frees itself
        once its jobs ended: one left waiting on a dead peer stays parked until that wait ends.

        Sends not yet waited for are kept alive for the life of the process: gloo keeps a posted
        send's buffer only weakly, and once it is gone a receive the peer posts later leaves the
        connection stuck on it, its I/O thread spinning (measured: 80 % of a core).
        """
        _NOTICES.extend(job for job in self._outstanding if job is not None)
        _NOTICES.extend(self._device)
        self._outstanding.clear()
        self._pending.clear()
        self._device = []
