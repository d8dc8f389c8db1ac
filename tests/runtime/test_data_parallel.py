"""Data parallel × pipeline: 2 pipeline × 2 data-parallel gloo ranks, with DDP and with FSDP2 (gradients,
clipping across the pipeline, eval)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from support.dist import run_ranks
from support.models import make_batch, mlp_layers

pytestmark = pytest.mark.slow


def _dp_cases(rank: int, world: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    from pipetrain import PipelineStage, clip_grad_norm_, get_schedule_class

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_group = mesh["pp"].get_group()
    dp_mesh = mesh["dp"]
    pp_rank = mesh["pp"].get_local_rank()
    dp_rank = mesh["dp"].get_local_rank()
    m = 2
    done = []
    # (max_unsharded=1: FSDP frees a stage whenever the other one runs, gathering it again after)
    cases = [(w, n, None) for w in ("ddp", "fsdp") for n in ("1F1B", "ZBVZeroBubble")] + [("fsdp", "ZBVZeroBubble", 1)]
    for wrap, name, limit in cases:
        v = 2 if name == "ZBVZeroBubble" else 1
        num_stages = 2 * v
        layers = mlp_layers(num_stages)
        # Plain data-parallel reference: the mean over replicas of each replica's mean microbatch loss.
        ref = nn.Sequential(*copy.deepcopy(layers))
        shards = [make_batch("mlp", 4 * m, seed=10 + r) for r in range(2)]
        total = []
        for x, y in shards:
            for xi, yi in zip(x.tensor_split(m), y.tensor_split(m), strict=True):
                total.append(nn.functional.mse_loss(ref(xi), yi))
        torch.stack(total).mean().backward()

        placement = {0: 0, 1: 1} if v == 1 else {0: 0, 3: 0, 1: 1, 2: 1}
        mine = sorted(s for s, r in placement.items() if r == pp_rank)
        stages = []
        for s in mine:
            module: nn.Module = layers[s]
            if wrap == "ddp":
                module = DistributedDataParallel(module, process_group=dp_mesh.get_group())
            else:
                fully_shard(module, mesh=dp_mesh)
            stages.append(PipelineStage(module, s, num_stages, "cpu", group=pp_group))
        options = {} if limit is None else {"lower_options": {"fsdp": True, "grad_reduce": True, "max_unsharded": 1}}
        sched = get_schedule_class(name)(stages, m, loss_fn=nn.functional.mse_loss, **options)
        program = [str(a) for a in sched.schedule.actions[pp_rank] if a is not None]
        ops = set(program)
        assert any("REDUCE_GRAD" in o for o in ops), ops
        assert (wrap == "fsdp") == any("UNSHARD" in o for o in ops), ops
        gathers = sum("UNSHARD" in o for o in program)
        assert wrap != "fsdp" or (gathers > len(mine) if limit == 1 else gathers == len(mine)), program
        x, y = shards[dp_rank]
        first, last = 0 in mine, num_stages - 1 in mine
        sched.step(*((x,) if first else ()), target=y if last else None)
        case = f"{wrap}/{name}" + ("" if limit is None else f"/max_unsharded={limit}")
        for s in mine:
            for (pname, p), q in zip(layers[s].named_parameters(), list(ref)[s].parameters(), strict=True):
                grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                torch.testing.assert_close(grad, q.grad, msg=lambda e, c=case, s=s, n=pname: f"{c} stage {s} {n}: {e}")
        # Clipping by the whole model's norm: over the pipeline group, data-parallel shards included.
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        got = clip_grad_norm_([p for s in mine for p in layers[s].parameters()], 0.05, group=pp_group)
        torch.testing.assert_close(got, want, msg=lambda e, c=case: f"{c} clipped norm: {e}")
        for s in mine:
            for p, q in zip(layers[s].parameters(), list(ref)[s].parameters(), strict=True):
                grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                torch.testing.assert_close(grad, q.grad, msg=lambda e, c=case, s=s: f"{c} stage {s} clipped: {e}")
        if wrap == "fsdp":
            # Validation between backward and optimizer step: eval must leave the stages
            # resharded, or the update below would not reach the next forward's weights.
            sched.eval(*((x,) if first else ()))
            for s in mine:
                assert all(isinstance(p, DTensor) for p in layers[s].parameters()), f"{case}: {s} unsharded"
            with torch.no_grad():
                for p, q in zip(
                    [p for s in mine for p in layers[s].parameters()],
                    [q for s in mine for q in list(ref)[s].parameters()],
                    strict=True,
                ):
                    p.sub_(0.1 * p.grad)
                    q.sub_(0.1 * q.grad)
                out = sched.eval(*((x,) if first else ()))
                if last:
                    for s in range(num_stages):  # the other rank's stages take the same update
                        if s not in mine:
                            for q in list(ref)[s].parameters():
                                q.sub_(0.1 * q.grad)
                    torch.testing.assert_close(out, ref(x), msg=lambda e, c=case: f"{c} eval after update: {e}")
        done.append(case)
    return done


def test_pipeline_times_data_parallel_matches_plain_data_parallel() -> None:
    results = run_ranks(_dp_cases, 4, timeout=240)
    assert all(len(r) == 5 for r in results), results


def test_fsdp_param_groups_reads_each_torch_layout() -> None:
    """torch 2.13 keeps a list of parameter groups per FSDP state, torch 2.11 one group or None
    (REDUCE_GRAD failed on 2.11 before: seen on a GPU machine's torch)."""
    from types import SimpleNamespace

    from pipetrain.runtime.data_parallel import fsdp_param_groups

    assert fsdp_param_groups(SimpleNamespace(_fsdp_param_groups=("a", "b"))) == ["a", "b"]
    assert fsdp_param_groups(SimpleNamespace(_fsdp_param_group="a")) == ["a"]
    assert fsdp_param_groups(SimpleNamespace(_fsdp_param_group=None)) == []
