"""torch's ``pipelining._debug`` helpers: values described for error messages."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["friendly_debug_info", "map_debug_info"]


def friendly_debug_info(v: object) -> str:
    """A tensor as its shape, ``requires_grad`` and dtype (what matters when stages disagree);
    anything else as ``str``."""
    if isinstance(v, torch.Tensor):
        return f"Tensor({v.shape}, grad={v.requires_grad}, dtype={v.dtype})"
    return str(v)


def map_debug_info(a: Any) -> Any:
    """:func:`friendly_debug_info` applied to every leaf of ``a`` (lists, tuples, dicts)."""
    return pytree.tree_map(friendly_debug_info, a)
