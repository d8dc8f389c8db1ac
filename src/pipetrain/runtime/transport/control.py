"""The CPU control plane of single-tag mode: where message headers and new layouts travel.

Its own module because it is a channel beside the data, with its own group and its own header
tensors; :class:`~pipetrain.runtime.transport.p2p.DistTransport` posts on it, and
:class:`~pipetrain.runtime.transport.sender.Sender` fills it.

Why it exists (``PIPETRAIN_CONTROL_PLANE=0`` turns it off). Reading a header out of received GPU
data is a device-to-host copy: it blocks the host until the message landed and every kernel
queued before it ran, so the host could never queue work ahead of the GPU. So each message's
header (flag, layout size, payload size) and a new layout's bytes travel on a CPU channel
instead, posted when the SEND is posted: the group itself when it has a CPU backend
(``cpu:gloo,cuda:nccl``), else a gloo group over the same ranks built on the group's store. The
receiver waits only for that header (which the sender's host posted as soon as it had queued the
producing kernels), never for the data: the data's operation is waited for on the consuming
stream (``stream_waits``), and sent buffers are held until the step's sends were waited for on
the stream. The data plane keeps its operations and order (a first message of the remembered
size, then the new payload when the layout changed), so matching is as without the control plane.
Every host read of a data-plane tensor goes through :func:`~pipetrain.runtime.transport.host.host_read`
(counted); with the control plane there is none.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.runtime.transport.wire import _HEADER

__all__ = ["control_default", "control_group", "control_header", "header_word", "private_gloo"]


def control_default() -> bool:
    """The control plane is on unless ``PIPETRAIN_CONTROL_PLANE=0`` (headers in the data, as before)."""
    return os.environ.get("PIPETRAIN_CONTROL_PLANE", "") != "0"


# data group -> the gloo group made for its control plane: it lives as long as its data group, no
# longer (a transport holds both weakly), so dist.destroy_process_group() ends both.
_PRIVATE: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


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


_FIXED: dict[int, torch.Tensor] = {}


def control_header(flag: int, layout_bytes: int, payload_bytes: int) -> torch.Tensor:
    """A control-plane header. Steady (and failure) headers are one shared tensor each: a send
    only reads its buffer, and building one costs more than the rest of a steady message."""
    if layout_bytes == 0 and payload_bytes == 0:
        fixed = _FIXED.get(flag)
        if fixed is None:
            fixed = _FIXED[flag] = torch.tensor([flag] + [0] * (_HEADER - 1), dtype=torch.int64)
        return fixed
    return torch.tensor([flag, layout_bytes, payload_bytes] + [0] * (_HEADER - 3), dtype=torch.int64)


def header_word(t: torch.Tensor, i: int) -> int:
    """Word ``i`` of a control header: host memory, read in place (no copy, nothing counted)."""
    return int(ctypes.c_int64.from_address(t.data_ptr() + 8 * i).value)
