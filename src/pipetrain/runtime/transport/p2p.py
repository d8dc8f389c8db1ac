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

The control plane (single-tag mode; ``PIPETRAIN_CONTROL_PLANE=0`` turns it off). Reading a header
out of received GPU data is a device-to-host copy: it blocks the host until the message landed
and every kernel queued before it ran, so the host could never queue work ahead of the GPU. So
each message's header (flag, layout size, payload size) and a new layout's bytes travel on a CPU
channel instead, posted when the SEND is posted: the group itself when it has a CPU backend
(``cpu:gloo,cuda:nccl``), else a gloo group over the same ranks built on the group's store. The
receiver waits only for that header (which the sender's host posted as soon as it had queued the
producing kernels), never for the data: the data's operation is waited for on the consuming
stream (``stream_waits``), and sent buffers are held until the step's sends were waited for on
the stream. The data plane keeps its operations and order (a first message of the remembered
size, then the new payload when the layout changed), so matching is as without the control plane.
Every host read of a data-plane tensor goes through :func:`~pipetrain.runtime.transport.host.host_read`
(counted); with the control plane there is none.

Reading the headers right after posting cannot deadlock, for schedules made by ``Schedule.lower()``:
the proof is in docs/semantics.md ("Reading headers right after posting"); on the control plane a
header is posted no later than its data, so the same proof holds.

``DistTransport`` uses ``torch.distributed`` point-to-point operations (on a gloo group posted
directly, elsewhere as ``batch_isend_irecv`` batches of buffers on the stage's device); sends
complete in the background (see :class:`Waiter`). A message that is one tensor or a list or
tuple of tensors skips pytree on both sides; one tensor travels in a buffer of its own dtype (the
header is a whole number of elements), so the receiver reads it back as a single view.
"""

from __future__ import annotations

import ctypes
import os
from collections import deque
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.errors import PipelineError
from pipetrain.runtime.failures import FailureChannel, RemoteFailureError
from pipetrain.runtime.transport.completion import Waiter, _describe, keep_alive
from pipetrain.runtime.transport.host import host_read
from pipetrain.runtime.transport.wire import (
    _FAIL,
    _HEADER,
    _NEW,
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
    _fingerprint,
    _pack,
    _recv_buffer,
    _same,
    _shapes,
    _signature,
    _specs,
    _unpack,
    layout_of,
    rebuild,
)

__all__ = ["DistTransport"]

_Op = tuple[bool, torch.Tensor, int, int]  # (is a send, tensor, group peer, tag)


def _single_tag_default(backend: str) -> bool:
    """NCCL (any backend but gloo) matches by posting order only; tests force it on gloo."""
    return backend != "gloo" or os.environ.get("PIPETRAIN_SINGLE_TAG", "") not in ("", "0")


def _control_default() -> bool:
    """The control plane is on unless ``PIPETRAIN_CONTROL_PLANE=0`` (headers in the data, as before)."""
    return os.environ.get("PIPETRAIN_CONTROL_PLANE", "") != "0"


_PRIVATE: dict[Any, Any] = {}  # data group -> the gloo group made for its control plane


def control_group(group: Any, backend: str, timeout: float = 1800.0) -> Any:
    """A process group that carries CPU tensors between the ranks of ``group``, in its rank numbering.

    ``group`` itself when it can: gloo, or a group with a CPU backend beside its device one
    (``init_process_group()`` without a backend gives ``cpu:gloo,cuda:nccl``). Else a gloo group
    over ``group``'s store, made once per group; every rank of ``group`` builds its runtime, so
    every rank makes it, as the rendezvous needs.
    """
    if backend == "gloo":
        return group
    try:
        group._get_backend(torch.device("cpu"))
        return group
    except Exception:  # no CPU backend on this group (NCCL alone)
        pass
    return private_gloo(group, timeout)


def private_gloo(group: Any, timeout: float = 1800.0) -> Any:
    """A gloo group over the ranks of ``group`` (same rank numbering), made once per group."""
    made = _PRIVATE.get(group)
    if made is None:
        c10d = dist.distributed_c10d
        entry = c10d._world.pg_map.get(group)
        store = entry[1] if entry is not None else c10d._get_default_store()
        name = str(getattr(group, "group_name", "world"))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        prefix = c10d.PrefixStore(f"pipetrain-control/{name}@{attempt}/", store)
        made = dist.ProcessGroupGloo(
            prefix, dist.get_rank(group), dist.get_world_size(group), timedelta(seconds=timeout)
        )
        _PRIVATE[group] = made
    return made


class _Joint:
    """One work standing for several operations (a coalesced NCCL batch returns a single work)."""

    __slots__ = ("works",)

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self, *timeout: Any) -> bool:
        for work in self.works:
            work.wait(*timeout)
        return True


_CTRL_FIXED: dict[int, torch.Tensor] = {}


def _ctrl_header(flag: int, layout_bytes: int, payload_bytes: int) -> torch.Tensor:
    """A control-plane header. Steady (and failure) headers are one shared tensor each: a send
    only reads its buffer, and building one costs more than the rest of a steady message."""
    if layout_bytes == 0 and payload_bytes == 0:
        fixed = _CTRL_FIXED.get(flag)
        if fixed is None:
            fixed = _CTRL_FIXED[flag] = torch.tensor([flag] + [0] * (_HEADER - 1), dtype=torch.int64)
        return fixed
    return torch.tensor([flag, layout_bytes, payload_bytes] + [0] * (_HEADER - 3), dtype=torch.int64)


def _word(t: torch.Tensor, i: int) -> int:
    """Word ``i`` of a control header: host memory, read in place (no copy, nothing counted)."""
    return int(ctypes.c_int64.from_address(t.data_ptr() + 8 * i).value)


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
        # Order-only matching: headers and layouts travel on a CPU channel (see the module docstring).
        use_control = self.single_tag and (_control_default() if control is None else control)
        self._ctrl_pg: Any = control_group(group_obj, backend) if use_control else None
        # Device data: a receive is waited for on the consuming stream, sends at the step's end on
        # the stream too (no host wait). Forced on the CPU by tests (gloo's wait then blocks).
        self.stream_waits = device.type != "cpu" if stream_waits is None else stream_waits

    @property
    def control(self) -> bool:
        """Whether headers and layouts travel on the CPU control plane."""
        return self._ctrl_pg is not None

    def _launch(self, ops: list[_Op], control: bool = False) -> list[Any]:
        """Post operations, one work per operation: straight on a gloo group (no Python wrappers)
        or the control group, else as one batch (whose single coalesced work then stands for each)."""
        if not ops:
            return []
        try:
            pg = self._ctrl_pg if control else self._pg
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
        ops: list[_Op] = []
        ctrl: list[_Op] = []
        sends: list[tuple[int, int, int, int, SendItem, list[torch.Tensor]]] = []
        for item in items:
            if isinstance(item, SendItem):
                start, cstart = len(ops), len(ctrl)
                keep = self._send_ops(item, ops, ctrl)
                sends.append((start, len(ops), cstart, len(ctrl), item, keep))
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
        for start, end, cstart, cend, send, keep in sends:
            if self.stream_waits:  # device data completes on the stream; control on the host
                self.waiter.background(
                    ctrl_works[cstart:cend], keep, None, (send.what, send.peer), data_works[start:end]
                )
            else:
                self.waiter.background(
                    data_works[start:end] + ctrl_works[cstart:cend], keep, None, (send.what, send.peer)
                )
            if send.on_done is not None:
                send.on_done()  # the data was copied into the message
        return handles

    def _flush(self, ops: list[_Op], ctrl: list[_Op], part: list[RecvHandle]) -> tuple[list[Any], list[Any]]:
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

    def _send_ops(self, item: SendItem, ops: list[_Op], ctrl: list[_Op]) -> list[torch.Tensor]:
        obj, item.obj = item.obj, None  # packed below: the message keeps no reference to the output
        control = self._ctrl_pg is not None
        sig = _signature(obj)
        old = self._sent.get(item.key)
        if sig is not None and old is not None and self._sent_sig.get(item.key) == sig:
            # Steady state of a plain message: same container and tensor specs, no pytree needed.
            tensors = [obj.detach()] if sig[0] is torch.Tensor else [t.detach() for t in obj]
            return self._steady(item, old, tensors, ops, ctrl)
        layout, tensors = layout_of(obj)
        tensors = [t.detach() for t in tensors]
        if sig is not None and layout.simple is sig[0]:
            self._sent_sig[item.key] = sig
        else:
            self._sent_sig.pop(item.key, None)
        if old is not None and _same(old, layout):
            return self._steady(item, layout, tensors, ops, ctrl)
        # The receiver posted a message of the remembered size: fill it with a notice giving the
        # sizes of the two follow-ups (the new layout, then the packed tensors). With the control
        # plane the notice's words and the layout go there instead; the data plane carries the
        # (unread) notice and the tensors.
        encoded = layout.encode()
        payload = _pack(_NEW, 0, 0, layout, tensors, self.device, header=not control)
        notice = _pack(_NEW, encoded.numel(), payload.nbytes, old, [], self.device, header=not control)
        ops.append((True, notice, item.peer, _TAG_STEADY))
        if control:
            header = _ctrl_header(_NEW, encoded.numel(), payload.nbytes)
            ctrl.append((True, header, item.peer, _TAG_CONTROL))
            ctrl.append((True, encoded, item.peer, _TAG_CONTROL))
            keep = [notice, payload, header, encoded]
        else:
            encoded = encoded.to(self.device)
            ops.append((True, encoded, item.peer, self._tag_new))
            keep = [notice, encoded, payload]
        ops.append((True, payload, item.peer, self._tag_new))
        _fingerprint(layout)  # now: the plain values as sent, before the caller may change them
        self._sent[item.key] = layout
        return keep

    def _steady(
        self, item: SendItem, layout: Layout, tensors: list[torch.Tensor], ops: list[_Op], ctrl: list[_Op]
    ) -> list[torch.Tensor]:
        """A message whose layout the receiver knows: one data operation (and a header on the control plane)."""
        if self._ctrl_pg is None:
            flat = _pack(_SAME, 0, 0, layout, tensors, self.device)
            ops.append((True, flat, item.peer, _TAG_STEADY))
            return [flat]
        flat = _pack(_SAME, 0, 0, layout, tensors, self.device, header=False)
        header = _ctrl_header(_SAME, 0, 0)
        ops.append((True, flat, item.peer, _TAG_STEADY))
        ctrl.append((True, header, item.peer, _TAG_CONTROL))
        return [flat, header]

    def _recv_ops(self, item: RecvItem, ops: list[_Op], ctrl: list[_Op]) -> RecvHandle:
        cached = self._received.get(item.key)
        flat = _recv_buffer(cached, self.device)
        handle = RecvHandle(item.key, item.peer, item.what, flat=flat, cached=cached)
        handle.works = [len(ops)]  # replaced by the Work objects once posted
        ops.append((False, flat, item.peer, _TAG_STEADY))
        if self._ctrl_pg is not None:
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
        ops: list[_Op] = []
        ctrl: list[_Op] = []
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
                layout_bytes, payload_bytes = _word(handle.ctrl, 1), _word(handle.ctrl, 2)
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
            return _word(handle.ctrl, 0)
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
        ops: list[_Op] = []
        ctrl: list[_Op] = []
        for key, peer in sends:
            notice = _pack(_FAIL, 0, 0, self._sent.get(key), [], self.device)
            ops.append((True, notice, peer, _TAG_STEADY))
            if self._ctrl_pg is not None:
                ctrl.append((True, _ctrl_header(_FAIL, 0, 0), peer, _TAG_CONTROL))
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
        self._sent.clear()
        self._sent_sig.clear()
        self._received.clear()
        self._before.clear()
        self._unresolved.clear()
