"""Split backward cost: time(I) + time(W) against time(B) on one MLP stage, or on transformer blocks.

Target: the ratio stays within 1.15 on the MLP (the split must not redo work). Run:
``python benchmarks/split_backward.py [--batch 256] [--width 1024] [--layers 4] [--reps 30]``;
``--blocks N``: N blocks of the ``bpe`` preset on one microbatch of 2 sequences instead (small
kernels: there the split's fixed costs show, which is why the planner prices B apart from I + W).
Steps alternate between B and I+W so both see the same machine state; medians are reported.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pipetrain.stage import PipelineStage


def build(width: int, layers: int) -> torch.nn.Module:
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*mods)


def bpe_blocks(count: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """``count`` blocks of the ``bpe`` preset and a block input for one microbatch of 2 sequences."""
    from pipetrain.train.model import GPT, MODEL_SIZES

    cfg = MODEL_SIZES["bpe"]
    model = GPT(cfg)
    layers = list(model.children())
    with torch.no_grad():
        x = layers[0](torch.randint(0, cfg.vocab_size, (2, cfg.seq_len)))
    return torch.nn.Sequential(*layers[1 : 1 + count]), x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--first", action="store_true", help="stage inputs need no grad (first stage)")
    parser.add_argument("--torch", action="store_true", help="also time torch.distributed.pipelining's split")
    parser.add_argument("--blocks", type=int, default=0, help="N blocks of the bpe preset instead of the MLP")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.blocks:
        module, x = bpe_blocks(args.blocks)
        title = f"{args.blocks} bpe block(s) (d_model 224, 2 x 64 tokens), {args.threads} thread(s)"
    else:
        module, x = build(args.width, args.layers), torch.randn(args.batch, args.width)
        title = (
            f"MLP {args.layers}x Linear({args.width},{args.width})+GELU, batch {args.batch}, {args.threads} thread(s)"
        )
    stage = PipelineStage(module, 1 if not args.first else 0, 2, "cpu")
    grad = torch.randn_like(x)

    def run(split: bool) -> tuple[float, float]:
        inp = x.clone().requires_grad_(not args.first)
        stage.forward_one_chunk(0, (inp,))
        t0 = time.perf_counter()
        if not split:
            stage.backward_one_chunk(0, grad_outputs=[grad], full=True)
            return time.perf_counter() - t0, 0.0
        stage.backward_one_chunk(0, grad_outputs=[grad], full=False)
        t1 = time.perf_counter()
        stage.backward_weight_one_chunk(0)
        return t1 - t0, time.perf_counter() - t1

    def run_torch() -> tuple[float, float]:
        from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

        inp = x.clone().requires_grad_(not args.first)
        out = stage.submodule(inp)
        params = list(stage.submodule.parameters())
        t0 = time.perf_counter()
        _, groups = stage_backward_input([out], [grad], [inp], iter(params))
        t1 = time.perf_counter()
        stage_backward_weight(iter(params), groups)
        return t1 - t0, time.perf_counter() - t1

    def held_mib() -> tuple[float, float, float]:
        """MiB one microbatch holds: saved activations after F, after I, and gradients I kept for W."""
        param_ptrs = {p.untyped_storage().data_ptr() for p in stage.submodule.parameters()}

        def activations() -> float:
            saved = stage._mbs[0].saved
            assert saved is not None
            storages = {
                h.tensor.untyped_storage().data_ptr(): h.tensor.untyped_storage().nbytes()
                for h in saved.holders
                if h.tensor is not None and h.tensor.untyped_storage().data_ptr() not in param_ptrs
            }
            return sum(storages.values()) / 2**20

        stage.forward_one_chunk(0, (x.clone().requires_grad_(not args.first),))
        after_f = activations()
        stage.backward_one_chunk(0, grad_outputs=[grad], full=False)
        after_i = activations()
        plan = stage._mbs[0].plan
        assert plan is not None
        kept = sum(g.nbytes for group in plan.groups for g in group.grads if g is not grad) / 2**20
        stage.backward_weight_one_chunk(0)
        return after_f, after_i, kept

    for _ in range(3):
        run(False)
        run(True)
    b_times, i_times, w_times, t_times = [], [], [], []
    for _ in range(args.reps):
        b_times.append(run(False)[0])
        i, w = run(True)
        i_times.append(i)
        w_times.append(w)
        if args.torch:
            t_times.append(sum(run_torch()))
    b = statistics.median(b_times)
    i = statistics.median(i_times)
    w = statistics.median(w_times)
    iw = statistics.median([a + c for a, c in zip(i_times, w_times, strict=True)])
    print(f"{title}{', first stage' if args.first else ''}")
    print(f"B     {b * 1e3:8.3f} ms")
    print(f"I     {i * 1e3:8.3f} ms")
    print(f"W     {w * 1e3:8.3f} ms")
    print(f"I+W   {iw * 1e3:8.3f} ms")
    print(f"ratio (I+W)/B = {iw / b:.3f}" + ("" if args.blocks else "  (target <= 1.15)"))
    after_f, after_i, kept = held_mib()
    print(
        f"one microbatch holds: saved activations {after_f:.1f} MiB after F, {after_i:.1f} MiB after I "
        f"(until W), plus {kept:.1f} MiB of gradients I kept for W"
    )
    if t_times:
        tiw = statistics.median(t_times)
        print(f"torch.distributed.pipelining I+W {tiw * 1e3:8.3f} ms (ratio to our B {tiw / b:.3f})")


if __name__ == "__main__":
    main()
