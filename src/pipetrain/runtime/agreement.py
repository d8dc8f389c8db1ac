"""Ranks agree on how the model was cut, before their first step.

Each rank builds its own stage modules. When two ranks cut one model differently (a time cut
measured on each rank, different weights), the layers at the boundary run twice or not at all,
and training goes on with a wrong model. A stage module built by :mod:`pipetrain.split` carries
its :class:`~pipetrain.split.StageCut`: the layer names of every stage of the cut and a digest of
each stage's parameter names, shapes and dtypes. Before the first step of a schedule each rank
leaves its stages' cuts in the store (beside what :func:`pipetrain.runtime.failures.agree` leaves
of its schedule, in the same round) and compares them with its neighbours': ranks that exchange messages must hold stages of
one cut of one model. Every rank reads its neighbours' and checks itself, so both sides of a
disagreement raise, each naming the stages and ranks. Stages built otherwise (no ``StageCut``)
are not compared. :func:`check_local` does the same for the stages of one process.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from pipetrain.errors import PipelineError
from pipetrain.plan import Schedule
from pipetrain.provenance import StageCut, stage_cut
from pipetrain.runtime.failures import _ROUNDS, StoreWait, _neighbours
from pipetrain.stage import PipelineStage

__all__ = ["agree_stages", "check_local"]


def _layers(names: Sequence[str]) -> str:
    """``[a, b, c]`` shortened for a message: at most the first and last two names."""
    if len(names) <= 4:
        return "[" + ", ".join(names) + "]"
    return f"[{names[0]}, {names[1]}, … {names[-2]}, {names[-1]}] ({len(names)} layers)"


def _cut_text(cut: StageCut) -> str:
    return ", ".join(f"stage {s} = {_layers(names)}" for s, names in enumerate(cut.layers))


def _cuts(stages: Sequence[PipelineStage]) -> dict[int, StageCut]:
    found = {}
    for st in stages:
        cut = stage_cut(st.submodule)
        if cut is not None:
            found[st.stage_index] = cut
    return found


def _check_own(cuts: Mapping[int, StageCut], stages: Sequence[PipelineStage], who: str) -> None:
    """A stage built from a cut must run as that cut's stage, among that many stages."""
    counts = {st.stage_index: st.num_stages for st in stages}
    for index, cut in cuts.items():
        if cut.index != index:
            raise PipelineError(
                f"{who}: stage {index} was given the module of stage {cut.index} of its cut "
                f"({_layers(cut.layers[cut.index])}); give stage {index} the module split_* returned at index {index}"
            )
        if len(cut.layers) != counts[index]:
            raise PipelineError(
                f"{who}: stage {index} comes from a cut into {len(cut.layers)} stages ({_cut_text(cut)}), "
                f"but the pipeline has {counts[index]} stages"
            )


def _compare(mine: tuple[str, int, StageCut], theirs: tuple[str, int, StageCut]) -> None:
    """Raise if two stages come from different cuts (or different models); ``who`` names each side."""
    (me, my_stage, my_cut), (peer, their_stage, their_cut) = mine, theirs
    if my_cut.layers != their_cut.layers:
        mine_at, theirs_at = _owner(my_cut), _owner(their_cut)
        moved = [n for n in dict.fromkeys([*mine_at, *theirs_at]) if mine_at.get(n) != theirs_at.get(n)]
        raise PipelineError(
            f"{me}: the ranks cut the model into different stages: {me} holds stage {my_stage} = "
            f"{_layers(my_cut.layers[my_stage])} of the cut {_cut_text(my_cut)}; {peer} holds stage {their_stage} = "
            f"{_layers(their_cut.layers[their_stage])} of the cut {_cut_text(their_cut)}. Layers placed differently: "
            f"{_layers(moved)}, which would run twice or not at all. Decide the cut once and give it to every rank "
            "(split by 'time' does when torch.distributed is initialised; a plan's stage_layers with split_by_names)"
        )
    for s, (a, b) in enumerate(zip(my_cut.digests, their_cut.digests, strict=True)):
        if a != b:
            raise PipelineError(
                f"{me}: the ranks built different models: the parameters (names, shapes or dtypes) of stage {s} = "
                f"{_layers(my_cut.layers[s])} differ between {me} (holding stage {my_stage}) and {peer} "
                f"(holding stage {their_stage})"
            )


def _owner(cut: StageCut) -> dict[str, int]:
    return {name: s for s, names in enumerate(cut.layers) for name in names}


def check_local(stages: Sequence[PipelineStage]) -> None:
    """The stages of one process (:class:`~pipetrain.runtime.LocalPipeline`) come from one cut."""
    cuts = _cuts(stages)
    _check_own(cuts, stages, "LocalPipeline")
    items = sorted(cuts.items())
    for (s, cut), (t, other) in itertools.pairwise(items):
        _compare((f"stage {s}'s module", s, cut), (f"stage {t}'s module", t, other))


@contextlib.contextmanager
def agree_stages(wait: StoreWait, schedule: Schedule, stages: Sequence[PipelineStage], rank: int) -> Iterator[None]:
    """Around :func:`~pipetrain.runtime.failures.agree` at a schedule's first step: on entry,
    leave this rank's stage cuts in the store under the round ``agree`` is about to start; once
    it agreed, check the neighbours' cuts against this rank's.

    A rank leaves its cuts before its schedule key, so a neighbour whose schedule key ``agree``
    read has left its cuts too: this adds no wait to the agreement (a rank waits only for the
    ranks ``agree`` waits for, as before).
    """
    peers = _neighbours(schedule, rank)
    failure = wait.failure
    if failure is None or not peers:
        yield
        return
    cuts = _cuts(stages)
    round_ = _ROUNDS.get(failure.namespace, 0) + 1  # the round agree() starts (failures._next_round)
    prefix = f"pipetrain/{failure.namespace}/stages/{round_}/"
    try:
        failure.store.set(f"{prefix}{rank}", json.dumps({str(s): cut.to_dict() for s, cut in cuts.items()}))
        posted = bool(failure.store.check([f"{prefix}{rank}"]))
    except Exception:  # a store without set/check (a fake backend's): nothing to compare with, as in agree()
        posted = False
    yield
    if not posted or failure.generation != round_:  # agree() compared nothing (a store that cannot hold keys)
        return
    _check_own(cuts, stages, f"rank {rank}")
    theirs = wait.values(failure, [f"{prefix}{p}" for p in peers])
    for peer, text in zip(peers, theirs, strict=True):
        data: dict[str, Any] = json.loads(text)
        for t, their in sorted((int(k), StageCut.from_dict(v)) for k, v in data.items()):
            if their.index != t:  # the peer raises too (its own check); this rank must not start either
                raise PipelineError(
                    f"rank {rank}: rank {peer} gave its stage {t} the module of stage {their.index} of its cut "
                    f"({_layers(their.layers[their.index])})"
                )
            if cuts:
                s, mine = min(cuts.items())
                _compare((f"rank {rank}", s, mine), (f"rank {peer}", t, their))
