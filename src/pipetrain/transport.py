"""Moving stage inputs, outputs and gradients between ranks.

A message is any pytree of tensors and plain values (a tensor, a tuple, a dict, a list of
gradients with ``None`` holes). Shapes, dtypes, ``requires_grad`` and structure travel with it,
so shapes may change between steps and between microbatches:

* A message is one flat byte buffer: a small int64 header, then the tensors. Both sides remember
  the layout of the last message under the same key (source stage, direction, microbatch), so in
  the steady state the receiver posts a receive of the right size at its RECV action, before the
  data is needed, and one operation carries the whole transfer.
* When the layout changed (or on the first step) the header says so; the sender fills the
  receive posted early with that notice, then sends the new layout as a byte string and the
  packed tensors on a second tag. The receiver resolves messages from one peer in posting order,
  so both tags stay matched first in, first out (gloo matches by tag).

``DistTransport`` uses ``torch.distributed`` point-to-point operations; receives are waited on
only right before use and sends complete in the background (see :class:`Waiter`).
``LocalTransport`` hands objects over in memory for :class:`pipetrain.local.LocalPipeline`.
"""

from __future__ import annotations

import ctypes
import pickle
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten, treespec_dumps, treespec_loads

from pipetrain.errors import PipelineError

__all__ = [
    "DistTransport",
    "FailureChannel",
    "Layout",
    "LocalTransport",
    "RecvHandle",
    "RemoteFailureError",
    "Waiter",
    "layout_of",
]

Key = Hashable
_HEADER = 4  # [flag, layout bytes, 0, 0]
_SAME, _NEW, _FAIL = 0, 1, 2
_TAG_STEADY, _TAG_NEW = 0, 1


@dataclass(frozen=True)
class Layout:
    """What a receiver must know to rebuild a message: structure, plain values, tensor specs."""

    spec: Any
    plain: tuple[Any, ...]  # non-tensor leaves, in order; a tensor leaf is marked by _TENSOR
    tensors: tuple[tuple[torch.dtype, tuple[int, ...], bool], ...]

    def encode(self) -> torch.Tensor:
        try:
            spec: Any = treespec_dumps(self.spec)
        except Exception:  # a container type pytree cannot name: send the spec object itself
            spec = self.spec
        data = pickle.dumps((spec, self.plain, self.tensors), protocol=pickle.HIGHEST_PROTOCOL)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    @staticmethod
    def decode(buf: torch.Tensor) -> Layout:
        spec, plain, tensors = pickle.loads(bytes(buf.tolist()))
        return Layout(treespec_loads(spec) if isinstance(spec, str) else spec, plain, tensors)


class _TensorMark:
    """Placeholder for a tensor leaf in ``Layout.plain``."""

    def __repr__(self) -> str:
        return "<tensor>"

    def __reduce__(self) -> str:
        return "_TENSOR"


_TENSOR = _TensorMark()


def layout_of(obj: Any) -> tuple[Layout, list[torch.Tensor]]:
    """Split ``obj`` into its layout and its tensors (flatten order)."""
    leaves, spec = tree_flatten(obj)
    tensors: list[torch.Tensor] = []
    plain: list[Any] = []
    specs: list[tuple[torch.dtype, tuple[int, ...], bool]] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
            plain.append(_TENSOR)
            specs.append((leaf.dtype, tuple(leaf.shape), bool(leaf.requires_grad)))
        else:
            plain.append(leaf)
    return Layout(spec, tuple(plain), tuple(specs)), tensors


def _same(a: Layout, b: Layout) -> bool:
    """Whether a receiver expecting layout ``a`` can take a message of layout ``b`` as is."""
    if a.tensors != b.tensors or a.spec != b.spec or len(a.plain) != len(b.plain):
        return False
    try:
        return all(x is y or bool(x == y) for x, y in zip(a.plain, b.plain, strict=True))
    except Exception:  # values without a plain truth value (arrays, ...): resend the layout
        return False


def rebuild(layout: Layout, tensors: list[torch.Tensor]) -> Any:
    """Inverse of :func:`layout_of`; received tensors that needed grad become leaves needing grad."""
    it = iter(tensors)
    leaves: list[Any] = []
    for value in layout.plain:
        if value is _TENSOR:
            leaves.append(next(it))
        else:
            leaves.append(value)
    for t, (_, _, rg) in zip(tensors, layout.tensors, strict=True):
        if rg and t.is_floating_point():
            t.requires_grad_(True)
    return tree_unflatten(leaves, layout.spec)


_ALIGN = 16
_Op = tuple[bool, torch.Tensor, int, int]  # (is a send, tensor, group peer, tag)
_NOTICES: list[Any] = []  # failure notices in flight: kept alive for the life of the process


def _slots(layout: Layout | None) -> tuple[list[tuple[int, int]], int]:
    """Byte offset and size of each tensor in a packed message, and the message size."""
    offset = _HEADER * 8
    slots: list[tuple[int, int]] = []
    if layout is not None:
        for dtype, shape, _ in layout.tensors:
            numel = 1
            for d in shape:
                numel *= d
            nbytes = numel * _itemsize(dtype)
            slots.append((offset, nbytes))
            offset += -(-nbytes // _ALIGN) * _ALIGN
    return slots, offset


_ITEMSIZE: dict[torch.dtype, int] = {}


def _itemsize(dtype: torch.dtype) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        size = _ITEMSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return size


def _pack(
    flag: int, extra: int, layout: Layout | None, tensors: list[torch.Tensor], device: torch.device
) -> torch.Tensor:
    """One flat byte buffer: the int64 header, then each tensor at an aligned offset."""
    slots, total = _slots(layout)
    if device.type == "cpu" and len(tensors) == 1 and slots[0][1] and extra == 0:
        # The common case, in one copy: header bytes and the tensor's bytes side by side.
        t = tensors[0]
        body = t.reshape(-1).view(torch.uint8)
        pad = total - _HEADER * 8 - body.numel()
        parts = [_header_bytes(flag), body] + ([torch.zeros(pad, dtype=torch.uint8)] if pad else [])
        return torch.cat(parts)
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    header = flat[: _HEADER * 8].view(torch.int64)
    header.zero_()
    header[0] = flag
    header[1] = extra
    for t, (offset, nbytes) in zip(tensors, slots, strict=False):
        if nbytes:
            flat[offset : offset + nbytes].view(t.dtype).view(t.shape).copy_(t)
    return flat


_HEADERS: dict[int, torch.Tensor] = {}


def _header_bytes(flag: int) -> torch.Tensor:
    header = _HEADERS.get(flag)
    if header is None:
        words = torch.zeros(_HEADER, dtype=torch.int64)
        words[0] = flag
        header = _HEADERS[flag] = words.view(torch.uint8)
    return header


def _unpack(flat: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """Views of the tensors in a packed message (no copy)."""
    slots, _ = _slots(layout)
    return [
        flat[offset : offset + nbytes].view(dtype).view(shape)
        if nbytes
        else torch.empty(shape, dtype=dtype, device=flat.device)
        for (dtype, shape, _), (offset, nbytes) in zip(layout.tensors, slots, strict=True)
    ]


@dataclass
class RecvHandle:
    """A posted receive; ``DistTransport.wait`` turns it into the received object."""

    key: Key
    peer: int
    what: str
    flat: torch.Tensor | None = None
    works: list[Any] = field(default_factory=list)
    cached: Layout | None = None
    resolved: bool = False
    value: Any = None


@dataclass
class SendItem:
    """One outgoing message, for :meth:`DistTransport.post`."""

    key: Key
    peer: int
    obj: Any
    what: str
    on_done: Callable[[], None] | None = None


@dataclass
class RecvItem:
    key: Key
    peer: int
    what: str


class DistTransport:
    """Point-to-point messages between the ranks of ``group`` (group ranks throughout).

    A message is one flat byte buffer (header and tensors packed together): one operation per
    transfer, whatever the number of tensors. Packing copies the sent tensors, so a sent output
    may be freed as soon as it is posted.
    """

    def __init__(self, group: Any, device: torch.device, failure: FailureChannel | None, waiter: Waiter) -> None:
        self.group = group
        self.device = device
        self.failure = failure
        self.waiter = waiter
        self._sent: dict[Key, Layout] = {}
        self._received: dict[Key, Layout] = {}
        self._unresolved: dict[int, deque[RecvHandle]] = {}
        group_obj = group if group is not None else dist.group.WORLD
        # gloo runs each operation on its own; posting directly skips per-call Python overhead.
        self._pg: Any = group_obj if dist.get_backend(group_obj) == "gloo" else None

    def _op(self, fn: Callable[..., Any], tensor: torch.Tensor, peer: int, tag: int) -> _Op:
        return (fn is dist.isend, tensor, peer, tag)

    def _launch(self, ops: list[_Op]) -> list[Any]:
        """Post operations: straight on a gloo group (no Python wrappers), else as one batch."""
        if not ops:
            return []
        if self._pg is not None:
            pg = self._pg
            return [pg.send([t], peer, tag) if is_send else pg.recv([t], peer, tag) for is_send, t, peer, tag in ops]
        return dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend if is_send else dist.irecv, t, group=self.group, tag=tag, group_peer=peer)
                for is_send, t, peer, tag in ops
            ]
        )

    def post(self, items: list[SendItem | RecvItem]) -> list[RecvHandle]:
        """Post the sends and receives of one run of consecutive SEND/RECV actions as one batch."""
        ops: list[_Op] = []
        handles: list[RecvHandle] = []
        sends: list[tuple[int, int, SendItem, list[torch.Tensor]]] = []
        for item in items:
            if isinstance(item, SendItem):
                start = len(ops)
                keep = self._send_ops(item, ops)
                sends.append((start, len(ops), item, keep))
            else:
                handles.append(self._recv_ops(item, ops))
        works = self._launch(ops)
        for handle in handles:
            handle.works = [works[i] for i in handle.works]
        for start, end, item, keep in sends:
            self.waiter.background(works[start:end], keep, None, f"{item.what} to rank {item.peer}")
            if item.on_done is not None:
                item.on_done()  # the data was copied into the message
        return handles

    def _send_ops(self, item: SendItem, ops: list[_Op]) -> list[torch.Tensor]:
        layout, tensors = layout_of(item.obj)
        tensors = [t.detach() for t in tensors]
        old = self._sent.get(item.key)
        if old is not None and _same(old, layout):
            flat = _pack(_SAME, 0, layout, tensors, self.device)
            ops.append(self._op(dist.isend, flat, item.peer, _TAG_STEADY))
            return [flat]
        # The receiver posted a message of the remembered size: fill it, then send the new layout.
        encoded = layout.encode().to(self.device)
        notice = _pack(_NEW, encoded.numel(), old, [], self.device)
        payload = _pack(_NEW, 0, layout, tensors, self.device)
        ops.append(self._op(dist.isend, notice, item.peer, _TAG_STEADY))
        ops.append(self._op(dist.isend, encoded, item.peer, _TAG_NEW))
        ops.append(self._op(dist.isend, payload, item.peer, _TAG_NEW))
        self._sent[item.key] = layout
        return [notice, encoded, payload]

    def _recv_ops(self, item: RecvItem, ops: list[_Op]) -> RecvHandle:
        cached = self._received.get(item.key)
        flat = torch.empty(_slots(cached)[1], dtype=torch.uint8, device=self.device)
        handle = RecvHandle(item.key, item.peer, item.what, flat=flat, cached=cached)
        handle.works = [len(ops)]  # replaced by the Work objects once posted
        ops.append(self._op(dist.irecv, flat, item.peer, _TAG_STEADY))
        self._unresolved.setdefault(item.peer, deque()).append(handle)
        return handle

    def wait(self, handle: RecvHandle) -> Any:
        """The received object; blocks (watching for failures elsewhere) until it has arrived."""
        queue = self._unresolved.get(handle.peer)
        if not handle.resolved and handle.cached is not None:
            # Steady state: the message was posted early; wait for it alone.
            self._wait_early(handle)
            if self._flag(handle) == _SAME and queue is not None:
                queue.remove(handle)
                self._resolve(handle)
        # A new layout travels on the second tag, which both sides use in posting order.
        while not handle.resolved and queue:
            self._resolve(queue.popleft())
        value = handle.value
        handle.value = None
        return value

    @staticmethod
    def _flag(handle: RecvHandle) -> int:
        flat = handle.flat
        assert flat is not None
        if flat.device.type == "cpu":  # the flag is the low byte of the first header word
            return int(ctypes.c_uint8.from_address(flat.data_ptr()).value)
        return int(flat[0])

    def _wait_early(self, handle: RecvHandle) -> None:
        what = f"{handle.what} from rank {handle.peer}"
        self.waiter.wait(handle.works, what)
        handle.works = []
        if self._flag(handle) == _FAIL:
            failure = self.failure
            story = None if failure is None else failure.check()
            because = story or f"rank {handle.peer} failed (see its error)"
            raise RemoteFailureError(f"{self.waiter.where()}: stopped while waiting for {what} because {because}")

    def poison(self, sends: Sequence[tuple[Key, int]]) -> None:
        """Wake the peers waiting for our messages ``(key, peer)`` with failure notices; never waits.

        Each notice has the size the receiver posted for that key (both sides remember the same
        layouts), so it completes the receive the peer is blocked in.
        """
        ops: list[_Op] = []
        for key, peer in sends:
            notice = _pack(_FAIL, 0, self._sent.get(key), [], self.device)
            ops.append(self._op(dist.isend, notice, peer, _TAG_STEADY))
        if ops:
            try:
                _NOTICES.extend(self._launch(ops))
            except Exception:  # the connection may already be gone; the peers then see it closed
                pass

    def _resolve(self, handle: RecvHandle) -> None:
        self._wait_early(handle)
        flat = handle.flat
        assert flat is not None
        header = flat[: _HEADER * 8].view(torch.int64)
        if int(header[0]) == _SAME and handle.cached is not None:
            layout = handle.cached
        else:
            what = f"{handle.what} from rank {handle.peer}"
            encoded = torch.empty(int(header[1]), dtype=torch.uint8, device=self.device)
            self.waiter.wait(self._launch([self._op(dist.irecv, encoded, handle.peer, _TAG_NEW)]), what)
            layout = Layout.decode(encoded)
            flat = torch.empty(_slots(layout)[1], dtype=torch.uint8, device=self.device)
            self.waiter.wait(self._launch([self._op(dist.irecv, flat, handle.peer, _TAG_NEW)]), what)
            self._received[handle.key] = layout
        handle.value = rebuild(layout, _unpack(flat, layout))
        handle.resolved = True
        handle.flat = None

    def finish(self) -> None:
        """Block until every send of the step has completed (watching for failures)."""
        self.waiter.drain()

    def reset(self) -> None:
        """Forget layouts and pending receives (after a failure both sides start afresh)."""
        self._sent.clear()
        self._received.clear()
        self._unresolved.clear()


class LocalTransport:
    """In-process mailboxes for :class:`~pipetrain.local.LocalPipeline`: first in, first out per pair."""

    def __init__(self) -> None:
        self._boxes: dict[tuple[int, int], deque[Any]] = {}
        self._posted: dict[tuple[int, int], deque[RecvHandle]] = {}

    def send(self, src: int, dst: int, obj: Any) -> None:
        layout, tensors = layout_of(obj)
        tensors = [t.detach() for t in tensors]
        box = self._boxes.setdefault((src, dst), deque())
        box.append((layout, tensors))
        self._match(src, dst)

    def recv(self, src: int, dst: int, key: Key, what: str) -> RecvHandle:
        handle = RecvHandle(key, src, what)
        self._posted.setdefault((src, dst), deque()).append(handle)
        self._match(src, dst)
        return handle

    def _match(self, src: int, dst: int) -> None:
        box = self._boxes.get((src, dst))
        posted = self._posted.get((src, dst))
        while box and posted:
            layout, tensors = box.popleft()
            handle = posted.popleft()
            handle.value = rebuild(layout, tensors)
            handle.resolved = True

    @staticmethod
    def ready(handle: RecvHandle) -> bool:
        return handle.resolved

    def pending(self) -> int:
        return sum(len(b) for b in self._boxes.values()) + sum(len(p) for p in self._posted.values())


class RemoteFailureError(PipelineError):
    """This rank stopped because another rank failed (the message tells which, where and why)."""


class FailureChannel:
    """A side channel (a ``torch.distributed`` Store) where the first failing rank leaves its story.

    Ranks waiting for data poll it, so a failure anywhere turns into an error everywhere instead
    of a hang. Keys are namespaced per process group, so a fresh group starts clean.
    """

    def __init__(self, store: Any, namespace: str, rank: int) -> None:
        self.store = store
        self.rank = rank
        self._count = f"pipetrain/{namespace}/failures"
        self._message = f"pipetrain/{namespace}/failure"

    def report(self, message: str) -> None:
        """Record ``message`` unless another rank already reported a failure."""
        try:
            if self.store.add(self._count, 1) == 1:
                self.store.set(self._message, message)
        except Exception:  # the store may be gone when the job is torn down; the raise still happens
            pass

    def check(self) -> str | None:
        try:
            if self.store.check([self._message]):
                return bytes(self.store.get(self._message)).decode()
        except Exception:
            return None
        return None


class _Job:
    __slots__ = ("done", "error", "keep", "on_done", "what", "works")

    def __init__(
        self, works: list[Any], what: str, keep: Any = None, on_done: Callable[[], None] | None = None
    ) -> None:
        self.works = works
        self.what = what
        self.keep = keep
        self.on_done = on_done
        self.done = threading.Event()
        self.error: BaseException | None = None


def _serve(jobs: queue.SimpleQueue[_Job | None], finished: deque[_Job] | None) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        try:
            for work in job.works:
                work.wait()
        except BaseException as err:  # reported by the thread that waits on job.done
            job.error = err
        job.keep = None
        if finished is not None:
            finished.append(job)
        job.done.set()


class Waiter:
    """Waits on ``torch.distributed`` work without ever blocking past a failure elsewhere.

    Receives are waited on directly (no thread hand-over on the critical path) with the timeout as
    the bound: a failing rank wakes the ranks waiting for its messages by sending them failure
    notices (:meth:`DistTransport.poison`), a crashed one closes its connections. The sends of a
    step are waited on together at its end by a helper thread while the caller polls the failure
    channel, because a send to a rank that stopped before posting its receive never completes.
    """

    def __init__(self, failure: FailureChannel | None, timeout: float, poll: float, where: Callable[[], str]) -> None:
        self.failure = failure
        self.timeout = timeout
        self.poll = poll
        self.where = where
        self._bg: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._finished: deque[_Job] = deque()
        self._outstanding: deque[_Job] = deque()
        threading.Thread(target=_serve, args=(self._bg, self._finished), daemon=True, name="pipetrain-sends").start()

    def wait(self, works: list[Any], what: str) -> None:
        limit = timedelta(seconds=self.timeout)
        for work in works:
            try:
                work.wait(limit)
            except Exception as err:
                story = None if self.failure is None else self.failure.check()
                if story is not None:
                    raise RemoteFailureError(f"{self.where()}: waiting for {what} failed because {story}") from err
                raise PipelineError(
                    f"{self.where()}: waiting for {what} failed (timeout {self.timeout:g} s; no rank reported a failure): {err}"
                ) from err

    def background(self, works: list[Any], keep: Any, on_done: Callable[[], None] | None, what: str) -> None:
        """Remember a posted send; :meth:`drain` waits for all of them at the end of the step."""
        self._outstanding.append(_Job(works, what, keep, on_done))

    def run_callbacks(self) -> None:
        while self._finished:
            job = self._finished.popleft()
            if job.error is not None:
                raise PipelineError(f"{self.where()}: sending {job.what} failed: {job.error}") from job.error
            if job.on_done is not None:
                job.on_done()

    def drain(self) -> None:
        """Wait for every remembered send: one hand-over to the helper thread per step."""
        if self._outstanding:
            jobs = list(self._outstanding)
            self._outstanding.clear()
            works = [w for job in jobs for w in job.works]
            what = ", ".join(job.what for job in jobs[:3]) + (f" and {len(jobs) - 3} more" if len(jobs) > 3 else "")
            batch = _Job(works, f"sends {what}", [job.keep for job in jobs])
            self._bg.put(batch)
            self._block(batch)
            for job in jobs:
                if job.on_done is not None:
                    self._finished.append(job)
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
        """Stop the helper threads once they are free (a thread stuck on a dead peer stays parked)."""
        self._bg.put(None)
