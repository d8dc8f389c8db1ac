"""Split backward for arbitrary modules: I computes everything but the weight GEMMs, W runs them.

A microbatch's backward is one engine run (I) in which every matrix multiply whose operand is a
parameter (``mm``, ``addmm``, ``bmm`` autograd nodes, reached through transposes, views and
autocast casts) computes only the gradient of its activation operand: a pre-hook keeps the two
tensors its weight gradient needs (the other operand and the output gradient) and autograd skips
that GEMM. Every other parameter (norms, biases, embeddings, what a compiled region or a custom
``autograd.Function`` computes) gets its gradient in I. W is then those GEMMs, straight into
``.grad``: no autograd engine call, no graph kept, so a checkpointed region is recomputed once (in
I) and between I and W a microbatch holds only what W reads. Why this is exact and what it
costs: docs/stage-and-split-backward.md.
"""

from __future__ import annotations

import functools
import itertools
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

from pipetrain.errors import PipelineError

__all__ = [
    "DeferredGemm",
    "SavedTensors",
    "WeightGradPlan",
    "backward_full",
    "backward_input",
    "backward_weight",
    "peeking",
]

_tls = threading.local()


def peeking() -> bool:
    """True while I reads a GEMM's saved operand for W: a saved-tensor hook must not consume it
    (the node itself unpacks it again right after)."""
    return bool(getattr(_tls, "peeking", False))


class _Holder:
    """One saved tensor, owned by the microbatch's store so it can be dropped on our terms.

    Once its node unpacked it (a backward pass ran the node), the holder keeps only a weak
    reference: the tensor goes as soon as the node is done with it, as in plain autograd, and a
    second read while something still holds it (a custom Function reading ``ctx.saved_tensors``
    twice) still works. I's read for W (:func:`peeking`) keeps it strong.
    """

    __slots__ = ("tensor", "version", "weak")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.version = tensor._version
        self.weak: weakref.ref[torch.Tensor] | None = None


class SavedTensors:
    """Saved-tensor hooks for one microbatch's forward: tracks what autograd saves.

    ``label`` names the stage and microbatch in the error raised if a released tensor is used.
    """

    def __init__(self, label: str) -> None:
        self.label = label
        self.holders: list[_Holder] = []

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> _Holder:
        holder = _Holder(tensor)
        self.holders.append(holder)
        return holder

    def _unpack(self, holder: _Holder) -> torch.Tensor:
        tensor = holder.tensor
        if tensor is None and holder.weak is not None:
            tensor = holder.weak()
        if tensor is None:
            raise PipelineError(
                f"{self.label}: a tensor saved for backward was already released "
                "(backward ran twice for this microbatch, or after clear())"
            )
        if tensor._version != holder.version:
            # Saved-tensor hooks bypass autograd's own in-place check, so it is done here.
            raise PipelineError(
                f"{self.label}: a tensor saved for backward (shape {tuple(tensor.shape)}, {tensor.dtype}) was "
                f"modified by an in-place operation after it was saved (version {holder.version} -> "
                f"{tensor._version}); gradients would be wrong"
            )
        if not peeking() and holder.tensor is not None:
            holder.weak, holder.tensor = weakref.ref(tensor), None
        return tensor

    def release_all(self) -> None:
        for holder in self.holders:
            holder.tensor = holder.weak = None
        self.holders = []

    def nbytes(self) -> int:
        """Bytes of the distinct storages still held (for memory reports)."""
        storages = {
            h.tensor.untyped_storage().data_ptr(): h.tensor.untyped_storage().nbytes()
            for h in self.holders
            if h.tensor is not None
        }
        return sum(storages.values())

    def storage_ptrs(self) -> set[int]:
        """Storages of saved tensors still held (an output in here must keep its storage)."""
        return {h.tensor.untyped_storage().data_ptr() for h in self.holders if h.tensor is not None}


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

    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in (self.g, self.a) if t is not None)

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
class WeightGradPlan:
    """What I keeps for W: the skipped GEMMs, with their operands."""

    gemms: list[DeferredGemm] = field(default_factory=list)
    full_in_input_pass: str | None = None  # why I already did all of it (then W has nothing to do)
    # A stage whose inputs need no gradient: I has nothing to give anyone, so W runs the whole
    # backward from these roots (one engine run) and I costs nothing where the schedule puts it.
    whole: tuple[list[GradientEdge], list[torch.Tensor]] | None = None

    def nbytes(self) -> int:
        """Bytes W still needs (distinct storages of the kept operands)."""
        seen: dict[int, int] = {}
        for gemm in self.gemms:
            for t in (gemm.g, gemm.a):
                if t is not None:
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(seen.values())


@dataclass
class _Analysis:
    gemms: list[DeferredGemm]
    eager_leaves: list[torch.Tensor]  # parameters (and other leaves) whose gradient I computes
    opaque: dict[str, list[torch.Tensor]]  # what kind of opaque node -> weights it computes in I
    unpeekable: list[torch.Tensor]  # GEMM weights whose saved operand another hook owns
    reentrant: bool = False  # a reentrant checkpoint region: I must be the full backward


def _chain(start: Node | None, batched: bool) -> tuple[list[Node], Node, bool, bool] | None:
    """From a GEMM operand to its parameter: (nodes on the way, the AccumulateGrad node,
    transposed?, cast?) when the way is transposes, casts and (untransposed) views only."""
    nodes: list[Node] = []
    transposed = cast = viewed = False
    node = start
    while node is not None and not _is_leaf_node(node):
        name = type(node).__name__
        if name in _TRANSPOSES:
            if viewed or not _is_last_two_swap(node, name, batched):
                return None
            transposed = not transposed
        elif name in _CASTS:
            cast = True
        elif name in _VIEWS:
            if transposed:
                return None
            viewed = True
        else:
            return None
        nodes.append(node)
        nexts = node.next_functions
        if len(nexts) != 1:
            return None
        node = nexts[0][0]
    if node is None or (viewed and transposed):
        return None
    return nodes, node, transposed, cast


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


def _analyse(roots: Sequence[Node], input_nodes: set[Node]) -> _Analysis:
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
            return _Analysis([], [], {}, [], reentrant=True)
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
            chain, acc, transposed, _cast = found_chain
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
    return _Analysis(gemms, eager, opaque, unpeekable)


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


def _run_engine(
    edges: Sequence[GradientEdge], grads: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor | GradientEdge] = ()
) -> None:
    """One accumulating autograd engine run from gradient edges (``autograd.backward``, into
    ``.grad`` of ``inputs`` or of every leaf reached when ``inputs`` is empty; a GradientEdge in
    ``inputs`` makes its node run), without the Python wrapper's per-call overhead. The graph is
    freed as it runs. The engine still checks every gradient's shape against its node."""
    torch.autograd.graph._engine_run_backward(tuple(edges), tuple(grads), False, False, tuple(inputs), True, True)


def _roots(edges: Sequence[GradientEdge], grads: Sequence[torch.Tensor | None]) -> tuple[list[GradientEdge], list[Any]]:
    kept = [(e, g) for e, g in zip(edges, grads, strict=True) if g is not None and e.node is not None]
    return [e for e, _ in kept], [g for _, g in kept]


def _into_inputs(run: Callable[[], None], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """Run an accumulating backward and return what it put into the stage inputs' ``.grad``
    (which are left as they were)."""
    previous = [t.grad for t in inputs]
    for t in inputs:
        t.grad = None
    try:
        run()
        return [t.grad for t in inputs]
    finally:
        for t, g in zip(inputs, previous, strict=True):
            t.grad = g


def backward_full(
    edges: Sequence[GradientEdge], grads: Sequence[torch.Tensor | None], inputs: Sequence[torch.Tensor]
) -> list[torch.Tensor | None]:
    """B: one engine call; weights accumulate as in plain autograd, input grads are returned."""
    root_edges, root_grads = _roots(edges, grads)
    if not root_edges:
        return [None] * len(inputs)

    def run() -> None:
        _run_engine(root_edges, root_grads)

    return _into_inputs(run, inputs)


def _notice(label: str, analysis: _Analysis, names: Callable[[Sequence[torch.Tensor]], str], noticed: set[str]) -> None:
    """Say once per cause (``noticed`` holds those said) that some weight gradients cannot wait for W."""
    causes = [(kind, f"of {names(ws)}") for kind, ws in analysis.opaque.items() if ws]
    if analysis.unpeekable:
        hook = "a saved-tensor hook that is not pipetrain's, e.g. torch.utils.checkpoint"
        causes.append((hook, f"of {names(analysis.unpeekable)}"))
    if analysis.reentrant:
        causes.append(("reentrant torch.utils.checkpoint", "of the whole stage"))
    for kind, what in causes:
        if kind in noticed:
            continue
        noticed.add(kind)
        warnings.warn(
            f"{label}: the weight gradients {what} are computed in I, not deferred to W ({kind}); "
            "the split backward gains nothing there. docs/stage-and-split-backward.md says which routes "
            "defer them (pipetrain.recompute.checkpoint for activation checkpointing, "
            "pipetrain.compiled.compile_for_split for torch.compile)",
            stacklevel=4,
        )


def backward_input(
    edges: Sequence[GradientEdge],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    *,
    label: str = "stage",
    names: Callable[[Sequence[torch.Tensor]], str] | None = None,
    noticed: set[str] | None = None,
) -> tuple[list[torch.Tensor | None], WeightGradPlan]:
    """I: one engine run; every gradient but the weight GEMMs' (kept for W) is computed now.

    Returns the input gradients and the plan W runs. The graph is freed: W needs none of it.
    With ``names`` (weights -> the modules owning them), what cannot wait for W is said once per
    cause in ``noticed``.
    """
    root_edges, root_grads = _roots(edges, grads)
    if not root_edges:
        return [None] * len(inputs), WeightGradPlan()
    if not inputs:
        return [], WeightGradPlan(whole=(root_edges, root_grads))
    input_nodes = {torch.autograd.graph.get_gradient_edge(t).node for t in inputs}
    analysis = _analyse([e.node for e in root_edges], input_nodes)
    if names is not None:
        _notice(label, analysis, names, noticed if noticed is not None else set())
    if analysis.reentrant:
        return backward_full(edges, grads, inputs), WeightGradPlan(full_in_input_pass="reentrant checkpoint")
    handles = [gemm.node.register_prehook(_keeper(gemm)) for gemm in analysis.gemms if gemm.node is not None]
    targets: list[torch.Tensor | GradientEdge] = [*inputs, *analysis.eager_leaves]
    targets += [GradientEdge(gemm.node, 0) for gemm in analysis.gemms if gemm.node is not None]

    def run() -> None:
        _run_engine(root_edges, root_grads, targets)

    try:
        result = _into_inputs(run, inputs)
    finally:
        for h in handles:
            h.remove()
    gemms = [g for g in analysis.gemms if g.g is not None]
    for gemm in analysis.gemms:
        gemm.node = None  # the graph goes now
    return result, WeightGradPlan(gemms)


def _keeper(gemm: DeferredGemm) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
    def keep(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        g = grad_outputs[0]
        if g is None:
            return
        _tls.peeking = True
        try:
            gemm.a = getattr(gemm.node, gemm.other)
        finally:
            _tls.peeking = False
        gemm.g = g

    return keep


def backward_weight(plan: WeightGradPlan) -> None:
    """W: the deferred GEMMs, accumulated into ``.grad`` as autograd's AccumulateGrad would (or,
    on a stage whose inputs need no gradient, its whole backward)."""
    if plan.whole is not None:
        edges, grads = plan.whole
        plan.whole = None
        _run_engine(edges, grads)
        return
    touched: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for gemm in plan.gemms:
            x, y = gemm.operands()
            w = gemm.weight
            mul = torch.bmm if gemm.batched else torch.mm
            grad = w.grad
            if grad is not None and grad.dtype == x.dtype and grad.shape == (*x.shape[:-1], y.shape[-1]):
                if gemm.batched:
                    grad.baddbmm_(x, y, alpha=gemm.alpha)
                else:
                    grad.addmm_(x, y, alpha=gemm.alpha)
            else:
                part = mul(x, y)
                if gemm.alpha != 1.0:
                    part.mul_(gemm.alpha)
                part = part.to(w.dtype).reshape(w.shape)
                if grad is None:
                    w.grad = part.contiguous() if not part.is_contiguous() else part
                else:
                    grad.add_(part)
            gemm.g = gemm.a = None
            touched[id(w)] = w
    plan.gemms = []
    for w in touched.values():
        hooks = getattr(w, "_post_accumulate_grad_hooks", None)
        if hooks:
            for hook in list(hooks.values()):
                hook(w)
