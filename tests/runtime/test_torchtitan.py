"""torchtitan 0.3.0 on pipetrain with only its imports changed.

torchtitan's own ``pipeline_llm`` (its installed package, not a copy) splits a tiny Llama 3 into
stages (wrapped by its own ``parallelize_llama``: FSDP2 at a data-parallel degree of 1) and builds
the schedule, with the names its module imported from
``torch.distributed.pipelining`` (and ``.schedules``) pointed at pipetrain's. The step is then
called as torchtitan's trainer and validator call it: the pre-split ``step(arg_mbs=, kwarg_mbs=,
target_mbs=, losses=, loss_kwargs=, return_outputs=False)`` and ``eval(...)``, on packed
microbatches of different lengths, for every schedule torchtitan offers that fits the model; the
losses and gradients are those of the same model trained without pipelining, and (with
microbatches of one length, the form torch 2.13 accepts) those of torch's own runtime.
"""

from __future__ import annotations

import ast
import copy
import importlib
import importlib.util
import inspect
import tempfile
import threading
import time
from typing import Any

import pytest
import torch

from support.dist import run_ranks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.torch_interop,
    # looked up, not imported: only the ranks pay for importing it
    pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan: dev extra, Python >= 3.11"),
]

NAMED = ["1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
SCHEDULES = [*NAMED, "InterleavedZeroBubble.csv"]  # and torchtitan's route for a schedule in a CSV file
TORCH_ACCEPTS = NAMED  # also run on torch's runtime (whole batch, one length)
N_MB = 4
VOCAB = 64
_PIPETRAIN = {
    "torch.distributed.pipelining": "pipetrain",
    "torch.distributed.pipelining.schedules": "pipetrain.schedules",
    "torch.distributed.pipelining.stage": "pipetrain.stage",
}


def _point_imports_at_pipetrain(module: Any) -> dict[str, Any]:
    """Rebind each name ``module`` imported from torch.distributed.pipelining to pipetrain's:
    the edit of its imports a user makes. Returns the original bindings (to undo it)."""
    original: dict[str, Any] = {}
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.ImportFrom) and node.module in _PIPETRAIN:
            target = importlib.import_module(_PIPETRAIN[node.module])
            for alias in node.names:
                bound = alias.asname or alias.name
                original[bound] = getattr(module, bound)
                setattr(module, bound, getattr(target, alias.name))
    return original


def _tiny_llama3() -> Any:
    """torchtitan's debug Llama 3, shrunk, with SDPA attention (as torchtitan's own graph tests
    do: FlexAttention's BlockMask does not run on a CPU-only torch)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    dim, n_heads = 32, 4
    config = Llama3Model.Config(
        dim=dim,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim),
        norm=RMSNorm.Config(normalized_shape=dim),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB),
        layers=_build_llama3_layers(
            n_layers=2,
            dim=dim,
            n_heads=n_heads,
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=32),
            rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=64, theta=500000, scaling="llama"),
            attn_backend="flex",
        ),
    )
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def _packed_batch(lengths: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per microbatch one row of two packed documents: tokens, per-document positions, labels."""
    g = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, VOCAB, (1, n), generator=g) for n in lengths]
    labels = [torch.randint(0, VOCAB, (1, n), generator=g) for n in lengths]
    positions = [torch.cat([torch.arange(n // 2), torch.arange(n - n // 2)]).unsqueeze(0) for n in lengths]
    return tokens, positions, labels


def _plain(model: torch.nn.Module, loss_fn: Any, batch: Any, gvt: torch.Tensor) -> tuple[list[Any], dict[str, Any]]:
    """The same model trained without pipelining: per-microbatch losses, gradients by name."""
    ref = copy.deepcopy(model)
    losses = []
    for x, pos, y in zip(*batch, strict=True):
        loss, _ = loss_fn(ref(x, positions=pos), y, global_valid_tokens=gvt)
        loss.backward()
        losses.append(loss.detach())
    return losses, {n: p.grad for n, p in ref.named_parameters()}


def _grads(parts: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Each parameter's gradient by its name in the whole model (FSDP2's DTensors made whole)."""
    out = {}
    for part in parts:
        for n, p in part.named_parameters():
            assert p.grad is not None, n
            out[n] = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
    return out


def _overlap_in_thread(calls: list[str]) -> Any:
    """A custom OVERLAP_F_B: the forward runs in a second thread while the backward runs."""
    from pipetrain.schedules import FULL_BACKWARD

    def run(action: Any, ctx: Any) -> None:
        f, b = action.sub_actions
        args, kwargs = ctx.forward_inputs(f.stage_index, f.microbatch_index)
        bwd = ctx.backward_inputs(b.stage_index, b.microbatch_index)
        out: dict[str, Any] = {}

        def forward() -> None:
            with torch.enable_grad():
                out["y"] = ctx.stages[f.stage_index].forward_one_chunk(f.microbatch_index, args, kwargs)

        thread = threading.Thread(target=forward)
        thread.start()
        grads = ctx.stages[b.stage_index].backward_one_chunk(
            b.microbatch_index, **bwd, full=b.computation_type is FULL_BACKWARD
        )
        thread.join()
        ctx.forward_done(f.stage_index, f.microbatch_index, out["y"])
        ctx.backward_done(b.stage_index, b.microbatch_index, grads)
        calls.append(str(action))

    return run


def _build(
    name: str, world: int, model: Any, config: Any, loss_fn: Any, parallel_dims: Any, ac_config: Any = None
) -> Any:
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.llama3 import parallelize_llama

    with tempfile.TemporaryDirectory() as dump:
        csv = ""
        if name.endswith(".csv"):  # torchtitan's CSV route: _PipelineScheduleRuntime, then _load_csv
            from pipetrain.plan import build_schedule

            name, csv = name.removesuffix(".csv"), f"{dump}/schedule.csv"
            build_schedule(name, world, N_MB, 2).to_csv(csv)
        return pipeline_llm(
            model,
            parallel_dims=parallel_dims,
            training=TrainingConfig(
                local_batch_size=N_MB, mixed_precision_param="float32", mixed_precision_reduce="float32"
            ),
            parallelism=ParallelismConfig(
                pipeline_parallel_degree=world,
                pipeline_parallel_schedule=name,
                pipeline_parallel_schedule_csv=csv,
                pipeline_parallel_microbatch_size=1,
            ),
            compile_config=CompileConfig(),
            ac_config=ac_config,
            dump_folder=dump,
            device=torch.device("cpu"),
            model_config=config,
            parallelize_fn=parallelize_llama,  # the model spec's: FSDP2 on a data-parallel degree of 1
            loss_fn=loss_fn,
        )


def _worker(rank: int, world: int, schedules: list[str]) -> dict[str, Any]:
    import torchtitan.distributed.parallel_dims as titan_dims
    import torchtitan.distributed.pipeline_parallel as titan_pp
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.distributed import ParallelDims

    import pipetrain
    from pipetrain.schedules import OVERLAP_F_B

    titan_dims.device_type = "cpu"  # torchtitan says "cuda" on a machine without an accelerator
    parallel_dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=world, ep=1, world_size=world)
    parallel_dims.build_mesh()
    config = _tiny_llama3()
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config())
    report: dict[str, Any] = {"torch": _against_torch(rank, world, TORCH_ACCEPTS, config, loss_fn, parallel_dims)}
    torch_names = _point_imports_at_pipetrain(titan_pp)
    report["replaced"] = sorted(torch_names)
    batch = _packed_batch([5, 8, 6, 9])  # packed documents: every microbatch a different length
    gvt = torch.tensor(sum(y.numel() for y in batch[2]))
    for name in schedules:
        t0 = time.perf_counter()
        torch.manual_seed(0)
        model = config.build()
        model.init_states()
        ref_losses, ref_grads = _plain(model, loss_fn, batch, gvt)
        schedule, parts, first, last = _build(name, world, model, config, loss_fn, parallel_dims)
        assert isinstance(schedule, pipetrain.PipelineScheduleRuntime), type(schedule)
        calls: list[str] = []
        if name == "DualPipeV":
            schedule.register_custom_function(OVERLAP_F_B, _overlap_in_thread(calls))
        tokens, positions, labels = batch
        # torchtitan's Trainer.pp_forward_backward_step, call for call
        losses: list[torch.Tensor] | None = [] if last else None
        schedule.step(
            arg_mbs=[(x,) for x in tokens] if first else None,
            kwarg_mbs=[{"positions": p} for p in positions],
            target_mbs=list(labels) if last else None,
            losses=losses,
            loss_kwargs={"global_valid_tokens": gvt},
            return_outputs=False,
        )
        got = _grads(parts)
        assert got, f"{name}: rank {rank} holds no parameters"
        for n, g in got.items():
            torch.testing.assert_close(g, ref_grads[n], msg=lambda m, n=n, s=name: f"{s} rank {rank} {n}: {m}")
        # torchtitan's Validator.validate: eval with the same microbatches, losses summed
        eval_losses: list[torch.Tensor] | None = [] if last else None
        with torch.no_grad():
            schedule.eval(
                arg_mbs=[(x,) for x in tokens] if first else None,
                kwarg_mbs=[{"positions": p} for p in positions],
                target_mbs=list(labels) if last else None,
                losses=eval_losses,
            )
        if last:
            assert losses is not None and eval_losses is not None
            torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
            plain_sums = [loss * gvt for loss in ref_losses]  # eval has no global_valid_tokens
            torch.testing.assert_close(torch.stack(eval_losses), torch.stack(plain_sums))
        fsdp = all(type(part).__name__.startswith("FSDP") for part in parts)
        report[name] = {"params": len(got), "overlaps": len(calls), "fsdp": fsdp, "s": time.perf_counter() - t0}
    return report


def _whole_batch_step(
    schedule: Any, first: bool, last: bool, batch: Any, gvt: torch.Tensor, losses: list[torch.Tensor]
) -> None:
    """The whole-batch step torch 2.13 takes (microbatches of one length), as torchtitan calls it."""
    tokens, positions, labels = batch
    schedule.step(
        *((torch.cat(tokens),) if first else ()),
        target=torch.cat(labels) if last else None,
        losses=losses if last else None,
        loss_kwargs={"global_valid_tokens": gvt},
        positions=torch.cat(positions),
        return_outputs=False,
    )


def _against_torch(rank: int, world: int, schedules: list[str], config: Any, loss_fn: Any, parallel_dims: Any) -> Any:
    """torch's own runtime under torchtitan's unchanged imports: the whole-batch step torch 2.13
    takes (microbatches of one length), against pipetrain's pre-split step on the same data."""
    import torchtitan.distributed.pipeline_parallel as titan_pp

    tokens, positions, labels = _packed_batch([7] * N_MB)
    gvt = torch.tensor(sum(y.numel() for y in labels))
    out: dict[str, Any] = {}
    for name in schedules:
        grads: list[dict[str, torch.Tensor]] = []
        for use_pipetrain in (False, True):
            original = _point_imports_at_pipetrain(titan_pp) if use_pipetrain else {}
            torch.manual_seed(0)
            model = config.build()
            model.init_states()
            schedule, parts, first, last = _build(name, world, model, config, loss_fn, parallel_dims)
            losses: list[torch.Tensor] = []
            if use_pipetrain:
                schedule.step(
                    arg_mbs=[(x,) for x in tokens] if first else None,
                    kwarg_mbs=[{"positions": p} for p in positions],
                    target_mbs=list(labels) if last else None,
                    losses=losses if last else None,
                    loss_kwargs={"global_valid_tokens": gvt},
                    return_outputs=False,
                )
            else:
                _whole_batch_step(schedule, first, last, (tokens, positions, labels), gvt, losses)
            for bound, value in original.items():
                setattr(titan_pp, bound, value)
            grads.append(_grads(parts))
            out.setdefault(name, []).append([float(v.detach()) for v in losses])
        assert grads[0].keys() == grads[1].keys()
        for n in grads[0]:
            torch.testing.assert_close(grads[1][n], grads[0][n], msg=lambda m, n=n, s=name: f"{s} rank {rank} {n}: {m}")
    return out


def test_torchtitan_pipeline_llm_runs_on_pipetrain() -> None:
    reports = run_ranks(_worker, 2, SCHEDULES, timeout=240)
    print({name: round(reports[0][name]["s"], 2) for name in SCHEDULES})
    replaced = set(reports[0]["replaced"])
    assert {"PipelineStage", "_PipelineSchedule", "get_schedule_class", "ScheduleDualPipeV"} <= replaced
    for name in SCHEDULES:
        assert all(r[name]["params"] > 0 and r[name]["fsdp"] for r in reports), name
    # DualPipeV's OVERLAP_F_B pairs went through the custom function on both ranks
    assert all(r["DualPipeV"]["overlaps"] > 0 for r in reports)
    # torch's runtime (its step, one length) and pipetrain's (pre-split): the same losses and gradients
    for name in TORCH_ACCEPTS:
        # the rank holding the last stage (1 on a loop, 0 on a V) has the losses
        [(on_torch, on_pipetrain)] = [r["torch"][name] for r in reports if r["torch"][name][0]]
        assert len(on_torch) == N_MB
        torch.testing.assert_close(torch.tensor(on_pipetrain), torch.tensor(on_torch))


def _ac_worker(rank: int, world: int) -> dict[str, Any]:
    """torchtitan's own activation checkpointing (its apply_ac, full and selective) under the
    zero-bubble schedules: pipetrain's stages take torch's checkpoint wrappers onto
    pipetrain.recompute.checkpoint, each block runs its forward twice per microbatch, and the
    gradients are plain training's and torch's 1F1B's under the same checkpointing."""
    import torchtitan.distributed.parallel_dims as titan_dims
    import torchtitan.distributed.pipeline_parallel as titan_pp
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    from pipetrain.recompute import checkpoint as pipetrain_checkpoint

    titan_dims.device_type = "cpu"
    parallel_dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=world, ep=1, world_size=world)
    parallel_dims.build_mesh()
    config = _tiny_llama3()
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config())
    tokens, positions, labels = _packed_batch([7] * N_MB)
    gvt = torch.tensor(sum(y.numel() for y in labels))
    torch.manual_seed(0)
    plain_model = config.build()
    plain_model.init_states()
    _, plain = _plain(plain_model, loss_fn, (tokens, positions, labels), gvt)
    report: dict[str, Any] = {}
    for ac_name, ac in (("full", FullAC.Config()), ("selective", SelectiveAC.Config())):
        for name, runtime in (
            ("1F1B", "torch"),
            ("ZBVZeroBubble", "pipetrain"),
            ("InterleavedZeroBubble", "pipetrain"),
        ):
            original = _point_imports_at_pipetrain(titan_pp) if runtime == "pipetrain" else {}
            try:
                torch.manual_seed(0)
                model = config.build()
                model.init_states()
                schedule, parts, first, last = _build(name, world, model, config, loss_fn, parallel_dims, ac)
                wrappers = [m for part in parts for m in part.modules() if hasattr(m, "checkpoint_fn")]
                adopted = [getattr(w.checkpoint_fn, "func", None) is pipetrain_checkpoint for w in wrappers]
                forwards = [0]
                blocks = [m for w in wrappers for m in w.children()]
                for block in blocks:
                    block.register_forward_pre_hook(lambda *_, n=forwards: n.__setitem__(0, n[0] + 1))
                _whole_batch_step(schedule, first, last, (tokens, positions, labels), gvt, [])
            finally:
                for bound, value in original.items():
                    setattr(titan_pp, bound, value)
            got = {n.replace("_checkpoint_wrapped_module.", ""): g for n, g in _grads(parts).items()}
            assert got, f"{ac_name} {name}: rank {rank} holds no parameters"
            for n, g in got.items():
                torch.testing.assert_close(g, plain[n], msg=lambda m, n=n, s=f"{ac_name} {name}": f"{s} {n}: {m}")
            report[f"{ac_name} {name}"] = {
                "wrappers": len(wrappers),
                "adopted": all(adopted) and bool(adopted),
                "forwards_per_block_and_microbatch": forwards[0] / (len(blocks) * N_MB) if blocks else 0,
            }
    return report


def test_torchtitans_activation_checkpointing_under_zero_bubble_schedules() -> None:
    reports = run_ranks(_ac_worker, 2, timeout=240)
    for key in reports[0]:
        assert sum(r[key]["wrappers"] for r in reports) == 2, key  # both blocks checkpointed, somewhere
    for report in reports:
        for key, entry in report.items():
            if not entry["wrappers"]:
                continue
            if "1F1B" in key:  # torch's runtime: its stages keep torch's checkpoint; its first step
                assert not entry["adopted"], key  # also runs a shape-inference forward
                assert entry["forwards_per_block_and_microbatch"] >= 2, (key, entry)
            else:
                assert entry["adopted"], key
                assert entry["forwards_per_block_and_microbatch"] == 2, (key, entry)


def _planned_worker(rank: int, world: int) -> dict[str, Any]:
    """plan_pipeline's cut, exported as torchtitan's module_fqns_per_model_part, through torchtitan's
    own pipeline_llm (its _pipeline_module_split cuts the Llama by those names), its schedule loaded
    by torchtitan's CSV route: the step equals the same model trained without pipelining."""
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as titan_dims
    import torchtitan.distributed.pipeline_parallel as titan_pp
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import parallelize_llama

    from pipetrain.plan import LayerCost, plan_pipeline

    titan_dims.device_type = "cpu"
    parallel_dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=world, ep=1, world_size=world)
    parallel_dims.build_mesh()
    config = _tiny_llama3()
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config())
    _point_imports_at_pipetrain(titan_pp)
    # A profile with a heavy head (as a large vocabulary makes it), planned once on rank 0 and shared.
    kb = 1024.0
    layers = [
        LayerCost("tok_embeddings", f=0.05, b=0.1, activation_bytes=kb, output_bytes=kb, static_bytes=4e4),
        LayerCost("layers.0", f=1.0, b=2.0, activation_bytes=8 * kb, output_bytes=kb, static_bytes=1e5),
        LayerCost("layers.1", f=1.0, b=2.0, activation_bytes=8 * kb, output_bytes=kb, static_bytes=1e5),
        LayerCost("norm", f=0.1, b=0.2, activation_bytes=kb, output_bytes=kb, static_bytes=1e3),
        LayerCost("lm_head", f=2.3, b=4.6, activation_bytes=16 * kb, output_bytes=2 * kb, static_bytes=4e4),
    ]
    shared: list[Any] = [None]
    if rank == 0:
        plan = plan_pipeline(layers, world, N_MB, None, stages_per_rank=2, time_limit=1.0)
        shared[0] = (plan.module_fqns_per_model_part(), plan.schedule.to_json(), plan.schedule.stage_to_rank)
    dist.broadcast_object_list(shared, src=0)
    fqns, schedule_json, stage_to_rank = shared[0]
    v_placement = stage_to_rank[2 * world - 1] == 0
    batch = _packed_batch([5, 8, 6, 9])
    gvt = torch.tensor(sum(y.numel() for y in batch[2]))
    torch.manual_seed(0)
    model = config.build()
    model.init_states()
    ref_losses, ref_grads = _plain(model, loss_fn, batch, gvt)
    from pipetrain.plan import Schedule

    with tempfile.TemporaryDirectory() as dump:
        csv = f"{dump}/planned.csv"
        Schedule.from_json_text(schedule_json).to_csv(csv)
        schedule, parts, first, last = titan_pp.pipeline_llm(
            model,
            parallel_dims=parallel_dims,
            training=TrainingConfig(
                local_batch_size=N_MB, mixed_precision_param="float32", mixed_precision_reduce="float32"
            ),
            parallelism=ParallelismConfig(
                pipeline_parallel_degree=world,
                module_fqns_per_model_part=fqns,
                pipeline_parallel_schedule="ZBVZeroBubble" if v_placement else "InterleavedZeroBubble",
                pipeline_parallel_schedule_csv=csv,
                pipeline_parallel_microbatch_size=1,
            ),
            compile_config=CompileConfig(),
            ac_config=None,
            dump_folder=dump,
            device=torch.device("cpu"),
            model_config=config,
            parallelize_fn=parallelize_llama,
            loss_fn=loss_fn,
        )
    tokens, positions, labels = batch
    losses: list[torch.Tensor] | None = [] if last else None
    schedule.step(
        arg_mbs=[(x,) for x in tokens] if first else None,
        kwarg_mbs=[{"positions": p} for p in positions],
        target_mbs=list(labels) if last else None,
        losses=losses,
        loss_kwargs={"global_valid_tokens": gvt},
        return_outputs=False,
    )
    got = _grads(parts)
    for n, g in got.items():
        torch.testing.assert_close(g, ref_grads[n], msg=lambda m, n=n: f"planned rank {rank} {n}: {m}")
    if last:
        assert losses is not None
        torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
    return {"fqns": fqns, "held": sorted(got), "v": v_placement}


def test_a_planned_cut_runs_through_torchtitans_own_split() -> None:
    reports = run_ranks(_planned_worker, 2, timeout=240)
    fqns = reports[0]["fqns"]
    # a complete cut in model order, the head (2.3 blocks) alone on its stage: torchtitan's default
    # puts the norm with it ([tok_embeddings], [layers.0], [layers.1], [norm, lm_head])
    assert [name for stage in fqns for name in stage] == ["tok_embeddings", "layers.0", "layers.1", "norm", "lm_head"]
    assert len(fqns) == 4 and fqns[-1] == ["lm_head"]
    held = {name.split(".")[0] for r in reports for name in r["held"]}
    assert held == {"tok_embeddings", "layers", "norm", "lm_head"}


def test_torchtitans_llama3_profiles_plans_and_trains_as_it_is() -> None:
    """pipetrain.titan.decoder_layers: the model's own layers and names, each layer called as the
    model calls it; the plan's stages train like the model (one process, every rank)."""
    from pipetrain import LocalPipeline, profile_layers
    from pipetrain.plan import plan_pipeline
    from pipetrain.split import split_by_names
    from pipetrain.titan import decoder_layers

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _tiny_llama3().build()
    model.init_states()
    reference = copy.deepcopy(model)

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    g = torch.Generator().manual_seed(5)
    x, y = torch.randint(0, VOCAB, (8, 12), generator=g), torch.randint(0, VOCAB, (8, 12), generator=g)
    layers = decoder_layers(model)
    assert [n for n, _ in layers] == ["tok_embeddings", "layers.0", "layers.1", "norm", "lm_head"]
    plan = plan_pipeline(profile_layers(layers, x[:2], loss_fn=loss_fn, target=y[:2]), 2, 4, None, time_limit=1)
    stages = split_by_names(layers, plan.stage_layers, recompute=plan.recompute)
    assert sorted(k for s in stages for k in s.state_dict()) == sorted(model.state_dict())
    losses: list[torch.Tensor] = []
    LocalPipeline(stages, plan.schedule, loss_fn=loss_fn).step(x, target=y, losses=losses)
    want = sum(loss_fn(reference(xs), ys) for xs, ys in zip(x.chunk(4), y.chunk(4), strict=True))
    (want / 4).backward()
    torch.testing.assert_close(torch.stack(losses).mean(), want.detach() / 4)
    mine = dict(model.named_parameters())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(mine[name].grad, p.grad, msg=lambda m, n=name: f"{n}: {m}")
