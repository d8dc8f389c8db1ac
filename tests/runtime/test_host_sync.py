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

from support.dist import run_ranks
from support.models import assert_grads_equal, make_batch, make_layers, reference, stages_per_rank

pytestmark = pytest.mark.slow


def _steps(rank: int, world: int, cases: list[tuple[str, bool]]) -> dict[tuple[str, bool], list[int]]:
    import os

    from torch import nn

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
    for rank_reads in run_ranks(_steps, 2, cases):
        assert set(rank_reads) == set(cases)
        for (name, control), counts in rank_reads.items():
            if control:
                assert counts[1:] == [0] * (len(counts) - 1), (name, counts)
            else:  # 2 ranks x 1F1B, 4 microbatches: each rank receives 4 messages per step
                assert all(c >= 4 for c in counts), counts
