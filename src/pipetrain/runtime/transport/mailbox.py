"""In-process mailboxes for :class:`~pipetrain.runtime.local.LocalPipeline`."""

from __future__ import annotations

from collections import deque
from typing import Any

from pipetrain.runtime.transport.wire import Key, RecvHandle, layout_of, rebuild

__all__ = ["LocalTransport"]


class LocalTransport:
    """In-process mailboxes for :class:`~pipetrain.runtime.local.LocalPipeline`: first in, first out per pair."""

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

    def clear(self) -> None:
        self._boxes.clear()
        self._posted.clear()

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
