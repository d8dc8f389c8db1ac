"""``pipetrain train``: a small GPT trained across local processes (or torchrun's), pipelined."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import os
import sys
from typing import Any

_DEFAULTS: dict[str, Any] = {
    "ranks": 2,
    "schedule": "ZBVZeroBubble",
    "microbatches": 8,
    "steps": 40,
    "batch_size": 16,
    "seed": 0,
    "model": "small",
    "lr": 3e-3,
}


def register(subparsers: Any) -> None:
    train = subparsers.add_parser(
        "train",
        help="train a small GPT across local processes with a pipeline schedule",
        description=(
            "Train a small GPT-style language model on the Python standard library's source, pipelined "
            "across processes. Without torchrun it spawns --ranks local processes (gloo on CPU, NCCL with "
            "--device cuda); under torchrun it uses torchrun's processes, so it runs across nodes."
        ),
    )
    _add_run_arguments(train)
    train.set_defaults(func=_train, costs_out=None, layers_out=None)
    profile = subparsers.add_parser(
        "profile",
        help="measure per-stage F, I, W, B and the message latency (a costs file), or each layer's costs (a layers file)",
        description=(
            "Run a few training steps of the small GPT (as `pipetrain train` does, same options), measure every "
            "stage's F, I, W and B and the latency of messages between ranks (medians over the first 3 steps, "
            "or all but the last if --steps is under 4), and write them in --costs form, for "
            "`pipetrain plan --from-profile FILE`. With --layers-out, rank 0 first measures every layer of the "
            "model (embedding, blocks, head + loss: F, I, W seconds, activation, output and static bytes, on one "
            "microbatch) and writes the planner's layers file, for `pipetrain plan --layers FILE`."
        ),
    )
    _add_run_arguments(profile, steps=4)
    profile.add_argument(
        "--costs-out", metavar="FILE", default="costs.txt", help="the costs file to write (default %(default)s)"
    )
    profile.add_argument(
        "--layers-out",
        metavar="FILE",
        default=None,
        help="also write the model's per-layer profile there, as a layers file (.json or .csv) for "
        "`pipetrain plan --layers FILE`",
    )
    profile.set_defaults(func=_train)


def _add_run_arguments(train: Any, steps: int = _DEFAULTS["steps"]) -> None:
    """The options `train` and `profile` share (profile runs the same job, fewer steps)."""
    train.add_argument(
        "--ranks",
        type=int,
        default=None,
        help=f"pipeline ranks to spawn (default {_DEFAULTS['ranks']}, or the ranks of a --schedule file; "
        "torchrun's WORLD_SIZE under torchrun)",
    )
    train.add_argument(
        "--stages-per-rank", type=int, default=None, help="stages per rank (default: what the schedule needs)"
    )
    train.add_argument(
        "--schedule",
        default=_DEFAULTS["schedule"],
        metavar="NAME|FILE.csv|auto",
        help="schedule name, a CSV/JSON schedule file, or auto: rank 0 measures every layer (embedding, blocks, "
        "head + loss) and plans the whole pipeline within --memory-limit (the cut into stages, their placement, "
        "which stages recompute, the order); every rank trains the plan (default %(default)s)",
    )
    train.add_argument(
        "--memory-limit",
        metavar="BYTES",
        default=None,
        help="--schedule auto: bytes a rank may hold (weights, gradients, Adam's state, activations, messages), "
        "e.g. 2GiB, 512MiB, 80e9 (default: a GPU's memory, or this machine's shared by its ranks)",
    )
    train.add_argument(
        "--placement",
        choices=("loop", "v"),
        default=None,
        help="--schedule auto: place the stages in a loop (stage s on rank s mod P) or a V (rank r holds "
        "r and 2P-1-r; the two middle stages share a rank, one message fewer each way) instead of "
        "letting the planner choose",
    )
    train.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="every transformer block keeps only its input from its forward and recomputes the rest in its "
        "backward, once per microbatch (pipetrain.recompute; a split backward's W rebuilds nothing); with "
        "--schedule auto the planner chooses what recomputes instead",
    )
    train.add_argument(
        "--plan-time-limit",
        metavar="SECONDS",
        type=float,
        default=None,
        help="--schedule auto: seconds rank 0 may search for the plan (default 5)",
    )
    train.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help=f"microbatches per step (default {_DEFAULTS['microbatches']}; a schedule file sets its own)",
    )
    train.add_argument("--steps", type=int, default=steps, help="optimizer steps (default %(default)s)")
    train.add_argument(
        "--batch-size", type=int, default=_DEFAULTS["batch_size"], help="sequences per step (default %(default)s)"
    )
    train.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per local rank)"
    )
    train.add_argument(
        "--out", metavar="DIR", default=None, help="where timelines and the summary go (default runs/<timestamp>)"
    )
    train.add_argument(
        "--seed", type=int, default=_DEFAULTS["seed"], help="model init and data order (default %(default)s)"
    )
    train.add_argument(
        "--check", action="store_true", help="also train without pipelining and compare the losses (1e-4 relative)"
    )
    train.add_argument(
        "--model",
        default=_DEFAULTS["model"],
        choices=("tiny", "small", "base", "bpe"),
        help="model size (default %(default)s): tiny, small and base read bytes (vocabulary 256); bpe has "
        "8,192 tokens of a BPE learnt from the training text on first use (cached), and a head and loss "
        "costing 2 to 3 blocks, as in Llama-3",
    )
    train.add_argument("--lr", type=float, default=_DEFAULTS["lr"], help="Adam learning rate (default %(default)s)")
    train.add_argument(
        "--clip-grad-norm",
        type=float,
        default=None,
        metavar="MAX",
        help="clip the gradients to this norm of the whole model, taken across the pipeline's ranks (e.g. 1.0)",
    )
    train.add_argument(
        "--json",
        action="store_true",
        help="print the run's summary (summary.json: losses, the plan, each rank's measured and promised memory) "
        "as JSON on stdout; progress goes to stderr",
    )
    train.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        default=None,
        help="save checkpoints there and resume from the latest complete one (e.g. after torchrun restarts the job)",
    )
    train.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        metavar="N",
        help="steps between checkpoints (default 10; one is written after the last step too); needs --checkpoint-dir",
    )


def _train(args: argparse.Namespace) -> int:
    if args.json:  # stdout carries only the summary, which the reporting rank prints
        with contextlib.redirect_stdout(sys.stderr):
            return _run(args)
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    # torch loads only here, so the planning commands stay torch-free.
    from pipetrain.cli.common import require

    require("torch", "train")
    from pipetrain.errors import PipelineError
    from pipetrain.plan.schedule import Schedule, is_schedule_file
    from pipetrain.train.auto import is_auto, parse_memory_limit
    from pipetrain.train.launch import no_cuda_reason, spawn, torchrun_env
    from pipetrain.train.loop import TrainConfig, load_data, plan_for, run_rank

    for name in ("ranks", "stages_per_rank", "microbatches", "steps", "batch_size", "checkpoint_every"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise PipelineError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    env = torchrun_env()
    if env is not None and args.ranks is not None and args.ranks != env.world_size:
        raise PipelineError(f"--ranks {args.ranks} but torchrun started WORLD_SIZE={env.world_size} processes")
    ranks = args.ranks
    microbatches = _DEFAULTS["microbatches"] if args.microbatches is None else args.microbatches
    mb_source = f"--microbatches {microbatches}"
    if is_schedule_file(args.schedule):
        # The file fixes the microbatch count (and, unless --ranks says otherwise, the ranks):
        # every check below must see its numbers, not the defaults.
        planned = Schedule.load(args.schedule)
        if args.microbatches is not None and args.microbatches != planned.num_microbatches:
            raise PipelineError(
                f"--microbatches {args.microbatches} contradicts {args.schedule}, "
                f"a schedule of {planned.num_microbatches} microbatches (leave --microbatches out)"
            )
        if args.stages_per_rank is not None and (args.stages_per_rank * planned.num_ranks != planned.num_stages):
            raise PipelineError(
                f"--stages-per-rank {args.stages_per_rank} contradicts {args.schedule}, a schedule of "
                f"{planned.num_stages} stages on {planned.num_ranks} ranks (leave --stages-per-rank out)"
            )
        microbatches = planned.num_microbatches
        mb_source = f"the {microbatches} microbatches of {args.schedule}"
        if env is None and ranks is None:
            ranks = planned.num_ranks
            cores = os.cpu_count() or 1
            crowded = f" (more than the {cores} CPU cores here)" if args.device == "cpu" and ranks > cores else ""
            print(
                f"{args.schedule}: {planned.num_ranks} ranks, {planned.num_stages} stages, "
                f"{planned.num_microbatches} microbatches: spawning {ranks} processes{crowded}",
                flush=True,
            )
    if args.checkpoint_every is not None and args.checkpoint_dir is None:
        raise PipelineError("--checkpoint-every needs --checkpoint-dir (where the checkpoints go)")
    if (
        args.checkpoint_dir is not None
        and os.path.exists(args.checkpoint_dir)
        and not os.path.isdir(args.checkpoint_dir)
    ):
        raise PipelineError(
            f"--checkpoint-dir {args.checkpoint_dir} is a file; give a directory (it is created if missing)"
        )
    out = args.out or f"runs/{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    if os.path.exists(out) and not os.path.isdir(out):  # found now, not after the whole run
        raise PipelineError(f"--out {out} is a file; give a directory (it is created if missing)")
    cfg = TrainConfig(
        ranks=env.world_size if env is not None else (ranks or _DEFAULTS["ranks"]),
        stages_per_rank=args.stages_per_rank,
        schedule=args.schedule,
        microbatches=microbatches,
        steps=args.steps,
        batch_size=args.batch_size,
        device=args.device,
        out=out,
        seed=args.seed,
        check=args.check,
        model=args.model,
        lr=args.lr,
        clip_grad_norm=args.clip_grad_norm,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every or 10,
        costs_out=args.costs_out,
        layers_out=args.layers_out,
        plan_time_limit=5.0 if args.plan_time_limit is None else args.plan_time_limit,
        placement=args.placement,
        memory_limit=None if args.memory_limit is None else parse_memory_limit(args.memory_limit),
        json=args.json,
        activation_checkpointing=args.activation_checkpointing,
    )
    if args.activation_checkpointing and is_auto(args.schedule):
        raise PipelineError(
            "--activation-checkpointing with --schedule auto: the planner chooses which stages recompute "
            "(within --memory-limit); give a schedule name to checkpoint every block"
        )
    if args.costs_out is not None and args.steps < 2:
        raise PipelineError("profile needs --steps 2 at least (the last step is not among the measured ones)")
    if args.costs_out is not None:  # found now, not after the steps it measures
        folder = os.path.dirname(os.path.abspath(args.costs_out))
        if os.path.isdir(args.costs_out) or not os.path.isdir(folder):
            raise PipelineError(f"--costs-out {args.costs_out}: give a file in an existing directory")
    if args.layers_out is not None:
        folder = os.path.dirname(os.path.abspath(args.layers_out))
        if os.path.isdir(args.layers_out) or not os.path.isdir(folder):
            raise PipelineError(f"--layers-out {args.layers_out}: give a file in an existing directory")
        if os.path.splitext(args.layers_out)[1].lower() not in (".json", ".csv"):
            raise PipelineError(f"--layers-out {args.layers_out}: a layers file is .json or .csv")
    planning = {
        "--memory-limit": args.memory_limit,
        "--plan-time-limit": args.plan_time_limit,
        "--placement": args.placement,
    }
    used = next((flag for flag, value in planning.items() if value is not None), None)
    if not is_auto(args.schedule) and used is not None:
        raise PipelineError(f"{used} is for --schedule auto (a named schedule or a file fixes the layout)")
    if args.plan_time_limit is not None and not 0 < args.plan_time_limit < float("inf"):
        raise PipelineError(f"--plan-time-limit must be a number of seconds > 0, got {args.plan_time_limit:g}")
    if args.clip_grad_norm is not None and not args.clip_grad_norm > 0:
        raise PipelineError(f"--clip-grad-norm must be > 0, got {args.clip_grad_norm}")
    if args.batch_size < microbatches:
        raise PipelineError(f"--batch-size {args.batch_size} is smaller than {mb_source}")
    if env is not None:
        if env.rank == 0:
            _say_if_no_pictures()
        run_rank(env, cfg)
        return 0
    # Problems every rank would hit are reported once, before any process starts.
    if not is_auto(cfg.schedule):
        plan_for(cfg, cfg.ranks)
    if cfg.model_config.tokenizer != "bytes":
        load_data(cfg)  # learnt and encoded once here (then cached), not by every rank at once
    if cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise PipelineError(f"--device cuda, but {no_cuda_reason()}")
        if torch.cuda.device_count() < cfg.ranks:
            gpus = f"{cfg.ranks} GPU{'s' * (cfg.ranks > 1)}"
            raise PipelineError(
                f"--device cuda with {cfg.ranks} ranks needs {gpus} (one per rank), {torch.cuda.device_count()} visible"
            )
    _say_if_no_pictures()
    spawn(run_rank, cfg.ranks, cfg)
    return 0


def _say_if_no_pictures() -> None:
    if not _importable("matplotlib"):
        print(
            "pipetrain train: matplotlib is not installed, so no timeline pictures are drawn "
            "(traces and the summary still are): pip install 'pipetrain[train]'",
            file=sys.stderr,
        )


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # an import hook that refuses it
        return False
