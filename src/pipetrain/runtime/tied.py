"""Weights tied across ranks (a GPT-2's embedding and head): one weight, one gradient.

A model whose input embedding is also its output head (``tie_word_embeddings``) gives the first
and the last stage one parameter. Where both stages run on one rank (a V placement) they hold one
tensor and autograd sums its gradient. Where they run on different ranks, each rank holds a copy
(it built the whole model): after every training step the ranks holding a copy exchange their
shares of its gradient and each adds them up in rank order, so every copy gets the same gradient,
bit for bit, and under the same optimizer stays the same weight. The copies are compared once,
before the first exchange. The pipeline's gradient norm (:func:`pipetrain.clip_grad_norm_`)
counts the weight once, on the rank of its lowest stage.

The ties come from the stages' :class:`~pipetrain.split.StageCut` (stages built by pipetrain's
splitters from one model); stages built otherwise share nothing that pipetrain can see.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from pipetrain.errors import PipelineError
from pipetrain.provenance import TiedParameter, stage_cut
from pipetrain.stage import PipelineStage

__all__ = ["TiedGrads", "is_mirror"]

_TAG = 73
"""The tag of the exchange (gloo matches per tag; the step's own messages use 0 and 1)."""

_MIRRORS = WeakIdKeyDictionary()
"""The copies this rank holds of weights another rank counts (by identity: a tensor's ``==`` is elementwise)."""


def is_mirror(p: torch.Tensor) -> bool:
    """Whether ``p`` is a copy of a weight tied across ranks whose gradient another rank counts."""
    return p in _MIRRORS


@dataclass
class _Tie:
    param: torch.Tensor
    names: str  # "stage 0's 'transformer.wte.weight' and stage 3's 'lm_head.weight'", for errors
    peers: tuple[int, ...]  # the other ranks holding a copy, in rank order (group ranks)
    position: int  # this rank's place among all holders, in rank order


class TiedGrads:
    """The exchange of this rank's tied gradients (see the module's docstring)."""

    def __init__(self, ties: Sequence[_Tie], group: dist.ProcessGroup, where: str) -> None:
        self._ties = list(ties)
        self._group = group
        self._where = where
        self._checked = False

    @classmethod
    def of(
        cls, stages: Sequence[PipelineStage], stage_to_rank: Mapping[int, int], rank: int, group: dist.ProcessGroup
    ) -> TiedGrads | None:
        """The ties of this rank's ``stages`` that span ranks, or None where there are none."""
        tied: dict[tuple[tuple[int, str], ...], TiedParameter] = {}
        for st in stages:
            cut = stage_cut(st.submodule)
            for t in cut.tied if cut is not None else ():
                tied.setdefault(t.members, t)
        by_index = {st.stage_index: st for st in stages}
        ties: list[_Tie] = []
        for t in sorted(tied.values(), key=lambda t: t.members):  # one order on every rank: pairs meet in it
            holders = sorted({stage_to_rank[s] for s, _ in t.members})
            mine = [(s, name) for s, name in t.members if s in by_index]
            if len(holders) < 2 or not mine:
                continue
            s, name = mine[0]
            param = by_index[s].submodule.get_parameter(name)
            if type(param).__name__ == "DTensor" or not isinstance(param, torch.Tensor):
                raise PipelineError(
                    f"rank {rank}: stage {s}'s {name!r} is tied to a weight on another rank but is sharded "
                    "(FSDP); tied weights across ranks need plain parameters: place the tied stages on one "
                    "rank (a V schedule such as ZBVZeroBubble) or untie them"
                )
            owner = stage_to_rank[t.members[0][0]]
            if rank != owner:
                _MIRRORS[param] = True
            names = " and ".join(f"stage {m}'s {n!r}" for m, n in t.members)
            peers = tuple(r for r in holders if r != rank)
            ties.append(_Tie(param, names, peers, holders.index(rank)))
        if not ties:
            return None
        return cls(ties, group, f"rank {rank}")

    def sync(self) -> None:
        """Give every copy the sum of the copies' gradients (a missing gradient counts as zero)."""
        if not self._checked:
            self._checked = True
            for tie in self._ties:
                self._check_equal(tie)
        for tie in self._ties:
            p = tie.param
            mine = p.grad if p.grad is not None else torch.zeros_like(p)
            theirs = self._exchange(mine, tie.peers)
            parts = [*theirs[: tie.position], mine, *theirs[tie.position :]]
            total = parts[0].clone()
            for part in parts[1:]:
                total.add_(part)
            if p.grad is None:
                p.grad = total
            else:
                p.grad.copy_(total)  # the same tensor: views of it (a DDP bucket's) stay right

    def _check_equal(self, tie: _Tie) -> None:
        theirs = self._exchange(tie.param.detach(), tie.peers)
        for peer, value in zip(tie.peers, theirs, strict=True):
            if not torch.equal(value, tie.param.detach()):
                diff = float((value.float() - tie.param.detach().float()).abs().max())
                raise PipelineError(
                    f"{self._where}: {tie.names} are one tied weight, but rank {peer}'s copy differs from this "
                    f"rank's (largest difference {diff:g}): build the model alike on every rank (the same seed) "
                    "or load one checkpoint on every rank before the first step"
                )

    def _exchange(self, tensor: torch.Tensor, peers: Sequence[int]) -> list[torch.Tensor]:
        """``tensor`` sent to each peer and theirs received, pair by pair in rank order (every rank
        takes its pairs in one global order, so no pair waits on a later one)."""
        out = []
        for peer in peers:
            buf = torch.empty_like(tensor)
            dst = dist.get_global_rank(self._group, peer)
            ops = [
                dist.P2POp(dist.isend, tensor.contiguous(), dst, self._group, _TAG),
                dist.P2POp(dist.irecv, buf, dst, self._group, _TAG),
            ]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            out.append(buf)
        return out
