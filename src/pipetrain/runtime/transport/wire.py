"""The wire format: a message as one flat buffer (header, then its tensors) and back.

A message is any pytree of tensors and plain values. ``layout_of`` splits it into a
:class:`Layout` (structure, plain values, tensor specs) and its tensors; ``_pack`` writes them
into one buffer; ``_unpack`` and ``rebuild`` reverse that. See ``p2p.py`` for how layouts travel.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten, treespec_dumps, treespec_loads

__all__ = ["Layout", "RecvHandle", "RecvItem", "SendItem", "layout_of", "rebuild"]

Key = tuple[str, int, int]  # (direction "F" or "B", source stage, microbatch)
_HEADER = 8  # int64 words: [flag, layout bytes, payload bytes, 0...]; 64 bytes keep tensors aligned
_SAME, _NEW, _FAIL = 0, 1, 2
_TAG_STEADY, _TAG_NEW, _TAG_CONTROL = 0, 1, 2


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
    def decode(data: bytes) -> Layout:
        """The layout :meth:`encode` wrote (its bytes read on the host by the caller)."""
        spec, plain, tensors = pickle.loads(data)
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
    flag: int,
    extra: int,
    extra2: int,
    layout: Layout | None,
    tensors: list[torch.Tensor],
    device: torch.device,
    header: bool = True,
) -> torch.Tensor:
    """One flat byte buffer: the int64 header, then each tensor at an aligned offset.

    ``header=False`` leaves the header bytes unwritten (the control plane carries them; on a GPU
    that saves four small kernels per message).
    """
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
    if header:
        words = flat[: _HEADER * 8].view(torch.int64)
        words.zero_()
        words[0] = flag
        words[1] = extra
        words[2] = extra2
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
    """The buffer a message of ``layout`` is received into: typed for one tensor, else bytes.

    Off the CPU always bytes, as the sender packs them there: NCCL is not relied on to match a
    send and a receive of one size but different dtypes (the tensor is then a view of the bytes).
    """
    single = layout.single if layout is not None else None
    if single is not None and device.type == "cpu":
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
    (``settled``), then the follow-ups of a new layout (``encoded`` and ``flat``), if any. With a
    control plane, ``ctrl`` is the header received there (host memory) and ``ctrl_works`` its
    operations (then those of the layout bytes); ``stub`` keeps the buffer of a first message
    whose layout changed alive until its operation completed.
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
    ctrl: torch.Tensor | None = None
    ctrl_works: list[Any] = field(default_factory=list)
    stub: torch.Tensor | None = None


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


def _shapes(layout: Layout, skip: int = 0) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """Dtypes and shapes of a layout's tensors, without their first ``skip`` dimensions."""
    return [(dtype, tuple(shape)[skip:]) for dtype, shape, _ in layout.tensors]


def _specs(layout: Layout) -> str:
    return (
        ", ".join(f"{str(dtype).replace('torch.', '')} {list(shape)}" for dtype, shape, _ in layout.tensors)
        or "no tensors"
    )
