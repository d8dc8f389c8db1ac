"""The sending half of :class:`~pipetrain.runtime.transport.p2p.DistTransport`'s protocol.

Its own module because it only builds operations, never posts or waits: from an object and the
layout its receiver remembers under the same key, the operations that carry it (one steady
message; or a notice and the two follow-ups of a new layout, see ``p2p``), and the failure
notice that completes a receive posted for it. The receiving half needs the group and the
waiter, so it stays with the posting in ``p2p``.
"""

from __future__ import annotations

from typing import Any

import torch

from pipetrain.runtime.transport.control import control_header
from pipetrain.runtime.transport.wire import (
    _FAIL,
    _NEW,
    _SAME,
    _TAG_CONTROL,
    _TAG_STEADY,
    Key,
    Layout,
    SendItem,
    _fingerprint,
    _pack,
    _same,
    _signature,
    layout_of,
)

__all__ = ["Op", "Sender"]

Op = tuple[bool, torch.Tensor, int, int]  # (is a send, tensor, group peer, tag)


class Sender:
    """What each key's receiver remembers of our messages, and the operations that send the next.

    ``control``: headers and new layouts go on the control plane (the ``ctrl`` operations), else
    in the data. ``tag_new``: the tag of a new layout's follow-ups.
    """

    def __init__(self, device: torch.device, control: bool, tag_new: int) -> None:
        self.device = device
        self.control = control
        self.tag_new = tag_new
        self.sent: dict[Key, Layout] = {}
        self._sig: dict[Key, Any] = {}  # _signature of the last plain message sent per key
        # Whether the last message built was one operation of a layout its receiver knows: its
        # RECV's post then posts all it needs (a new layout's follow-ups wait for the receiver
        # to read the notice), which plan.delivery's confirmations rely on.
        self.last_steady = False

    def ops(self, item: SendItem, ops: list[Op], ctrl: list[Op]) -> list[torch.Tensor]:
        """Append ``item``'s operations to ``ops`` (data) and ``ctrl`` (control plane); the
        tensors to keep alive until they complete."""
        obj, item.obj = item.obj, None  # packed below: the message keeps no reference to the output
        control = self.control
        sig = _signature(obj)
        old = self.sent.get(item.key)
        if sig is not None and old is not None and self._sig.get(item.key) == sig:
            # Steady state of a plain message: same container and tensor specs, no pytree needed.
            tensors = [obj.detach()] if sig[0] is torch.Tensor else [t.detach() for t in obj]
            return self._steady(item, old, tensors, ops, ctrl)
        layout, tensors = layout_of(obj)
        tensors = [t.detach() for t in tensors]
        if sig is not None and layout.simple is sig[0]:
            self._sig[item.key] = sig
        else:
            self._sig.pop(item.key, None)
        if old is not None and _same(old, layout):
            return self._steady(item, layout, tensors, ops, ctrl)
        self.last_steady = False
        # The receiver posted a message of the remembered size: fill it with a notice giving the
        # sizes of the two follow-ups (the new layout, then the packed tensors). With the control
        # plane the notice's words and the layout go there instead; the data plane carries the
        # (unread) notice and the tensors.
        encoded = layout.encode()
        payload = _pack(_NEW, 0, 0, layout, tensors, self.device, header=not control)
        notice = _pack(_NEW, encoded.numel(), payload.nbytes, old, [], self.device, header=not control)
        ops.append((True, notice, item.peer, _TAG_STEADY))
        if control:
            header = control_header(_NEW, encoded.numel(), payload.nbytes)
            ctrl.append((True, header, item.peer, _TAG_CONTROL))
            ctrl.append((True, encoded, item.peer, _TAG_CONTROL))
            keep = [notice, payload, header, encoded]
        else:
            encoded = encoded.to(self.device)
            ops.append((True, encoded, item.peer, self.tag_new))
            keep = [notice, encoded, payload]
        ops.append((True, payload, item.peer, self.tag_new))
        _fingerprint(layout)  # now: the plain values as sent, before the caller may change them
        self.sent[item.key] = layout
        return keep

    def _steady(
        self, item: SendItem, layout: Layout, tensors: list[torch.Tensor], ops: list[Op], ctrl: list[Op]
    ) -> list[torch.Tensor]:
        """A message whose layout the receiver knows: one data operation (and a header on the control plane)."""
        self.last_steady = True
        if not self.control:
            flat = _pack(_SAME, 0, 0, layout, tensors, self.device)
            ops.append((True, flat, item.peer, _TAG_STEADY))
            return [flat]
        flat = _pack(_SAME, 0, 0, layout, tensors, self.device, header=False)
        header = control_header(_SAME, 0, 0)
        ops.append((True, flat, item.peer, _TAG_STEADY))
        ctrl.append((True, header, item.peer, _TAG_CONTROL))
        return [flat, header]

    def failure(self, key: Key, peer: int, ops: list[Op], ctrl: list[Op]) -> None:
        """Append a failure notice for ``key``: of the size its receiver posted (both sides remember
        the same layouts), so it completes that receive; on the control plane a failure header too."""
        ops.append((True, _pack(_FAIL, 0, 0, self.sent.get(key), [], self.device), peer, _TAG_STEADY))
        if self.control:
            ctrl.append((True, control_header(_FAIL, 0, 0), peer, _TAG_CONTROL))

    def reset(self) -> None:
        """Forget every layout sent (after a failure both sides start afresh)."""
        self.sent.clear()
        self._sig.clear()
