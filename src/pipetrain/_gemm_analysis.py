"""Which weight GEMMs of a microbatch's autograd graph a split backward can leave to W.

One walk over the graph finds every ``mm``/``addmm``/``bmm`` node whose operand is a parameter
(reached through transposes, views and autocast casts) and keeps those whose weight gets its
gradient from such GEMMs only; everything else is I's. Used by :mod:`pipetrain._backward`.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.autograd.graph import Node

__all__ = ["Analysis", "DeferredGemm", "analyse"]

# ------------------------------------------------------------------------------ the GEMMs
# Per autograd node type: (slot in next_functions, saved attribute of the *other* operand,
# whether the slot is the left operand) for each operand that may be a weight.
_GEMM_SLOTS: dict[str, tuple[tuple[int, str, bool], ...]] = {
    "MmBackward0": ((0, "_saved_mat2", True), (1, "_saved_self", False)),
    "AddmmBackward0": ((1, "_saved_mat2", True), (2, "_saved_mat1", False)),
    "BmmBackward0": ((0, "_saved_mat2", True), (1, "_saved_self", False)),
}
_TRANSPOSES = frozenset({"TBackward0", "TransposeBackward0", "PermuteBackward0"})
_CASTS = frozenset({"ToCopyBackward0"})
_VIEWS = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "AliasBackward0"})
# Opaque nodes that compute weight gradients themselves, all of them in I (named in the notice).
_OPAQUE = {"CompiledFunctionBackward": "torch.compile'd region"}
# Reentrant checkpointing refuses an engine run limited to some inputs: then I is the full backward.
_REENTRANT = "CheckpointFunctionBackward"

_ACCUMULATE_GRAD: type | None = getattr(getattr(torch._C, "_functions", None), "AccumulateGrad", None)


def _is_leaf_node(node: Node) -> bool:
    """A weight (or other leaf) gradient sink: autograd's AccumulateGrad node."""
    if _ACCUMULATE_GRAD is not None:
        return isinstance(node, _ACCUMULATE_GRAD)
    return hasattr(node, "variable")  # pragma: no cover - torch without the class exported


@functools.cache
def _peekable_types() -> tuple[type, ...]:
    """Packed forms of a saved tensor that can be read twice: no hook, ours, pipetrain.recompute's."""
    from pipetrain._backward import _Holder
    from pipetrain.recompute import _Slot

    return (torch.Tensor, _Holder, _Slot)


@dataclass
class DeferredGemm:
    """One weight-gradient GEMM that I skipped.

    I's pre-hook fills ``g`` (the GEMM's output gradient) and ``a`` (its other operand, read from
    the node's saved tensors); W adds to ``weight.grad`` the weight's gradient: ``a^T g`` (weight as
    the right operand) or ``g a^T`` (left), transposed when the weight reached the GEMM through a
    transpose, scaled by ``alpha`` (addmm), cast and reshaped to the weight.
    """

    node: Node | None
    other: str  # saved attribute of the activation operand
    weight_is_left: bool
    transposed: bool
    batched: bool
    weight: torch.Tensor
    alpha: float = 1.0
    g: torch.Tensor | None = None
    a: torch.Tensor | None = None

    def operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) with the weight's gradient (in the weight's own orientation) = x @ y."""
        g, a = self.g, self.a
        assert g is not None and a is not None

        def t(z: torch.Tensor) -> torch.Tensor:
            return z.transpose(-1, -2)

        if self.weight_is_left:  # dW = g @ b^T, or (dW)^T = b @ g^T
            return (a, t(g)) if self.transposed else (g, t(a))
        return (t(g), a) if self.transposed else (t(a), g)  # dW = a^T g, or (dW)^T = g^T a


@dataclass
class Analysis:
    gemms: list[DeferredGemm]
    eager_leaves: list[torch.Tensor]  # parameters (and other leaves) whose gradient I computes
    opaque: dict[str, list[torch.Tensor]]  # what kind of opaque node -> weights it computes in I
    unpeekable: list[torch.Tensor]  # GEMM weights whose saved operand another hook owns
    reentrant: bool = False  # a reentrant checkpoint region: I must be the full backward


def _chain(start: Node | None, batched: bool) -> tuple[list[Node], Node, bool] | None:
    """From a GEMM operand to its parameter: (nodes on the way, the AccumulateGrad node,
    transposed?) when the way is transposes, casts and (untransposed) views only. (W casts and
    reshapes every product to its weight, so a cast or a view needs nothing noted.)"""
    nodes: list[Node] = []
    transposed = viewed = False
    node = start
    while node is not None and not _is_leaf_node(node):
        name = type(node).__name__
        if name in _TRANSPOSES:
            if viewed or not _is_last_two_swap(node, name, batched):
                return None
            transposed = not transposed
        elif name in _VIEWS:
            if transposed:
                return None
            viewed = True
        elif name not in _CASTS:
            return None
        nodes.append(node)
        nexts = node.next_functions
        if len(nexts) != 1:
            return None
        node = nexts[0][0]
    if node is None:
        return None
    return nodes, node, transposed


def _is_last_two_swap(node: Node, name: str, batched: bool) -> bool:
    ndim = 3 if batched else 2
    if name == "TBackward0":
        return not batched
    if name == "TransposeBackward0":
        dims = {int(getattr(node, "_saved_dim0")) % ndim, int(getattr(node, "_saved_dim1")) % ndim}  # noqa: B009
        return dims == {ndim - 2, ndim - 1}
    perm = tuple(int(d) % ndim for d in getattr(node, "_saved_dims"))  # noqa: B009
    return perm == ((1, 0) if not batched else (0, 2, 1))


def _walk(roots: Sequence[Node]) -> tuple[list[Node], dict[Node, int]]:
    """Every node reachable from ``roots`` once, and how many edges enter each."""
    order: list[Node] = []
    in_count: dict[Node, int] = {}
    stack = list(roots)
    for r in roots:
        in_count[r] = in_count.get(r, 0)
    seen: set[Node] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        order.append(node)
        for child, _ in node.next_functions:
            if child is not None:
                in_count[child] = in_count.get(child, 0) + 1
                if child not in seen:
                    stack.append(child)
    return order, in_count


def _has_tensor_hooks(t: torch.Tensor) -> bool:
    return bool(getattr(t, "_backward_hooks", None))


def analyse(roots: Sequence[Node], input_nodes: set[Node]) -> Analysis:
    order, in_count = _walk(roots)
    peekable = _peekable_types()
    candidates: list[tuple[DeferredGemm, list[Node], Node]] = []
    unpeekable: list[torch.Tensor] = []
    opaque: dict[str, list[torch.Tensor]] = {}
    leaves: list[Node] = []
    for node in order:
        name = type(node).__name__
        if _is_leaf_node(node):
            if node not in input_nodes:
                leaves.append(node)
            continue
        if name == _REENTRANT:
            return Analysis([], [], {}, [], reentrant=True)
        kind = _OPAQUE.get(name)
        if kind is not None:
            found = opaque.setdefault(kind, [])
            # (matrices only: a norm's or a bias's gradient is I's anyway)
            leaves_here = [c for c, _ in node.next_functions if c is not None and _is_leaf_node(c)]
            found.extend(
                c.variable  # type: ignore[attr-defined]  # AccumulateGrad nodes have .variable
                for c in leaves_here
                if c not in input_nodes and c.variable.dim() >= 2  # type: ignore[attr-defined]
            )
            continue
        slots = _GEMM_SLOTS.get(name)
        if slots is None:
            continue
        nexts = node.next_functions
        for slot, other, left in slots:
            found_chain = _chain(nexts[slot][0], name == "BmmBackward0")
            if found_chain is None:
                continue
            chain, acc, transposed = found_chain
            weight: torch.Tensor = acc.variable  # type: ignore[attr-defined]  # AccumulateGrad nodes have .variable
            if acc in input_nodes or _has_tensor_hooks(weight) or weight.is_sparse:
                continue
            if not isinstance(getattr(node, "_raw_saved" + other[len("_saved") :]).data, peekable):
                unpeekable.append(weight)
                continue
            alpha = float(getattr(node, "_saved_alpha", 1.0))
            gemm = DeferredGemm(node, other, left, transposed, name == "BmmBackward0", weight, alpha)
            candidates.append((gemm, chain, acc))
    gemms = _consistent(candidates, in_count)
    deferred = {id(g.weight) for g in gemms}
    eager = [leaf.variable for leaf in leaves if id(leaf.variable) not in deferred]  # type: ignore[attr-defined]
    return Analysis(gemms, eager, opaque, unpeekable)


def _consistent(
    candidates: list[tuple[DeferredGemm, list[Node], Node]], in_count: dict[Node, int]
) -> list[DeferredGemm]:
    """Keep the GEMMs whose weight gets its gradient through deferred GEMMs only.

    A weight also used otherwise (a tied embedding and head on one stage, a norm reusing a
    matrix) is computed in I by autograd, all its uses together; so is every GEMM on it.
    """
    alive = list(candidates)
    while True:
        # Edges into a node from deferred parents: the GEMM slot edges, plus chain-internal edges
        # (counted once per distinct parent node, since a shared cast has one edge onward).
        incoming: dict[Node, int] = {}
        parents: set[Node] = set()
        for _gemm, chain, acc in alive:
            path = (*chain, acc)
            incoming[path[0]] = incoming.get(path[0], 0) + 1
            for parent, child in itertools.pairwise(path):
                if parent not in parents:
                    parents.add(parent)
                    incoming[child] = incoming.get(child, 0) + 1
        bad = {node for node, n in incoming.items() if n != in_count.get(node, 0)}
        if not bad:
            return [gemm for gemm, _, _ in alive]
        alive = [(g, c, a) for g, c, a in alive if a not in bad and not any(n in bad for n in c)]
