"""Microbatch split and merge: structure, chunk specs, uneven sizes and clear errors."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.errors import PipelineError
from pipetrain.microbatch import (
    REPLICATE,
    TensorChunkSpec,
    merge_chunks,
    split_args_kwargs_into_chunks,
    split_into_chunks,
)

Pair = namedtuple("Pair", ["left", "right"])


def _same(a: Any, b: Any) -> None:
    """Same structure, tensors exactly equal, other leaves equal."""
    leaves_a, spec_a = pytree.tree_flatten(a)
    leaves_b, spec_b = pytree.tree_flatten(b)
    assert spec_a == spec_b
    for x, y in zip(leaves_a, leaves_b, strict=True):
        if isinstance(x, torch.Tensor):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
        else:
            assert x == y


def test_uneven_split_like_tensor_split() -> None:
    args, kwargs = split_args_kwargs_into_chunks((torch.arange(10),), {"y": torch.arange(20).view(10, 2)}, 4)
    assert [a[0].tolist() for a in args] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert [k["y"].shape[0] for k in kwargs] == [3, 3, 2, 2]
    _same(merge_chunks([a[0] for a in args]), torch.arange(10))


def test_nested_structures_round_trip() -> None:
    x = {"ids": torch.arange(12).view(6, 2), "extra": (torch.randn(6, 3), [torch.randn(6), "label", None])}
    pair = Pair(torch.randn(6, 4), torch.randn(6))
    args, kwargs = split_args_kwargs_into_chunks((x, pair), {"mask": torch.ones(6, 5), "flag": True}, 3)
    assert len(args) == len(kwargs) == 3
    for a, k in zip(args, kwargs, strict=True):
        assert a[0]["ids"].shape == (2, 2) and a[0]["extra"][1][1] == "label" and a[0]["extra"][1][2] is None
        assert isinstance(a[1], Pair) and a[1].left.shape == (2, 4)
        assert k["flag"] is True and k["mask"].shape == (2, 5)
    _same(merge_chunks([a[0] for a in args]), x)
    _same(merge_chunks([a[1] for a in args]), pair)
    _same(merge_chunks(kwargs), {"mask": torch.ones(6, 5), "flag": True})


def test_chunk_specs_other_dims_and_replicate() -> None:
    seq_major = torch.randn(5, 8, 3)  # (seq, batch, feature): split along dim 1
    table = torch.randn(7, 7)
    args, kwargs = split_args_kwargs_into_chunks(
        (seq_major, table),
        {"bias": torch.randn(8), "scale": torch.tensor(2.0)},
        4,
        args_chunk_spec=(TensorChunkSpec(1), REPLICATE),
        kwargs_chunk_spec={"bias": TensorChunkSpec(-1)},
    )
    assert [a[0].shape for a in args] == [(5, 2, 3)] * 4
    assert all(a[1] is table for a in args)
    assert all(k["scale"] is kwargs[0]["scale"] for k in kwargs)  # 0-dim: given whole
    _same(merge_chunks([a[0] for a in args], TensorChunkSpec(1)), seq_major)
    _same(merge_chunks([(a[0], a[1]) for a in args], (TensorChunkSpec(1), REPLICATE)), (seq_major, table))
    _same(merge_chunks([k["bias"] for k in kwargs]), kwargs_spec_bias := torch.cat([k["bias"] for k in kwargs]))
    assert kwargs_spec_bias.shape == (8,)


def test_spec_tree_prefix_inside_an_argument() -> None:
    arg = {"a": torch.randn(4, 6), "b": (torch.randn(6, 4), torch.randn(3, 3))}
    spec = {"a": TensorChunkSpec(1), "b": (TensorChunkSpec(0), REPLICATE)}
    (parts, _) = split_args_kwargs_into_chunks((arg,), None, 3, args_chunk_spec=(spec,))
    assert [p[0]["a"].shape for p in parts] == [(4, 2)] * 3
    assert [p[0]["b"][0].shape for p in parts] == [(2, 4)] * 3
    assert all(p[0]["b"][1] is arg["b"][1] for p in parts)
    _same(merge_chunks([p[0] for p in parts], spec), arg)


def test_targets_split_like_inputs() -> None:
    x, y = torch.randn(10, 3), torch.randn(10)
    args, _ = split_args_kwargs_into_chunks((x,), None, 4)
    targets = split_into_chunks(y, 4, name="target")
    assert [t.shape[0] for t in targets] == [a[0].shape[0] for a in args]
    _same(torch.cat(targets), y)


def test_merge_scalars_and_non_tensors() -> None:
    losses = [torch.tensor(float(i)) for i in range(3)]
    _same(merge_chunks(losses), torch.tensor([0.0, 1.0, 2.0]))
    assert merge_chunks([{"n": 3}, {"n": 3}]) == {"n": 3}
    assert merge_chunks([{"n": 1}, {"n": 2}]) == {"n": [1, 2]}


def test_gradient_flows_through_split_and_merge() -> None:
    x = torch.randn(7, 2, requires_grad=True)
    args, _ = split_args_kwargs_into_chunks((x,), None, 3)
    merge_chunks([a[0] * 2 for a in args]).sum().backward()
    _same(x.grad, torch.full((7, 2), 2.0))


@given(
    rows=st.integers(1, 40),
    chunks=st.integers(1, 9),
    dim=st.integers(0, 1),
    other=st.integers(1, 4),
)
@settings(max_examples=40, deadline=None)
def test_split_sizes_and_round_trip(rows: int, chunks: int, dim: int, other: int) -> None:
    shape = (rows, other) if dim == 0 else (other, rows)
    x = torch.randn(shape)
    if rows < chunks:
        with pytest.raises(PipelineError, match=f"size {rows}"):
            split_args_kwargs_into_chunks((x,), None, chunks, args_chunk_spec=(TensorChunkSpec(dim),))
        return
    args, _ = split_args_kwargs_into_chunks((x,), None, chunks, args_chunk_spec=(TensorChunkSpec(dim),))
    sizes = [a[0].shape[dim] for a in args]
    assert sum(sizes) == rows and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    _same(merge_chunks([a[0] for a in args], TensorChunkSpec(dim)), x)


def test_spec_helpers_and_torch_spec_objects() -> None:
    """Specs written for torch.distributed.pipelining work unchanged."""
    from torch.distributed.pipelining import microbatch as tmb

    assert TensorChunkSpec.from_tuple((0, 1)) == (TensorChunkSpec(0), TensorChunkSpec(1))
    assert TensorChunkSpec.from_dict({"m": 1}) == {"m": TensorChunkSpec(1)}
    x, table = torch.randn(3, 6), torch.randn(2, 2)
    args, _ = split_args_kwargs_into_chunks(
        (x, table), None, 3, args_chunk_spec=(tmb.TensorChunkSpec(1), tmb._Replicate)
    )
    assert [a[0].shape for a in args] == [(3, 2)] * 3 and all(a[1] is table for a in args)
    _same(merge_chunks([a[0] for a in args], tmb.TensorChunkSpec(1)), x)
    total = merge_chunks([torch.tensor(1.0), torch.tensor(2.5)], tmb.sum_reducer)
    _same(total, torch.tensor(3.5))


# ----------------------------------------------------------------------------- errors
def test_batch_smaller_than_microbatches_names_argument_and_sizes() -> None:
    with pytest.raises(PipelineError, match=r"args\[1\]\['ids'\] into 8 microbatches: its dim 0 has size 5"):
        split_args_kwargs_into_chunks((torch.randn(8, 2), {"ids": torch.arange(5)}), None, 8)
    with pytest.raises(PipelineError, match=r"kwargs\['mask'\] into 4 microbatches: its dim 1 has size 2"):
        split_args_kwargs_into_chunks((), {"mask": torch.ones(9, 2)}, 4, kwargs_chunk_spec={"mask": TensorChunkSpec(1)})


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: split_args_kwargs_into_chunks((torch.ones(4),), None, 0), "positive int"),
        (lambda: split_args_kwargs_into_chunks((torch.ones(4),), None, 2, args_chunk_spec=()), "1 positional"),
        (
            lambda: split_args_kwargs_into_chunks((), {"a": torch.ones(4)}, 2, kwargs_chunk_spec={"b": REPLICATE}),
            r"not given: \['b'\]",
        ),
        (lambda: split_args_kwargs_into_chunks((torch.ones(4),), None, 2, args_chunk_spec=(3,)), "must be"),
        (
            lambda: split_args_kwargs_into_chunks((torch.ones(4),), None, 2, args_chunk_spec=(TensorChunkSpec(2),)),
            "along dim 2",
        ),
        (
            lambda: split_args_kwargs_into_chunks(((torch.ones(4),),), None, 2, args_chunk_spec=({"a": REPLICATE},)),
            "not a prefix",
        ),
        (lambda: merge_chunks([]), "at least one"),
        (lambda: merge_chunks([(torch.ones(2),), [torch.ones(2)]]), "microbatch 1 has structure"),
        (lambda: merge_chunks([torch.ones(2, 3), torch.ones(2, 4)]), r"shapes \[\(2, 3\), \(2, 4\)\]"),
        (lambda: merge_chunks([torch.ones(2), 3]), "some microbatches gave a tensor"),
    ],
)
def test_clear_errors(call: Any, message: str) -> None:
    with pytest.raises(PipelineError, match=message):
        call()


def test_torchs_reducers_merge_by_reducing() -> None:
    """torch's ``sum_reducer`` (and ``_CustomReducer``) in an output merge spec: reduced, not concatenated."""
    import operator

    from pipetrain.microbatch import DEFAULT_CHUNK_DIM, _CustomReducer, merge_chunks, sum_reducer

    chunks = [
        {"loss": torch.tensor(1.0), "out": torch.ones(2, 3)},
        {"loss": torch.tensor(2.5), "out": torch.ones(1, 3)},
    ]
    merged = merge_chunks(chunks, {"loss": sum_reducer, "out": None})
    assert merged["loss"].item() == 3.5 and merged["out"].shape == (3, 3) and DEFAULT_CHUNK_DIM == 0
    assert merge_chunks([2, 3, 4], _CustomReducer(1, operator.mul)) == 24
