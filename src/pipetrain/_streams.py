"""Streams for split backward: W runs on the stream its I ran on.

I (input grads) keeps a plan that W (weight grads) runs later. When I ran on a side stream (a
custom ``OVERLAP_F_B`` function overlapping F and B on two streams, say), W reads what I left on
that stream, so it must run there too; the stream W was called on then waits for it (a device-side
wait, never a host one), so the gradients it accumulated are ready for whatever comes next.
On devices without streams (the CPU) this is a no-op. ``_KINDS`` maps a device type to its
``(current_stream, use_stream)`` pair; tests register a stand-in for the CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["current_stream", "on_stream"]


def _cuda_current(device: torch.device) -> Any:
    return torch.cuda.current_stream(device)


def _cuda_use(stream: Any) -> contextlib.AbstractContextManager[Any]:
    return torch.cuda.stream(stream)


_KINDS: dict[str, tuple[Callable[[torch.device], Any], Callable[[Any], contextlib.AbstractContextManager[Any]]]] = {
    "cuda": (_cuda_current, _cuda_use),
}


def current_stream(device: torch.device) -> Any:
    """The stream work on ``device`` is queued on now; None for a device without streams."""
    kind = _KINDS.get(device.type)
    return None if kind is None else kind[0](device)


@contextlib.contextmanager
def on_stream(stream: Any, device: torch.device) -> Iterator[None]:
    """Run the body on ``stream`` (from :func:`current_stream`), then make the caller's stream wait for it."""
    kind = _KINDS.get(device.type)
    if stream is None or kind is None:
        yield
        return
    caller = kind[0](device)
    if caller == stream:
        yield
        return
    with kind[1](stream):
        yield
    caller.wait_stream(stream)
