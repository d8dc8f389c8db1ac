"""torch's tracing frontend (``pipeline``, ``pipe_split``, ``SplitPoint``, ``Pipe``, ``build_stage``).

A model is exported once with ``torch.export`` (split points are marker ops in its graph), and the
graph is cut at the markers into one ``GraphModule`` per stage. pipetrain's runtime hands a stage's
output to the next stage only, so the stages form a chain: stage ``s`` takes every value that was
made before it and is still needed at or after it (a skip connection's input, a mask used by every
block), and returns everything still needed after it. A value that skips stages thus travels
through the stages between; the stage modules are ordinary ``GraphModule``s whose parameters and
buffers keep the model's dotted names, so a stage's ``state_dict`` keys are the whole model's.

``build_stage`` also takes a ``Pipe`` made by ``torch.distributed.pipelining.pipeline``: its stage
module is inlined into such a chain link, read from the pipe's top-level graph.
"""

from __future__ import annotations

import contextlib
import difflib
import enum
import functools
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo

from pipetrain import PipelineStage
from pipetrain.errors import PipelineError

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["Pipe", "PipeInfo", "SplitPoint", "build_stage", "pipe_split", "pipeline"]


class SplitPoint(enum.Enum):
    """Where a split named in ``split_spec`` goes: before the module's forward, or after it."""

    BEGINNING = 1
    END = 2


@torch.library.custom_op("pipetrain::pipe_split", mutates_args=())
def _pipe_split_op() -> None:
    """The marker ``pipeline`` cuts at; eager, it does nothing."""
    return None


@_pipe_split_op.register_fake
def _pipe_split_fake() -> None:
    return None


# An op with no outputs would be dropped from the exported graph as dead code.
torch.fx.node.has_side_effect(torch.ops.pipetrain.pipe_split.default)

# torch's own marker (a model written with torch's pipe_split) counts too; compared by name, so
# the library never imports torch.distributed.pipelining.
_MARKERS = frozenset({"pipetrain.pipe_split.default", "pippy._pipe_split.default"})


def pipe_split() -> None:
    """Mark a stage boundary inside a model's ``forward``; outside ``pipeline()`` it does nothing."""
    torch.ops.pipetrain.pipe_split()


def _is_marker(node: fx.Node) -> bool:
    return node.op == "call_function" and str(node.target) in _MARKERS


@dataclass
class PipeInfo:
    """What ``build_stage`` needs besides the stage module (torch's fields, same meaning)."""

    graph: fx.Graph
    num_stages: int
    has_loss_and_backward: bool = False


class Pipe(torch.nn.Module):
    """A model cut into stages: ``split_gm`` calls ``submod_0`` … ``submod_{n-1}`` in a chain.

    Calling the pipe runs every stage in this process, one after the other (a check that the
    split computes what the model does) and returns the model's outputs as a flat tuple, as
    torch's ``Pipe`` does (``pipe(x)[0]`` is a one-output model's output).
    """

    def __init__(
        self,
        split_gm: fx.GraphModule,
        num_stages: int,
        has_loss_and_backward: bool = False,
        loss_spec: Any = None,
    ) -> None:
        super().__init__()
        self.split_gm = split_gm
        self.num_stages = num_stages
        self.has_loss_and_backward = has_loss_and_backward
        self.loss_spec = loss_spec

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return tuple(pytree.tree_leaves(self.split_gm(*args, **kwargs)))

    def get_stage_module(self, stage_idx: int) -> torch.nn.Module:
        """Stage ``stage_idx``'s module; its parameter names are the model's."""
        _check_index("Pipe.get_stage_module", stage_idx, self.num_stages)
        module: torch.nn.Module = getattr(self.split_gm, f"submod_{stage_idx}")
        return module

    def info(self) -> PipeInfo:
        return PipeInfo(self.split_gm.graph, self.num_stages, self.has_loss_and_backward)

    def build_stage(
        self, stage_index: int, device: torch.device | str | int, group: dist.ProcessGroup | None = None
    ) -> PipelineStage:
        """The ``PipelineStage`` of stage ``stage_index`` (moved to ``device``), for a schedule."""
        return build_stage(self.get_stage_module(stage_index), stage_index, self.info(), device, group)


def _check_index(who: str, stage_index: object, num_stages: int) -> None:
    if isinstance(stage_index, bool) or not isinstance(stage_index, int) or not 0 <= stage_index < num_stages:
        raise PipelineError(
            f"{who}: stage index {stage_index!r} is outside 0..{num_stages - 1} (the pipe has {num_stages} stages)"
        )


# ---------------------------------------------------------------------------------------- tracing
def pipeline(
    module: torch.nn.Module,
    mb_args: tuple[Any, ...],
    mb_kwargs: dict[str, Any] | None = None,
    split_spec: dict[str, SplitPoint] | None = None,
) -> Pipe:
    """Trace ``module`` on one microbatch and cut it into stages (torch's signature).

    Stages are cut at each ``pipe_split()`` the forward reaches and at each module named in
    ``split_spec`` (``SplitPoint.BEGINNING``: before its forward, ``END``: after). Shapes are
    fixed by the example microbatch, as with ``torch.export``: run every microbatch at its size;
    so is the mode (dropout, batch norm): trace in the mode you will run. The stage modules share
    the model's parameters (no copies); a parameter used by two stages (tied embeddings) is in
    both, and its gradient is split between them.
    """
    if not isinstance(module, torch.nn.Module):
        raise PipelineError(f"pipeline: module must be a torch.nn.Module, got {type(module).__name__}")
    if isinstance(mb_args, list):
        mb_args = tuple(mb_args)
    elif not isinstance(mb_args, tuple):
        mb_args = (mb_args,)
    if mb_kwargs is not None and not isinstance(mb_kwargs, Mapping):
        raise PipelineError(f"pipeline: mb_kwargs must be a dict of keyword inputs, got {type(mb_kwargs).__name__}")
    spec = _check_split_spec(module, split_spec)
    reached = dict.fromkeys(spec, 0)
    with _marked(module, spec, reached):
        try:
            exported = torch.export.export(module, mb_args, dict(mb_kwargs or {}), strict=False)
        except Exception as exc:
            raise PipelineError(
                f"pipeline: torch.export could not trace {type(module).__name__} on the example microbatch: {exc}"
            ) from exc
    missed = [name for name, count in reached.items() if count == 0]
    if missed:
        raise PipelineError(
            f"pipeline: split point(s) {missed} never ran: forward does not call "
            f"{'that module' if len(missed) == 1 else 'those modules'} on the example inputs, so no stage starts there"
        )
    flat = exported.module()
    return _split(module, flat, spec)


def _as_split_point(name: str, point: object) -> SplitPoint:
    if isinstance(point, SplitPoint):
        return point
    # torch's own SplitPoint (an Accelerate user switching imports halfway) means the same.
    if isinstance(point, enum.Enum) and point.name in SplitPoint.__members__:
        return SplitPoint[point.name]
    raise PipelineError(f"pipeline: split_spec[{name!r}] is {point!r}; use SplitPoint.BEGINNING or SplitPoint.END")


def _check_split_spec(module: torch.nn.Module, split_spec: object) -> dict[str, SplitPoint]:
    if split_spec is None:
        return {}
    if not isinstance(split_spec, Mapping):
        raise PipelineError(
            f"pipeline: split_spec must map module names to SplitPoint, got {type(split_spec).__name__}"
        )
    names = [name for name, _ in module.named_modules(remove_duplicate=False) if name]
    known = set(names)
    out: dict[str, SplitPoint] = {}
    for name, point in split_spec.items():
        if not isinstance(name, str):
            raise PipelineError(f"pipeline: split_spec keys are module names (str), got {name!r}")
        if name == "":
            raise PipelineError("pipeline: split_spec names '' (the whole model); name a submodule to split at")
        if name not in known:
            close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else f"; its modules include {names[:6]}"
            raise PipelineError(f"pipeline: split point {name!r} names no module of {type(module).__name__}{hint}")
        out[name] = _as_split_point(name, point)
    return out


@contextlib.contextmanager
def _marked(module: torch.nn.Module, spec: dict[str, SplitPoint], reached: dict[str, int]) -> Iterator[None]:
    """Wrap each named module's forward in markers while tracing, then put it back as it was."""
    patched: list[tuple[torch.nn.Module, bool, Any]] = []

    def wrap(name: str, point: SplitPoint, forward: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(forward)
        def marked(*args: Any, **kwargs: Any) -> Any:
            reached[name] += 1
            if point is SplitPoint.BEGINNING:
                pipe_split()
            out = forward(*args, **kwargs)
            if point is SplitPoint.END:
                pipe_split()
            return out

        return marked

    try:
        for name, point in spec.items():
            sub = module.get_submodule(name)
            had = "forward" in sub.__dict__
            patched.append((sub, had, sub.__dict__.get("forward")))
            sub.forward = wrap(name, point, sub.forward)
        yield
    finally:
        for sub, had, old in reversed(patched):
            if had:
                sub.forward = old
            else:
                del sub.forward


# -------------------------------------------------------------------------------------- splitting
def _carries(nodes: Sequence[fx.Node], stage_of: Mapping[fx.Node, int], num_stages: int) -> list[list[fx.Node]]:
    """Per boundary ``b`` (after stage ``b``): the values made at or before ``b`` and used after it."""
    last_use: dict[fx.Node, int] = {}
    for n in nodes:
        if n.op == "output" or n not in stage_of:
            continue
        uses = [stage_of[u] for u in n.users if u in stage_of]
        if uses:
            last_use[n] = max(uses)
    return [[n for n in nodes if n in last_use and stage_of[n] <= b < last_use[n]] for b in range(num_stages - 1)]


def _split(model: torch.nn.Module, flat: fx.GraphModule, spec: dict[str, SplitPoint]) -> Pipe:
    graph = flat.graph
    codegen = graph._codegen
    if not isinstance(codegen, _PyTreeCodeGen):
        raise PipelineError("pipeline: torch.export gave a graph without its input/output structure")
    info = codegen.pytree_info
    _check_flat_inputs(info)
    nodes = list(graph.nodes)
    stage_of: dict[fx.Node, int] = {}
    work = [0]  # computing nodes per stage
    for n in nodes:
        if n.op == "placeholder":
            stage_of[n] = 0
        elif n.op == "get_attr" or (n.op == "call_module" and str(n.target).startswith("_guards_fn")):
            continue  # attributes are fetched in each stage that uses them; export's input guards are dropped
        elif _is_marker(n):
            work.append(0)
        else:
            stage_of[n] = len(work) - 1
            if n.op != "output":
                work[-1] += 1
    num_stages = len(work)
    empty = [s for s, count in enumerate(work) if count == 0]
    if empty and num_stages > 1:
        raise PipelineError(
            f"pipeline: stage {empty[0]} of {num_stages} would compute nothing (two split points with nothing "
            "between them, or one at the very start or end of forward); split points: "
            + (repr({name: point.name for name, point in spec.items()}) if spec else "pipe_split() calls in forward")
        )
    carries = _carries(nodes, stage_of, num_stages)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = nodes[-1]
    setattr(flat, _OUT_SPEC, info.out_spec)  # read by the last stage (flat is this call's own module)
    state_keys = set(model.state_dict().keys())
    stages: dict[str, torch.nn.Module] = {}
    for s in range(num_stages):
        g = fx.Graph()
        inputs = placeholders if s == 0 else carries[s - 1]
        env = _stage_inputs(g, inputs, list(info.orig_args) if s > 0 else None)
        lookup = _attr_lookup(g, env)
        for n in nodes:
            if stage_of.get(n) == s and n.op not in ("placeholder", "output"):
                env[n] = g.node_copy(n, lookup)
        last = s == num_stages - 1
        if not last:
            g.output(tuple(_passed(g, env[v], v in inputs) for v in carries[s]))
        elif s == 0:
            g.output(fx.map_arg(output.args[0], lookup))
        else:  # the model's output structure, rebuilt from the graph's flat outputs
            flat_out = fx.map_arg(list(output.args[0]), lookup)
            g.output(g.call_function(pytree.tree_unflatten, (flat_out, g.get_attr(_OUT_SPEC))))
        if s == 0:
            g._codegen = _PyTreeCodeGen(
                _PyTreeInfo(list(info.orig_args), info.in_spec, info.out_spec if last else None)
            )
        stage = fx.GraphModule(flat, g, class_name=f"PipeStage{s}")
        _keep_model_state_keys(state_keys, stage)
        stages[f"submod_{s}"] = stage
    return Pipe(_top_graph(stages, placeholders, carries, info), num_stages)


_OUT_SPEC = "output_spec"


def _stage_inputs(g: fx.Graph, inputs: Sequence[fx.Node], ignored: Sequence[str] | None) -> dict[fx.Node, fx.Node]:
    """Placeholders for ``inputs`` (positional), then, after the first stage, the model's own
    input names as keywords that are accepted and ignored: a schedule's ``step()`` hands its
    keyword inputs to every stage of the rank it runs on, and a later stage gets those values
    from the stage before it (on any rank) instead."""
    reserved = set(ignored or ())
    used: set[str] = set()
    env: dict[fx.Node, fx.Node] = {}
    for v in inputs:
        name = v.name
        while name in reserved or name in used:
            name += "_"
        used.add(name)
        env[v] = g.placeholder(name)
        env[v].meta = dict(v.meta)
    for name in ignored or ():
        g.placeholder(name, default_value=None)
    return env


def _check_flat_inputs(info: _PyTreeInfo) -> None:
    """Stage 0 is called with the model's own arguments: each must be one value, not a container."""
    spec = info.in_spec
    children = [spec.child(0).child(i) for i in range(spec.child(0).num_children)]
    children += [spec.child(1).child(i) for i in range(spec.child(1).num_children)]
    for name, child in zip(info.orig_args, children, strict=False):
        if not child.is_leaf():
            raise PipelineError(
                f"pipeline: input {name!r} is a {child.type.__name__} of values; the first stage takes each input "
                "as its own argument or keyword (pass its tensors separately)"
            )


def _attr_lookup(g: fx.Graph, env: dict[fx.Node, fx.Node]) -> Callable[[fx.Node], fx.Node]:
    """``env`` lookup that fetches a model attribute (parameter, buffer, constant) once per stage."""
    attrs: dict[fx.Node, fx.Node] = {}

    def lookup(n: fx.Node) -> fx.Node:
        if n.op == "get_attr":
            if n not in attrs:
                attrs[n] = g.get_attr(str(n.target))
                attrs[n].meta = dict(n.meta)
            return attrs[n]
        return env[n]

    return lookup


def _passed(g: fx.Graph, value: fx.Node, is_input: bool) -> fx.Node:
    """A value this stage only forwards leaves as an alias: every output is a tensor this stage
    made, never one of its input objects, which the runtime treats apart (cut from upstream)."""
    if is_input and isinstance(value.meta.get("val"), torch.Tensor):
        alias = g.call_function(torch.ops.aten.alias.default, (value,))
        alias.meta = dict(value.meta)
        return alias
    return value


def _keep_model_state_keys(keys: set[str], stage: torch.nn.Module) -> None:
    """Buffers that are not in the model's ``state_dict`` (non-persistent ones, traced constants)
    stay out of the stage's, so stage checkpoints hold exactly the model's keys."""
    for name, buf in list(stage.named_buffers()):
        if name not in keys:
            owner_name, _, field = name.rpartition(".")
            stage.get_submodule(owner_name).register_buffer(field, buf, persistent=False)


def _top_graph(
    stages: dict[str, torch.nn.Module], placeholders: list[fx.Node], carries: list[list[fx.Node]], info: _PyTreeInfo
) -> fx.GraphModule:
    """``split_gm``: the model's inputs, then each stage called on what the one before returned."""
    g = fx.Graph()
    values = [g.placeholder(p.name) for p in placeholders]
    for s in range(len(stages)):
        call = g.call_module(f"submod_{s}", tuple(values))
        if s < len(carries):
            values = [g.call_function(operator.getitem, (call, i)) for i in range(len(carries[s]))]
    g.output(call)
    g._codegen = _PyTreeCodeGen(_PyTreeInfo(list(info.orig_args), info.in_spec, None))
    return fx.GraphModule(stages, g, class_name="SplitGraph")


# ------------------------------------------------------------------------------------ build_stage
def build_stage(
    stage_module: torch.nn.Module,
    stage_index: int,
    pipe_info: Any,
    device: torch.device | str | int,
    group: dist.ProcessGroup | None = None,
) -> PipelineStage:
    """A ``PipelineStage`` for ``stage_module`` (moved to ``device``), from a pipetrain or torch ``Pipe``.

    A torch-made pipe's stage module takes values from any earlier stage; it is rewritten into a
    chain link (values it does not use pass through), keeping its parameter names.
    """
    if not isinstance(stage_module, torch.nn.Module):
        raise PipelineError(f"build_stage: stage_module must be a torch.nn.Module, got {type(stage_module).__name__}")
    num_stages = getattr(pipe_info, "num_stages", None)
    graph = getattr(pipe_info, "graph", None)
    if not isinstance(num_stages, int) or not isinstance(graph, fx.Graph):
        raise PipelineError(
            f"build_stage: pipe_info must be a Pipe's info() (a graph and num_stages), got {type(pipe_info).__name__}"
        )
    _check_index("build_stage", stage_index, num_stages)
    if getattr(pipe_info, "has_loss_and_backward", False):
        raise PipelineError(
            "build_stage: this pipe was traced with its loss inside the model (has_loss_and_backward); "
            "trace the model without the loss and give the schedule a loss_fn"
        )
    module = (
        stage_module if isinstance(pipe_info, PipeInfo) else _chain_link(stage_module, stage_index, graph, num_stages)
    )
    stage = PipelineStage(module, stage_index, num_stages, device, group=group)
    if isinstance(module, fx.GraphModule):
        _retarget_devices(module, stage.device)
    module.to(stage.device)
    return stage


def _traced_device(module: fx.GraphModule) -> torch.device | None:
    """The device the module was traced on: its tensors', else its example inputs'."""
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    for n in module.graph.nodes:
        val = n.meta.get("val") if n.op == "placeholder" else None
        if isinstance(val, torch.Tensor):
            return val.device
    return None


def _retarget_devices(module: fx.GraphModule, device: torch.device) -> None:
    """Tracing bakes the example's device into the graph (``arange(device=cpu)``, ``.to(cpu)``);
    point those at the stage's device, as moving the parameters alone would not."""
    old = _traced_device(module)
    if old is None or old == device:
        return

    def swap(value: Any) -> Any:
        if isinstance(value, torch.device) and value.type == old.type and value.index in (None, old.index):
            return device
        return value

    changed = False
    for n in module.graph.nodes:
        if n.op == "call_function":
            args, kwargs = fx.node.map_aggregate(n.args, swap), fx.node.map_aggregate(n.kwargs, swap)
            if args != n.args or kwargs != n.kwargs:
                n.args, n.kwargs, changed = args, kwargs, True
    if changed:
        module.recompile()


def _chain_link(stage_module: torch.nn.Module, stage_index: int, top: fx.Graph, num_stages: int) -> fx.GraphModule:
    """Stage ``stage_index`` of a torch-made pipe as a chain link: it takes what the stage before
    returns and returns what later stages need, with ``stage_module``'s graph inlined."""
    if not isinstance(stage_module, fx.GraphModule):
        raise PipelineError(
            f"build_stage: the stage module of a torch-made pipe must be its fx.GraphModule "
            f"(pipe.get_stage_module(i)), got {type(stage_module).__name__}"
        )
    nodes = list(top.nodes)
    calls = [n for n in nodes if n.op == "call_module"]
    if len(calls) != num_stages:
        raise PipelineError(
            f"build_stage: the pipe's graph calls {len(calls)} stage modules but pipe_info says {num_stages} stages"
        )
    stage_of: dict[fx.Node, int] = {}
    for n in nodes:
        if n.op == "placeholder":
            stage_of[n] = 0
        elif n.op == "call_module":
            stage_of[n] = calls.index(n)
        elif n.op == "call_function":
            stage_of[n] = max((stage_of[a] for a in n.all_input_nodes), default=0)
        elif n.op != "output":
            raise PipelineError(
                f"build_stage: the pipe's graph has a {n.op} node {n.name!r} outside its stages; only stage calls "
                "and what reads their results can be placed on a stage"
            )
    carries = _carries(nodes, stage_of, num_stages)
    g = fx.Graph()
    inputs = [n for n in nodes if n.op == "placeholder"] if stage_index == 0 else carries[stage_index - 1]
    roots = [str(n.target) for n in nodes if n.op == "placeholder"]
    env: dict[fx.Node, Any] = dict(_stage_inputs(g, inputs, roots if stage_index > 0 else None))
    call = calls[stage_index]
    for n in nodes:
        if stage_of.get(n) != stage_index or n.op == "placeholder":
            continue
        if n is call:
            env[n] = _inline(g, stage_module.graph, n, env)
        elif n.op == "call_function" and n.target is operator.getitem and not isinstance(env[n.args[0]], fx.Node):
            env[n] = env[n.args[0]][n.args[1]]
        else:
            env[n] = g.node_copy(n, lambda a: env[a])
    if stage_index == num_stages - 1:
        g.output(env[call])  # what torch's last stage returns: its module's output
    else:
        g.output(
            tuple(
                _passed(g, env[v], v in inputs) if isinstance(env[v], fx.Node) else env[v] for v in carries[stage_index]
            )
        )
    return fx.GraphModule(stage_module, g, class_name=f"PipeStage{stage_index}")


def _inline(g: fx.Graph, sub: fx.Graph, call: fx.Node, env: dict[fx.Node, Any]) -> Any:
    """Copy ``sub``'s nodes into ``g`` with its placeholders bound to ``call``'s arguments."""
    params = [n for n in sub.nodes if n.op == "placeholder"]
    args = list(call.args)
    bound: dict[fx.Node, Any] = {}
    for i, p in enumerate(params):
        if i < len(args):
            value = args[i]
        elif p.target in call.kwargs:
            value = call.kwargs[str(p.target)]
        else:
            raise PipelineError(f"build_stage: stage call {call.name!r} gives no value for input {p.target!r}")
        bound[p] = fx.map_arg(value, lambda a: env[a])
    result: Any = None
    for n in sub.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            result = fx.map_arg(n.args[0], lambda a: bound[a])
        else:
            bound[n] = g.node_copy(n, lambda a: bound[a])
    return result
