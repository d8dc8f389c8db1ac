"""DistTransport on its own: layouts changing under order-only matching (what NCCL does)."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks

pytestmark = pytest.mark.slow


def _messages(round_: int) -> dict[str, object]:
    """Per key, the message of one round: shapes, structure and plain values change between rounds."""
    g = torch.Generator().manual_seed(round_)
    n = 3 + round_ % 2
    return {
        "a": torch.randn(n, 4, generator=g),
        "b": [torch.randn(2, generator=g), torch.randn(n, generator=g)],
        "c": {"x": torch.randn(1, n, generator=g), "tag": f"r{round_ // 2}"},
    }


def _exchange(rank: int, world: int, single_tag: bool) -> int:
    import torch.distributed as dist

    from pipetrain.transport import DistTransport, RecvItem, SendItem, Waiter

    waiter = Waiter(None, timeout=60.0, poll=0.05, where=lambda: f"rank {rank}")
    transport = DistTransport(dist.group.WORLD, torch.device("cpu"), None, waiter, single_tag=single_tag)
    assert transport.single_tag is single_tag
    checked = 0
    for round_ in range(5):  # rounds 0, 2, 4 share "a"'s shape: steady messages between new layouts
        msgs = _messages(round_)
        if rank == 0:
            # One send per batch, so a receiver posting all three at once is ahead of the sender.
            for key, obj in msgs.items():
                transport.post([SendItem(key, 1, obj, f"send {key}")])
        else:
            handles = transport.post([RecvItem(key, 0, f"recv {key}") for key in msgs])  # three from one peer
            for handle, (key, want) in zip(reversed(handles), reversed(list(msgs.items())), strict=True):
                got = transport.wait(handle)  # waited in the opposite order
                if isinstance(want, dict):  # a plain value travels in the layout
                    assert isinstance(got, dict) and got["tag"] == want["tag"], (round_, key, got)
                    got, want = got["x"], want["x"]
                torch.testing.assert_close(got, want, msg=lambda e, k=key, r=round_: f"round {r}, {k}: {e}")
                checked += 1
        transport.finish()
    waiter.close()
    return checked


@pytest.mark.parametrize("single_tag", [False, True], ids=["tags", "single_tag"])
def test_changing_layouts_match_with_and_without_tags(single_tag: bool) -> None:
    results = run_ranks(_exchange, 2, single_tag)
    assert results == [0, 15]


@pytest.mark.parametrize("old, new", [(1, True), (1, 1.0), (0, False)])
def test_a_plain_value_of_another_type_is_a_new_layout(old: object, new: object) -> None:
    """1 and True compare equal, but a receiver rebuilding the old layout would hand over 1."""
    from pipetrain.transport import _same, layout_of

    t = torch.zeros(2)
    before, _ = layout_of({"x": t, "flag": old})
    after, _ = layout_of({"x": t, "flag": new})
    assert not _same(before, after)
    assert _same(before, layout_of({"x": t, "flag": old})[0])
