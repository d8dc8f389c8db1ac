"""pipetrain.split: balanced contiguous cuts of layer lists and nn.Sequential models."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from pipetrain.split import (
    LayerStage,
    layer_times,
    parameter_counts,
    partition_balanced,
    split_layers,
    split_sequential,
    stage_boundaries,
)


def _brute_force_best(weights: list[int], parts: int) -> int:
    n = len(weights)
    best = None
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = [0, *cuts, n]
        heaviest = max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))
        best = heaviest if best is None else min(best, heaviest)
    assert best is not None
    return best


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=9), st.integers(1, 9))
def test_partition_is_optimal_and_complete(weights: list[int], parts: int) -> None:
    if parts > len(weights):
        with pytest.raises(ValueError, match="non-empty stages"):
            partition_balanced(weights, parts)
        return
    sizes = partition_balanced(weights, parts)
    assert len(sizes) == parts
    assert all(s >= 1 for s in sizes)
    assert sum(sizes) == len(weights)
    heaviest = max(sum(weights[a:b]) for a, b in stage_boundaries(sizes))
    assert heaviest == _brute_force_best(weights, parts)


def test_partition_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="num_parts"):
        partition_balanced([1, 2], 0)
    with pytest.raises(ValueError, match=">= 0"):
        partition_balanced([1, -2], 1)


def test_explicit_weights_put_the_heavy_layer_alone() -> None:
    layers = [nn.Linear(2, 2) for _ in range(4)]
    stages = split_layers(layers, 2, by=[1, 1, 1, 10])
    assert [len(s) for s in stages] == [3, 1]
    assert stages[1][0] is layers[3]


def test_split_sequential_keeps_names_and_function() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    stages = split_sequential(model, 3)
    assert len(stages) == 3
    keys = [k for s in stages for k in s.state_dict()]
    assert keys == list(model.state_dict())
    x = torch.randn(5, 4)
    y = x
    for stage in stages:
        y = stage(y)
    torch.testing.assert_close(y, model(x), rtol=0, atol=0)
    # The stages share the model's parameters: nothing is copied.
    assert {id(p) for s in stages for p in s.parameters()} == {id(p) for p in model.parameters()}


def test_split_by_params_balances_parameter_counts() -> None:
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10), nn.Linear(10, 100), nn.Linear(100, 1))
    counts = parameter_counts(list(model))
    stages = split_sequential(model, 2)
    per_stage = [sum(p.numel() for p in s.parameters()) for s in stages]
    assert sum(per_stage) == sum(counts)
    assert max(per_stage) == _brute_force_best(counts, 2)


def test_parameter_counts_count_shared_parameters_once() -> None:
    a = nn.Linear(3, 3)
    b = nn.Linear(3, 3)
    b.weight = a.weight
    assert parameter_counts([a, b]) == [12, 3]


def test_split_sequential_needs_a_sequential() -> None:
    with pytest.raises(TypeError, match=r"nn\.Sequential"):
        split_sequential(nn.Linear(2, 2), 1)  # type: ignore[arg-type]


def test_split_by_time_measures_and_restores_grads() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 256), nn.Linear(256, 8))
    model[0].weight.grad = torch.full_like(model[0].weight, 3.0)
    times = layer_times(list(model), torch.randn(4, 8), repeats=2)
    assert len(times) == 3 and all(t > 0 for t in times)
    assert model[1].weight.grad is None
    torch.testing.assert_close(model[0].weight.grad, torch.full_like(model[0].weight, 3.0))
    stages = split_sequential(model, 2, by="time", sample_input=torch.randn(4, 8), repeats=1)
    assert sum(len(s) for s in stages) == 3


def test_split_by_time_needs_a_sample_and_a_known_mode() -> None:
    with pytest.raises(ValueError, match="sample_input"):
        split_layers([nn.Linear(1, 1)], 1, by="time")
    with pytest.raises(ValueError, match="params"):
        split_layers([nn.Linear(1, 1)], 1, by="flops")
    with pytest.raises(ValueError, match="2 weights for 1 layers"):
        split_layers([nn.Linear(1, 1)], 1, by=[1, 2])


def test_partition_rejects_weights_that_are_not_finite() -> None:
    # inf or NaN made every cut look equally bad: [inf, 1, 1] into 2 came back as [0, 3].
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="weight 0 is"):
            partition_balanced([bad, 1.0, 1.0], 2)


def test_a_module_used_twice_runs_twice_in_its_stage() -> None:
    # One activation object shared between positions, as people write nn.Sequential.
    torch.manual_seed(0)
    act = nn.Tanh()
    model = nn.Sequential(nn.Linear(4, 4), act, nn.Linear(4, 4), act, nn.Linear(4, 2))
    x = torch.randn(3, 4)
    for parts in (1, 2, 3):
        stages = split_sequential(model, parts)
        assert sum(len(s) for s in stages) == 5
        y = x
        for stage in stages:
            y = stage(y)
        torch.testing.assert_close(y, model(x), rtol=0, atol=0)
        assert [k for s in stages for k in s.state_dict()] == list(model.state_dict())


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.ReLU()) for _ in range(4))
        self.head = nn.Linear(6, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def test_a_list_of_blocks_with_model_keeps_the_whole_models_keys() -> None:
    torch.manual_seed(0)
    net = _Net()
    stages = split_layers([net.embed, *net.blocks, net.head], 3, model=net)
    keys = [k for s in stages for k in s.state_dict()]
    assert keys == list(net.state_dict())
    tokens = torch.randint(0, 10, (2, 5))
    y = tokens
    for stage in stages:
        y = stage(y)
    torch.testing.assert_close(y, net(tokens), rtol=0, atol=0)
    # A checkpoint of the whole model loads into the stages, key for key.
    full = {k: v + 1 for k, v in net.state_dict().items()}
    for stage in stages:
        stage.load_state_dict({k: v for k, v in full.items() if k in stage.state_dict()})
    torch.testing.assert_close(net.head.bias, full["head.bias"])
    assert {id(p) for s in stages for p in s.parameters()} == {id(p) for p in net.parameters()}


def test_layer_names_from_a_mapping_or_positions() -> None:
    a, b, c = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
    stages = split_layers({"enc.0": a, "enc.1": b, "out": c}, 2, by=[1, 1, 1])
    assert [k for s in stages for k in s.state_dict()] == [
        "enc.0.weight", "enc.0.bias", "enc.1.weight", "enc.1.bias", "out.weight", "out.bias"
    ]  # fmt: skip
    assert [k for s in split_layers([a, b, c], 3) for k in s.state_dict()][::2] == ["0.weight", "1.weight", "2.weight"]
    with pytest.raises(ValueError, match="not a submodule"):
        split_layers([a, nn.Linear(2, 2)], 2, model=nn.Sequential(a))


class _Pair(nn.Module):
    """A layer taking and returning a tuple (hidden state, mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, mask = x
        return self.lin(h) * mask, mask


def test_layer_times_handles_tuple_outputs_and_leaves_buffers_alone() -> None:
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(4)
    layers = [_Pair(), _Pair()]
    # Tuple in, tuple out: each layer must get the previous output detached (it crashed before).
    sample = (torch.randn(8, 4), torch.ones(8, 4))
    times = layer_times(layers, sample, repeats=2)
    assert len(times) == 2 and all(t > 0 for t in times)
    assert all(p.grad is None for layer in layers for p in layer.parameters())
    # Measuring runs BatchNorm in training mode; its running statistics must be restored.
    before = {k: v.clone() for k, v in norm.state_dict().items()}
    layer_times([nn.Linear(4, 4), norm], torch.randn(8, 4) * 5 + 3, repeats=2)
    after = norm.state_dict()
    for k, v in before.items():
        torch.testing.assert_close(after[k], v, rtol=0, atol=0)


def test_named_stages_train_in_a_pipeline_like_the_whole_model() -> None:
    from pipetrain import LocalPipeline

    torch.manual_seed(0)
    net = _Net()
    ref = copy.deepcopy(net)
    stages = split_layers([net.embed, *net.blocks, net.head], 4, model=net)
    assert any(isinstance(s, LayerStage) for s in stages)
    tokens = torch.randint(0, 10, (8, 5))
    target = torch.randn(8, 5, 10)
    losses: list[torch.Tensor] = []
    LocalPipeline(stages, "ZBVZeroBubble", 4, loss_fn=nn.functional.mse_loss).step(tokens, target=target, losses=losses)
    loss = nn.functional.mse_loss(ref(tokens), target)
    loss.backward()
    torch.testing.assert_close(torch.stack(losses).mean(), loss)
    got = {k: p.grad for s in stages for k, p in s.named_parameters()}
    for k, p in ref.named_parameters():
        torch.testing.assert_close(got[k], p.grad)


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.queries, self.keys, self.values = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)


def test_model_paths_name_every_kind_of_layer_container() -> None:
    # Found by review: model= was ignored for an nn.Sequential, paths through names a ModuleDict
    # owns ("keys", "values") crashed, and a layer inside another given one was caught only when
    # both fell in one stage (else its parameters were in two stages).
    net = _Net()
    net.attn = _Attention()
    stages = split_layers(net.blocks[0], 2, model=net)  # an nn.Sequential inside the model
    assert [k for s in stages for k in s.state_dict()] == ["blocks.0.0.weight", "blocks.0.0.bias"]
    attn = [net.attn.queries, net.attn.keys, net.attn.values]
    stages = split_layers(attn, 1, model=net)
    assert list(stages[0].state_dict())[::2] == ["attn.queries.weight", "attn.keys.weight", "attn.values.weight"]
    for parts in (1, 2):
        with pytest.raises(ValueError, match=r"'blocks\.0' lies inside layer 'blocks'"):
            split_layers([net.blocks, net.blocks[0]], parts, model=net)
    # layer_times takes any iterable of layers, a generator too.
    assert len(layer_times((m for m in attn), torch.randn(2, 4), repeats=1)) == 3


# ------------------------------------------------------------- a plan's cut, the loss, one cut for all


def test_time_cuts_count_the_loss_in_the_last_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    import pipetrain.split as split

    calls: list[torch.Tensor] = []

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls.append(out)
        return nn.functional.cross_entropy(out, target)

    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 50))
    x, y = torch.randn(6, 4), torch.randint(0, 50, (6,))
    times = layer_times(model, x, repeats=2, loss_fn=loss_fn, target=y)
    assert len(times) == 3 and len(calls) == 3  # the last layer's warm-up and two timed runs
    assert all(t.shape == (6, 50) for t in calls)
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="loss_fn and target together"):
        layer_times(model, x, loss_fn=loss_fn)
    # split_* pass the loss on to the measurement.
    seen: dict[str, object] = {}

    def fake_times(layers: object, sample: object, **kwargs: object) -> list[float]:
        seen.update(kwargs)
        return [1.0, 1.0, 5.0]

    monkeypatch.setattr(split, "layer_times", fake_times)
    stages = split_sequential(model, 2, by="time", sample_input=x, loss_fn=loss_fn, target=y)
    assert seen["loss_fn"] is loss_fn and seen["target"] is y
    assert [list(s._modules) for s in stages] == [["0", "1"], ["2"]]


def test_split_by_names_builds_a_plans_stages() -> None:
    from pipetrain.recompute import is_recomputed
    from pipetrain.split import split_by_names, stage_cut

    torch.manual_seed(0)
    net = _Net()
    named = [("embed", net.embed), *((f"blocks.{k}", b) for k, b in enumerate(net.blocks)), ("head", net.head)]
    cut = [["embed", "blocks.0"], ["blocks.1", "blocks.2", "blocks.3"], ["head"]]
    for layers in (named, dict(named), net):  # (name, layer) pairs, a mapping, or the model's own paths
        stages = split_by_names(layers, cut, recompute={1})
        assert [is_recomputed(s) for s in stages] == [False, True, False]
        assert [k for s in stages for k in s.state_dict()] == list(net.state_dict())
        tokens = torch.randint(0, 10, (2, 5))
        y = tokens
        for stage in stages:
            y = stage(y)
        torch.testing.assert_close(y, net(tokens), rtol=0, atol=0)
        info = stage_cut(stages[1])
        assert info is not None and info.index == 1 and info.layers == tuple(tuple(s) for s in cut)
        assert type(info).from_dict(info.to_dict()) == info
    errors = {
        "missing": [["embed", "blocks.0"], ["blocks.1", "blocks.2"], ["head"]],
        "not layers of the model": [["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3"], ["head", "tail"]],
        "out of order": [["blocks.0", "embed"], ["blocks.1", "blocks.2", "blocks.3", "head"]],
        "more than one stage": [["embed", "blocks.0"], ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]],
        "stage 1 has no layers": [["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"], []],
    }
    for words, bad in errors.items():
        with pytest.raises(ValueError, match=words):
            split_by_names(named, bad)
    with pytest.raises(ValueError, match="no submodule 'tail'"):
        split_by_names(net, [["embed"], ["tail"]])
    with pytest.raises(ValueError, match="recompute names stage 3, but there are 3 stages"):
        split_by_names(named, cut, recompute={3})


def test_stages_for_rank_follows_the_placement() -> None:
    from pipetrain.plan import build_schedule
    from pipetrain.split import stages_for_rank

    stages = split_sequential(nn.Sequential(*[nn.Linear(2, 2) for _ in range(8)]), 4)
    v = build_schedule("ZBVZeroBubble", 2, 4, 2)
    assert [s for s, _ in stages_for_rank(stages, v.stage_to_rank, 0)] == [0, 3]
    assert [m for _, m in stages_for_rank(stages, v, 1)] == [stages[1], stages[2]]
    loop = build_schedule("Interleaved1F1B", 2, 4, 2)
    assert [s for s, _ in stages_for_rank(stages, loop, 1)] == [1, 3]
    with pytest.raises(ValueError, match="covers stages"):
        stages_for_rank(stages[:3], v, 0)
