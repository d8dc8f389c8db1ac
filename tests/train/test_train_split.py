"""pipetrain.split: balanced contiguous cuts of layer lists and nn.Sequential models."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from pipetrain.split import (
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
