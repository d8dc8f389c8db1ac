"""pipetrain's copies of torch's private lowering passes (``pipetrain.schedules._add_send_recv``
and friends) give what torch's own give, action for action, over a grid of schedules."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

import pipetrain.schedules as ours
from pipetrain.plan import build_schedule

theirs = pytest.importorskip("torch.distributed.pipelining.schedules")
importlib.import_module("torch.distributed.pipelining")

pytestmark = pytest.mark.torch_interop

GRID = [
    (name, ranks, mbs, spr)
    for name, spr in (
        ("1F1B", 1),
        ("GPipe", 1),
        ("ZBH1", 1),
        ("Interleaved1F1B", 2),
        ("InterleavedZeroBubble", 2),
        ("LoopedBFS", 2),
        ("ZBVZeroBubble", 2),
        ("DualPipeV", 2),
        ("Interleaved1F1B", 3),
    )
    for ranks in (2, 3, 4)
    for mbs in (4, 8)
]


def _torch(row: list[Any]) -> list[Any]:
    return [None if a is None else theirs._Action.from_str(str(a)) for a in row]


def _text(rows: dict[int, list[Any]]) -> dict[int, list[str]]:
    return {r: _no_waits(row) for r, row in rows.items()}


def _no_waits(row: list[Any]) -> list[str]:
    """A row as text without torch 2.15's wait actions (``1WAIT_REDUCE_GRAD``, ``0WAIT_SEND_F3``),
    which its passes add and pipetrain's grammar reads and drops; on torch 2.13 there are none."""
    return [str(a) for a in row if "WAIT_" not in str(a)]


@pytest.mark.parametrize(("name", "ranks", "mbs", "spr"), GRID)
def test_the_passes_match_torchs(name: str, ranks: int, mbs: int, spr: int) -> None:
    sched = build_schedule(name, ranks, mbs, spr)
    order = {r: list(row) for r, row in sched.actions.items()}
    place = dict(sched.stage_to_rank)

    def where(s: int) -> int:
        return place[s]

    for r, row in order.items():
        assert [str(a) for a in ours._merge_bw(row)] == [str(a) for a in theirs._merge_bw(_torch(row))]
        assert [str(a) for a in ours._add_reduce_grad(row, mbs)] == _no_waits(theirs._add_reduce_grad(_torch(row), mbs))
        assert [str(a) for a in ours._add_unshard_reshard(row)] == [
            str(a) for a in theirs._add_unshard_reshard(_torch(row))
        ], (name, r)
    mine = ours._add_send_recv(order, where, sched.num_stages)
    torch_order = {r: _torch(row) for r, row in order.items()}
    want = theirs._add_send_recv(torch_order, where, sched.num_stages)
    assert _text(mine) == _text(want)
    assert _text(ours._defer_recv_ops(dict(mine), where)) == _text(theirs._defer_recv_ops(want, where))
    if any(a is not None and a.sub_actions is not None for row in order.values() for a in row):
        return  # torch's dry run has no OVERLAP_F_B (its container's stage -1 fails a lookup): nothing to match
    steps = ours._simulate_comms_compute(mine, where, sched.num_stages)
    assert _text(steps) == _text(theirs._simulate_comms_compute(want, where, sched.num_stages))


def test_a_stalled_order_is_refused_as_torch_refuses_it() -> None:
    order = {0: [ours._Action.from_str("0B0")], 1: [ours._Action.from_str("1F0")]}
    with pytest.raises(AssertionError, match="Malformed compute schedule"):
        ours._add_send_recv(order, lambda s: s, 2)
    with pytest.raises(ValueError, match="not progressing"):
        ours._simulate_comms_compute({0: [ours._Action.from_str("0RECV_B0")], 1: []}, lambda s: s, 2)
