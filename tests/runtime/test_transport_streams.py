"""The GPU-only paths, run on the CPU with stand-ins: streams, waits without a host block, batches."""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn


class _Stream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.waited_for: list[_Stream] = []

    def wait_stream(self, other: _Stream) -> None:
        self.waited_for.append(other)


class _Streams:
    """A device's streams as ``pipetrain._streams`` sees them: the current one, and switching."""

    def __init__(self) -> None:
        self.main = _Stream("main")
        self.current = self.main

    def current_stream(self, device: torch.device) -> _Stream:
        return self.current

    @contextlib.contextmanager
    def use(self, stream: _Stream) -> Iterator[None]:
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before


def test_w_runs_on_the_stream_its_i_ran_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """I on a side stream (an overlapping custom function, say): W runs there, then main waits for it."""
    import pipetrain._streams as streams
    import pipetrain.stage as stage_module
    from pipetrain import PipelineStage

    fake = _Streams()
    monkeypatch.setitem(streams._KINDS, "cpu", (fake.current_stream, fake.use))
    ran_on: list[str] = []
    real = stage_module.backward_weight

    def spy(plan: Any) -> None:
        ran_on.append(fake.current.name)
        real(plan)

    monkeypatch.setattr(stage_module, "backward_weight", spy)
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    ref = layer  # compare with a plain backward of the same parameters first
    x = torch.randn(3, 4, requires_grad=True)
    ref(x).sum().backward()
    want = [p.grad.clone() for p in ref.parameters() if p.grad is not None]
    layer.zero_grad(set_to_none=True)
    stage = PipelineStage(layer, 1, 2, "cpu")
    out = stage.forward_one_chunk(0, (x.detach().requires_grad_(),))
    side = _Stream("side")
    with fake.use(side):
        stage.backward_one_chunk(0, grad_outputs=[torch.ones_like(out)], full=False)
    assert fake.current is fake.main
    stage.backward_weight_one_chunk(0)
    assert ran_on == ["side"]
    assert fake.main.waited_for == [side]  # the caller's stream waits for W's (no host wait)
    for got, exp in zip([p.grad for p in layer.parameters()], want, strict=True):
        torch.testing.assert_close(got, exp)


def test_w_on_the_same_stream_switches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import pipetrain._streams as streams
    from pipetrain import PipelineStage

    fake = _Streams()
    monkeypatch.setitem(streams._KINDS, "cpu", (fake.current_stream, fake.use))
    stage = PipelineStage(nn.Linear(4, 4), 1, 2, "cpu")
    out = stage.forward_one_chunk(0, (torch.randn(2, 4, requires_grad=True),))
    stage.backward_one_chunk(0, grad_outputs=[torch.ones_like(out)], full=False)
    stage.backward_weight_one_chunk(0)
    assert fake.main.waited_for == []


class _Work:
    def __init__(self, log: list[tuple[str, tuple[Any, ...]]], name: str) -> None:
        self.log = log
        self.name = name

    def wait(self, *args: Any) -> bool:
        self.log.append((self.name, args))
        return True


def test_stream_waits_pass_no_timeout_and_sent_buffers_live_until_drained() -> None:
    """NCCL's ``wait`` blocks the host when given a timeout: device data is waited for without one,
    and a sent buffer is dropped only once its send was waited for on the stream."""
    from pipetrain.runtime.transport import Waiter

    log: list[tuple[str, tuple[Any, ...]]] = []
    waiter = Waiter(None, timeout=5.0, poll=0.01, where=lambda: "rank 0")
    try:
        waiter.wait_stream([_Work(log, "recv")], "a receive")
        assert log == [("recv", ())]
        buffer = torch.empty(16)
        alive = weakref.ref(buffer)
        waiter.background([_Work(log, "ctrl")], [buffer], None, ("1SEND_F0", 1), [_Work(log, "data")])
        del buffer
        assert alive() is not None  # held while its send may be in flight
        waiter.drain()
        assert ("data", ()) in log and ("ctrl", ()) in log
        assert log.index(("data", ())) < log.index(("ctrl", ()))
        for _ in range(200):  # the helper thread drops the buffers after the host works
            if alive() is None:
                break
            time.sleep(0.01)
        assert alive() is None
    finally:
        waiter.close()


def test_a_coalesced_batch_stands_for_each_operation(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL's batch_isend_irecv returns one work for the whole batch: every operation gets it."""
    import torch.distributed as dist

    from pipetrain.runtime.transport import DistTransport

    log: list[tuple[str, tuple[Any, ...]]] = []
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [_Work(log, "batch")])
    monkeypatch.setattr(dist, "P2POp", lambda *args, **kwargs: None)
    transport = DistTransport.__new__(DistTransport)
    transport._pg = None
    transport._ctrl_pg = None
    transport.group = None
    works = transport._launch(
        [(True, torch.zeros(1), 1, 0), (False, torch.zeros(2), 1, 0), (False, torch.zeros(3), 0, 0)]
    )
    assert len(works) == 3 and works[0] is works[2]
    works[2].wait()
    assert log == [("batch", ())]


def test_off_the_cpu_a_one_tensor_message_is_received_as_bytes() -> None:
    """The device packs bytes; its receive buffer is bytes too (NCCL need not match dtypes), and
    the tensor is read back as a view of them."""
    from pipetrain.runtime.transport.wire import _SAME, _pack, _recv_buffer, _unpack, layout_of, rebuild

    t = torch.randn(3, 4).t()
    layout, tensors = layout_of([t])
    assert layout.single is not None
    assert _recv_buffer(layout, torch.device("meta")).dtype is torch.uint8
    flat = _pack(_SAME, 0, 0, layout, tensors, torch.device("cpu"))
    received = torch.empty(flat.nbytes, dtype=torch.uint8)
    received.copy_(flat.view(torch.uint8))  # what the wire does
    got = rebuild(layout, _unpack(received, layout))
    assert got[0].untyped_storage().data_ptr() == received.untyped_storage().data_ptr()
    torch.testing.assert_close(got[0], t)
