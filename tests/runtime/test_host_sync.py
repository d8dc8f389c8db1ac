"""NCCL's code path (order-only matching: single-tag mode on gloo) reads nothing on the host.

Every host read of a data-plane tensor goes through ``transport.host.host_read``, which counts.
With the control plane (headers and layouts on a CPU channel) the count stays at zero for every
schedule, even when the sequence length changes between steps; with headers in the data (the
control plane off) the same steps read every message's header, so the counter is seen to count.
Receives are waited for as on a GPU (``stream_waits``: on the consuming stream, without timeout).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from support.dist import run_ranks
from support.models import Explodes, assert_grads_equal, make_batch, make_layers, reference, stages_per_rank

pytestmark = pytest.mark.slow


def _steps(rank: int, world: int, cases: list[tuple[str, bool]]) -> dict[tuple[str, bool], list[int]]:
    import os

    from pipetrain import PipelineStage, get_schedule_class
    from pipetrain.plan import build_schedule
    from pipetrain.runtime.transport.host import host_reads

    reads: dict[tuple[str, bool], list[int]] = {}
    for name, control in cases:
        os.environ["PIPETRAIN_CONTROL_PLANE"] = "1" if control else "0"
        v = stages_per_rank(name)
        num_stages, m = world * v, 2 * world
        layers = make_layers("transformer", num_stages)
        placement = build_schedule(name, world, m, v).stage_to_rank
        mine = [s for s, r in placement.items() if r == rank]
        stages = [PipelineStage(layers[s], s, num_stages, "cpu") for s in mine]
        sched = get_schedule_class(name)(stages if v > 1 else stages[0], m, loss_fn=nn.functional.mse_loss)
        transport = sched._transport
        assert transport.single_tag and transport.control is control, name
        transport.stream_waits = True  # the GPU's waits: on the stream, no timeout
        is_first, is_last = 0 in mine, num_stages - 1 in mine
        counts = []
        for seq in (3, 3, 5, 2):  # the first step learns the layouts; then two changes of length
            x, y = make_batch("transformer", 2 * m, seq=seq)
            for layer in layers:
                layer.zero_grad(set_to_none=True)
            before = host_reads()
            losses: list[torch.Tensor] = []
            sched.step(*((x,) if is_first else ()), target=y if is_last else None, losses=losses)
            counts.append(host_reads() - before)
            if name != "ForwardOnly" and seq != 3:
                ref_layers, ref_losses, _ = reference(layers, x, y, m)
                assert_grads_equal({s: layers[s] for s in mine}, ref_layers, f"{name}, seq {seq}")
                if is_last:
                    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
        reads[(name, control)] = counts
    return reads


def test_no_host_read_after_the_first_step_on_every_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    """And variable shapes still work: the sequence length changes twice, gradients stay plain
    training's. Without the control plane (1F1B) each received message's header is read: counted."""
    from pipetrain.plan import schedule_names

    monkeypatch.setenv("PIPETRAIN_SINGLE_TAG", "1")
    names = schedule_names()
    cases = [(name, True) for name in names] + [("1F1B", False)]
    for rank, (rank_reads, (msg, elapsed)) in enumerate(run_ranks(_steps_then_a_failure, 2, cases)):
        # Last, a failure: the peers wait for headers on the control plane, where its notices wake them.
        assert elapsed < 30, (rank, elapsed, msg)
        assert "rank 1, step 1, action 1F2: ValueError: bug in the module" in msg, (rank, msg)
        assert set(rank_reads) == set(cases)
        for (name, control), counts in rank_reads.items():
            if control:
                assert counts[1:] == [0] * (len(counts) - 1), (name, counts)
            else:  # 2 ranks x 1F1B, 4 microbatches: each rank receives 4 messages per step
                assert all(c >= 4 for c in counts), counts


def _fails(rank: int, world: int) -> tuple[str, float]:
    import time

    from pipetrain import PipelineStage, Schedule1F1B
    from pipetrain.errors import PipelineError

    torch.manual_seed(0)
    stage = PipelineStage(Explodes(6 if rank == 1 else -1), rank, world, "cpu")
    sched = Schedule1F1B(stage, 4, loss_fn=nn.functional.mse_loss, timeout=60)
    assert sched._transport.control
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    args, target = ((x,) if rank == 0 else ()), (y if rank == world - 1 else None)
    sched.step(*args, target=target)
    t0 = time.monotonic()
    try:
        sched.step(*args, target=target)  # rank 1 raises in its F of microbatch 2
    except PipelineError as err:
        return str(err), time.monotonic() - t0
    raise AssertionError("no PipelineError was raised")


def _steps_then_a_failure(
    rank: int, world: int, cases: list[tuple[str, bool]]
) -> tuple[dict[tuple[str, bool], list[int]], tuple[str, float]]:
    reads = _steps(rank, world, cases)
    import os

    os.environ["PIPETRAIN_CONTROL_PLANE"] = "1"
    return reads, _fails(rank, world)
