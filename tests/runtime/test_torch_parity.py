"""Behaviour a user switching from torch.distributed.pipelining relies on, checked against torch
itself: the same script, the same models and data, both runtimes, equal gradients and losses."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from support.dist import run_ranks

pytestmark = pytest.mark.slow
WIDTH = 4
M = 4
# torch 2.11's own ScheduleZBVZeroBubble fails its first step on 2 gloo ranks by itself (seen on a
# GPU machine, no pipetrain involved): that step sends between neighbouring stages even where one
# rank holds both (ZBV's stages 1 and 2), and gloo cannot send to its own rank ("Pair is not
# connected"). 2.13 skips such pairs. Before 2.13 the comparison has no ZBV reference.
KEYWORD_CASES = (("1F1B", 1), ("Interleaved1F1B", 2)) + (
    (("ZBVZeroBubble", 2),) if torch.__version__ >= (2, 13) else ()
)


class Scaled(nn.Module):
    """Every block takes a keyword input, as transformer blocks take an attention mask."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * scale


def _keywords_on_every_rank(rank: int, world: int) -> list[str]:
    import torch.distributed.pipelining as tpp

    import pipetrain
    from pipetrain.plan import build_schedule

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)
    scale = torch.rand(8, 1, generator=g) + 0.5
    checked = []
    for name, v in KEYWORD_CASES:
        num_stages = world * v
        torch.manual_seed(0)
        blocks = [Scaled() for _ in range(num_stages)]
        mine = [s for s, r in build_schedule(name, world, M, v).stage_to_rank.items() if r == rank]
        grads = {}
        for label, lib in (("torch", tpp), ("pipetrain", pipetrain)):
            mods = {s: copy.deepcopy(blocks[s]) for s in mine}
            stages = [lib.PipelineStage(mods[s], s, num_stages, torch.device("cpu")) for s in mine]
            cls = lib.get_schedule_class(name) if lib is pipetrain else tpp.schedules.get_schedule_class(name)
            sched = cls(stages if v > 1 else stages[0], M, loss_fn=nn.functional.mse_loss)
            losses: list[torch.Tensor] = []
            # torchtitan's pattern: the input on the first rank, the target on the last, and the
            # keyword input on every rank, for every stage that rank holds.
            first, last = 0 in mine, num_stages - 1 in mine
            sched.step(*((x,) if first else ()), target=y if last else None, losses=losses, scale=scale)
            grads[label] = ([p.grad for s in mine for p in mods[s].parameters()], [loss.detach() for loss in losses])
        for ours, theirs in zip(grads["pipetrain"][0], grads["torch"][0], strict=True):
            torch.testing.assert_close(ours, theirs, msg=lambda e, n=name: f"{n} rank {rank}: {e}")
        torch.testing.assert_close(grads["pipetrain"][1], grads["torch"][1])
        checked.append(name)
    from pipetrain.errors import PipelineError

    with pytest.raises(PipelineError, match=r"losses must be a list .*, got tuple"):  # torch: "must be a list"
        sched.step(*((x,) if 0 in mine else ()), target=y if last else None, losses=(), scale=scale)
    return checked


def test_step_keywords_reach_every_stage_of_the_rank_as_in_torch() -> None:
    assert run_ranks(_keywords_on_every_rank, 2) == [[name for name, _ in KEYWORD_CASES]] * 2


def _csv_route(rank: int, world: int, directory: str) -> list[str]:
    """torchtitan's CSV route: ``_PipelineScheduleRuntime(stages, n, loss_fn)._load_csv(path)``."""
    import torch.distributed as dist
    import torch.distributed.pipelining as tpp
    import torch.distributed.pipelining.schedules as theirs

    import pipetrain
    import pipetrain.schedules as ours
    from pipetrain.errors import PipelineError
    from pipetrain.plan import build_schedule

    torch.manual_seed(0)
    blocks = [nn.Linear(WIDTH, WIDTH) for _ in range(4)]
    plan = build_schedule("Interleaved1F1B", world, M, 2)
    path, dumped, two = f"{directory}/il.csv", f"{directory}/ours.csv", f"{directory}/two.csv"
    others = [f"{directory}/{name}.csv" for name in ("LoopedBFS", "InterleavedZeroBubble")]
    if rank == 0:
        plan.to_csv(path)
        build_schedule("Interleaved1F1B", world, 2, 2).to_csv(two)
        for other in others:
            build_schedule(other.rsplit("/", 1)[1][:-4], world, M, 2).to_csv(other)
    dist.barrier()
    mine = plan.stages_of(rank)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)
    results = {}
    for label, lib, module, cls_name in (
        ("torch", tpp, theirs, "_PipelineScheduleRuntime"),
        ("pipetrain", pipetrain, ours, "_PipelineScheduleRuntime"),
        ("pipetrain multi", pipetrain, ours, "PipelineScheduleMulti"),
    ):
        mods = {s: copy.deepcopy(blocks[s]) for s in mine}
        if label == "pipetrain multi":  # torch's positional order: input_args, then group by keyword
            stages = [lib.PipelineStage(mods[s], s, 4, torch.device("cpu"), None, group=dist.group.WORLD) for s in mine]
        else:
            stages = [lib.PipelineStage(mods[s], s, 4, torch.device("cpu")) for s in mine]
        sched = getattr(module, cls_name)(stages, M, loss_fn=nn.functional.mse_loss)
        if lib is pipetrain:
            with pytest.raises(PipelineError, match="names no schedule: load one with _load_csv"):
                sched.step()
            with pytest.raises(AttributeError, match=r"names no schedule yet \('pipeline_order' needs one\)"):
                sched.pipeline_order  # noqa: B018
            with pytest.raises(ValueError, match="format must be"):
                sched._load_csv(path, format="bogus")
            with pytest.raises(PipelineError, match=r"two\.csv is a schedule of 2 microbatches"):
                sched._load_csv(two)  # a failed load leaves the object ready for the right file
        sched._load_csv(path)
        losses: list[torch.Tensor] = []
        sched.step(*((x,) if 0 in mine else ()), target=y if 3 in mine else None, losses=losses)
        order = {r: [None if a is None else str(a) for a in acts] for r, acts in sched.pipeline_order.items()}
        results[label] = ([p.grad for s in mine for p in mods[s].parameters()], losses, order)
        if label == "pipetrain" and rank == 0:
            sched._dump_csv(dumped)
    for label in ("pipetrain", "pipetrain multi"):
        for a, b in zip(results[label][0], results["torch"][0], strict=True):
            torch.testing.assert_close(a, b, msg=lambda e, n=label: f"{n} rank {rank}: {e}")
        torch.testing.assert_close([t.detach() for t in results[label][1]], [t.detach() for t in results["torch"][1]])
        assert results[label][2] == results["torch"][2]
    dist.barrier()
    # What pipetrain writes, torch reads back as the same order.
    stages = [tpp.PipelineStage(copy.deepcopy(blocks[s]), s, 4, torch.device("cpu")) for s in mine]
    reread = theirs._PipelineScheduleRuntime(stages, M, loss_fn=nn.functional.mse_loss)
    reread._load_csv(dumped)
    assert {r: [None if a is None else str(a) for a in acts] for r, acts in reread.pipeline_order.items()} == results[
        "torch"
    ][2]
    # Loading files in turn, with steps and evals between, keeps the ranks in step (ids of
    # dropped schedules once made one rank skip the agreement the other ran: a hang).
    mods = {s: copy.deepcopy(blocks[s]) for s in mine}
    stages = [pipetrain.PipelineStage(mods[s], s, 4, "cpu") for s in mine]
    sched = ours._PipelineScheduleRuntime(stages, M, loss_fn=nn.functional.mse_loss, timeout=20)
    for i in range(9):
        sched._load_csv([path, *others][i % 3])
        orders = sched.pipeline_order  # what user code might hold on to between loads
        sched.step(*((x,) if 0 in mine else ()), target=y if 3 in mine else None)
        kept = sched.last_timeline
        sched.eval(*((x,) if 0 in mine else ()))
        del orders, kept
    # Wrong input is refused before any communication, on every rank alike.
    mods = {s: copy.deepcopy(blocks[s]) for s in mine}
    sched = ours.ScheduleInterleaved1F1B([pipetrain.PipelineStage(mods[s], s, 4, "cpu") for s in mine], 2)
    with pytest.raises(
        PipelineError, match=r"il.csv is a schedule of 4 microbatches, but this schedule was built for n_microbatches=2"
    ):
        sched._load_csv(path)
    with pytest.raises(PipelineError, match="has no SEND/RECV actions; load it with format='compute_only'"):
        sched._load_csv(path, format="compute_comms")
    return sorted(results)


def test_torchs_csv_route_runs_the_same_schedule_with_the_same_gradients(tmp_path: Path) -> None:
    assert run_ranks(_csv_route, 2, str(tmp_path)) == [["pipetrain", "pipetrain multi", "torch"]] * 2


def _fsdp_with_torch_215_keywords(rank: int, world: int) -> list[str]:
    """2 pipeline × 2 FSDP ranks, ZB-V: ``max_active_stages=1`` plans what the lowering's
    ``max_unsharded=1`` plans, and two steps, the first with ``finalize_gradients=False``, leave
    the gradients of plain data parallelism accumulated over both batches (torch 2.15's meaning)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from pipetrain import PipelineStage, ScheduleZBVZeroBubble
    from support.models import make_batch, mlp_layers

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_group, dp_mesh = mesh["pp"].get_group(), mesh["dp"]
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    m, num_stages = 2, 4
    layers = mlp_layers(num_stages)
    ref = nn.Sequential(*copy.deepcopy(layers))
    batches = [[make_batch("mlp", 4 * m, seed=10 * step + r) for r in range(2)] for step in range(2)]
    for shards in batches:  # two steps of plain data parallelism, gradients accumulated
        total = [
            nn.functional.mse_loss(ref(xi), yi)
            for x, y in shards
            for xi, yi in zip(x.tensor_split(m), y.tensor_split(m), strict=True)
        ]
        torch.stack(total).mean().backward()
    mine = [pp_rank, num_stages - 1 - pp_rank]
    for s in mine:
        fully_shard(layers[s], mesh=dp_mesh)
    stages = [PipelineStage(layers[s], s, num_stages, "cpu", group=pp_group) for s in sorted(mine)]
    sched = ScheduleZBVZeroBubble(stages, m, loss_fn=nn.functional.mse_loss, max_active_stages=1)
    same = ScheduleZBVZeroBubble(
        stages, m, loss_fn=nn.functional.mse_loss, lower_options={"fsdp": True, "grad_reduce": True, "max_unsharded": 1}
    )
    program = [str(a) for a in sched.schedule.actions[pp_rank] if a is not None]
    assert program == [str(a) for a in same.schedule.actions[pp_rank] if a is not None]
    assert sum("UNSHARD" in a for a in program) > len(mine), program  # one stage gathered at a time
    for step, shards in enumerate(batches):
        x, y = shards[dp_rank]
        sched.step(*((x,) if 0 in mine else ()), target=y if 3 in mine else None, finalize_gradients=step == 1)
    for s in mine:
        for (name, p), q in zip(layers[s].named_parameters(), list(ref)[s].parameters(), strict=True):
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            torch.testing.assert_close(grad, q.grad, msg=lambda e, s=s, n=name: f"stage {s} {n}: {e}")
    return ["fsdp"]


def test_torch_215_fsdp_keywords_mean_what_they_mean_in_torch() -> None:
    assert run_ranks(_fsdp_with_torch_215_keywords, 4, timeout=240) == [["fsdp"]] * 4
