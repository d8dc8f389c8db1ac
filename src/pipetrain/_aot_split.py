"""A ``torch.compile`` backend whose compiled backward is split into I's part and W's part.

AOTAutograd makes a compiled region one autograd node whose backward graph computes every
gradient of the region. The backends here partition that graph once, when it is compiled: part
(a) computes the gradients of the region's non-parameter inputs plus the boundary tensors the
parameters' gradients need (for a Linear: its input and its output's gradient); part (b)
computes the parameters' gradients from those. Each part is compiled by inductor (or run as
aot_eager runs it). At run time the region's backward runs (a) then (b), as one backward,
unless a split backward's I (``pipetrain._backward.backward_input``) registered the region's
node: then (a) runs, the parameters get no gradient now, and (b) with its boundary tensors is
handed to I's plan, which W runs (:meth:`DeferredRegion.gradients`) and accumulates through the
parameters' own AccumulateGrad nodes, as autograd would have. B and I + W run the same compiled
kernels, so they agree bit for bit.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.autograd.graph import GradientEdge, Node

__all__ = [
    "DeferredRegion",
    "compiled_nodes",
    "deferring",
    "split_backend",
]

_COMPILED_NODE = "CompiledFunctionBackward"
BoxedFn = Callable[[list[Any]], Any]

# CompiledFunctionBackward nodes that a split backward's I is running now -> where their W goes.
# Keyed by node (not thread): the autograd engine may run a node on a device thread.
_deferring: dict[Node, list[DeferredRegion]] = {}


@dataclass
class DeferredRegion:
    """One compiled region's weight-gradient part, waiting for W: (b) and what it reads."""

    weight_part: BoxedFn
    boundary: list[Any]
    edges: list[GradientEdge]  # the parameters' AccumulateGrad nodes, one per output of (b)
    label: str = field(default="")

    def gradients(self) -> list[tuple[GradientEdge, torch.Tensor]]:
        """Run (b) once; its outputs paired with the edges they accumulate into."""
        boundary, self.boundary = self.boundary, []
        with torch.no_grad():
            grads = _call(self.weight_part, boundary)
        return [(e, g) for e, g in zip(self.edges, grads, strict=True) if g is not None]

    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.boundary if isinstance(t, torch.Tensor))


def compiled_nodes(roots: Sequence[Node]) -> list[Node]:
    """The compiled regions' backward nodes reachable from ``roots``."""
    found: list[Node] = []
    seen: set[Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == _COMPILED_NODE:
            found.append(node)
        stack.extend(child for child, _ in node.next_functions if child is not None and child not in seen)
    return found


@contextmanager
def deferring(nodes: Sequence[Node]) -> Iterator[list[DeferredRegion]]:
    """While the block runs, split regions among ``nodes`` leave their weight part to the list."""
    regions: list[DeferredRegion] = []
    for node in nodes:
        _deferring[node] = regions
    try:
        yield regions
    finally:
        for node in nodes:
            _deferring.pop(node, None)


def _call(fn: BoxedFn, args: list[Any]) -> list[Any]:
    """Call a compiled part with the boxed convention (it may clear ``args``)."""
    return list(fn(args))


# ------------------------------------------------------------------ partitioning the backward graph
@dataclass
class _Parts:
    input_part: fx.GraphModule  # (a): same placeholders as the whole graph
    weight_part: fx.GraphModule  # (b): the boundary tensors in
    input_slots: list[int]  # which whole-graph outputs (a) returns, in order
    weight_slots: list[int]  # which whole-graph outputs (b) returns, in order
    n_boundary: int
    n_outputs: int


def _ancestors(starts: Sequence[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(starts)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


NO_PARAMETER_GRADIENT = "no parameter gets a gradient here"
NO_WEIGHT_GEMM = "no weight-gradient GEMM only the parameters need"
SILENT = (NO_PARAMETER_GRADIENT, NO_WEIGHT_GEMM)  # nothing worth W: no one needs telling


def partition(graph_module: fx.GraphModule, is_param: Sequence[bool]) -> _Parts | str:
    """Split a backward graph whose i-th output is the gradient of the i-th forward input, or
    say why not (one of :data:`SILENT`: nothing worth splitting).

    W gets the weight-gradient GEMMs (``mm``, ``bmm``, ``addmm``) that only the parameters'
    gradients need, with what leads into them and follows from them; what else only the
    parameters need (a norm's weight-gradient reduction, a bias sum that is no GEMM's) runs in I,
    so that between I and W a microbatch holds the GEMMs' operands and small gradients only."""
    graph = graph_module.graph
    outs = _outputs(graph_module)
    if len(outs) != len(is_param):
        return f"its {len(outs)} gradients do not line up with the region's {len(is_param)} inputs"
    weight_slots = [i for i, o in enumerate(outs) if is_param[i] and isinstance(o, fx.Node)]
    input_slots = [i for i, o in enumerate(outs) if not is_param[i] and isinstance(o, fx.Node)]
    if not weight_slots:
        return NO_PARAMETER_GRADIENT
    in_a = _ancestors([outs[i] for i in input_slots])
    in_b = _ancestors([outs[i] for i in weight_slots]) - in_a
    # A multi-output op's element belongs where the op runs (a tuple never crosses the boundary).
    for node in list(in_b):
        if node.op == "call_function" and any(arg in in_a for arg in node.all_input_nodes) and _is_getitem(node):
            in_b.discard(node)
            in_a.add(node)
    in_b = {n for n in in_b if n.op != "placeholder"}
    _keep_gemm_side(graph, in_a, in_b)
    if not in_b:
        return NO_WEIGHT_GEMM
    order = {node: k for k, node in enumerate(graph.nodes)}
    boundary = sorted(
        {arg for node in in_b for arg in node.all_input_nodes if arg not in in_b}
        | {outs[i] for i in weight_slots if outs[i] not in in_b},
        key=order.__getitem__,
    )
    if any(not isinstance(b.meta.get("val"), torch.Tensor) for b in boundary):
        return "a symbolic size would cross from the input part to the weight part (dynamic shapes)"

    a_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node.op == "placeholder" or node in in_a:
            env[node] = a_graph.node_copy(node, env.__getitem__)
    a_graph.output(tuple([env[outs[i]] for i in input_slots] + [env[b] for b in boundary]))

    b_graph = fx.Graph()
    env_b: dict[fx.Node, fx.Node] = {}
    for k, b in enumerate(boundary):
        env_b[b] = b_graph.placeholder(f"boundary_{k}")
        env_b[b].meta = dict(b.meta)
    for node in graph.nodes:
        if node in in_b:
            env_b[node] = b_graph.node_copy(node, env_b.__getitem__)
    b_graph.output(tuple(env_b[outs[i]] for i in weight_slots))
    return _Parts(
        fx.GraphModule(graph_module, a_graph),
        fx.GraphModule(graph_module, b_graph),
        input_slots,
        weight_slots,
        len(boundary),
        len(outs),
    )


_GEMMS = frozenset({"mm.default", "bmm.default", "addmm.default", "baddbmm.default"})


def _is_gemm(node: fx.Node) -> bool:
    return (
        node.op == "call_function"
        and str(getattr(node.target, "_opname", "")) + "." + str(getattr(node.target, "_overloadname", "")) in _GEMMS
    )


def _keep_gemm_side(graph: fx.Graph, in_a: set[fx.Node], in_b: set[fx.Node]) -> None:
    """Move to ``in_a`` the nodes of ``in_b`` neither leading into nor following from a GEMM of
    ``in_b`` (whose inputs are all ``in_a``'s by then), in place."""
    nodes = [n for n in graph.nodes if n in in_b]
    after: set[fx.Node] = set()
    for node in nodes:
        if _is_gemm(node) or any(arg in after for arg in node.all_input_nodes):
            after.add(node)
    before: set[fx.Node] = set()
    for node in reversed(nodes):
        if _is_gemm(node) or any(user in before for user in node.users):
            before.add(node)
    for node in nodes:
        if node not in after and node not in before and not any(arg in in_b for arg in node.all_input_nodes):
            in_b.discard(node)
            in_a.add(node)


def _outputs(graph_module: fx.GraphModule) -> list[Any]:
    return list(graph_module.graph.output_node().args[0])  # type: ignore[arg-type]


def _is_getitem(node: fx.Node) -> bool:
    import operator

    return node.target is operator.getitem


def example_inputs(part: fx.GraphModule) -> list[Any]:
    return [n.meta.get("val") for n in part.graph.nodes if n.op == "placeholder"]


# ------------------------------------------------------------------ the run-time backward
class _SplitBackward:
    """The region's compiled backward: (a) then (b), or (a) now and (b) left for W."""

    def __init__(self, parts: _Parts, input_fn: BoxedFn, weight_fn: BoxedFn, label: str) -> None:
        self._boxed_call = True  # (an instance attribute: wrappers copy __dict__, not class attributes)
        self.parts, self.input_fn, self.weight_fn, self.label = parts, input_fn, weight_fn, label
        self.weight_shapes = [
            tuple(v.shape) if isinstance(v := n.meta.get("val"), torch.Tensor) else None
            for n in _outputs(parts.weight_part)
        ]
        self.warned = False

    def __call__(self, args: list[Any]) -> list[Any]:
        parts = self.parts
        got = _call(self.input_fn, args)
        n_in = len(parts.input_slots)
        grads: list[Any] = [None] * parts.n_outputs
        for slot, g in zip(parts.input_slots, got[:n_in], strict=True):
            grads[slot] = g
        boundary = got[n_in:]
        del got
        sink = _deferring.get(torch._C._current_autograd_node()) if _deferring else None
        edges = self._edges(torch._C._current_autograd_node()) if sink is not None else None
        if sink is not None and edges is not None:
            sink.append(DeferredRegion(self.weight_fn, boundary, edges, self.label))
            return grads
        for slot, g in zip(parts.weight_slots, _call(self.weight_fn, boundary), strict=True):
            grads[slot] = g
        return grads

    def _edges(self, node: Node | None) -> list[GradientEdge] | None:
        """The parameters' AccumulateGrad edges, or None (and a warning, once) when they do not
        line up with (b)'s outputs: then W gets nothing and this backward computes everything."""
        nexts = node.next_functions if node is not None else ()
        edges: list[GradientEdge] = []
        ok = len(nexts) == self.parts.n_outputs
        for slot, shape in zip(self.parts.weight_slots, self.weight_shapes, strict=True):
            if not ok:
                break
            child, nr = nexts[slot]
            variable = getattr(child, "variable", None)
            ok = child is not None and isinstance(variable, nn.Parameter) and tuple(variable.shape) == shape
            if child is not None:
                edges.append(GradientEdge(child, nr))
        if ok:
            return edges
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"{self.label}: the compiled region's parameters do not line up with its autograd node's inputs; "
                "its weight gradients are computed in I, W holds nothing for it",
                stacklevel=2,
            )
        return None


# ------------------------------------------------------------------ the backends
def _param_mask(graph_module: fx.GraphModule, inputs: Sequence[Any]) -> list[bool]:
    """Which forward inputs of AOTAutograd's graph are parameters (its own first, when modules
    are not inlined, then dynamo's graph inputs)."""
    own = [*graph_module.named_parameters(remove_duplicate=False), *graph_module.named_buffers(remove_duplicate=False)]
    return [isinstance(t, nn.Parameter) for _, t in own] + [isinstance(t, nn.Parameter) for t in inputs]


def _say_whole(label: str, why: str) -> None:
    warnings.warn(
        f"{label}: the compiled backward is not split ({why}); its weight gradients are computed in I, "
        "W holds nothing for it",
        stacklevel=3,
    )


def _split_bw_compiler(
    is_param: Sequence[bool], label: str, compile_part: Callable[[fx.GraphModule, list[Any], bool], BoxedFn]
) -> Callable[..., Any]:
    """A bw_compiler: partition the backward graph, compile both parts (``compile_part(gm,
    example_inputs, is_weight_part)``), or the whole graph when it cannot be split."""

    def compile_backward(graph_module: fx.GraphModule, inputs: list[Any], **kwargs: Any) -> Any:
        parts = partition(graph_module, is_param)
        if isinstance(parts, str):
            if parts not in SILENT:
                _say_whole(label, parts)
            return compile_part(graph_module, inputs, False, **kwargs)
        input_fn = compile_part(parts.input_part, inputs, False, **kwargs)
        weight_fn = compile_part(parts.weight_part, example_inputs(parts.weight_part), True, **kwargs)
        return _SplitBackward(parts, input_fn, weight_fn, label)

    return compile_backward


def _eager_part(graph_module: fx.GraphModule, inputs: list[Any], weight_part: bool, **kwargs: Any) -> BoxedFn:
    del inputs, weight_part, kwargs
    run = graph_module.forward

    def boxed(args: list[Any]) -> Any:
        return run(*args)

    boxed._boxed_call = True  # type: ignore[attr-defined]  # AOTAutograd's calling convention
    return boxed


def _inductor_part(graph_module: fx.GraphModule, inputs: list[Any], weight_part: bool, **kwargs: Any) -> BoxedFn:
    from torch._inductor.compile_fx import compile_fx_inner

    if not weight_part:
        return compile_fx_inner(graph_module, inputs, **kwargs)
    # (b)'s inputs are not the backward's: AOTAutograd's indices of static and donated backward
    # inputs do not apply to it (a donated one could be written over).
    kwargs = {**kwargs, "static_input_idxs": []}
    with _no_donated_buffers():
        return compile_fx_inner(graph_module, inputs, **kwargs)


@contextmanager
def _no_donated_buffers() -> Iterator[None]:
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    saved = getattr(meta, "bw_donated_idxs", None)
    if meta is not None:
        meta.bw_donated_idxs = []
    try:
        yield
    finally:
        if meta is not None:
            meta.bw_donated_idxs = saved


_backends: dict[tuple[str, str, str], Callable[..., Any]] = {}


def split_backend(backend: str, label: str, options: dict[str, Any] | None = None) -> Callable[..., Any]:
    """A ``torch.compile`` backend (``"inductor"`` or ``"aot_eager"``) whose regions' backward is
    split; ``label`` names the module in what it warns; ``options`` are inductor's config.

    The same arguments give the same backend: dynamo reuses a compiled frame only for the backend
    it was compiled with, so blocks of one class compiled one by one share their code (a fresh
    backend per block would recompile each and soon reach dynamo's recompile limit)."""
    if backend not in ("inductor", "aot_eager"):
        raise ValueError(
            f"split_backend: backend {backend!r} is not one the graph split supports (inductor, aot_eager)"
        )
    key = (backend, label, repr(sorted((options or {}).items())))
    if key not in _backends:
        _backends[key] = _make_backend(backend, label, options)
    return _backends[key]


def _make_backend(backend: str, label: str, options: dict[str, Any] | None) -> Callable[..., Any]:

    def compile_region(graph_module: fx.GraphModule, inputs: list[Any]) -> Any:
        is_param = _param_mask(graph_module, inputs)
        # A cached artifact of an unsplit compile of the same graph must not be loaded here.
        with torch._functorch.config.patch(enable_autograd_cache=False):
            if backend == "aot_eager":
                from torch._dynamo.backends.common import aot_autograd
                from torch._functorch.partitioners import min_cut_rematerialization_partition

                return aot_autograd(
                    fw_compiler=functools.partial(_eager_part, weight_part=False),
                    bw_compiler=_split_bw_compiler(is_param, label, _eager_part),
                    partition_fn=min_cut_rematerialization_partition,
                    keep_inference_input_mutations=True,
                )(graph_module, inputs)
            from torch._inductor.compile_fx import compile_fx, compile_fx_inner

            split = _split_bw_compiler(is_param, label, _inductor_part)

            def inner(gm: fx.GraphModule, ex: list[Any], **kwargs: Any) -> Any:
                if kwargs.get("is_backward"):
                    return split(gm, ex, **kwargs)
                return compile_fx_inner(gm, ex, **kwargs)

            return compile_fx(graph_module, inputs, inner_compile=inner, config_patches=options)

    return compile_region
