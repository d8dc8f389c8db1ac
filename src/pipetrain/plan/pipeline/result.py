"""What :func:`~pipetrain.plan.plan_pipeline` returns, and the forms a user pastes into a peer."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipetrain.plan.costs import Costs
from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.pipeline.cuts import layer_symbol
from pipetrain.plan.pipeline.layers import LayerCost
from pipetrain.plan.pipeline.search import HandSplit
from pipetrain.plan.search import Plan
from pipetrain.plan.simulate import simulate

__all__ = ["PipelinePlan", "megatron_layout", "parse_megatron_layout"]

SymbolRule = Callable[[str], str] | Mapping[str, str]


@dataclass(frozen=True)
class PipelinePlan(Plan):
    """A plan for the whole pipeline: the cut, placement, recompute and schedule.

    A :class:`~pipetrain.plan.Plan` (``schedule``, ``makespan``, ``memory`` — the largest peak
    in bytes — and ``best_named``, the best named schedule on a hand split, for comparison) with:

    - ``stage_layers``: one list of layer names per stage, in stage order;
    - ``recompute``: the stages that recompute their activations in backward;
    - ``costs``: the per-stage :class:`~pipetrain.plan.Costs` of this cut, which
      ``simulate(plan.schedule, plan.costs)`` reproduces ``makespan`` and ``peak_memory_bytes`` from;
    - ``peak_memory_bytes``: per rank, static + held activations and buffers + transient;
    - ``hand_splits``: every hand split tried, each with its best named schedule that fits.
    """

    stage_layers: list[list[str]]
    recompute: frozenset[int]
    costs: Costs
    peak_memory_bytes: dict[int, float]
    bubble: float
    memory_limit: float | None
    num_ranks: int
    num_microbatches: int
    stages_per_rank: int
    placement: str
    layers: tuple[LayerCost, ...]
    hand_splits: tuple[HandSplit, ...]
    how: str
    search_seconds: float
    notes: tuple[str, ...] = ()

    def __repr__(self) -> str:
        # A dataclass repr would print every layer and hand split (kilobytes): what matters, in a line.
        limit = "none" if self.memory_limit is None else f"{self.memory_limit:.4g}"
        peak = max(self.peak_memory_bytes.values(), default=0.0)
        return (
            f"PipelinePlan({self.schedule.name}, {self.num_ranks} ranks x {self.stages_per_rank} stage(s) "
            f"({self.placement}), {self.num_microbatches} microbatches, stage sizes {self.stage_sizes}, "
            f"recompute {sorted(self.recompute)}, makespan {self.makespan:.4g}, bubble {self.bubble:.1%}, "
            f"peak {peak:.4g} bytes, limit {limit}; plan.summary() has the rest)"
        )

    @property
    def stage_sizes(self) -> list[int]:
        """Layers per stage."""
        return [len(names) for names in self.stage_layers]

    @property
    def stage_to_rank(self) -> dict[int, int]:
        return dict(self.schedule.stage_to_rank)

    def lowered_peak_memory_bytes(self) -> dict[int, float]:
        """Per rank, the peak of the lowered schedule (SEND/RECV added, as the runtime runs it):
        ``simulate(plan.schedule.lower(), plan.costs)``, whose message buffers are posted where the
        lowering puts them. The plan checks ``peak_memory_bytes`` (compute-only) against the limit;
        the two differ by a few message buffers."""
        result = simulate(self.schedule.lower(), self.costs)
        return dict(result.peak_memory_bytes or dict.fromkeys(range(self.num_ranks), 0.0))

    @property
    def best_hand_split(self) -> HandSplit | None:
        """The fastest hand split whose named schedule fits (None if none fits)."""
        fitting = [h for h in self.hand_splits if h.fits]
        return min(fitting, key=lambda h: h.makespan) if fitting else None

    # ------------------------------------------------------------ exports
    def module_fqns_per_model_part(self) -> list[list[str]]:
        """torchtitan's ``module_fqns_per_model_part`` (``[parallelism]`` in its config): the layer
        names of each stage, in stage order. torchtitan places stages in a loop, or in a V for its
        V-shaped schedules (ZBVZeroBubble, DualPipeV); this plan's ``placement`` says which."""
        return [list(names) for names in self.stage_layers]

    torchtitan_fqns = module_fqns_per_model_part

    def megatron_layout(self, symbols: SymbolRule | None = None) -> str:
        """Megatron's ``--pipeline-model-parallel-layout`` for this cut (see :func:`megatron_layout`).

        Megatron puts stage k on rank k mod P (virtual stage k // P), a loop: a plan with V
        placement has no such string and raises ScheduleError."""
        if self.placement == "v" and self.num_ranks > 1:
            raise ScheduleError(
                "Megatron places stage k on rank k mod P (a loop); this plan places its stages in a V. "
                "Plan with placement='loop' for a Megatron layout"
            )
        return megatron_layout(self.stage_layers, symbols)

    def step_terms(self) -> dict[str, list[str]]:
        """What ``makespan`` prices and what it leaves out of a training step, in words.

        It prices each action's compute (the layers' f, b, i, w, a recomputed stage's rebuild)
        and the message latency (``comm``); the optimizer step where the layers' w and b carry it
        (:func:`~pipetrain.plan.pipeline.layers.with_optimizer`); it leaves out an optimizer
        step the layers still hold apart (their ``optimizer``), posting messages (``Costs.send``
        and ``recv``, the lowered schedule's) and a runtime's time per action
        (``Costs.action_overhead``), which ``pipetrain train`` prices in its step promise."""
        prices = ["compute (the layers' f, b, i, w)", f"message latency (comm {self.costs.comm:.4g})"]
        leaves_out: list[str] = []
        apart = sum(layer.optimizer for layer in self.layers)
        if apart > 0:
            leaves_out.append(
                f"the optimizer step ({apart:.4g} in all, held apart in the layers' optimizer: "
                "plan with with_optimizer(layers, num_microbatches) to price it)"
            )
        else:
            prices.append("the optimizer step where the layers' w and b carry it (with_optimizer)")
        for name, what in (("send", "posting a message"), ("action_overhead", "a runtime's time per action")):
            value = getattr(self.costs, name)
            (prices if value else leaves_out).append(f"{what} ({name} {value:.4g})" if value else what)
        leaves_out.append("the training loop's own time (drawing data, reading losses)")
        return {"prices": prices, "leaves_out": leaves_out}

    def summary(self) -> dict[str, Any]:
        """A JSON-ready summary (what ``pipetrain plan --layers ... --json`` prints)."""
        try:
            megatron: str | None = self.megatron_layout()
        except ScheduleError:
            megatron = None
        return {
            "num_ranks": self.num_ranks,
            "num_microbatches": self.num_microbatches,
            "stages_per_rank": self.stages_per_rank,
            "placement": self.placement,
            "memory_limit": self.memory_limit,
            "schedule": self.schedule.name,
            "stage_layers": self.module_fqns_per_model_part(),
            "stage_sizes": self.stage_sizes,
            "stage_to_rank": {str(s): r for s, r in sorted(self.stage_to_rank.items())},
            "recompute": sorted(self.recompute),
            "makespan": self.makespan,
            "makespan_terms": self.step_terms(),
            "bubble": self.bubble,
            "peak_memory_bytes": {str(r): v for r, v in sorted(self.peak_memory_bytes.items())},
            "lowered_peak_memory_bytes": {str(r): v for r, v in sorted(self.lowered_peak_memory_bytes().items())},
            "how": self.how,
            "search_seconds": self.search_seconds,
            "costs": str(self.costs),
            "module_fqns_per_model_part": self.module_fqns_per_model_part(),
            "pipeline_model_parallel_layout": megatron,
            "hand_splits": [
                {
                    "rule": h.rule,
                    "stages_per_rank": h.stages_per_rank,
                    "placement": h.placement,
                    "stage_sizes": list(h.sizes),
                    "schedule": h.schedule_name,
                    "fits": h.fits,
                    "makespan": h.makespan,
                    "bubble": h.bubble,
                    "peak_memory_bytes": {str(r): v for r, v in sorted(h.peak_memory_bytes.items())},
                    **({"closest": h.closest} if not h.fits else {}),
                }
                for h in self.hand_splits
            ],
        }


def _rule(symbols: SymbolRule | None) -> Callable[[str], str]:
    if symbols is None:
        return layer_symbol
    if callable(symbols):
        return symbols
    table = dict(symbols)

    def lookup(name: str) -> str:
        return table[name] if name in table else layer_symbol(name)

    return lookup


def megatron_layout(stage_layers: Sequence[Sequence[str]], symbols: SymbolRule | None = None) -> str:
    """Megatron's ``--pipeline-model-parallel-layout`` string for stages of named layers.

    Each layer becomes a symbol by ``symbols`` (a function of the name, or a mapping of names,
    others by :func:`~pipetrain.plan.pipeline.cuts.layer_symbol`): ``E`` embedding, ``t``
    transformer layer, ``m`` MTP layer, ``L`` loss (the head), ``""`` none (a final norm).
    Several embedding (or head) layers in one stage make one ``E`` (``L``); stages are joined by
    ``|``, a run of one symbol is written ``t*N`` and repeated stages ``(tt|)*N``, as in
    Megatron's example ``Et*3|(tt|)*29,m|L``. Raises ScheduleError when an embedding or a head
    falls in more than one stage (Megatron builds each in one place).
    """
    rule = _rule(symbols)
    texts: list[str] = []
    where: dict[str, int] = {}
    for s, names in enumerate(stage_layers):
        stage: list[str] = []
        for name in names:
            sym = rule(name)
            if sym not in ("E", "t", "m", "L", ""):
                raise ScheduleError(f"layer {name!r}: symbol {sym!r} is not one of Megatron's E, t, m, L (or '')")
            if not sym or (sym in ("E", "L") and stage and stage[-1] == sym):
                continue
            if sym in ("E", "L"):
                if where.get(sym, s) != s:
                    kind = "embedding" if sym == "E" else "head/loss"
                    raise ScheduleError(
                        f"the {kind} layers fall in stages {where[sym]} and {s}; Megatron's layout holds one {sym}"
                    )
                where[sym] = s
            stage.append(sym)
        texts.append(_runs(stage))
    return _stages(texts)


def _runs(symbols: Sequence[str]) -> str:
    out: list[str] = []
    k = 0
    while k < len(symbols):
        j = k
        while j < len(symbols) and symbols[j] == symbols[k]:
            j += 1
        count = j - k
        out.append(symbols[k] if count == 1 else symbols[k] * 2 if count == 2 else f"{symbols[k]}*{count}")
        k = j
    return "".join(out)


def _stages(texts: Sequence[str]) -> str:
    """Stages joined by ``|``, runs of equal stages as ``(s|)*N`` (the last stage written alone)."""
    groups: list[tuple[str, int]] = []
    for text in texts:
        if groups and groups[-1][0] == text:
            groups[-1] = (text, groups[-1][1] + 1)
        else:
            groups.append((text, 1))
    parts: list[str] = []
    for k, (text, count) in enumerate(groups):
        last = k == len(groups) - 1
        if last:
            count -= 1  # the final stage is written without a trailing '|'
        if count == 1:
            parts.append(f"{text}|")
        elif count > 1:
            parts.append(f"({text}|)*{count}")
        if last:
            parts.append(text)
    return "".join(parts)


def parse_megatron_layout(text: str) -> list[list[str]]:
    """The symbols of each stage of a ``--pipeline-model-parallel-layout`` string (``,`` ignored,
    ``x*N`` and ``(...)*N`` expanded, ``|`` between stages, empty stages kept)."""
    flat = _expand(text.replace(",", "").replace(" ", ""))
    stages: list[list[str]] = [[]]
    for ch in flat:
        if ch == "|":
            stages.append([])
        else:
            stages[-1].append(ch)
    return stages


def _expand(text: str) -> str:
    out: list[str] = []
    k = 0
    while k < len(text):
        ch = text[k]
        if ch == "(":
            depth, j = 1, k + 1
            while j < len(text) and depth:
                depth += {"(": 1, ")": -1}.get(text[j], 0)
                j += 1
            if depth:
                raise ScheduleError(f"layout {text!r}: unbalanced parentheses")
            inner = _expand(text[k + 1 : j - 1])
            k = j
            count, k = _count(text, k)
            out.append(inner * count)
        elif ch in "EtmL|":
            count, nxt = _count(text, k + 1)
            out.append(ch * count if ch != "|" else ch)
            k = nxt if ch != "|" else k + 1
        else:
            raise ScheduleError(f"layout {text!r}: unexpected {ch!r} at {k}")
    return "".join(out)


def _count(text: str, k: int) -> tuple[int, int]:
    if k < len(text) and text[k] == "*":
        match = re.match(r"\*(\d+)", text[k:])
        if match is None:
            raise ScheduleError(f"layout {text!r}: '*' needs a count at {k}")
        return int(match.group(1)), k + match.end()
    return 1, k
