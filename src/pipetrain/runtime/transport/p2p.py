"""Moving stage inputs, outputs and gradients between ranks.

A message is any pytree of tensors and plain values (a tensor, a tuple, a dict, a list of
gradients with ``None`` holes). Shapes, dtypes, ``requires_grad`` and structure travel with it,
so shapes may change between steps and between microbatches:

* A message is one flat byte buffer: a small int64 header, then the tensors. Both sides remember
  the layout of the last message under the same key (source stage, direction, microbatch), so in
  the steady state the receiver posts a receive of the right size at its RECV action, before the
  data is needed, and one operation carries the whole transfer.
* When the layout changed (or on the first step) the sender fills the receive posted early with
  a *notice* giving the sizes of two follow-ups, the new layout (a byte string) and the packed
  tensors, and sends those right behind it. The receiver posts the follow-ups once it has read the
  notice, so per pair of ranks both sides post the same operations in the same order.

Matching. NCCL ignores tags: it pairs the operations between two ranks strictly in posting order.
In *single-tag* mode (always for backends other than gloo; ``PIPETRAIN_SINGLE_TAG=1`` forces it on
gloo for the tests) every operation uses tag 0 and a receive is never posted behind another
receive from the same peer whose follow-ups may still be due: a batch is cut before a second
receive from one peer, and right after each part is posted its headers are read and the
follow-ups of new layouts posted, before anything else. Sends of a batch go first with its first
part. The price: a message is waited for at its RECV rather than right before its use. On gloo by
default the follow-ups use tag 1 instead, so headers are read lazily, right before the data is
needed, in posting order per peer (gloo matches per tag, first in, first out).

Why reading the headers right after posting cannot deadlock, for schedules made by
``Schedule.lower()`` (see ``plan/passes/communication.py``): run the compute in unit time. A
message produced by an action ending at time T is sent right after that action and received in
the consumer rank's gap holding T, i.e. after its compute that started before T and before its
compute starting at T or later. So the receives of a gap, whose headers are read there, carry
messages no later than the start S of the rank's next compute, and reading them delays only that
compute and what follows it, which ends after S: no message of time <= S depends on it. By
induction on T every message of time T is posted by its sender (its producer waited only for
messages of earlier times) and arrives. Under NCCL's stricter stream model (docs/semantics.md) the
same holds: the sends of a gap were produced at the start of the gap's times, so the peer's
receives of them are in groups at or before the peer's groups holding the messages the gap
receives, and the follow-ups, posted next on the receiver's stream, are the only thing a sender's
group waits for beyond the notice.

``DistTransport`` uses ``torch.distributed`` point-to-point operations (on a gloo group posted
directly, elsewhere as ``batch_isend_irecv`` batches of buffers on the stage's device); sends
complete in the background (see :class:`Waiter`). A message that is one tensor or a list or
tuple of tensors skips pytree on both sides; one tensor travels in a buffer of its own dtype (the
header is a whole number of elements), so the receiver reads it back as a single view.
``LocalTransport`` hands objects over in memory for :class:`pipetrain.local.LocalPipeline`.
"""

from __future__ import annotations

import ctypes
import os
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
_HEADER = 8  # int64 words: [flag, layout bytes, payload bytes, 0...]; 64 bytes keep tensors aligned
_SAME, _NEW, _FAIL = 0, 1, 2
_TAG_STEADY, _TAG_NEW = 0, 1


@dataclass(frozen=True)
class Layout:
    """What a receiver must know to rebuild a message: structure, plain values, tensor specs."""

    spec: Any
    plain: tuple[Any, ...]  # non-tensor leaves, in order; a tensor leaf is marked by _TENSOR
    tensors: tuple[tuple[torch.dtype, tuple[int, ...], bool], ...]
    # The container when the message is one tensor (Tensor), or a plain list or tuple of tensors
    # (list, tuple): these skip pytree on both sides. None for anything else.
    simple: type | None = field(default=None, init=False, compare=False, repr=False)
    slots: tuple[list[tuple[int, int]], int] | None = field(default=None, init=False, compare=False, repr=False)
    # A one-tensor message (the tensor alone, or the only element of a flat list or tuple, as input
    # gradients are) travels in a buffer of the tensor's own dtype (the header is 64 bytes, a whole
    # number of elements): then the tensor is one strided view of it. ``(dtype, buffer elements,
    # shape, strides, element offset)``; None for other messages.
    single: tuple[torch.dtype, int, tuple[int, ...], tuple[int, ...], int] | None = field(
        default=None, init=False, compare=False, repr=False
    )
    # Structure and plain values as bytes, taken when first asked (see _same); b"" if unpicklable.
    fingerprint: bytes | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.plain) == len(self.tensors) and all(p is _TENSOR for p in self.plain):
            kind = self.spec.type if not self.spec.is_leaf() else torch.Tensor
            n = len(self.tensors)
            # A flat list or tuple: every child a leaf (a nested container would add nodes).
            if kind is torch.Tensor or (
                kind in (list, tuple) and self.spec.num_children == n == self.spec.num_nodes - 1
            ):
                object.__setattr__(self, "simple", kind)
            if n == 1 and self.simple is not None:  # one tensor, alone or in a list/tuple (input grads)
                dtype, shape, _ = self.tensors[0]
                size = _itemsize(dtype)
                if (_HEADER * 8) % size == 0:
                    strides, step = [], 1
                    for d in reversed(shape):
                        strides.append(step)
                        step *= max(d, 1)
                    total = _compute_slots(self)[1]
                    single = (dtype, total // size, tuple(shape), tuple(reversed(strides)), _HEADER * 8 // size)
                    object.__setattr__(self, "single", single)

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


def _signature(obj: Any) -> tuple[type, tuple[tuple[torch.dtype, torch.Size, bool], ...]] | None:
    """What a one-tensor or list/tuple-of-tensors message looks like, without pytree; else None."""
    if isinstance(obj, torch.Tensor):
        return torch.Tensor, ((obj.dtype, obj.shape, obj.requires_grad),)
    kind = type(obj)
    if kind is list or kind is tuple:
        sig = []
        for t in obj:
            if not isinstance(t, torch.Tensor):
                return None
            sig.append((t.dtype, t.shape, t.requires_grad))
        return kind, tuple(sig)
    return None


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


def _fingerprint(layout: Layout) -> bytes:
    """``layout``'s structure and plain values as bytes, computed once (b"" when unpicklable).

    Bytes rather than ``==``: a plain value the caller changed in place since it was sent (an
    array, a config object) must count as changed, and so must equal values of other types
    (``1``, ``1.0``, ``True``, also as dict keys), which the receiver would rebuild as the old ones.
    """
    cached = layout.fingerprint
    if cached is None:
        try:
            cached = pickle.dumps((layout.spec, layout.plain), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # sending it fails later, with the reason
            cached = b""
        object.__setattr__(layout, "fingerprint", cached)
    return cached


def _same(a: Layout, b: Layout) -> bool:
    """Whether a receiver expecting layout ``a`` (fingerprinted when sent) can take a message of layout ``b`` as is."""
    if a.tensors != b.tensors or len(a.plain) != len(b.plain):
        return False
    fa = _fingerprint(a)
    return bool(fa) and fa == _fingerprint(b)


def rebuild(layout: Layout, tensors: list[torch.Tensor]) -> Any:
    """Inverse of :func:`layout_of`; received tensors that needed grad become leaves needing grad."""
    for t, (_, _, rg) in zip(tensors, layout.tensors, strict=True):
        if rg and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_(True)
    simple = layout.simple
    if simple is torch.Tensor:
        return tensors[0]
    if simple is list:
        return tensors
    if simple is tuple:
        return tuple(tensors)
    it = iter(tensors)
    leaves: list[Any] = []
    for value in layout.plain:
        if value is _TENSOR:
            leaves.append(next(it))
        else:
            leaves.append(value)
    return tree_unflatten(leaves, layout.spec)


_ALIGN = 64  # tensors start on cache-line (and SIMD) boundaries, as the allocator gives
_Op = tuple[bool, torch.Tensor, int, int]  # (is a send, tensor, group peer, tag)
_NOTICES: list[Any] = []  # operations abandoned in flight after a failure: kept alive for the life of the process


_HEADER_ONLY: tuple[list[tuple[int, int]], int] = ([], _HEADER * 8)


def _slots(layout: Layout | None) -> tuple[list[tuple[int, int]], int]:
    """Byte offset and size of each tensor in a packed message, and the message size (cached)."""
    if layout is None:
        return _HEADER_ONLY
    cached = layout.slots
    if cached is None:
        cached = _compute_slots(layout)
        object.__setattr__(layout, "slots", cached)
    return cached


def _compute_slots(layout: Layout | None) -> tuple[list[tuple[int, int]], int]:
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
    flag: int, extra: int, extra2: int, layout: Layout | None, tensors: list[torch.Tensor], device: torch.device
) -> torch.Tensor:
    """One flat byte buffer: the int64 header, then each tensor at an aligned offset."""
    slots, total = _slots(layout)
    if device.type == "cpu" and len(tensors) == 1 and slots[0][1] and extra == 0:
        # The common case, in one copy: header and the tensor side by side.
        t = tensors[0]
        single = layout.single if layout is not None else None
        if single is not None and single[0] is t.dtype:
            pad = single[1] - single[4] - t.numel()
            head = _header_as(flag, t.dtype)
            return torch.cat((head, t.reshape(-1), _zeros(pad, t.dtype)) if pad else (head, t.reshape(-1)))
        body = t.reshape(-1).view(torch.uint8)
        pad = total - _HEADER * 8 - body.numel()
        parts = [_header_bytes(flag), body] + ([torch.zeros(pad, dtype=torch.uint8)] if pad else [])
        return torch.cat(parts)
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    header = flat[: _HEADER * 8].view(torch.int64)
    header.zero_()
    header[0] = flag
    header[1] = extra
    header[2] = extra2
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


_HEADERS_AS: dict[tuple[int, torch.dtype], torch.Tensor] = {}
_ZEROS: dict[tuple[int, torch.dtype], torch.Tensor] = {}


def _header_as(flag: int, dtype: torch.dtype) -> torch.Tensor:
    """The header bytes of ``flag`` seen as elements of ``dtype`` (cached, never written)."""
    header = _HEADERS_AS.get((flag, dtype))
    if header is None:
        header = _HEADERS_AS[(flag, dtype)] = _header_bytes(flag).view(dtype)
    return header


def _zeros(n: int, dtype: torch.dtype) -> torch.Tensor:
    pad = _ZEROS.get((n, dtype))
    if pad is None:
        pad = _ZEROS[(n, dtype)] = torch.zeros(n, dtype=dtype)
    return pad


def _recv_buffer(layout: Layout | None, device: torch.device) -> torch.Tensor:
    """The buffer a message of ``layout`` is received into: typed for one tensor, else bytes."""
    single = layout.single if layout is not None else None
    if single is not None:
        return torch.empty(single[1], dtype=single[0], device=device)
    return torch.empty(_slots(layout)[1], dtype=torch.uint8, device=device)


def _bytes(flat: torch.Tensor) -> torch.Tensor:
    return flat if flat.dtype is torch.uint8 else flat.view(torch.uint8)


def _unpack(flat: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """Views of the tensors in a packed message (no copy)."""
    single = layout.single
    if single is not None and flat.dtype is single[0]:
        return [flat.as_strided(single[2], single[3], single[4])]
    flat = _bytes(flat)
    slots, _ = _slots(layout)
    return [
        flat[offset : offset + nbytes].view(dtype).view(shape)
        if nbytes
        else torch.empty(shape, dtype=dtype, device=flat.device)
        for (dtype, shape, _), (offset, nbytes) in zip(layout.tensors, slots, strict=True)
    ]


@dataclass(slots=True)
class RecvHandle:
    """A posted receive; ``DistTransport.wait`` turns it into the received object.

    ``works`` are the operations still to wait for: the first message until its header was read
    (``settled``), then the follow-ups of a new layout (``encoded`` and ``flat``), if any.
    """

    key: Key
    peer: int
    what: str
    flat: torch.Tensor | None = None
    works: list[Any] = field(default_factory=list)
    cached: Layout | None = None
    resolved: bool = False
    value: Any = None
    settled: bool = False
    layout: Layout | None = None
    encoded: torch.Tensor | None = None


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


def _single_tag_default(backend: str) -> bool:
    """NCCL (any backend but gloo) matches by posting order only; tests force it on gloo."""
    return backend != "gloo" or os.environ.get("PIPETRAIN_SINGLE_TAG", "") not in ("", "0")


class DistTransport:
    """Point-to-point messages between the ranks of ``group`` (group ranks throughout).

    A message is one flat byte buffer (header and tensors packed together): one operation per
    transfer, whatever the number of tensors. Packing copies the sent tensors, so a sent output
    may be freed as soon as it is posted. ``single_tag`` selects the order-only protocol (see the
    module docstring); it is always on for backends other than gloo.
    """

    def __init__(
        self,
        group: Any,
        device: torch.device,
        failure: FailureChannel | None,
        waiter: Waiter,
        single_tag: bool | None = None,
    ) -> None:
        self.group = group
        self.device = device
        self.failure = failure
        self.waiter = waiter
        self._sent: dict[Key, Layout] = {}
        self._sent_sig: dict[Key, Any] = {}  # _signature of the last plain message sent per key
        self._received: dict[Key, Layout] = {}
        self._before: dict[Key, Layout] = {}  # the layout a key had before its last change (for errors)
        self._unresolved: dict[int, deque[RecvHandle]] = {}
        group_obj = group if group is not None else dist.group.WORLD
        backend = str(dist.get_backend(group_obj))
        self.single_tag = _single_tag_default(backend) if single_tag is None else single_tag
        self._tag_new = _TAG_STEADY if self.single_tag else _TAG_NEW
        # gloo runs each operation on its own; posting directly skips per-call Python overhead.
        self._pg: Any = group_obj if backend == "gloo" else None

    def _launch(self, ops: list[_Op]) -> list[Any]:
        """Post operations: straight on a gloo group (no Python wrappers), else as one batch."""
        if not ops:
            return []
        try:
            if self._pg is not None:
                pg = self._pg
                return [
                    pg.send([t], peer, tag) if is_send else pg.recv([t], peer, tag) for is_send, t, peer, tag in ops
                ]
            return dist.batch_isend_irecv(
                [
                    dist.P2POp(dist.isend if is_send else dist.irecv, t, group=self.group, tag=tag, group_peer=peer)
                    for is_send, t, peer, tag in ops
                ]
            )
        except RuntimeError as err:  # a peer's connection closed: tell why if that rank left its story
            story = None if self.failure is None else self.failure.check()
            peers = sorted({peer for _, _, peer, _ in ops})
            with_ = f"with rank{'s' if len(peers) > 1 else ''} {', '.join(map(str, peers))}"
            if story is not None:
                raise RemoteFailureError(
                    f"{self.waiter.where()}: exchanging messages {with_} failed because {story}"
                ) from err
            raise PipelineError(
                f"{self.waiter.where()}: exchanging messages {with_} failed (no rank reported a failure): {err}"
            ) from err

    def post(self, items: list[SendItem | RecvItem]) -> list[RecvHandle]:
        """Post the sends and receives of one run of consecutive SEND/RECV actions as one batch.

        Sends go first. Every message is built before any is posted, so one that cannot be built
        (say, an unpicklable value) posts nothing. In single-tag mode the batch is cut before a
        second receive from the same peer, and the headers of each part are read right after it
        is posted (see the module docstring).
        """
        ops: list[_Op] = []
        sends: list[tuple[int, int, SendItem, list[torch.Tensor]]] = []
        for item in items:
            if isinstance(item, SendItem):
                start = len(ops)
                keep = self._send_ops(item, ops)
                sends.append((start, len(ops), item, keep))
        handles: list[RecvHandle] = []
        part: list[RecvHandle] = []
        peers: set[int] = set()
        works: list[Any] | None = None
        for item in items:
            if isinstance(item, SendItem):
                continue
            if self.single_tag and item.peer in peers:
                launched = self._flush(ops, part)
                works = launched if works is None else works
                ops, part, peers = [], [], set()
            handle = self._recv_ops(item, ops)
            handles.append(handle)
            part.append(handle)
            peers.add(item.peer)
        launched = self._flush(ops, part)
        works = launched if works is None else works
        for start, end, send, keep in sends:
            self.waiter.background(works[start:end], keep, None, (send.what, send.peer))
            if send.on_done is not None:
                send.on_done()  # the data was copied into the message
        return handles

    def _flush(self, ops: list[_Op], part: list[RecvHandle]) -> list[Any]:
        """Launch ``ops``; in single-tag mode settle the receives among them at once."""
        works = self._launch(ops)
        for handle in part:
            handle.works = [works[i] for i in handle.works]
        if self.single_tag and part:
            self._settle(part)
        return works

    def _send_ops(self, item: SendItem, ops: list[_Op]) -> list[torch.Tensor]:
        obj, item.obj = item.obj, None  # packed below: the message keeps no reference to the output
        sig = _signature(obj)
        old = self._sent.get(item.key)
        if sig is not None and old is not None and self._sent_sig.get(item.key) == sig:
            # Steady state of a plain message: same container and tensor specs, no pytree needed.
            tensors = [obj.detach()] if sig[0] is torch.Tensor else [t.detach() for t in obj]
            flat = _pack(_SAME, 0, 0, old, tensors, self.device)
            ops.append((True, flat, item.peer, _TAG_STEADY))
            return [flat]
        layout, tensors = layout_of(obj)
        tensors = [t.detach() for t in tensors]
        if sig is not None and layout.simple is sig[0]:
            self._sent_sig[item.key] = sig
        else:
            self._sent_sig.pop(item.key, None)
        if old is not None and _same(old, layout):
            flat = _pack(_SAME, 0, 0, layout, tensors, self.device)
            ops.append((True, flat, item.peer, _TAG_STEADY))
            return [flat]
        # The receiver posted a message of the remembered size: fill it with a notice giving the
        # sizes of the two follow-ups (the new layout, then the packed tensors).
        encoded = layout.encode().to(self.device)
        payload = _pack(_NEW, 0, 0, layout, tensors, self.device)
        notice = _pack(_NEW, encoded.numel(), payload.nbytes, old, [], self.device)
        ops.append((True, notice, item.peer, _TAG_STEADY))
        ops.append((True, encoded, item.peer, self._tag_new))
        ops.append((True, payload, item.peer, self._tag_new))
        _fingerprint(layout)  # now: the plain values as sent, before the caller may change them
        self._sent[item.key] = layout
        return [notice, encoded, payload]

    def _recv_ops(self, item: RecvItem, ops: list[_Op]) -> RecvHandle:
        cached = self._received.get(item.key)
        flat = _recv_buffer(cached, self.device)
        handle = RecvHandle(item.key, item.peer, item.what, flat=flat, cached=cached)
        handle.works = [len(ops)]  # replaced by the Work objects once posted
        ops.append((False, flat, item.peer, _TAG_STEADY))
        if not self.single_tag:
            self._unresolved.setdefault(item.peer, deque()).append(handle)
        return handle

    def _settle(self, handles: Sequence[RecvHandle]) -> None:
        """Read the headers of ``handles`` (in order) and post the follow-ups of new layouts."""
        ops: list[_Op] = []
        pending: list[tuple[RecvHandle, int]] = []
        for handle in handles:
            flag = self._wait_early(handle)
            handle.settled = True
            flat = handle.flat
            assert flat is not None
            if flag == _SAME and handle.cached is not None:
                handle.layout = handle.cached
                continue
            header = _bytes(flat)[: _HEADER * 8].view(torch.int64)
            encoded = torch.empty(int(header[1]), dtype=torch.uint8, device=self.device)
            payload = torch.empty(int(header[2]), dtype=torch.uint8, device=self.device)
            handle.encoded, handle.flat = encoded, payload
            pending.append((handle, len(ops)))
            ops.append((False, encoded, handle.peer, self._tag_new))
            ops.append((False, payload, handle.peer, self._tag_new))
        works = self._launch(ops)
        for handle, i in pending:
            handle.works = works[i : i + 2]

    def wait(self, handle: RecvHandle) -> Any:
        """The received object; blocks (watching for failures elsewhere) until it has arrived."""
        if not handle.settled:
            queue = self._unresolved.get(handle.peer)
            if handle.cached is not None:
                # Steady state: the message was posted early; wait for it alone.
                if self._wait_early(handle) == _SAME and queue is not None:
                    if queue[0] is handle:
                        queue.popleft()
                    else:
                        queue.remove(handle)
                    handle.settled = True
                    handle.layout = handle.cached
            # Follow-ups travel on their own tag, which both sides use in posting order.
            while not handle.settled and queue:
                self._settle([queue.popleft()])
        if handle.works:
            self.waiter.wait(handle.works, handle)
            handle.works = []
        layout = handle.layout
        if layout is None:
            assert handle.encoded is not None
            layout = handle.layout = Layout.decode(handle.encoded)
            old = self._received.get(handle.key)
            if old is not None:
                self._before[handle.key] = old
            self._received[handle.key] = layout
        flat = handle.flat
        assert flat is not None
        value = rebuild(layout, _unpack(flat, layout))
        handle.flat = handle.encoded = handle.layout = handle.cached = None
        handle.resolved = True
        return value

    def input_note(self, action: Any, stage_to_rank: dict[int, int], rank: int) -> str:
        """For an error in ``action``'s compute: how its received input differs from what came before.

        Shapes may change between steps and microbatches; where the stage then fails, the change
        is a likely cause, so the error names both stages and both shapes: against the same
        microbatch of an earlier step, else against another microbatch of this step (ignoring
        the microbatch dimension, which uneven splits change by design). "" if nothing changed.
        """
        notes = []
        for part in action.parts:
            s, m, kind = part.stage, part.microbatch, part.kind.value
            if kind == "F":
                key, src, what = ("F", s - 1, m), s - 1, f"the output of stage {s - 1}"
            elif kind in ("B", "I"):
                key, src, what = ("B", s + 1, m), s + 1, f"the input gradient from stage {s + 1}"
            else:
                continue
            now = self._received.get(key)
            if now is None or stage_to_rank.get(src) == rank:
                continue
            before, label = self._before.get(key), f"microbatch {m} of an earlier step"
            if before is None or _shapes(before) == _shapes(now):
                before = None
                for k, lay in self._received.items():
                    if k[:2] == key[:2] and k != key and _shapes(lay, 1) != _shapes(now, 1):
                        before, label = lay, f"microbatch {k[2]}"
            if before is not None:
                notes.append(
                    f"stage {s} received {what} for microbatch {m} as {_specs(now)}, but {_specs(before)} for {label}"
                )
        return f" (input shapes changed: {'; '.join(notes)})" if notes else ""

    @staticmethod
    def _flag(handle: RecvHandle) -> int:
        flat = handle.flat
        assert flat is not None
        if flat.device.type == "cpu":  # the flag is the low byte of the first header word
            return int(ctypes.c_uint8.from_address(flat.data_ptr()).value)
        return int(_bytes(flat)[0])

    def _wait_early(self, handle: RecvHandle) -> int:
        """Wait for the first message of ``handle``; its flag (raises on a failure notice)."""
        if not handle.works:
            return self._flag(handle)
        self.waiter.wait(handle.works, handle)
        handle.works = []
        flag = self._flag(handle)
        if flag == _FAIL:
            failure = self.failure
            story = None if failure is None else failure.check()
            because = story or f"rank {handle.peer} failed (see its error)"
            raise RemoteFailureError(
                f"{self.waiter.where()}: stopped while waiting for {_describe(handle)} because {because}"
            )
        return flag

    def poison(self, sends: Sequence[tuple[Key, int]]) -> None:
        """Wake the peers waiting for our messages ``(key, peer)`` with failure notices; never waits.

        Each notice has the size the receiver posted for that key (both sides remember the same
        layouts), so it completes the receive the peer is blocked in.
        """
        ops: list[_Op] = []
        for key, peer in sends:
            notice = _pack(_FAIL, 0, 0, self._sent.get(key), [], self.device)
            ops.append((True, notice, peer, _TAG_STEADY))
        if ops:
            try:
                _NOTICES.extend(self._launch(ops))
            except Exception:  # the connection may already be gone; the peers then see it closed
                pass

    def finish(self) -> None:
        """Block until every send of the step has completed (watching for failures)."""
        self.waiter.drain()

    def park(self, handles: Sequence[RecvHandle]) -> None:
        """Keep ``handles`` (receives that may still be in flight) alive for the life of the process."""
        _NOTICES.extend(handles)

    def reset(self) -> None:
        """Forget layouts and pending receives (after a failure both sides start afresh)."""
        # Receives still posted can never complete in order now; keep their operations and
        # buffers alive (as the failure notices are) rather than destroying operations in flight.
        _NOTICES.extend(handle for queue in self._unresolved.values() for handle in queue)
        self._sent.clear()
        self._sent_sig.clear()
        self._received.clear()
        self._before.clear()
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
        self.namespace = namespace
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


def _shapes(layout: Layout, skip: int = 0) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """Dtypes and shapes of a layout's tensors, without their first ``skip`` dimensions."""
    return [(dtype, tuple(shape)[skip:]) for dtype, shape, _ in layout.tensors]


def _specs(layout: Layout) -> str:
    return (
        ", ".join(f"{str(dtype).replace('torch.', '')} {list(shape)}" for dtype, shape, _ in layout.tensors)
        or "no tensors"
    )


def _describe(what: Any) -> str:
    """What an operation carries, for error messages (built only when one is raised)."""
    if isinstance(what, tuple):  # (what, peer) of a send: the item itself would keep its data alive
        return f"{what[0]} to rank {what[1]}"
    if isinstance(what, RecvHandle):
        return f"{what.what} from rank {what.peer}"
    return str(what)


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
        self._limit = timedelta(seconds=timeout)
        self._bg: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._finished: deque[_Job] = deque()
        self._outstanding: deque[tuple[list[Any], str, Any, Callable[[], None] | None]] = deque()
        threading.Thread(target=_serve, args=(self._bg, self._finished), daemon=True, name="pipetrain-sends").start()

    def wait(self, works: list[Any], what: Any) -> None:
        """Wait for ``works``; ``what`` (a string, or a handle or item :func:`_describe` names) is for errors."""
        limit = self._limit
        start = time.monotonic()
        for work in works:
            try:
                work.wait(limit)
            except Exception as err:
                handle_peer = what.peer if isinstance(what, RecvHandle) else None
                what = _describe(what)
                story = None if self.failure is None else self.failure.check()
                if story is not None:
                    raise RemoteFailureError(f"{self.where()}: waiting for {what} failed because {story}") from err
                waited = time.monotonic() - start
                if waited >= self.timeout:
                    peer = f"rank {handle_peer}" if handle_peer is not None else "the sender"
                    how = (
                        f"timed out after {self.timeout:g} s (no rank reported a failure: {peer}, or a rank it "
                        "waits for, may be stalled)"
                    )
                else:
                    how = f"failed after {waited:.2g} s (no rank reported a failure)"
                raise PipelineError(f"{self.where()}: waiting for {what} {how}: {err}") from err

    def background(self, works: list[Any], keep: Any, on_done: Callable[[], None] | None, what: Any) -> None:
        """Remember a posted send; :meth:`drain` waits for all of them at the end of the step.

        ``what`` names it in errors: a string, or ``(what, peer)`` of a send (named only when needed).
        """
        self._outstanding.append((works, what, keep, on_done))

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
        """Stop the helper thread once it is free (a thread stuck on a dead peer stays parked).

        Sends not yet waited for are kept alive for the life of the process: gloo keeps a posted
        send's buffer only weakly, and once it is gone a receive the peer posts later leaves the
        connection stuck on it, its I/O thread spinning (measured: 80 % of a core).
        """
        _NOTICES.extend(self._outstanding)
        self._outstanding.clear()
        self._bg.put(None)
