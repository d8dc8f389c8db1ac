"""Split backward cost: time(I) + time(W) against time(B) on one MLP stage, or on transformer blocks.

Targets (issue 35): (I + W)/B <= 1.05 eager, <= 1.10 under activation checkpointing and compiled,
with W holding the weight GEMMs. Run:
``python benchmarks/split_backward.py [--batch 256] [--width 1024] [--layers 4] [--reps 30]``;
``--blocks N``: N blocks of the ``bpe`` preset on one microbatch of 2 sequences instead;
``--wide``: blocks of d_model 256, 4 heads, 128 tokens instead. ``--ac`` checkpoints every block
(``pipetrain``: pipetrain.recompute; ``wrapper``: torch's checkpoint_wrapper, as torchtitan's
apply_ac makes it; ``sac``: the same with a selective policy saving matmuls; ``torch``: a plain
``torch.utils.checkpoint`` call in the block's forward); ``--compile`` compiles every block
(``--backend aot_eager``, the default, or ``inductor``): ``whole`` with torch.compile (one autograd
node, W holds nothing), ``between`` all of it but its Linear layers and ``graph`` with its backward
graph split into an input and a weight part (pipetrain.compiled.compile_for_split, split="linears"
and split="graph"). Steps alternate between B and I+W so both see the same machine state; medians
are reported, with W's share, the block forwards per microbatch and the largest gradient difference.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from pipetrain.stage import PipelineStage


def build(width: int, layers: int) -> torch.nn.Module:
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*mods)


def bpe_blocks(count: int, wide: bool = False) -> tuple[list[torch.nn.Module], torch.Tensor]:
    """``count`` blocks of the ``bpe`` preset (or of d_model 256, 4 heads, 128 tokens) and a
    block input for one microbatch of 2 sequences."""
    from dataclasses import replace

    from pipetrain.train.model import GPT, MODEL_SIZES

    cfg = MODEL_SIZES["bpe"]
    if wide:
        cfg = replace(cfg, d_model=256, n_heads=4, seq_len=128)
    model = GPT(cfg)
    layers = list(model.children())
    with torch.no_grad():
        x = layers[0](torch.randint(0, cfg.vocab_size, (2, cfg.seq_len)))
    return layers[1 : 1 + count], x


class _TorchCheckpointed(torch.nn.Module):
    """A block whose forward calls ``torch.utils.checkpoint`` itself (what pipetrain cannot adopt)."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        out: torch.Tensor = checkpoint(self.block, x, use_reentrant=False)
        return out


def wrap(block: torch.nn.Module, ac: str, compiled: str | None, backend: str = "aot_eager") -> torch.nn.Module:
    """One block as the options ask: checkpointed one way or another, compiled or not."""
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from pipetrain.recompute import recompute

    def save_matmuls(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        mm = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return CheckpointPolicy.MUST_SAVE if mm else CheckpointPolicy.PREFER_RECOMPUTE

    if ac == "pipetrain":
        block = recompute(block)
    elif ac == "wrapper":
        block = checkpoint_wrapper(block)
    elif ac == "sac":
        block = checkpoint_wrapper(block, context_fn=partial(create_selective_checkpoint_contexts, save_matmuls))
    elif ac == "torch":
        block = _TorchCheckpointed(block)
    if compiled in ("between", "graph"):
        from pipetrain.compiled import compile_for_split

        block = compile_for_split(block, split="linears" if compiled == "between" else "graph", backend=backend)
    elif compiled:
        block = torch.compile(block, backend=backend)
    return block


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--first", action="store_true", help="stage inputs need no grad (first stage)")
    parser.add_argument("--torch", action="store_true", help="also time torch.distributed.pipelining's split")
    parser.add_argument("--blocks", type=int, default=0, help="N blocks of the bpe preset instead of the MLP")
    parser.add_argument("--wide", action="store_true", help="blocks of d_model 256, 4 heads, 128 tokens")
    parser.add_argument("--ac", choices=["none", "pipetrain", "wrapper", "sac", "torch"], default="none")
    parser.add_argument(
        "--compile",
        nargs="?",
        const="whole",
        choices=["whole", "between", "graph"],
        help="torch.compile every block: whole, between its Linear layers, or with its backward graph split "
        "(pipetrain.compiled)",
    )
    parser.add_argument("--backend", choices=["aot_eager", "inductor"], default="aot_eager", help="for --compile")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (timed with a synchronize around each)")
    return parser.parse_args()


def subject(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.Tensor, str, list[int]]:
    """The stage's module, its input, a title, and a counter of the first block's forwards."""
    forwards = [0]
    if not args.blocks:
        title = f"MLP {args.layers}x Linear({args.width},{args.width})+GELU, batch {args.batch}"
        return build(args.width, args.layers), torch.randn(args.batch, args.width), title, forwards
    blocks, x = bpe_blocks(args.blocks, args.wide)
    # (on a layer inside: a recomputed block's rebuild calls its forward, not the module)
    blocks[0].ln1.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    module = torch.nn.Sequential(*[wrap(b, args.ac, args.compile, args.backend) for b in blocks])
    shape = "d_model 256, 2 x 128 tokens" if args.wide else "bpe, d_model 224, 2 x 64 tokens"
    how = [f"checkpointed ({args.ac})"] if args.ac != "none" else []
    how += [f"compiled ({args.compile}, {args.backend})"] if args.compile else []
    return module, x, f"{args.blocks} block(s) ({shape}) {', '.join(how) or 'eager'}", forwards


class Bench:
    """B, I and W of one microbatch through one stage, and torch's split on the same module."""

    def __init__(self, module: torch.nn.Module, x: torch.Tensor, first: bool, device: str = "cpu") -> None:
        self.device = torch.device(device)
        module.to(self.device)
        self.torch_module = copy.deepcopy(module)  # as torch's stage runs it (no checkpoint adopted)
        self.stage = PipelineStage(module, 0 if first else 1, 2, self.device)
        self.x, self.first = x.to(self.device), first
        self.grad = torch.randn_like(self.x)

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def run(self, split: bool) -> tuple[float, float]:
        stage = self.stage
        stage.forward_one_chunk(0, (self.x.clone().requires_grad_(not self.first),))
        t0 = self.now()
        if not split:
            stage.backward_one_chunk(0, grad_outputs=[self.grad], full=True)
            return self.now() - t0, 0.0
        stage.backward_one_chunk(0, grad_outputs=[self.grad], full=False)
        t1 = self.now()
        stage.backward_weight_one_chunk(0)
        return t1 - t0, self.now() - t1

    def run_torch(self) -> float:
        from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

        inp = self.x.clone().requires_grad_(not self.first)
        out = self.torch_module(inp)
        params = list(self.torch_module.parameters())
        t0 = self.now()
        _, groups = stage_backward_input([out], [self.grad], [inp], iter(params))
        stage_backward_weight(iter(params), groups)
        return self.now() - t0

    def grads_differ(self) -> float:
        """The largest difference between B's and I+W's parameter gradients (same microbatch)."""
        params = list(self.stage.submodule.parameters())
        got = []
        for split in (False, True):
            for p in params:
                p.grad = None
            self.run(split)
            got.append([p.grad.clone() if p.grad is not None else None for p in params])
        return max(
            (float((a - b).abs().max()) for a, b in zip(*got, strict=True) if a is not None and b is not None),
            default=0.0,
        )

    def held_mib(self) -> tuple[float, float]:
        """MiB one microbatch holds: saved activations after F, and W's operands from I to W."""
        stage = self.stage
        params = {p.untyped_storage().data_ptr() for p in stage.submodule.parameters()}
        stage.forward_one_chunk(0, (self.x.clone().requires_grad_(not self.first),))
        saved = stage._mbs[0].saved
        assert saved is not None
        storages = {
            h.tensor.untyped_storage().data_ptr(): h.tensor.untyped_storage().nbytes()
            for h in saved.holders
            if h.tensor is not None and h.tensor.untyped_storage().data_ptr() not in params
        }
        stage.backward_one_chunk(0, grad_outputs=[self.grad], full=False)
        plan = stage._mbs[0].plan
        assert plan is not None
        kept = plan.nbytes() if hasattr(plan, "nbytes") else float("nan")  # (older pipetrain: not counted)
        stage.backward_weight_one_chunk(0)
        return sum(storages.values()) / 2**20, kept / 2**20


def main() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    module, x, title, forwards = subject(args)
    bench = Bench(module, x, args.first, args.device)
    for _ in range(3):
        bench.run(False)
        bench.run(True)
    diff = bench.grads_differ()
    forwards[0] = 0
    bench.run(True)
    split_forwards = forwards[0]
    # The graph split against plain torch.compile's B (does cutting the backward graph cost?).
    whole = None
    if args.compile == "graph":
        torch.manual_seed(0)
        whole_module, whole_x, _, _ = subject(argparse.Namespace(**{**vars(args), "compile": "whole"}))
        whole = Bench(whole_module, whole_x, args.first, args.device)
        for _ in range(3):
            whole.run(False)
    b_times, i_times, w_times, t_times, whole_times = [], [], [], [], []
    torch_error = None
    for _ in range(args.reps):
        if whole is not None:
            whole_times.append(whole.run(False)[0])
        b_times.append(bench.run(False)[0])
        i, w = bench.run(True)
        i_times.append(i)
        w_times.append(w)
        if args.torch and torch_error is None:
            try:
                t_times.append(bench.run_torch())
            except RuntimeError as exc:  # torch's split re-runs a selective checkpoint: it refuses
                torch_error = str(exc).splitlines()[0]
    b, i, w = (statistics.median(v) for v in (b_times, i_times, w_times))
    iw = statistics.median([a + c for a, c in zip(i_times, w_times, strict=True)])
    where = f"{args.threads} thread(s)" if args.device == "cpu" else args.device
    print(f"{title}, {where}{', first stage' if args.first else ''}")
    print(f"B     {b * 1e3:8.3f} ms")
    print(f"I     {i * 1e3:8.3f} ms")
    print(f"W     {w * 1e3:8.3f} ms")
    print(f"I+W   {iw * 1e3:8.3f} ms")
    print(f"ratio (I+W)/B = {iw / b:.3f}   W's share of I+W {w / (i + w):.0%}")
    print(f"largest |grad(B) - grad(I+W)| = {diff:.2e}")
    if whole_times:
        bw = statistics.median(whole_times)
        print(
            f"B of torch.compile (whole) {bw * 1e3:8.3f} ms: B/B(whole) = {b / bw:.3f}, (I+W)/B(whole) = {iw / bw:.3f}"
        )
    if args.blocks:
        print(f"forwards of the first block per microbatch under I+W: {split_forwards}")
    after_f, kept = bench.held_mib()
    print(f"one microbatch holds: saved activations {after_f:.1f} MiB after F; W's operands {kept:.1f} MiB from I to W")
    if torch_error is not None:
        print(f"torch.distributed.pipelining I+W fails: {torch_error}")
    elif t_times:
        tiw = statistics.median(t_times)
        print(f"torch.distributed.pipelining I+W {tiw * 1e3:8.3f} ms (ratio to our B {tiw / b:.3f})")


if __name__ == "__main__":
    main()
