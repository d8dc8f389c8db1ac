"""Split backward for arbitrary modules: input gradients now (I), weight gradients later (W).

The autograd graph of a microbatch is cut in two, with no custom autograd op: ``X``, the nodes
that reach a stage input (I runs exactly these), and the weight region. During I a pre-hook on
each *entry* (an ``X`` node with a child in the weight region) keeps the gradient it received; W
re-runs the entries from those gradients asking for weight gradients only, so I's work is not
redone. Saved tensors go through :class:`SavedTensors`, so between I and W a microbatch keeps
only what its weight gradients need. Why this is exact (shared and tied weights, tensor hooks)
and what it costs: docs/stage-and-split-backward.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

from pipetrain.errors import PipelineError

__all__ = [
    "SavedTensors",
    "WeightGradPlan",
    "backward_full",
    "backward_input",
    "backward_weight",
    "defer_all",
]

_tls = threading.local()


class _Holder:
    """One saved tensor, owned by the microbatch's store so it can be dropped on our terms."""

    __slots__ = ("release_after_input", "tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.version = tensor._version
        self.release_after_input = False


class SavedTensors:
    """Saved-tensor hooks for one microbatch's forward: tracks what autograd saves.

    ``label`` names the stage and microbatch in the error raised if a released tensor is used.
    """

    def __init__(self, label: str) -> None:
        self.label = label
        self.holders: list[_Holder] = []
        self.tracking_input_pass = False

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> _Holder:
        holder = _Holder(tensor)
        self.holders.append(holder)
        return holder

    def _unpack(self, holder: _Holder) -> torch.Tensor:
        tensor = holder.tensor
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
        if self.tracking_input_pass and not getattr(_tls, "in_entry", False):
            holder.release_after_input = True
        return tensor

    def release_input_only(self) -> None:
        """Drop what only the I pass used (call right after I)."""
        for holder in self.holders:
            if holder.release_after_input:
                holder.tensor = None
        self.holders = [h for h in self.holders if h.tensor is not None]

    def release_all(self) -> None:
        for holder in self.holders:
            holder.tensor = None
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


@dataclass
class _Group:
    """One W engine call: entries whose weight regions touch, and the weights they reach."""

    edges: list[GradientEdge] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    weights: list[torch.Tensor] | None = field(default_factory=list)  # None: every leaf reached
    pins: list[tuple[Node, tuple[torch.Tensor | None, ...]]] = field(default_factory=list)  # entry, kept grads
    needs_pins: bool = False  # an entry reaches another through X: W walks X again (see module docs)


@dataclass
class WeightGradPlan:
    """What I keeps for W: per group, the entry edges, their kept gradients and the weights."""

    groups: list[_Group]
    full_in_input_pass: str | None = None  # why I already did all of it (then W has nothing to do)

    @property
    def redoes_input_work(self) -> bool:
        return any(g.needs_pins for g in self.groups)


# Nodes whose backward cannot run twice (donated buffers) or refuses autograd.grad (reentrant
# checkpoint). When one lies on the way to an input, I falls back to the full backward.
_UNSPLITTABLE = frozenset({"CompiledFunctionBackward", "CheckpointFunctionBackward"})

_ACCUMULATE_GRAD: type | None = getattr(getattr(torch._C, "_functions", None), "AccumulateGrad", None)


def _is_leaf_node(node: Node) -> bool:
    """A weight (or other leaf) gradient sink: autograd's AccumulateGrad node."""
    if _ACCUMULATE_GRAD is not None:
        return isinstance(node, _ACCUMULATE_GRAD)
    return hasattr(node, "variable")  # pragma: no cover - torch without the class exported


def _input_nodes(inputs: Sequence[torch.Tensor]) -> list[Node]:
    return [torch.autograd.graph.get_gradient_edge(t).node for t in inputs]


def _classify(
    roots: Sequence[Node], input_nodes: dict[Node, int]
) -> tuple[dict[Node, list[Node]], dict[Node, bool], dict[Node, bool]]:
    """Walk the graph once: children of every node, and whether it reaches an input / a weight."""
    children_of: dict[Node, list[Node]] = {}
    reach_in: dict[Node, bool] = {}
    reach_w: dict[Node, bool] = {}
    stack: list[Node] = list(dict.fromkeys(roots))
    while stack:
        node = stack[-1]
        if node in reach_in:
            stack.pop()
            continue
        children = children_of.get(node)
        if children is None:
            if node in input_nodes or _is_leaf_node(node):
                children_of[node] = []
                reach_in[node] = node in input_nodes
                reach_w[node] = not reach_in[node]
                stack.pop()
                continue
            children = children_of[node] = [c for c, _ in node.next_functions if c is not None]
            pending = [c for c in children if c not in reach_in]
            if pending:
                stack.extend(pending)
                continue
        stack.pop()
        reach_in[node] = any(reach_in[c] for c in children)
        reach_w[node] = any(reach_w[c] for c in children)
    return children_of, reach_in, reach_w


class _UnionFind:
    def __init__(self, n: int) -> None:
        self.parent = list(range(n))

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def union(self, a: int, b: int) -> None:
        self.parent[self.find(a)] = self.find(b)


def _entry_reaches_another(
    entry: Node, others: set[Node], children_of: dict[Node, list[Node]], reach_in: dict[Node, bool]
) -> bool:
    """True if, following X nodes only, ``entry`` reaches one of ``others``."""
    seen: set[Node] = set()
    stack = [c for c in children_of[entry] if reach_in[c]]
    while stack:
        node = stack.pop()
        if node in others:
            return True
        if node in seen:
            continue
        seen.add(node)
        stack.extend(c for c in children_of[node] if reach_in[c])
    return False


def _run_engine(
    edges: Sequence[GradientEdge],
    grads: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor] = (),
    *,
    keep_graph: bool,
    accumulate: bool,
) -> tuple[torch.Tensor | None, ...]:
    """One autograd engine run from gradient edges, without the Python wrappers' per-call overhead.

    ``accumulate=True`` is ``autograd.backward`` (into ``.grad`` of ``inputs``, or of every leaf
    reached when ``inputs`` is empty); ``False`` is ``autograd.grad`` (returns the gradients). The
    engine still checks every gradient's shape against the node that receives it.
    """
    run = getattr(torch.autograd.graph, "_engine_run_backward", None)
    if run is None:  # pragma: no cover - older torch
        if accumulate:
            torch.autograd.backward(list(edges), list(grads), retain_graph=keep_graph, inputs=list(inputs) or None)
            return ()
        return torch.autograd.grad(list(edges), list(inputs), list(grads), retain_graph=keep_graph, allow_unused=True)
    result: tuple[torch.Tensor | None, ...] = run(
        tuple(edges), tuple(grads), keep_graph, False, tuple(inputs), True, accumulate
    )
    return result


def _nonempty(grads: Sequence[torch.Tensor | None]) -> bool:
    return any(g is not None for g in grads)


def _roots(edges: Sequence[GradientEdge], grads: Sequence[torch.Tensor | None]) -> tuple[list[GradientEdge], list[Any]]:
    kept = [(e, g) for e, g in zip(edges, grads, strict=True) if g is not None and e.node is not None]
    return [e for e, _ in kept], [g for _, g in kept]


def backward_full(
    edges: Sequence[GradientEdge], grads: Sequence[torch.Tensor | None], inputs: Sequence[torch.Tensor]
) -> list[torch.Tensor | None]:
    """B: one engine call; weights accumulate as in plain autograd, input grads are returned."""
    root_edges, root_grads = _roots(edges, grads)
    if not root_edges:
        return [None] * len(inputs)
    previous = [t.grad for t in inputs]
    for t in inputs:
        t.grad = None
    try:
        _run_engine(root_edges, root_grads, keep_graph=False, accumulate=True)
        result = [t.grad for t in inputs]
    finally:
        for t, g in zip(inputs, previous, strict=True):
            t.grad = g
    return result


@dataclass
class _Analysis:
    """The split of one microbatch's graph: entries, their groups and whether a group needs pins."""

    unsplittable: str | None  # type name of an X node that forbids the split, if any
    x_entries: list[Node]  # X nodes with children in the weight region
    root_entries: list[Node]  # output roots outside X that reach a weight
    group_of: list[int]  # per entry (x_entries, then root_entries): its group id
    weights: dict[int, list[torch.Tensor]]  # group id -> weights it reaches
    pinned_groups: set[int]  # groups where one entry reaches another through X


def _analyse(roots: Sequence[Node], input_nodes: dict[Node, int]) -> tuple[_Analysis, dict[Node, bool]]:
    children_of, reach_in, reach_w = _classify(roots, input_nodes)
    unsplittable = next(
        (type(n).__name__ for n, inside in reach_in.items() if inside and type(n).__name__ in _UNSPLITTABLE), None
    )
    x_entries: list[Node] = []
    starts: list[list[Node]] = []
    for node, inside in reach_in.items():
        if inside and node not in input_nodes:
            w_children = [c for c in children_of[node] if not reach_in[c] and reach_w[c]]
            if w_children:
                x_entries.append(node)
                starts.append(w_children)
    root_entries = [r for r in dict.fromkeys(roots) if not reach_in[r] and reach_w[r]]
    starts += [[r] for r in root_entries]

    # Entries whose weight regions share a node form one group (one engine call in W).
    uf = _UnionFind(len(starts))
    owner: dict[Node, int] = {}
    leaf_owner: dict[Node, int] = {}
    for idx, stack in enumerate(starts):
        while stack:
            node = stack.pop()
            prev = owner.get(node)
            if prev is not None:
                uf.union(prev, idx)
                continue
            owner[node] = idx
            if _is_leaf_node(node):
                leaf_owner[node] = idx
            stack.extend(c for c in children_of[node] if reach_w[c] and not reach_in[c])
    group_of = [uf.find(i) for i in range(len(starts))]
    weights: dict[int, list[torch.Tensor]] = {}
    for leaf, idx in leaf_owner.items():
        weights.setdefault(group_of[idx], []).append(leaf.variable)  # type: ignore[attr-defined]  # AccumulateGrad nodes have .variable; the Node stub lacks it
    members: dict[int, list[Node]] = {}
    for idx, node in enumerate(x_entries):
        members.setdefault(group_of[idx], []).append(node)
    pinned: set[int] = set()
    for gid, nodes in members.items():
        if len(nodes) > 1:
            others = set(nodes)
            if any(_entry_reaches_another(n, others - {n}, children_of, reach_in) for n in nodes):
                pinned.add(gid)
    return _Analysis(unsplittable, x_entries, root_entries, group_of, weights, pinned), reach_in


def _input_pass(
    root_edges: list[GradientEdge],
    root_grads: list[Any],
    wanted: list[torch.Tensor],
    x_entries: list[Node],
    saved: SavedTensors | None,
) -> tuple[tuple[torch.Tensor | None, ...], dict[Node, tuple[torch.Tensor | None, ...]]]:
    """Run the engine towards ``wanted`` only, keeping the gradient each X entry receives."""
    kept: dict[Node, tuple[torch.Tensor | None, ...]] = {}

    def keep_hook(node: Node) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
        def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            kept[node] = tuple(grad_outputs)
            _tls.in_entry = True  # saved tensors unpacked from here to leave_hook are W's too

        return hook

    def leave_hook(grad_inputs: Any, grad_outputs: Any) -> None:
        _tls.in_entry = False

    handles: list[Any] = []
    try:
        for node in x_entries:
            handles.append(node.register_prehook(keep_hook(node)))
            handles.append(node.register_hook(leave_hook))
        if saved is not None:
            saved.tracking_input_pass = True
        grads = _run_engine(root_edges, root_grads, wanted, keep_graph=True, accumulate=False)
    finally:
        _tls.in_entry = False
        if saved is not None:
            saved.tracking_input_pass = False
        for h in handles:
            h.remove()
    return grads, kept


def backward_input(
    edges: Sequence[GradientEdge],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    saved: SavedTensors | None = None,
) -> tuple[list[torch.Tensor | None], WeightGradPlan]:
    """I: input grads only; returns them and the plan W needs (entries and their gradients)."""
    root_edges, root_grads = _roots(edges, grads)
    result: list[torch.Tensor | None] = [None] * len(inputs)
    if not root_edges:
        return result, WeightGradPlan([])
    input_node_list = _input_nodes(inputs)
    analysis, reach_in = _analyse([e.node for e in root_edges], dict.fromkeys(input_node_list, 0))
    if analysis.unsplittable is not None:
        return backward_full(edges, grads, inputs), WeightGradPlan([], full_in_input_pass=analysis.unsplittable)
    wanted = [i for i, n in enumerate(input_node_list) if reach_in.get(n)]
    kept: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    if wanted:
        # With pins, W walks X between entries again, so it needs everything saved: release nothing.
        track = saved if not analysis.pinned_groups else None
        input_grads, kept = _input_pass(root_edges, root_grads, [inputs[i] for i in wanted], analysis.x_entries, track)
        for i, grad in zip(wanted, input_grads, strict=True):
            result[i] = grad
        if track is not None:
            track.release_input_only()

    groups: dict[int, _Group] = {}
    for idx, node in enumerate(analysis.x_entries):
        grads_in = kept.get(node)
        if grads_in is None or not _nonempty(grads_in):
            continue
        group = groups.setdefault(analysis.group_of[idx], _Group())
        group.pins.append((node, grads_in))
        if analysis.group_of[idx] in analysis.pinned_groups:
            group.needs_pins = True
        for slot, grad in enumerate(grads_in):
            if grad is not None:
                group.edges.append(GradientEdge(node, slot))
                group.grads.append(grad)
    offset = len(analysis.x_entries)
    for idx, node in enumerate(analysis.root_entries, start=offset):
        group = groups.setdefault(analysis.group_of[idx], _Group())
        for edge, grad in zip(root_edges, root_grads, strict=True):
            if edge.node is node:
                group.edges.append(edge)
                group.grads.append(grad)
    for gid, group in groups.items():
        group.weights = analysis.weights.get(gid, [])
    return result, WeightGradPlan([g for g in groups.values() if g.edges and g.weights])


def defer_all(edges: Sequence[GradientEdge], grads: Sequence[torch.Tensor | None]) -> WeightGradPlan:
    """I on a stage whose inputs need no gradient: nothing to compute now, W does the whole backward."""
    root_edges, root_grads = _roots(edges, grads)
    if not root_edges:
        return WeightGradPlan([])
    return WeightGradPlan([_Group(edges=root_edges, grads=root_grads, weights=None)])


def backward_weight(plan: WeightGradPlan) -> None:
    """W: weight grads from what I kept; they accumulate into ``.grad`` like plain autograd."""
    last = len(plan.groups) - 1
    for i, group in enumerate(plan.groups):
        # Every entry is pinned to what it received in I, which its tensor hooks (Tensor.register_hook
        # on an intermediate) already changed: they run before node pre-hooks, and would run again.
        handles = [node.register_prehook(lambda _g, kept=grads_in: kept) for node, grads_in in group.pins]
        try:
            _run_engine(group.edges, group.grads, group.weights or (), keep_graph=i != last, accumulate=True)
        finally:
            for h in handles:
                h.remove()
    plan.groups = []
