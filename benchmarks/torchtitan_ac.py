"""torchtitan 0.3.0's own pipeline code with its activation checkpointing, on pipetrain: ZB-V against 1F1B.

torchtitan's ``pipeline_llm`` (its installed package) builds a Llama 3 (d_model 256, 8 heads, 4
layers, vocabulary 2048, 128 tokens) on 2 gloo ranks with ``FullAC`` (its ``apply_ac``: torch's
checkpoint wrapper on every block), its module's ``torch.distributed.pipelining`` names pointed at
pipetrain's. Median step time of ZBVZeroBubble and of 1F1B, alternating, over ``--steps`` steps
after 2 warm-up steps. torchtitan users reported Interleaved Zero Bubble at a tenth of Interleaved
1F1B's throughput once activation checkpointing was on (torchtitan #773). Run:
``python benchmarks/torchtitan_ac.py [--steps 10] [--ac full|selective|none]``.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from _two_ranks import run_on_two_ranks

VOCAB, DIM, HEADS, LAYERS, SEQ, N_MB = 2048, 256, 8, 4, 128, 8


def _config() -> Any:
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    config = Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=_build_llama3_layers(
            n_layers=LAYERS,
            dim=DIM,
            n_heads=HEADS,
            hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=64),
            rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=SEQ, theta=500000, scaling="llama"),
            attn_backend="flex",
        ),
    )
    for layer in config.layers:  # FlexAttention's BlockMask does not run on a CPU-only torch
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def _to_pipetrain(module: Any) -> None:
    """The edit of imports a user makes: each name taken from torch.distributed.pipelining, pipetrain's."""
    targets = {
        "torch.distributed.pipelining": "pipetrain",
        "torch.distributed.pipelining.schedules": "pipetrain.schedules",
        "torch.distributed.pipelining.stage": "pipetrain.stage",
    }
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.ImportFrom) and node.module in targets:
            target = importlib.import_module(targets[node.module])
            for alias in node.names:
                setattr(module, alias.asname or alias.name, getattr(target, alias.name))


def _rank(rank: int, port: int, results: Any, steps: int, ac: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as titan_dims
    import torchtitan.distributed.pipeline_parallel as titan_pp
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.llama3 import parallelize_llama

    dist.init_process_group("gloo", rank=rank, world_size=2)
    titan_dims.device_type = "cpu"
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=2, ep=1, world_size=2)
    dims.build_mesh()
    _to_pipetrain(titan_pp)
    config = _config()
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config())
    ac_config = {"full": FullAC.Config(), "selective": SelectiveAC.Config(), "none": None}[ac]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (N_MB, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (N_MB, SEQ), generator=g)
    gvt = torch.tensor(labels.numel())
    built = {}
    for name in ("ZBVZeroBubble", "1F1B"):
        torch.manual_seed(0)
        model = config.build()
        model.init_states()
        with tempfile.TemporaryDirectory() as dump:
            built[name] = titan_pp.pipeline_llm(
                model,
                parallel_dims=dims,
                training=TrainingConfig(local_batch_size=N_MB, mixed_precision_param="float32"),
                parallelism=ParallelismConfig(
                    pipeline_parallel_degree=2,
                    pipeline_parallel_schedule=name,
                    pipeline_parallel_microbatch_size=1,
                ),
                compile_config=CompileConfig(),
                ac_config=ac_config,
                dump_folder=dump,
                device=torch.device("cpu"),
                model_config=config,
                parallelize_fn=parallelize_llama,
                loss_fn=loss_fn,
            )
    times: dict[str, list[float]] = {name: [] for name in built}
    for step in range(steps + 2):
        for name, (schedule, _parts, first, last) in built.items():
            dist.barrier()
            t0 = time.perf_counter()
            schedule.step(
                *((tokens,) if first else ()),
                target=labels if last else None,
                losses=[] if last else None,
                loss_kwargs={"global_valid_tokens": gvt},
                return_outputs=False,
            )
            dist.barrier()
            if step >= 2:
                times[name].append(time.perf_counter() - t0)
    if rank == 0:
        results.put({name: statistics.median(v) for name, v in times.items()})
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ac", choices=["full", "selective", "none"], default="full")
    args = parser.parse_args()
    med = run_on_two_ranks(_rank, args.steps, args.ac)
    print(f"torchtitan Llama 3 (d_model {DIM}, {LAYERS} layers, {SEQ} tokens, {N_MB} microbatches), AC {args.ac}")
    for name, t in med.items():
        print(f"  {name:>14}: {t * 1e3:8.1f} ms a step")
    print(f"ZB-V / 1F1B step time: {med['ZBVZeroBubble'] / med['1F1B']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
