"""Moving stage inputs, outputs and gradients between ranks.

``wire``: the message format (one flat buffer per message). ``p2p``: ``torch.distributed``
point-to-point operations and the protocol for messages whose layout changed; ``sender`` builds
what a send posts, ``control`` is the CPU control plane that carries headers and layouts under
NCCL. ``completion``: waiting on those operations without
blocking past a failure elsewhere (device data: on the stream). ``host``: the one, counted, host
read of a data-plane tensor. ``mailbox``: in-process hand-over for
:class:`~pipetrain.runtime.local.LocalPipeline`.
"""

from __future__ import annotations

from pipetrain.runtime.transport.completion import Waiter
from pipetrain.runtime.transport.mailbox import LocalTransport
from pipetrain.runtime.transport.p2p import DistTransport
from pipetrain.runtime.transport.wire import Layout, RecvHandle, RecvItem, SendItem, layout_of, rebuild

__all__ = [
    "DistTransport",
    "Layout",
    "LocalTransport",
    "RecvHandle",
    "RecvItem",
    "SendItem",
    "Waiter",
    "layout_of",
    "rebuild",
]
