"""One pipeline stage: the model computation of F, B, I and W for one microbatch at a time.

The stage does no communication: the executor hands it inputs (received floating tensors already
made leaves that require grad), output gradients or the loss, and sends what it returns. Per
microbatch it keeps only what backward needs and drops it as soon as the last backward ran.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils.hooks import RemovableHandle

from pipetrain._backward import SavedTensors, WeightGradPlan, backward_full, backward_input, backward_weight
from pipetrain._streams import current_stream, on_stream
from pipetrain.errors import PipelineError
from pipetrain.recompute import adopt_checkpointing

__all__ = ["PipelineStage", "PipelineStageInfo"]


@dataclass(frozen=True, kw_only=True)
class PipelineStageInfo:
    """Which forward a context registered with :meth:`PipelineStage.register_forward_context` is
    around (torch 2.15's class): the stage, the microbatch, and ``is_metadata_inference``, always
    False here (pipetrain runs no shape-probing forward)."""

    stage_index: int
    microbatch_index: int
    is_metadata_inference: bool = False


@dataclass
class _Microbatch:
    """Everything one microbatch keeps between its forward and its last backward."""

    inputs: list[torch.Tensor]  # input leaves that require grad, pytree order
    needed: list[bool]  # per flattened input leaf: does it get a gradient back
    output_edges: list[GradientEdge]  # per output leaf that requires grad, pytree order
    outputs: list[torch.Tensor] = field(default_factory=list)  # output tensors, until sent (free_output_storage)
    out_needs_grad: list[bool] = field(default_factory=list)  # per output tensor leaf
    saved: SavedTensors | None = None
    plan: WeightGradPlan | None = None  # set by I, consumed by W
    stream: Any = None  # the stream I ran on (a device with streams): W runs there too
    # First stage only: the caller's tensors behind ``inputs`` (a microbatch's view of a batch
    # that requires grad, or a leaf such as a learnable scale), which get the input gradients.
    origins: list[torch.Tensor] = field(default_factory=list)


def _refs_of_a_list_item() -> int:
    """``sys.getrefcount`` of an object that only a list being iterated holds, on this interpreter."""
    for item in [object()]:
        return sys.getrefcount(item)
    raise AssertionError("unreachable")  # pragma: no cover


_HELD_BY_LIST_ONLY = _refs_of_a_list_item()


def _as_device(device: torch.device | str | int) -> torch.device:
    """An int is an index on this machine's accelerator (CUDA, XPU, …), or the CPU when it has none."""
    if isinstance(device, int):
        accelerator = getattr(torch, "accelerator", None)
        current = accelerator.current_accelerator() if accelerator is not None else None
        return torch.device(current.type, device) if current is not None else torch.device("cpu")
    return torch.device(device)


def _is_process_group(value: object) -> bool:
    return isinstance(value, dist.ProcessGroup)


class PipelineStage:
    """Stage ``stage_index`` of ``num_stages``, running ``submodule`` on ``device``.

    ``track_saved_tensors`` (default on) routes the tensors autograd saves through this stage, so
    they are released right after the last backward of their microbatch, what only the input-grad
    pass needed is released right after I, and :meth:`free_output_storage` can tell which outputs
    autograd still needs. Turn it off for modules that cannot run under saved-tensor hooks. The
    runtimes use it only where a schedule splits the stage's backward into I and W.

    ``split_backward=False`` makes I do the full backward (W then does nothing). A split I
    computes every gradient but the weight GEMMs', which W runs from what I kept
    (docs/stage-and-split-backward.md); weight gradients that cannot wait (a ``torch.compile``'d
    region's, reentrant checkpointing's) are computed in I, and the stage says so once. Torch's
    non-reentrant ``checkpoint_wrapper`` modules inside ``submodule`` are moved onto
    :func:`pipetrain.recompute.checkpoint` (same recompute, but W can still wait).

    Driving a first stage by hand (not through a schedule) with inputs made by a graph that
    requires grad: call :meth:`backward_into_inputs` once the step's backwards ran, as the
    runtimes do; until then the stage keeps those inputs' gradients.
    """

    def __init__(
        self,
        submodule: torch.nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device | str | int,
        *positional: Any,
        group: dist.ProcessGroup | None = None,
        track_saved_tensors: bool = True,
        split_backward: bool = True,
        input_args: Any = None,
        output_args: Any = None,
        output_grads: Any = None,
        input_grads: Any = None,
        dw_builder: Any = None,
        get_mesh: Any = None,
    ) -> None:
        # After the device: pipetrain's ``group`` alone, or torch's order (input_args, output_args,
        # output_grads, input_grads, group, dw_builder, get_mesh), so a call written for torch
        # keeps working. Example inputs and outputs serve torch's fixed buffers; shapes travel
        # with the messages here, so they are accepted and not needed.
        torch_args = {
            "input_args": input_args,
            "output_args": output_args,
            "output_grads": output_grads,
            "input_grads": input_grads,
            "group": group,
            "dw_builder": dw_builder,
            "get_mesh": get_mesh,
        }
        if len(positional) == 1 and group is None and (positional[0] is None or _is_process_group(positional[0])):
            torch_args["group"] = positional[0]
        elif positional:
            if len(positional) > len(torch_args):
                raise TypeError(f"PipelineStage takes at most {4 + len(torch_args)} positional arguments")
            for name, value in zip(list(torch_args), positional, strict=False):
                if torch_args[name] is not None:
                    raise TypeError(f"PipelineStage got multiple values for argument {name!r}")
                torch_args[name] = value
        group, dw_builder = torch_args["group"], torch_args["dw_builder"]
        if group is not None and not _is_process_group(group):
            raise TypeError(
                f"PipelineStage: group must be a torch.distributed ProcessGroup, got {type(group).__name__}"
            )
        if dw_builder is not None and not callable(dw_builder):
            raise TypeError(f"PipelineStage: dw_builder must be callable, got {type(dw_builder).__name__}")
        if num_stages < 1 or not 0 <= stage_index < num_stages:
            raise PipelineError(f"stage_index {stage_index} is outside 0..{num_stages - 1} (num_stages={num_stages})")
        self.submodule = submodule
        adopt_checkpointing(submodule)
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = _as_device(device)
        self.group = group
        self.track_saved_tensors = track_saved_tensors
        self.split_backward = split_backward
        # torch's hook for modules that defer their own weight gradients: I is then autograd's
        # whole backward and W calls what dw_builder() returned at I (B calls it at once).
        self.dw_builder: Callable[[], Callable[[], None]] | None = dw_builder
        self._mbs: dict[int, _Microbatch] = {}
        self._noticed: set[str] = set()  # causes of weight gradients computed in I, said once
        self._origin_grads: list[tuple[torch.Tensor, torch.Tensor]] = []  # see backward_into_inputs
        self._forward_contexts: OrderedDict[int, Callable[[PipelineStageInfo], AbstractContextManager[Any]]] = (
            OrderedDict()
        )

    def register_forward_context(
        self, context_factory: Callable[[PipelineStageInfo], AbstractContextManager[Any]]
    ) -> RemovableHandle:
        """Run every forward of this stage (``forward_one_chunk``, as the runtimes and custom
        functions call it) inside ``context_factory(PipelineStageInfo(...))`` (torch 2.15's hook).
        One at a time; the handle's ``remove()`` unregisters it."""
        if self._forward_contexts:
            raise PipelineError(
                f"stage {self.stage_index}: a forward context is already registered; remove its handle first"
            )
        handle = RemovableHandle(self._forward_contexts)
        self._forward_contexts[handle.id] = context_factory
        return handle

    def _call_submodule(self, mb: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self._forward_contexts:
            return self.submodule(*args, **kwargs)
        factory = next(iter(self._forward_contexts.values()))
        done = False
        with factory(PipelineStageInfo(stage_index=self.stage_index, microbatch_index=mb)):
            output = self.submodule(*args, **kwargs)
            done = True
        if not done:  # the context swallowed the module's exception: there is no output
            raise PipelineError(f"{self._where(mb, 'F')}: the forward context suppressed the forward's exception")
        return output

    @property
    def submod(self) -> torch.nn.Module:
        """torch's name for :attr:`submodule`; assignable, as torchtitan's ``pipeline_llm`` does."""
        return self.submodule

    @submod.setter
    def submod(self, module: torch.nn.Module) -> None:
        if module is not None:
            adopt_checkpointing(module)
        self.submodule = module

    @property
    def group_rank(self) -> int:
        """This process's rank in the pipeline group (torch's attribute; assignable, as torch's
        test doubles of a stage set it without a process group)."""
        given = self.__dict__.get("_group_rank")
        return dist.get_rank(self.group) if given is None else int(given)

    @group_rank.setter
    def group_rank(self, value: int) -> None:
        self.__dict__["_group_rank"] = value

    @property
    def group_size(self) -> int:
        """The pipeline group's size (torch's attribute; assignable like :attr:`group_rank`)."""
        given = self.__dict__.get("_group_size")
        return dist.get_world_size(self.group) if given is None else int(given)

    @group_size.setter
    def group_size(self, value: int) -> None:
        self.__dict__["_group_size"] = value

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def __repr__(self) -> str:
        return f"PipelineStage(stage_index={self.stage_index}, num_stages={self.num_stages}, device={self.device})"

    def _where(self, mb: int, action: str) -> str:
        return f"stage {self.stage_index}, microbatch {mb}, action {self.stage_index}{action}{mb}"

    # ------------------------------------------------------------------ forward
    def forward_one_chunk(
        self, mb: int, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None, *, track: bool = True
    ) -> Any:
        """F: run the submodule; under grad mode keep what backward of ``mb`` needs.

        ``track=False`` skips saved-tensor tracking for this microbatch (runtimes pass it when the
        schedule runs no I/W for this stage: a full B frees what autograd saved by itself, and the
        hooks would cost a Python call per saved tensor for nothing).
        """
        kwargs = kwargs or {}
        if not torch.is_grad_enabled():
            return self._call_submodule(mb, args, kwargs)
        if mb in self._mbs:
            raise PipelineError(f"{self._where(mb, 'F')}: forward ran again before the backward of its previous run")
        plain = not kwargs and all(isinstance(t, torch.Tensor) for t in args)  # skips pytree
        leaves, spec = (list(args), None) if plain else pytree.tree_flatten((tuple(args), kwargs))
        needed = [isinstance(t, torch.Tensor) and t.requires_grad for t in leaves]
        origins = [t for t, need in zip(leaves, needed, strict=True) if need] if self.is_first else []
        # Cut inputs from any graph upstream: this stage's backward ends at its inputs. A tensor
        # given twice (a leaf handed over in memory, say) gets a leaf per place, so that each
        # place's gradient goes back once; the first stage's inputs are always cut, and their
        # gradients go to the caller's tensors after backward.
        if any(needed):
            seen: set[int] = set()
            cut = []
            for t, need in zip(leaves, needed, strict=True):
                if need and (t.grad_fn is not None or id(t) in seen or self.is_first):
                    cut.append(t.detach().requires_grad_())
                else:
                    cut.append(t)
                if need:
                    seen.add(id(t))
            leaves = cut
        if plain:
            args = tuple(leaves)
        else:
            assert spec is not None
            args, kwargs = pytree.tree_unflatten(leaves, spec)
        saved = (
            SavedTensors(f"stage {self.stage_index}, microbatch {mb}") if self.track_saved_tensors and track else None
        )
        if saved is None:
            output = self._call_submodule(mb, args, kwargs)
        else:
            with saved.hooks():
                output = self._call_submodule(mb, args, kwargs)
        if isinstance(output, torch.Tensor):
            out_tensors = [output]
        else:
            out_tensors = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
        self._mbs[mb] = _Microbatch(
            inputs=[t for t, need in zip(leaves, needed, strict=True) if need],
            needed=needed,
            output_edges=[get_gradient_edge(t) for t in out_tensors if t.requires_grad],
            outputs=out_tensors,
            out_needs_grad=[t.requires_grad for t in out_tensors],
            saved=saved,
            origins=origins,
        )
        return output

    def input_grads_needed(self, mb: int) -> list[bool]:
        """Per flattened input leaf of ``mb``: a tensor that requires grad (gets a gradient back)."""
        return list(self._get(mb, "F").needed)

    def output_grads_needed(self, mb: int) -> list[bool]:
        """Per flattened output leaf of ``mb`` that is a tensor: does it require grad."""
        return list(self._get(mb, "F").out_needs_grad)

    # ----------------------------------------------------------------- backward
    def backward_one_chunk(
        self,
        mb: int,
        *,
        loss: torch.Tensor | None = None,
        grad_outputs: list[torch.Tensor | None] | None = None,
        full: bool = True,
    ) -> list[torch.Tensor | None]:
        """B (``full=True``) or I (``full=False``) for ``mb``; returns the needed input grads."""
        kind = "B" if full else "I"
        state = self._get(mb, kind)
        if state.plan is not None:
            raise PipelineError(f"{self._where(mb, kind)}: the input-grad backward (I) already ran")
        edges, grads = self._roots(mb, kind, state, loss, grad_outputs)
        try:
            if self.dw_builder is not None:
                result = backward_full(edges, grads, state.inputs)
                if full:
                    self.dw_builder()()
                else:
                    state.plan = WeightGradPlan(runner=self.dw_builder())
            elif full:
                result = backward_full(edges, grads, state.inputs)
            elif not self.split_backward:
                result = backward_full(edges, grads, state.inputs)
                state.plan = WeightGradPlan(full_in_input_pass="split_backward=False")
            else:
                result, state.plan = backward_input(
                    edges,
                    grads,
                    state.inputs,
                    label=f"stage {self.stage_index}",
                    names=self._module_names,
                    noticed=self._noticed,
                )
        except RuntimeError as exc:
            raise PipelineError(f"{self._where(mb, kind)}: backward failed: {exc}") from exc
        if state.origins:
            self._to_origins(mb, kind, state.origins, result)
        if full:
            self._drop(mb)
        else:
            state.stream = current_stream(self.device)
            state.output_edges, state.outputs = [], []
            if state.saved is not None and state.plan is not None and state.plan.whole is None:
                state.saved.release_all()  # W holds what it reads itself; the graph is gone
        return result

    def _module_names(self, weights: Sequence[torch.Tensor]) -> str:
        """The modules (by their names in this stage) that own ``weights``, for messages."""
        owner = {
            id(p): (k, name.rpartition(".")[0] or name) for k, (name, p) in enumerate(self.submodule.named_parameters())
        }
        ranked = sorted(weights, key=lambda w: owner.get(id(w), (len(owner), ""))[0])
        found = list(dict.fromkeys(owner[id(w)][1] if id(w) in owner else f"a {tuple(w.shape)} tensor" for w in ranked))
        more = f" and {len(found) - 4} more" if len(found) > 4 else ""
        return ", ".join(found[:4]) + more

    def backward_weight_one_chunk(self, mb: int) -> None:
        """W for ``mb``: weight grads from what I kept (accumulated into ``.grad``), then drop ``mb``."""
        state = self._get(mb, "W")
        if state.plan is None:
            raise PipelineError(
                f"{self._where(mb, 'W')}: the weight-grad backward needs the input-grad backward (I) first"
            )
        try:
            with on_stream(state.stream, self.device):
                backward_weight(state.plan)
        except RuntimeError as exc:
            raise PipelineError(f"{self._where(mb, 'W')}: backward failed: {exc}") from exc
        self._drop(mb)

    def _roots(
        self,
        mb: int,
        kind: str,
        state: _Microbatch,
        loss: torch.Tensor | None,
        grad_outputs: list[torch.Tensor | None] | None,
    ) -> tuple[list[GradientEdge], list[torch.Tensor | None]]:
        if loss is not None:
            if grad_outputs is not None:
                raise PipelineError(f"{self._where(mb, kind)}: give either loss or grad_outputs, not both")
            if loss.numel() != 1:
                raise PipelineError(f"{self._where(mb, kind)}: loss must be a scalar, got shape {tuple(loss.shape)}")
            if not loss.requires_grad:
                raise PipelineError(f"{self._where(mb, kind)}: loss does not require grad (no path to any parameter)")
            return [get_gradient_edge(loss)], [torch.ones_like(loss)]
        if grad_outputs is None:
            raise PipelineError(f"{self._where(mb, kind)}: needs the loss (last stage) or grad_outputs")
        if len(grad_outputs) != len(state.output_edges):
            raise PipelineError(
                f"{self._where(mb, kind)}: got {len(grad_outputs)} output gradients for "
                f"{len(state.output_edges)} outputs that require grad"
            )
        return list(state.output_edges), list(grad_outputs)

    def _to_origins(self, mb: int, kind: str, origins: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
        """Leaves (a learnable scale) take their gradient now; tensors a graph made wait for
        :meth:`backward_into_inputs`, so that a graph the microbatches share is traversed once."""
        leaves: list[tuple[torch.Tensor, torch.Tensor]] = []
        for t, g in zip(origins, grads, strict=True):
            if g is None:
                continue
            if t.grad_fn is None:
                leaves.append((t, g))
            else:
                self._origin_grads.append((t, g))
        if leaves:
            self._into(leaves)

    def _into(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        try:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        except RuntimeError as exc:
            raise PipelineError(
                f"stage {self.stage_index}: backward into the inputs given to step() failed: {exc}"
            ) from exc

    def backward_into_inputs(self) -> None:
        """First stage, end of a training step: carry the gradients its inputs got on into the
        tensors given to ``step()`` (and any graph that made them), in one backward call, as plain
        autograd's one backward over the batch would; a graph shared by the microbatches is thus
        traversed once. The runtimes call it; nothing to do when no input requires grad."""
        pairs, self._origin_grads = self._origin_grads, []
        if pairs:
            self._into(pairs)

    # ------------------------------------------------------------------- memory
    def free_output_storage(self, mb: int) -> int:
        """Drop this stage's references to ``mb``'s outputs once they were sent: their memory goes
        back now instead of at the microbatch's backward. Returns the bytes that released.

        Backward needs only the outputs' autograd edges, which the stage keeps. An output's memory
        stays when backward needs it (autograd saved it) or something else holds the tensor (a
        custom ``autograd.Function`` keeping it on ``ctx``, the module itself): dropping a
        reference is always safe, unlike emptying the tensor in place, which would break those.
        Bytes are counted with saved-tensor tracking only (without it, what autograd saved is unknown).
        """
        state = self._mbs.get(mb)
        if state is None:
            return 0
        released = 0
        if state.saved is not None:
            keep = state.saved.storage_ptrs()
            keep.update(t.untyped_storage().data_ptr() for t in state.inputs)
            for t in state.outputs:
                alone = sys.getrefcount(t) <= _HELD_BY_LIST_ONLY
                if alone and t._base is None and t.untyped_storage().data_ptr() not in keep:
                    released += t.untyped_storage().nbytes()
        state.outputs = []
        return released

    def clear(self) -> None:
        """Drop every microbatch's state (end of step, or after an error)."""
        for mb in list(self._mbs):
            self._drop(mb)
        self._origin_grads = []

    def scale_grads(self, factor: float) -> None:
        """Divide every parameter gradient by ``factor`` (once per step, e.g. n_microbatches)."""
        with torch.no_grad():
            for p in self.submodule.parameters():
                if p.grad is not None:
                    p.grad.div_(factor)

    def has_state(self) -> bool:
        return bool(self._mbs)

    def _get(self, mb: int, kind: str) -> _Microbatch:
        state = self._mbs.get(mb)
        if state is None:
            raise PipelineError(
                f"{self._where(mb, kind)}: no forward state for this microbatch "
                "(its forward did not run with grad enabled, or its backward already finished)"
            )
        return state

    def _drop(self, mb: int) -> None:
        state = self._mbs.pop(mb, None)
        if state is not None and state.saved is not None:
            state.saved.release_all()


_PipelineStageBase = PipelineStage
"""torch's base class of its stage classes; torchtitan imports it as a type."""


@dataclass
class _RecvInfo:
    """torch's description of one input a stage receives: its name, the stage it comes from,
    the buffer it lands in and its metadata (pipetrain's messages carry their own shapes)."""

    input_name: str
    source: int
    buffer: Any = None
    tensor_meta: Any = None


def _normalize_model_output_as_tuple(output: Any) -> tuple[Any, ...]:
    """torch's helper of the same name (torchtitan imports it): a stage output as a tuple."""
    if isinstance(output, tuple) and not hasattr(output, "_fields"):
        return output
    if isinstance(output, list):
        return tuple(output)
    return (output,)
