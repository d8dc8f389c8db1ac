"""Wording shared by messages and titles."""

from __future__ import annotations


def count(n: int, noun: str) -> str:
    """``1 microbatch``, ``2 microbatches``: ``noun`` is the plural; a trailing "es"/"s" goes for one."""
    if n != 1:
        return f"{n} {noun}"
    singular = noun[:-2] if noun.endswith(("ches", "shes", "sses")) else noun[:-1] if noun.endswith("s") else noun
    return f"{n} {singular}"


def align_columns(rows: list[list[str]], gap: str) -> list[str]:
    """``rows`` as lines of left-aligned columns ``gap`` apart, trailing blanks dropped (text grids)."""
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return [gap.join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
