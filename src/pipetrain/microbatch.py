"""Split a batch into microbatches and merge per-microbatch outputs back.

Nested inputs (tuples, lists, dicts, namedtuples, anything registered with torch's pytree) are
walked with ``torch.utils._pytree``, so the split follows the same structure rules as the rest of
torch. A chunk spec may be given for a whole argument or as a tree that mirrors the argument (a
tree *prefix*: one spec for a sub-tree applies to every tensor inside it).

Defaults: tensors split along dim 0 (uneven sizes allowed, like ``torch.tensor_split``: 10 rows
into 4 gives 3, 3, 2, 2); 0-dim tensors and non-tensor values are given whole to every microbatch.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from pipetrain.errors import PipelineError

__all__ = [
    "REPLICATE",
    "TensorChunkSpec",
    "merge_chunks",
    "split_args_kwargs_into_chunks",
    "split_into_chunks",
    "split_stage_kwargs",
]


@dataclass(frozen=True)
class TensorChunkSpec:
    """Split (and merge) a tensor along ``split_dim``."""

    split_dim: int

    def __str__(self) -> str:
        return f"TensorChunkSpec({self.split_dim})"

    @staticmethod
    def from_tuple(split_dims: tuple[int, ...]) -> tuple[TensorChunkSpec, ...]:
        """One spec per positional argument: ``from_tuple((0, 1))``."""
        return tuple(TensorChunkSpec(d) for d in split_dims)

    @staticmethod
    def from_dict(split_dims: dict[str, int]) -> dict[str, TensorChunkSpec]:
        """One spec per keyword argument: ``from_dict({"x": 0, "mask": 1})``."""
        return {k: TensorChunkSpec(d) for k, d in split_dims.items()}


class _Replicate:
    """Marker spec: the value is given whole to every microbatch (and not concatenated on merge)."""

    _instance: _Replicate | None = None

    def __new__(cls) -> _Replicate:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "REPLICATE"

    def __reduce__(self) -> str:
        return "REPLICATE"


REPLICATE = _Replicate()


@dataclass(frozen=True)
class _CustomReducer:
    """torch's merge spec for a value reduced over microbatches (a loss summed, say) instead of
    concatenated: ``reduce_fn(... reduce_fn(init_value, v0) ..., v_last)``."""

    init_value: Any
    reduce_fn: Callable[[Any, Any], Any]


class _LossReducer(_CustomReducer):
    """torch's name for a reducer of losses."""


sum_reducer = _LossReducer(torch.tensor(0.0), operator.add)
"""Sums a value over microbatches (torch's ``sum_reducer``): an ``output_merge_spec`` leaf."""

DEFAULT_CHUNK_DIM = 0
"""The dimension inputs are split along when no chunk spec says otherwise (the batch)."""

_DEFAULT = TensorChunkSpec(DEFAULT_CHUNK_DIM)
_Spec = Any  # TensorChunkSpec | _Replicate | a reducer (merge only)


def _normalize(spec: Any) -> Any:
    """Our spec for ``spec``; torch.distributed.pipelining's specs are accepted too (drop-in use).

    Returns None when ``spec`` is not a leaf spec (then it must be a tree of specs).
    """
    if spec is None:
        return _DEFAULT
    if isinstance(spec, (TensorChunkSpec, _Replicate)):
        return spec
    if getattr(spec, "__name__", None) == "_Replicate" or type(spec).__name__ == "_Replicate":
        return REPLICATE
    split_dim = getattr(spec, "split_dim", None)
    if isinstance(split_dim, int):
        return TensorChunkSpec(split_dim)
    if callable(getattr(spec, "reduce_fn", None)) and hasattr(spec, "init_value"):
        return spec  # torch's _CustomReducer / sum_reducer: merge by reducing
    return None


def _leaf_specs(value: Any, spec: Any, name: str) -> list[tuple[str, Any, _Spec]]:
    """Flatten ``value`` and pair every leaf with its spec (``spec`` is a prefix tree of ``value``)."""
    leaves_with_path, treespec = pytree.tree_flatten_with_path(value)
    if spec is None or _normalize(spec) is not None:
        specs: list[Any] = [spec] * len(leaves_with_path)
    else:
        broadcast = pytree._broadcast_to_and_flatten(spec, treespec)
        if broadcast is None:
            raise PipelineError(
                f"chunk spec for {name} does not match its structure: spec {spec!r} is not a prefix of "
                f"{pytree.treespec_pprint(treespec)}"
            )
        specs = broadcast
    out: list[tuple[str, Any, _Spec]] = []
    for (path, leaf), raw in zip(leaves_with_path, specs, strict=True):
        leaf_spec = _normalize(raw)
        if leaf_spec is None:
            raise PipelineError(
                f"chunk spec for {name}{pytree.keystr(path)} must be TensorChunkSpec, REPLICATE or None, got {raw!r}"
            )
        out.append((name + pytree.keystr(path), leaf, leaf_spec))
    return out


def _split_leaf(name: str, leaf: Any, spec: _Spec, chunks: int) -> list[Any]:
    if not isinstance(spec, (TensorChunkSpec, _Replicate)):
        raise PipelineError(f"chunk spec for {name} must be TensorChunkSpec, REPLICATE or None, got {spec!r}")
    if not isinstance(leaf, torch.Tensor) or isinstance(spec, _Replicate):
        return [leaf] * chunks
    if leaf.dim() == 0 and spec is _DEFAULT:
        return [leaf] * chunks
    dim = spec.split_dim
    if not -leaf.dim() <= dim < leaf.dim():
        raise PipelineError(f"cannot split {name} along dim {dim}: it has shape {tuple(leaf.shape)}")
    size = leaf.size(dim)
    if size < chunks:
        raise PipelineError(
            f"cannot split {name} into {chunks} microbatches: its dim {dim} has size {size} "
            f"(shape {tuple(leaf.shape)}); the batch must have at least as many rows as microbatches"
        )
    return list(torch.tensor_split(leaf, chunks, dim=dim))


def split_into_chunks(value: Any, chunks: int, chunk_spec: Any = None, name: str = "value") -> list[Any]:
    """Split one (possibly nested) value into ``chunks`` values of the same structure.

    Used for targets, which are split exactly like the inputs. ``name`` appears in error messages.
    """
    if not isinstance(chunks, int) or chunks < 1:
        raise PipelineError(f"number of microbatches must be a positive int, got {chunks!r}")
    entries = _leaf_specs(value, chunk_spec, name)
    treespec = pytree.tree_structure(value)
    per_leaf = [_split_leaf(leaf_name, leaf, spec, chunks) for leaf_name, leaf, spec in entries]
    return [pytree.tree_unflatten([parts[i] for parts in per_leaf], treespec) for i in range(chunks)]


def split_args_kwargs_into_chunks(
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    chunks: int,
    args_chunk_spec: Sequence[Any] | None = None,
    kwargs_chunk_spec: dict[str, Any] | None = None,
) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
    """Split positional and keyword inputs into per-microbatch ``(args, kwargs)`` lists.

    ``args_chunk_spec`` has one entry per positional argument and ``kwargs_chunk_spec`` one per
    keyword (missing keywords use the default); each entry is ``None`` (default),
    ``TensorChunkSpec(dim)``, ``REPLICATE`` or a tree of those mirroring the argument.
    """
    if not isinstance(chunks, int) or chunks < 1:
        raise PipelineError(f"number of microbatches must be a positive int, got {chunks!r}")
    kwargs = dict(kwargs or {})
    if args_chunk_spec is not None and len(args_chunk_spec) != len(args):
        raise PipelineError(
            f"args_chunk_spec has {len(args_chunk_spec)} entries but {len(args)} positional arguments were given"
        )
    if kwargs_chunk_spec is not None:
        unknown = sorted(set(kwargs_chunk_spec) - set(kwargs))
        if unknown:
            raise PipelineError(
                f"kwargs_chunk_spec names keyword arguments that were not given: {unknown}; given: {sorted(kwargs)}"
            )
    arg_chunks = [
        split_into_chunks(a, chunks, None if args_chunk_spec is None else args_chunk_spec[i], f"args[{i}]")
        for i, a in enumerate(args)
    ]
    kwarg_chunks = {
        k: split_into_chunks(v, chunks, (kwargs_chunk_spec or {}).get(k), f"kwargs[{k!r}]") for k, v in kwargs.items()
    }
    args_out = [tuple(parts[i] for parts in arg_chunks) for i in range(chunks)]
    kwargs_out = [{k: parts[i] for k, parts in kwarg_chunks.items()} for i in range(chunks)]
    return args_out, kwargs_out


def requires_grad(value: Any) -> bool:
    """Whether any tensor in ``value`` (any pytree) requires grad."""
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(value))


def split_stage_kwargs(
    stage_kwargs: Any,
    chunks: int,
    num_stages: int,
    held: Sequence[int],
    chunk_spec: Any = None,
) -> dict[int, list[dict[str, Any]]]:
    """Per stage in ``held``, its extra keyword inputs split into ``chunks`` microbatches.

    ``stage_kwargs`` maps a stage index to keyword inputs that stage's forward takes besides what
    the previous stage sends (an attention mask, position ids): data given on the rank that
    holds the stage, not carried through the pipeline. Every rank may pass the same mapping;
    stages held elsewhere are skipped. ``chunk_spec`` mirrors it (``{stage: {name: spec}}``,
    default dim 0). Tensors that require grad are refused beyond stage 0: no gradient flows back
    to a later stage's keyword inputs (stage 0's get theirs, as its other inputs do).
    """
    if stage_kwargs is None:
        if chunk_spec is not None:
            raise PipelineError("stage_kwargs_chunk_spec was given without stage_kwargs")
        return {}
    if not isinstance(stage_kwargs, dict):
        raise PipelineError(
            f"stage_kwargs must be a dict {{stage index: {{name: value}}}}, got {type(stage_kwargs).__name__}"
        )
    specs = chunk_spec or {}
    if not isinstance(specs, dict) or not set(specs) <= set(stage_kwargs):
        raise PipelineError(
            "stage_kwargs_chunk_spec must be a dict over stages that stage_kwargs names "
            f"({sorted(stage_kwargs)}), got {specs!r}"
        )
    out: dict[int, list[dict[str, Any]]] = {}
    for stage, kwargs in stage_kwargs.items():
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < num_stages:
            raise PipelineError(
                f"stage_kwargs: {stage!r} is not a stage index (the pipeline has stages 0..{num_stages - 1})"
            )
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise PipelineError(f"stage_kwargs[{stage}] must be a dict of keyword names to values, got {kwargs!r}")
        if stage not in held:
            continue
        spec = specs.get(stage) or {}
        if not isinstance(spec, dict) or not set(spec) <= set(kwargs):
            raise PipelineError(
                f"stage_kwargs_chunk_spec[{stage}] must be a dict over the names stage_kwargs[{stage}] gives "
                f"({sorted(kwargs)}), got {spec!r}"
            )
        parts: dict[str, list[Any]] = {}
        for name, value in kwargs.items():
            label = f"stage_kwargs[{stage}][{name!r}]"
            if stage and requires_grad(value):
                raise PipelineError(
                    f"{label} requires grad, but a later stage's keyword inputs get no gradient (only the first "
                    f"stage's do); detach it, or have stage {stage - 1} return it so it travels through the pipeline"
                )
            parts[name] = split_into_chunks(value, chunks, spec.get(name), label)
        out[stage] = [{name: chunks_[i] for name, chunks_ in parts.items()} for i in range(chunks)]
    return out


def _merge_leaf(name: str, values: list[Any], spec: _Spec) -> Any:
    if not isinstance(spec, (TensorChunkSpec, _Replicate)):  # a reducer
        return functools.reduce(spec.reduce_fn, values, spec.init_value)
    first = values[0]
    if not isinstance(first, torch.Tensor):
        if any(isinstance(v, torch.Tensor) for v in values):
            raise PipelineError(f"cannot merge {name}: some microbatches gave a tensor and some did not")
        return first if all(v == first for v in values[1:]) else list(values)
    if isinstance(spec, _Replicate):
        return first
    if not all(isinstance(v, torch.Tensor) for v in values):
        raise PipelineError(f"cannot merge {name}: some microbatches gave a tensor and some did not")
    if first.dim() == 0:
        return torch.stack(values)
    try:
        return torch.cat(values, dim=spec.split_dim)
    except (RuntimeError, IndexError) as exc:
        shapes = [tuple(v.shape) for v in values]
        raise PipelineError(f"cannot merge {name} along dim {spec.split_dim}: shapes {shapes}: {exc}") from exc


def merge_chunks(chunks: list[Any], chunk_spec: Any = None) -> Any:
    """Merge per-microbatch values (same structure each) into one value.

    Tensors are concatenated along their spec's dim (default 0; 0-dim tensors are stacked),
    ``REPLICATE`` leaves take the first microbatch's value, and non-tensor leaves keep the value
    when all microbatches agree, else become the list of per-microbatch values. A reducer spec
    (an object with ``reduce_fn`` and ``init_value``, like torch's ``sum_reducer``) folds the
    per-microbatch values instead. torch.distributed.pipelining's spec objects are accepted.
    """
    if not chunks:
        raise PipelineError("merge_chunks needs at least one microbatch value")
    flat = [pytree.tree_flatten(c) for c in chunks]
    treespec = flat[0][1]
    for i, (_, spec_i) in enumerate(flat[1:], start=1):
        if spec_i != treespec:
            raise PipelineError(
                f"cannot merge outputs: microbatch {i} has structure {pytree.treespec_pprint(spec_i)} "
                f"but microbatch 0 has {pytree.treespec_pprint(treespec)}"
            )
    entries = _leaf_specs(chunks[0], chunk_spec, "output")
    merged = [_merge_leaf(name, [leaves[j] for leaves, _ in flat], spec) for j, (name, _, spec) in enumerate(entries)]
    return pytree.tree_unflatten(merged, treespec)


def _split_block_mask(block_mask: Any, num_chunks: int) -> list[Any]:
    """A FlexAttention ``BlockMask`` split along its batch dimension into ``num_chunks`` masks
    (torch's name and signature; torchtitan imports it). A mask of batch 1 serves every chunk.

    Each chunk's ``mask_mod`` sees the whole batch's index (``b`` + the chunk's offset), so a mask
    that depends on the sequence's place in the batch means the same after the split.
    """
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
        raise PipelineError(f"num_chunks must be an integer >= 1, got {num_chunks!r}")
    batch = block_mask.kv_num_blocks.size(0)
    if batch == 1:
        return [block_mask] * num_chunks
    if num_chunks > batch:
        raise PipelineError(f"a block mask of batch {batch} cannot be split into {num_chunks} microbatches")
    base = block_mask.mask_mod
    chunks = []
    start = 0
    for size in (len(part) for part in torch.arange(batch).tensor_split(num_chunks)):
        chunk = block_mask[start : start + size]
        chunk.mask_mod = _with_batch_offset(base, start)
        chunks.append(chunk)
        start += size
    return chunks


def _with_batch_offset(mask_mod: Any, offset: int) -> Any:
    def shifted(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return mask_mod(b + offset, h, q_idx, kv_idx)

    return shifted
