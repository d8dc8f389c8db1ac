"""Cuts of a layer list into contiguous stages: the hand splits peers use, balanced cuts, and the
symbols Megatron's layout string gives each layer.

A cut is a tuple of boundaries ``(0, b1, ..., n)``: stage ``s`` holds layers ``bounds[s]`` up to
(not including) ``bounds[s + 1]``; every stage holds at least one layer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from itertools import pairwise

from pipetrain.plan.errors import ScheduleError

__all__ = [
    "Cut",
    "bounds_of",
    "hand_splits",
    "layer_symbol",
    "minmax_cut",
    "sizes_of",
]

Cut = tuple[int, ...]
SymbolRule = Callable[[str], str]

_EMBED = re.compile(r"(embed|^wte$|^wpe$|^tok_)")
_HEAD = re.compile(r"(^output$|lm_head|^head$|loss|logits|classifier|^out_head$|^score$)")
_FINAL_NORM = {"norm", "ln_f", "final_layernorm", "final_norm", "norm_f", "final_ln", "ln_out"}


def layer_symbol(name: str) -> str:
    """Megatron's symbol for a layer named ``name``: ``"E"`` an embedding (``tok_embeddings``,
    ``wte``, ``embed_tokens``), ``"L"`` the head and loss (``output``, ``lm_head``, ``head``,
    ``loss``), ``"m"`` a multi-token-prediction layer (a name holding ``mtp``), ``""`` a final norm
    (``norm``, ``ln_f``, ``final_layernorm``: no symbol of its own, Megatron builds it with its
    neighbours), and ``"t"`` anything else (a transformer layer). Matched on the dotted name's
    parts, case-insensitively."""
    parts = [p for p in name.lower().split(".") if p]
    if any("mtp" in p for p in parts):
        return "m"
    last = parts[-1] if parts else ""
    if any(_EMBED.search(p) for p in parts):
        return "E"
    if last in _FINAL_NORM:
        return ""
    if any(_HEAD.search(p) for p in parts):
        return "L"
    return "t"


def sizes_of(cut: Cut) -> list[int]:
    return [b - a for a, b in pairwise(cut)]


def bounds_of(sizes: Sequence[int]) -> Cut:
    out = [0]
    for size in sizes:
        out.append(out[-1] + size)
    return tuple(out)


def _spread(count: int, parts: int, extra_from: int = 0) -> list[int] | None:
    """``count`` items in ``parts`` near-equal parts; the larger ones from part ``extra_from`` on."""
    if parts < 1 or count < parts:
        return None
    base, extra = divmod(count, parts)
    sizes = [base] * parts
    order = list(range(extra_from, parts)) + list(range(extra_from))
    for k in order[:extra]:
        sizes[k] += 1
    return sizes


def _units(symbols: Sequence[str]) -> list[int]:
    """Layers grouped into the units torchtitan and Megatron count: the leading run of
    embedding-like layers (with any norm among them) as one unit when it holds an embedding,
    the trailing run of head-like layers (final norm, head, loss, MTP) as one when it holds a
    head, every other layer one unit each. Returns each unit's layer count."""
    n = len(symbols)
    lead = 0
    while lead < n and symbols[lead] in ("E", ""):
        lead += 1
    if "E" not in symbols[:lead]:
        lead = 0
    trail = 0
    while trail < n - lead and symbols[n - 1 - trail] in ("L", "", "m"):
        trail += 1
    if "L" not in symbols[n - trail :]:
        trail = 0
    units = ([lead] if lead else []) + [1] * (n - lead - trail) + ([trail] if trail else [])
    return units


def _from_units(units: Sequence[int], unit_sizes: Sequence[int] | None) -> Cut | None:
    if unit_sizes is None:
        return None
    sizes: list[int] = []
    k = 0
    for count in unit_sizes:
        sizes.append(sum(units[k : k + count]))
        k += count
    return bounds_of(sizes)


def minmax_cut(weights: Sequence[float], num_stages: int, second: Sequence[float] | None = None) -> Cut | None:
    """The contiguous cut into ``num_stages`` non-empty stages whose heaviest stage (sum of
    ``weights``) is lightest; ties go to the lighter heaviest stage by ``second`` (another weight),
    then to the smaller sum of squares. None when there are fewer layers than stages."""
    n = len(weights)
    if num_stages < 1 or n < num_stages:
        return None
    pw = [0.0]
    for x in weights:
        pw.append(pw[-1] + x)
    sec = second if second is not None else [0.0] * n
    ps = [0.0]
    for x in sec:
        ps.append(ps[-1] + x)
    inf = (float("inf"), float("inf"), float("inf"))
    # best[k][i]: (heaviest, heaviest by second, sum of squares) with the first i layers in k stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    back = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0, 0.0)
    for k in range(1, num_stages + 1):
        row, prev = best[k], best[k - 1]
        for i in range(k, n - (num_stages - k) + 1):
            top = inf
            arg = 0
            for j in range(k - 1, i):
                p = prev[j]
                if p[0] == float("inf"):
                    continue
                load = pw[i] - pw[j]
                cand = (max(p[0], load), max(p[1], ps[i] - ps[j]), p[2] + load * load)
                if cand < top:
                    top, arg = cand, j
            row[i] = top
            back[k][i] = arg
    if best[num_stages][n][0] == float("inf"):
        return None
    return traced_cut(back, n, num_stages)


def traced_cut(back: Sequence[Sequence[int]], n: int, num_stages: int) -> Cut:
    """The cut a dynamic program over cuts chose: ``back[k][i]`` is where the k-th stage of the
    best cut of the first ``i`` layers into ``k`` stages begins."""
    cut = [n]
    i = n
    for k in range(num_stages, 0, -1):
        i = back[k][i]
        cut.append(i)
    return tuple(reversed(cut))


def hand_splits(
    symbols: Sequence[str], times: Sequence[float], static: Sequence[float], num_stages: int
) -> list[tuple[str, Cut]]:
    """The cuts peers make by hand (or by their one rule) into ``num_stages`` stages, each named;
    a rule that cannot cut this many stages is left out, and a cut two rules make is listed once,
    under both names (``"a = b"``).

    - ``equal layers``: every layer counts one, the first stages take the remainder;
    - ``torchtitan default``: torchtitan's ``generate_llm_fqn_per_model_part``: the embedding and
      the head (with the final norm) count one layer each, the rest spread evenly, the first
      stages taking the remainder (32 layers on 4 stages: 8, 9, 8, 7 blocks);
    - ``even blocks``: Megatron's default: transformer layers spread evenly, the embedding
      with the first stage and the head with the last;
    - ``Megatron account-for-embedding/loss``: Megatron's ``--account-for-embedding-in-pipeline-split``
      and ``--account-for-loss-in-pipeline-split``: the embedding and the loss count one layer
      each (Megatron needs them to divide evenly; here the stages after the first take the remainder);
    - ``min-max time``: the cut whose slowest stage (f + i + w) is fastest;
    - ``DeepSpeed parameters``: DeepSpeed's ``partition_method="parameters"``, balancing static bytes.
    """
    n = len(symbols)
    units = _units(symbols)
    out: list[tuple[str, Cut | None]] = [
        ("equal layers", bounds_of(_spread(n, num_stages) or []) if n >= num_stages else None),
        ("torchtitan default", _from_units(units, _spread(len(units), num_stages))),
    ]
    blocks = [k for k, s in enumerate(symbols) if s in ("t", "m")]
    even: Cut | None = None
    if len(blocks) >= num_stages and blocks:
        spread = _spread(len(blocks), num_stages)
        assert spread is not None
        sizes = list(spread)
        sizes[0] += blocks[0]  # what comes before the first block joins the first stage
        sizes[-1] += n - 1 - blocks[-1]  # what comes after the last block joins the last
        even = bounds_of(sizes)
    out.append(("even blocks", even))
    out.append(
        ("Megatron account-for-embedding/loss", _from_units(units, _spread(len(units), num_stages, extra_from=1)))
    )
    out.append(("min-max time", minmax_cut(times, num_stages, static)))
    out.append(("DeepSpeed parameters", minmax_cut(static, num_stages, times)))
    named: dict[Cut, list[str]] = {}
    for name, cut in out:
        if cut is not None and len(cut) == num_stages + 1 and all(b > a for a, b in pairwise(cut)):
            named.setdefault(cut, []).append(name)
    return [(" = ".join(names), cut) for cut, names in named.items()]


def check_cut(cut: Sequence[int], n: int, num_stages: int) -> Cut:
    """``cut`` as a Cut, or a ScheduleError saying what is wrong with it."""
    cut = tuple(int(b) for b in cut)
    if len(cut) != num_stages + 1 or cut[0] != 0 or cut[-1] != n or any(b <= a for a, b in pairwise(cut)):
        raise ScheduleError(f"not a cut of {n} layers into {num_stages} non-empty stages: {cut}")
    return cut
