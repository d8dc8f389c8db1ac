"""Split backward for arbitrary modules: I computes everything but the weight GEMMs, W runs them.

A microbatch's backward is one engine run (I) in which every matrix multiply whose operand is a
parameter (``mm``, ``addmm``, ``bmm`` autograd nodes, reached through transposes, views and
autocast casts) computes only the gradient of its activation operand: a pre-hook keeps the two
tensors its weight gradient needs (the other operand and the output gradient) and autograd skips
that GEMM. A region compiled by :func:`pipetrain.compiled.compile_for_split` runs the input part
of its split backward graph and leaves the weight part to W (:mod:`pipetrain._aot_split`). Every
other parameter (norms, biases, embeddings, what a plain compiled region or a custom
``autograd.Function`` computes) gets its gradient in I. W is then those GEMMs, straight into
``.grad``, and the regions' weight parts: no graph kept, so a checkpointed region is recomputed once (in
I) and between I and W a microbatch holds only what W reads. Why this is exact and what it
costs: docs/stage-and-split-backward.md.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from pipetrain._aot_split import DeferredRegion, compiled_nodes, deferring
from pipetrain._gemm_analysis import Analysis, DeferredGemm, analyse
from pipetrain.errors import PipelineError

__all__ = [
    "DeferredGemm",
    "SavedTensors",
    "WeightGradPlan",
    "backward_full",
    "backward_input",
    "backward_weight",
    "peeking",
    "stage_backward",
    "stage_backward_input",
    "stage_backward_weight",
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


@dataclass
class WeightGradPlan:
    """What I keeps for W: the skipped GEMMs, with their operands."""

    gemms: list[DeferredGemm] = field(default_factory=list)
    full_in_input_pass: str | None = None  # why I already did all of it (then W has nothing to do)
    # A stage whose inputs need no gradient: I has nothing to give anyone, so W runs the whole
    # backward from these roots (one engine run) and I costs nothing where the schedule puts it.
    whole: tuple[list[GradientEdge], list[torch.Tensor]] | None = None
    # torch's dw_builder: I ran autograd's whole backward and W calls the user's runner.
    runner: Callable[[], None] | None = None
    # Compiled regions' weight-gradient parts (pipetrain.compiled.compile_for_split).
    regions: list[DeferredRegion] = field(default_factory=list)

    def nbytes(self) -> int:
        """Bytes W still needs (distinct storages of the kept operands)."""
        seen: dict[int, int] = {}
        kept = [t for gemm in self.gemms for t in (gemm.g, gemm.a)]
        kept += [t for region in self.regions for t in region.boundary]
        for t in kept:
            if isinstance(t, torch.Tensor):
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(seen.values())


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


def _notice(label: str, analysis: Analysis, names: Callable[[Sequence[torch.Tensor]], str], noticed: set[str]) -> None:
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
    analysis = analyse([e.node for e in root_edges], input_nodes)
    if analysis.reentrant:
        if names is not None:
            _notice(label, analysis, names, noticed if noticed is not None else set())
        return backward_full(edges, grads, inputs), WeightGradPlan(full_in_input_pass="reentrant checkpoint")
    handles = [gemm.node.register_prehook(_keeper(gemm)) for gemm in analysis.gemms if gemm.node is not None]
    targets: list[torch.Tensor | GradientEdge] = [*inputs, *analysis.eager_leaves]
    targets += [GradientEdge(gemm.node, 0) for gemm in analysis.gemms if gemm.node is not None]

    def run() -> None:
        _run_engine(root_edges, root_grads, targets)

    regions_here = compiled_nodes([e.node for e in root_edges]) if analysis.opaque else []
    try:
        with deferring(regions_here) as regions:
            result = _into_inputs(run, inputs)
    finally:
        for h in handles:
            h.remove()
    gemms = [g for g in analysis.gemms if g.g is not None]
    for gemm in analysis.gemms:
        gemm.node = None  # the graph goes now
    if names is not None:
        _notice(label, _less_deferred(analysis, regions), names, noticed if noticed is not None else set())
    return result, WeightGradPlan(gemms, regions=regions)


def _less_deferred(analysis: Analysis, regions: Sequence[DeferredRegion]) -> Analysis:
    """``analysis`` without the compiled regions' weights that W got after all (split regions)."""
    if not regions:
        return analysis
    deferred = {id(getattr(e.node, "variable", None)) for region in regions for e in region.edges}
    opaque = {kind: [w for w in ws if id(w) not in deferred] for kind, ws in analysis.opaque.items()}
    return Analysis(analysis.gemms, analysis.eager_leaves, opaque, analysis.unpeekable, analysis.reentrant)


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
    on a stage whose inputs need no gradient, its whole backward; or dw_builder's runner)."""
    if plan.runner is not None:
        runner, plan.runner = plan.runner, None
        runner()
        return
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
            # The product, then added: what autograd's AccumulateGrad does, so the sum rounds as
            # a one-pass backward's does (a fused addmm_ differs in the last bits, measured).
            part = mul(x, y)
            if gemm.alpha != 1.0:
                part.mul_(gemm.alpha)
            part = part.to(w.dtype).reshape(w.shape)
            if w.grad is None:
                w.grad = part.contiguous()
            else:
                w.grad.add_(part)
            gemm.g = gemm.a = None
            touched[id(w)] = w
    plan.gemms = []
    for w in touched.values():
        hooks = getattr(w, "_post_accumulate_grad_hooks", None)
        if hooks:
            for hook in list(hooks.values()):
                hook(w)
    if plan.regions:
        # The compiled regions' weight parts, then one engine run over their parameters'
        # AccumulateGrad nodes only: accumulated (and hooked) as autograd accumulates them.
        regions, plan.regions = plan.regions, []
        pairs = [pair for region in regions for pair in region.gradients()]
        if pairs:
            _run_engine([e for e, _ in pairs], [g for _, g in pairs])


# ------------------------------------------------------------------ torch's functions of this module
def _pairs(outputs: Any, grads: Any) -> tuple[list[GradientEdge], list[torch.Tensor]]:
    """Each output tensor that requires grad with its gradient (ones for a loss), as torch pairs them."""
    import torch.utils._pytree as pytree

    flat_out = pytree.tree_leaves(outputs)
    # (None is a leaf here: an output given no gradient keeps its place)
    flat_grads = [None] * len(flat_out) if grads is None else pytree.tree_leaves(grads, is_leaf=lambda x: x is None)
    edges, given = [], []
    for out, grad in zip(flat_out, flat_grads, strict=False):
        if isinstance(out, torch.Tensor) and (out.requires_grad or out.grad_fn is not None):
            if grads is None:
                grad = torch.ones_like(out)
            if grad is not None:
                edges.append(torch.autograd.graph.get_gradient_edge(out))
                given.append(grad)
    return edges, given


def _failed(what: str, outputs: Any, grads: Any, inputs: Any, exc: Exception) -> RuntimeError:
    def shapes(x: Any) -> str:
        import torch.utils._pytree as pytree

        return str([tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in pytree.tree_leaves(x)])

    return RuntimeError(
        f"Failed to run {what}: stage outputs {shapes(outputs)}, output gradients {shapes(grads)}, "
        f"inputs {shapes(inputs)}: {exc}"
    )


def stage_backward(
    stage_output: Any, output_grads: Any, input_values: Any, outputs_with_grads_idxs: list[int] | None = None
) -> tuple[torch.Tensor | None, ...]:
    """torch's: the whole backward (parameters accumulate), the gradients of ``input_values``
    returned (their ``.grad`` set back to None). ``outputs_with_grads_idxs`` is unused, as in torch."""
    del outputs_with_grads_idxs
    tensors = [v for v in input_values if isinstance(v, torch.Tensor) and v.requires_grad]
    try:
        edges, grads = _pairs(stage_output, output_grads)
        before = {id(t): t.grad for t in tensors}
        got = dict(zip((id(t) for t in tensors), backward_full(edges, grads, tensors), strict=True))
    except RuntimeError as exc:
        raise _failed("stage backward", stage_output, output_grads, input_values, exc) from exc
    result: list[torch.Tensor | None] = []
    for v in input_values:
        if not isinstance(v, torch.Tensor) or id(v) not in got:
            result.append(v.grad if isinstance(v, torch.Tensor) else None)
            continue
        prev, new = before[id(v)], got[id(v)]
        result.append(new if prev is None else prev if new is None else prev + new)
        v.grad = None
    return tuple(result)


def stage_backward_input(
    stage_outputs_or_loss: list[torch.Tensor],
    output_grads: list[torch.Tensor] | None,
    input_values: list[Any],
    weights: Any,
) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, Any]]]:
    """torch's I: the inputs' gradients (also added into their ``.grad``) and the ``param_groups``
    that :func:`stage_backward_weight` takes; no ``weights``' ``.grad`` changes before W. Here the
    groups hold the deferred weight GEMMs (W makes no engine call) and the other weights'
    gradients, which I computed on the way and W adds."""
    params = [w for w in weights if isinstance(w, torch.Tensor)]
    kept = [w.grad for w in params]
    for w in params:
        w.grad = None
    tensors = [v for v in input_values if isinstance(v, torch.Tensor) and v.requires_grad]
    try:
        edges, grads = _pairs(stage_outputs_or_loss, output_grads)
        got, plan = backward_input(edges, grads, tensors)  # (no input needs grad: all waits for W)
    except RuntimeError as exc:
        raise _failed("stage backward input", stage_outputs_or_loss, output_grads, input_values, exc) from exc
    finally:
        early = [(w, w.grad) for w in params if w.grad is not None]
        for w, g in zip(params, kept, strict=True):
            w.grad = g
    by_id = dict(zip((id(t) for t in tensors), got, strict=True))
    dinputs: list[torch.Tensor | None] = []
    for v in input_values:
        grad = by_id.get(id(v)) if isinstance(v, torch.Tensor) else None
        if grad is not None:
            v.grad = grad if v.grad is None else v.grad + grad
        dinputs.append(grad)
    for t in stage_outputs_or_loss:
        if isinstance(t, torch.Tensor):
            t.detach_()
    return tuple(dinputs), [{"pipetrain_plan": plan, "pipetrain_early": early}]


def stage_backward_weight(
    weights: Any, param_groups: list[dict[str, Any]], retain_graph: bool = False
) -> tuple[torch.Tensor | None, ...]:
    """torch's W: the weight gradients :func:`stage_backward_input` left, added into ``.grad``.
    Returns each weight's ``.grad`` as it was before (torch's return value). ``retain_graph`` is
    accepted: W here needs no graph."""
    del retain_graph
    before = tuple(w.grad for w in weights)
    for group in param_groups:
        plan = group.get("pipetrain_plan")
        if not isinstance(plan, WeightGradPlan):
            raise PipelineError(
                "stage_backward_weight: these param_groups are not pipetrain's; give it what "
                "pipetrain's stage_backward_input returned"
            )
        with torch.no_grad():
            for w, grad in group.pop("pipetrain_early", ()):
                w.grad = grad if w.grad is None else w.grad.add_(grad)
        backward_weight(plan)
    return before
