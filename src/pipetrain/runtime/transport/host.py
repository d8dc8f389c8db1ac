"""The one door through which the runtime reads a data-plane tensor's values on the host.

On a GPU such a read is a device-to-host copy that blocks the host until the tensor is ready,
and with it every kernel queued before: the host can no longer queue work ahead of the device.
The runtime makes none in the steady state (see ``control.py``); every read it does make goes
through :func:`host_read`, which counts it, so tests can assert that the count stays at zero.
Tensors of the control plane (headers and layouts on a CPU channel) are host memory by
construction and are not counted.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["host_read", "host_reads"]

_COUNT = [0]


def host_read(t: torch.Tensor, first_byte: bool = False) -> list[int] | int:
    """``t``'s values on the host (its first byte only with ``first_byte``), counted."""
    _COUNT[0] += 1
    if first_byte:
        if t.device.type == "cpu":  # no copy: the low byte of the first header word
            return int(ctypes.c_uint8.from_address(t.data_ptr()).value)
        t = t.view(torch.uint8)[:1] if t.dtype is not torch.uint8 else t[:1]
        return int(t.tolist()[0])
    values: list[int] = t.tolist()
    return values


def host_reads() -> int:
    """How many reads :func:`host_read` made in this process so far."""
    return _COUNT[0]
