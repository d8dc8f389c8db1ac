"""DistTransport on its own: layouts changing under order-only matching (what NCCL does)."""

from __future__ import annotations

import pytest
import torch

from support.dist import run_ranks

pytestmark = pytest.mark.slow


def _messages(round_: int) -> dict[str, object]:
    """Per key, the message of one round: shapes, structure and plain values change between rounds."""
    g = torch.Generator().manual_seed(round_)
    n = 3 + round_ % 2
    return {
        "a": torch.randn(n, 4, generator=g),
        "b": [torch.randn(2, generator=g), torch.randn(n, generator=g)],
        "c": {"x": torch.randn(1, n, generator=g), "tag": f"r{round_ // 2}"},
        # One tensor in a list or tuple (input gradients travel so): the typed one-view buffer.
        "d": [torch.randn(n, 2, generator=g).t()],
        "e": (torch.arange(n, dtype=torch.int16),),
    }


# (single tag, control plane, waits on the stream, control plane on a gloo group of its own)
_CONFIGS = {
    "tags": (False, False, False, False),
    "single_tag, headers in the data": (True, False, False, False),
    "single_tag, control plane, stream waits": (True, True, True, False),
    "single_tag, control plane on a private gloo group": (True, True, False, True),
}


def _exchange(rank: int, world: int, configs: list[tuple[bool, bool, bool, bool]]) -> list[int]:
    import torch.distributed as dist

    from pipetrain.runtime.transport import DistTransport, RecvItem, SendItem, Waiter
    from pipetrain.runtime.transport.control import private_gloo

    counts = []
    for single_tag, control, stream_waits, private in configs:
        waiter = Waiter(None, timeout=60.0, poll=0.05, where=lambda: f"rank {rank}")
        transport = DistTransport(
            dist.group.WORLD, torch.device("cpu"), None, waiter, single_tag, control, stream_waits
        )
        assert transport.single_tag is single_tag and transport.control is control
        if private:  # what a group without a CPU backend (NCCL alone) gets
            transport._ctrl_pg = private_gloo(dist.group.WORLD, 60.0)
            assert transport._ctrl_pg is not dist.group.WORLD
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
                    assert type(got) is type(want), (round_, key, type(got))
                    torch.testing.assert_close(got, want, msg=lambda e, k=key, r=round_: f"round {r}, {k}: {e}")
                    checked += 1
            transport.finish()
        waiter.close()
        counts.append(checked)
    return counts


def test_changing_layouts_match_in_every_mode() -> None:
    """gloo's tags; order-only matching (NCCL's) with headers in the data or on the control plane."""
    results = run_ranks(_exchange, 2, list(_CONFIGS.values()))
    assert results == [[0] * len(_CONFIGS), [25] * len(_CONFIGS)]


@pytest.mark.parametrize("old, new", [(1, True), (1, 1.0), (0, False)])
def test_a_plain_value_of_another_type_is_a_new_layout(old: object, new: object) -> None:
    """1 and True compare equal, but a receiver rebuilding the old layout would hand over 1."""
    from pipetrain.runtime.transport.wire import _same, layout_of

    t = torch.zeros(2)
    before, _ = layout_of({"x": t, "flag": old})
    after, _ = layout_of({"x": t, "flag": new})
    assert not _same(before, after)
    assert _same(before, layout_of({"x": t, "flag": old})[0])


@pytest.mark.parametrize("container", [None, list, tuple])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.complex128, torch.bool])
def test_one_tensor_messages_are_one_view_of_a_typed_buffer(container: type | None, dtype: torch.dtype) -> None:
    """A tensor alone or in a one-element list/tuple (input gradients) unpacks without a copy."""
    from pipetrain.runtime.transport.wire import _SAME, _pack, _recv_buffer, _unpack, layout_of, rebuild

    t = (torch.arange(12).reshape(3, 4) % 2).to(dtype).t()  # non-contiguous on purpose
    obj = t if container is None else container([t])
    layout, tensors = layout_of(obj)
    assert layout.single is not None and layout.single[0] is dtype
    flat = _pack(_SAME, 0, 0, layout, tensors, torch.device("cpu"))
    buffer = _recv_buffer(layout, torch.device("cpu"))
    assert buffer.dtype is dtype and buffer.nbytes == flat.nbytes
    buffer.view(torch.uint8).copy_(flat.view(torch.uint8))  # what the wire does
    got = rebuild(layout, _unpack(buffer, layout))
    assert type(got) is type(obj)
    value = got if container is None else got[0]
    assert value.data_ptr() != 0 and value.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    torch.testing.assert_close(value, t)
