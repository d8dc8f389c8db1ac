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
gloo for the tests) every data operation uses tag 0 and a receive is never posted behind another
receive from the same peer whose follow-ups may still be due: a batch is cut before a second
receive from one peer, and right after each part is posted its headers are read and the
follow-ups of new layouts posted, before anything else. Sends of a batch go first with its first
part. On gloo by default the follow-ups use tag 1 instead, so headers are read lazily, right
before the data is needed, in posting order per peer (gloo matches per tag, first in, first out).
In single-tag mode headers and new layouts travel on a CPU control plane by default (see
:mod:`~pipetrain.runtime.transport.control`: under NCCL, reading a header out of the data would
block the host).

Reading the headers right after posting cannot deadlock, for schedules made by ``Schedule.lower()``:
the proof is in docs/semantics.md ("Reading headers right after posting"); on the control plane a
header is posted no later than its data, so the same proof holds.

``DistTransport`` uses ``torch.distributed`` point-to-point operations (on a gloo group posted
directly, elsewhere as ``batch_isend_irecv`` batches of buffers on the stage's device); sends
complete in the background (see :class:`Waiter`). A message that is one tensor or a list or
tuple of tensors skips pytree on both sides; one tensor travels in a buffer of its own dtype (the
header is a whole number of elements), so the receiver reads it back as a single view. What a
send posts is built by :class:`~pipetrain.runtime.transport.sender.Sender`; posting, receiving
and failures are here.
"""

from __future__ import annotations

import os
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.errors import PipelineError
from pipetrain.runtime.failures import FailureChannel, RemoteFailureError
from pipetrain.runtime.transport.completion import Waiter, _describe, keep_alive
from pipetrain.runtime.transport.control import control_default, control_group, header_word
from pipetrain.runtime.transport.host import host_read
from pipetrain.runtime.transport.sender import Op, Sender
from pipetrain.runtime.transport.wire import (
    _FAIL,
    _HEADER,
    _SAME,
    _TAG_CONTROL,
    _TAG_NEW,
    _TAG_STEADY,
    Key,
    Layout,
    RecvHandle,
    RecvItem,
    SendItem,
    _bytes,
    _recv_buffer,
    _shapes,
    _specs,
    _unpack,
    rebuild,
)

__all__ = ["DistTransport"]


def _single_tag_default(backend: str) -> bool:
    """NCCL (any backend but gloo) matches by posting order only; tests force it on gloo."""
    return backend != "gloo" or os.environ.get("PIPETRAIN_SINGLE_TAG", "") not in ("", "0")


class _Joint:
    """One work standing for several operations (a coalesced NCCL batch returns a single work)."""

    __slots__ = ("works",)

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self, *timeout: Any) -> bool:
        for work in self.works:
            work.wait(*timeout)
        return True


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
        control: bool | None = None,
        stream_waits: bool | None = None,
    ) -> None:
        self.group = group
        self.device = device
        self.failure = failure
        self.waiter = waiter
        self._received: dict[Key, Layout] = {}
        self._before: dict[Key, Layout] = {}  # the layout a key had before its last change (for errors)
        self._unresolved: dict[int, deque[RecvHandle]] = {}
        group_obj = group if group is not None else dist.group.WORLD
        backend = str(dist.get_backend(group_obj))
        self.single_tag = _single_tag_default(backend) if single_tag is None else single_tag
        self._tag_new = _TAG_STEADY if self.single_tag else _TAG_NEW
        # gloo runs each operation on its own; posting directly skips per-call Python overhead.
        # Both groups are held weakly (see _pg).
        self._pg_ref: weakref.ref[Any] | None = None
        self._ctrl_ref: weakref.ref[Any] | None = None
        self._pg = group_obj if backend == "gloo" else None
        # Order-only matching: headers and layouts travel on a CPU channel (see transport/control.py).
        use_control = self.single_tag and (control_default() if control is None else control)
        self._ctrl_pg = control_group(group_obj, backend) if use_control else None
        self._sender = Sender(device, use_control, self._tag_new)
        # Device data: a receive is waited for on the consuming stream, sends at the step's end on
        # the stream too (no host wait). Forced on the CPU by tests (gloo's wait then blocks).
        self.stream_waits = device.type != "cpu" if stream_waits is None else stream_waits

    @property
    def _pg(self) -> Any:
        """The gloo group operations are posted on directly (None: posted as batches, or the group
        is gone).

        Held weakly, as the control group: a transport never keeps a process group alive.
        ``dist.destroy_process_group()`` then ends the group and joins its gloo threads, as without
        pipetrain, even while a schedule object lives on (a module global, say). A group kept
        alive past it lives into interpreter finalization, where a gloo worker thread that drops
        the last reference to a collective's tensor (``clip_grad_norm_``'s, say) needs the GIL
        and aborts the process ("terminate called without an active exception", issue 37).
        """
        ref = self._pg_ref
        return None if ref is None else ref()

    @_pg.setter
    def _pg(self, pg: Any) -> None:
        self._pg_ref = None if pg is None else weakref.ref(pg)

    @property
    def _ctrl_pg(self) -> Any:
        """The control plane's group (None: no control plane, or the group is gone); held weakly."""
        ref = self._ctrl_ref
        return None if ref is None else ref()

    @_ctrl_pg.setter
    def _ctrl_pg(self, pg: Any) -> None:
        self._ctrl_ref = None if pg is None else weakref.ref(pg)

    @property
    def control(self) -> bool:
        """Whether headers and layouts travel on the CPU control plane."""
        return self._ctrl_ref is not None

    def _launch(self, ops: list[Op], control: bool = False) -> list[Any]:
        """Post operations, one work per operation: straight on a gloo group (no Python wrappers)
        or the control group, else as one batch (whose single coalesced work then stands for each)."""
        if not ops:
            return []
        ref = self._ctrl_ref if control else self._pg_ref
        pg = None if ref is None else ref()
        if ref is not None and pg is None:
            raise PipelineError(
                f"{self.waiter.where()}: the pipeline's process group was destroyed (dist.destroy_process_group()); "
                "build the stages and the schedule on a live group"
            )
        try:
            if pg is not None:
                return [
                    pg.send([t], peer, tag) if is_send else pg.recv([t], peer, tag) for is_send, t, peer, tag in ops
                ]
            works: list[Any] = dist.batch_isend_irecv(
                [
                    dist.P2POp(dist.isend if is_send else dist.irecv, t, group=self.group, tag=tag, group_peer=peer)
                    for is_send, t, peer, tag in ops
                ]
            )
            if len(works) != len(ops):
                works = [_Joint(list(works))] * len(ops)
            return list(works)
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
        is posted (see the module docstring); with the control plane, on the CPU channel.
        """
        ops: list[Op] = []
        ctrl: list[Op] = []
        sends: list[tuple[int, int, int, int, SendItem, list[torch.Tensor], bool]] = []
        for item in items:
            if isinstance(item, SendItem):
                start, cstart = len(ops), len(ctrl)
                keep = self._sender.ops(item, ops, ctrl)
                sends.append((start, len(ops), cstart, len(ctrl), item, keep, self._sender.last_steady))
        handles: list[RecvHandle] = []
        part: list[RecvHandle] = []
        peers: set[int] = set()
        works: tuple[list[Any], list[Any]] | None = None
        for item in items:
            if isinstance(item, SendItem):
                continue
            if self.single_tag and item.peer in peers:
                launched = self._flush(ops, ctrl, part)
                works = launched if works is None else works
                ops, ctrl, part, peers = [], [], [], set()
            handle = self._recv_ops(item, ops, ctrl)
            handles.append(handle)
            part.append(handle)
            peers.add(item.peer)
        launched = self._flush(ops, ctrl, part)
        data_works, ctrl_works = launched if works is None else works
        for start, end, cstart, cend, send, keep, steady in sends:
            key = send.key if steady else None  # (only a steady message is sure once its RECV is posted)
            if self.stream_waits:  # device data completes on the stream; control on the host
                self.waiter.background(
                    ctrl_works[cstart:cend], keep, None, (send.what, send.peer), data_works[start:end], key
                )
            else:
                host = data_works[start:end] + ctrl_works[cstart:cend]
                self.waiter.background(host, keep, None, (send.what, send.peer), None, key)
            if send.on_done is not None:
                send.on_done()  # the data was copied into the message
        return handles

    def _flush(self, ops: list[Op], ctrl: list[Op], part: list[RecvHandle]) -> tuple[list[Any], list[Any]]:
        """Launch ``ctrl`` (first: the peers' headers wait on it), then ``ops``; in single-tag mode
        settle the receives among them at once."""
        ctrl_works = self._launch(ctrl, control=True)
        works = self._launch(ops)
        for handle in part:
            handle.works = [works[i] for i in handle.works]
            handle.ctrl_works = [ctrl_works[i] for i in handle.ctrl_works]
        if self.single_tag and part:
            self._settle(part)
        return works, ctrl_works

    def _recv_ops(self, item: RecvItem, ops: list[Op], ctrl: list[Op]) -> RecvHandle:
        cached = self._received.get(item.key)
        flat = _recv_buffer(cached, self.device)
        handle = RecvHandle(item.key, item.peer, item.what, flat=flat, cached=cached)
        handle.works = [len(ops)]  # replaced by the Work objects once posted
        ops.append((False, flat, item.peer, _TAG_STEADY))
        if self._ctrl_ref is not None:
            handle.ctrl = torch.empty(_HEADER, dtype=torch.int64)
            handle.ctrl_works = [len(ctrl)]
            ctrl.append((False, handle.ctrl, item.peer, _TAG_CONTROL))
        if not self.single_tag:
            self._unresolved.setdefault(item.peer, deque()).append(handle)
        return handle

    def _settle(self, handles: Sequence[RecvHandle]) -> None:
        """Read the headers of ``handles`` (in order) and post the follow-ups of new layouts.

        With the control plane the headers are host memory (the data is not waited for: its
        operation completes on the consuming stream, at :meth:`wait`); without it they are read
        from the received data, on the host (:func:`host_read`).
        """
        ops: list[Op] = []
        ctrl: list[Op] = []
        pending: list[tuple[RecvHandle, int, int]] = []
        for handle in handles:
            flag = self._wait_early(handle)
            handle.settled = True
            flat = handle.flat
            assert flat is not None
            if flag == _SAME and handle.cached is not None:
                handle.layout = handle.cached
                continue
            if handle.ctrl is not None:
                layout_bytes, payload_bytes = header_word(handle.ctrl, 1), header_word(handle.ctrl, 2)
                encoded = torch.empty(layout_bytes, dtype=torch.uint8)
                handle.stub = flat  # its operation may still be in flight
                pending.append((handle, len(ops), len(ctrl)))
                ctrl.append((False, encoded, handle.peer, _TAG_CONTROL))
            else:
                words = host_read(_bytes(flat)[: _HEADER * 8].view(torch.int64)[:3])
                assert isinstance(words, list)
                layout_bytes, payload_bytes = words[1], words[2]
                encoded = torch.empty(layout_bytes, dtype=torch.uint8, device=self.device)
                pending.append((handle, len(ops), -1))
                ops.append((False, encoded, handle.peer, self._tag_new))
            payload = torch.empty(payload_bytes, dtype=torch.uint8, device=self.device)
            handle.encoded, handle.flat = encoded, payload
            ops.append((False, payload, handle.peer, self._tag_new))
        ctrl_works = self._launch(ctrl, control=True)
        works = self._launch(ops)
        for handle, i, c in pending:
            if c < 0:
                handle.works = works[i : i + 2]
            else:
                handle.works = [*handle.works, works[i]]
                handle.ctrl_works = [ctrl_works[c]]

    def wait(self, handle: RecvHandle) -> Any:
        """The received object; blocks (watching for failures elsewhere) until it has arrived.

        With ``stream_waits`` the data is waited for on the current (consuming) stream instead:
        the host goes on queueing work, and the device runs the consumer once the data landed.
        """
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
        if handle.ctrl_works:  # the layout bytes, on the control plane
            self.waiter.wait(handle.ctrl_works, handle)
            handle.ctrl_works = []
        if handle.works:
            if self.stream_waits:
                self.waiter.wait_stream(handle.works, handle)
            else:
                self.waiter.wait(handle.works, handle)
            handle.works = []
        layout = handle.layout
        if layout is None:
            encoded = handle.encoded
            assert encoded is not None
            if encoded.device.type == "cpu" and handle.ctrl is not None:
                data = encoded.numpy().tobytes()  # host memory: the control plane's
            else:
                values = host_read(encoded)
                assert isinstance(values, list)
                data = bytes(values)
            layout = handle.layout = Layout.decode(data)
            old = self._received.get(handle.key)
            if old is not None:
                self._before[handle.key] = old
            self._received[handle.key] = layout
        flat = handle.flat
        assert flat is not None
        value = rebuild(layout, _unpack(flat, layout))
        handle.flat = handle.encoded = handle.layout = handle.cached = handle.ctrl = handle.stub = None
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
        if handle.ctrl is not None:  # host memory: the control plane's header
            return header_word(handle.ctrl, 0)
        flat = handle.flat
        assert flat is not None
        flag = host_read(flat, first_byte=True)  # the low byte of the first header word
        assert isinstance(flag, int)
        return flag

    def _wait_early(self, handle: RecvHandle) -> int:
        """Wait for the header of ``handle`` (with the control plane, there; else the first
        message); its flag (raises on a failure notice)."""
        if handle.ctrl is not None:
            if handle.ctrl_works:
                self.waiter.wait(handle.ctrl_works, handle)
                handle.ctrl_works = []
        elif not handle.works:
            return self._flag(handle)
        else:
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
        layouts), so it completes the receive the peer is blocked in; with the control plane a
        failure header goes there too (where the peer waits).
        """
        ops: list[Op] = []
        ctrl: list[Op] = []
        for key, peer in sends:
            self._sender.failure(key, peer, ops, ctrl)
        for group, control in ((ctrl, True), (ops, False)):
            if group:
                try:
                    keep_alive(self._launch(group, control=control))
                    keep_alive(t for _, t, _, _ in group)
                except Exception:  # the connection may already be gone; the peers then see it closed
                    pass

    def finish(self) -> None:
        """Every send of the step completed (watching for failures); device data on the stream."""
        self.waiter.drain()

    def park(self, handles: Sequence[RecvHandle]) -> None:
        """Keep ``handles`` (receives that may still be in flight) alive for the life of the process."""
        keep_alive(handles)

    def reset(self) -> None:
        """Forget layouts and pending receives (after a failure both sides start afresh)."""
        # Receives still posted can never complete in order now; keep their operations and
        # buffers alive (as the failure notices are) rather than destroying operations in flight.
        keep_alive(handle for queue in self._unresolved.values() for handle in queue)
        self._sender.reset()
        self._received.clear()
        self._before.clear()
        self._unresolved.clear()
