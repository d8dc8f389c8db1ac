"""Wording shared by messages and titles."""

from __future__ import annotations


def count(n: int, noun: str) -> str:
    """``1 microbatch``, ``2 microbatches``: ``noun`` is the plural; a trailing "es"/"s" goes for one."""
    if n != 1:
        return f"{n} {noun}"
    singular = noun[:-2] if noun.endswith(("ches", "shes", "sses")) else noun[:-1] if noun.endswith("s") else noun
    return f"{n} {singular}"
