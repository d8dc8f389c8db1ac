"""Per-layer costs (:class:`LayerCost`), the layers file, and byte sizes as people write them.

A layers file is what ``pipetrain profile --layers-out FILE`` writes and ``pipetrain plan --layers
FILE`` reads: one :class:`LayerCost` per layer, in model order, as JSON or CSV.

JSON (``.json``)::

    {"format": "pipetrain-layers", "version": 1,
     "meta": {"time_unit": "ms", "comm": 0.05},
     "layers": [{"name": "tok_embeddings", "f": 0.05, "i": 0.05, "w": 0.05,
                 "activation_bytes": 0, "output_bytes": 67108864, "static_bytes": 8.4e9}, ...]}

(a bare list of layer objects reads too). CSV (``.csv``): a header row naming the columns
``name,f,i,w,activation_bytes,output_bytes,static_bytes,weight_grad_bytes,workspace_bytes,i_workspace_bytes,i_saved_bytes,optimizer``
(``b`` may replace ``i`` and ``w``; only ``name`` and ``f`` are required, a missing byte column
is 0, but ``weight_grad_bytes`` defaults to ``activation_bytes`` and ``i_workspace_bytes`` to
``workspace_bytes``: files written before the last three columns existed read as they did), one
row per layer; lines
starting with ``#`` are comments, and ``# key=value`` comment lines before the header are the
file's ``meta``. Known ``meta`` keys: ``time_unit`` (what the durations are in) and ``comm``
(the measured latency between ranks, in that unit).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pipetrain.plan.errors import ScheduleError

__all__ = [
    "BYTES_PER_PARAMETER",
    "LayerCost",
    "format_bytes",
    "parse_bytes",
    "read_layers",
    "read_layers_meta",
    "static_bytes_for",
    "with_optimizer",
    "write_layers",
]

LAYERS_FORMAT = "pipetrain-layers"
_FIELDS = (
    "name",
    "f",
    "i",
    "w",
    "b",
    "activation_bytes",
    "output_bytes",
    "static_bytes",
    "weight_grad_bytes",
    "workspace_bytes",
    "i_workspace_bytes",
    "i_saved_bytes",
    "optimizer",
)

BYTES_PER_PARAMETER: dict[tuple[str, str], int] = {
    # (optimizer, precision): bytes per parameter for weights + gradients + optimizer state
    ("adam", "fp32"): 16,  # fp32 weight 4 + fp32 gradient 4 + Adam's two fp32 moments 8
    ("adam", "bf16"): 16,  # bf16 weight 2 + bf16 gradient 2 + fp32 master weight 4 + two fp32 moments 8
    ("adam", "bf16-fp32-grads"): 18,  # as bf16, gradients accumulated in fp32 (4 instead of 2)
    ("sgd", "fp32"): 12,  # fp32 weight 4 + fp32 gradient 4 + fp32 momentum 4
    ("sgd", "bf16"): 12,  # bf16 weight 2 + bf16 gradient 2 + fp32 master weight 4 + fp32 momentum 4
    ("sgd", "bf16-fp32-grads"): 14,
}
"""What :func:`static_bytes_for` assumes (ZeRO's accounting: no activations, no temporary buffers,
no gradient-reduction buckets). ``adamw`` counts as ``adam``."""


def static_bytes_for(params: float, *, optimizer: str = "adam", precision: str = "bf16") -> float:
    """Bytes that ``params`` parameters hold for a whole step: weights, gradients and optimizer state.

    ``optimizer``: ``"adam"`` (or ``"adamw"``) or ``"sgd"`` (with momentum); ``precision``:
    ``"fp32"``, ``"bf16"`` (mixed: bf16 weights and gradients, fp32 master weights and state) or
    ``"bf16-fp32-grads"`` (mixed, gradients accumulated in fp32, as Megatron does by default).
    Adam takes 16 bytes a parameter in fp32 and in bf16 mixed precision, 18 with fp32 gradients;
    SGD 12 (14). See :data:`BYTES_PER_PARAMETER`.
    """
    if isinstance(params, bool) or not isinstance(params, int | float) or not math.isfinite(params) or params < 0:
        raise ScheduleError(f"params must be a finite number >= 0, got {params!r}")
    key = ("adam" if optimizer.lower() == "adamw" else optimizer.lower(), precision.lower())
    if key not in BYTES_PER_PARAMETER:
        known = ", ".join(f"{o}/{p}" for o, p in BYTES_PER_PARAMETER)
        raise ScheduleError(f"no byte count for optimizer {optimizer!r} in precision {precision!r}; known: {known}")
    return float(params) * BYTES_PER_PARAMETER[key]


def _number(owner: str, label: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ScheduleError(f"{owner}: {label} must be a finite number >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class LayerCost:
    """One layer's costs per microbatch, as measured (or estimated).

    Durations (any unit, the same for every layer): ``f`` forward; ``i`` the backward for the
    input gradient and ``w`` the backward for the weight gradient, or ``b`` the whole backward
    (``i`` and ``w`` are then half of it each unless one of them is given). Without ``b``, ``i``
    and ``w`` default to ``f`` and ``b`` is ``i + w``. Given all three, ``b`` is the backward run
    in one pass (a schedule's B) and ``i + w`` the same backward split in two, which is rarely free:
    measured on the bpe preset's blocks, split costs 1.26-1.31x one pass (two engine calls, the
    split's bookkeeping, small kernels), so a plan that splits only where it fills a bubble wins.

    Bytes: ``activation_bytes`` what the layer's forward keeps for its backward;
    ``output_bytes`` its output (what crosses a cut to the next stage, and all that a
    recomputed stage keeps of its input); ``static_bytes`` what it holds for the whole step
    (parameters, gradients, optimizer state: :func:`static_bytes_for` counts them from a number
    of parameters, or use :meth:`static_for`); ``weight_grad_bytes`` what it holds from its
    input-gradient backward (I) until its weight-gradient backward (W) ends, under a split backward
    (W's inputs and output gradients; default: ``activation_bytes``); ``workspace_bytes`` the most
    its F, I or W allocates beyond what it holds before and after the action, freed by the
    action's end (a backward's temporaries: for a head with its loss, the logits' gradient and the
    softmax's); ``i_workspace_bytes`` the same for its I alone (default: ``workspace_bytes``);
    ``i_saved_bytes`` what of its activations only I reads, which a split backward frees when its
    stage's whole I ends (so while a stage's I runs, the layers it already went through still
    hold theirs). A stage's workspace is the largest of its layers' ``workspace_bytes`` and, over
    its layers k, of ``i_workspace_bytes[k]`` plus the ``i_saved_bytes`` of its layers after k.

    ``optimizer``: the time, per training step (not per microbatch), of the optimizer's update of
    the layer's parameters and their ``zero_grad`` (0: not measured). A step pays it once per
    rank after the pipeline; :func:`with_optimizer` spreads it over the step's microbatches' W
    and B, which is how a planner prices it.
    """

    name: str
    f: float
    i: float | None = None
    w: float | None = None
    activation_bytes: float = 0.0
    output_bytes: float = 0.0
    static_bytes: float = 0.0
    b: float | None = None
    weight_grad_bytes: float | None = None
    workspace_bytes: float = 0.0
    i_workspace_bytes: float | None = None
    i_saved_bytes: float = 0.0
    optimizer: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ScheduleError(f"a layer needs a name (a non-empty string), got {self.name!r}")
        owner = f"layer {self.name!r}"
        f = _number(owner, "f", self.f)
        i = None if self.i is None else _number(owner, "i", self.i)
        w = None if self.w is None else _number(owner, "w", self.w)
        b = None if self.b is None else _number(owner, "b", self.b)
        if b is None:
            i = f if i is None else i
            w = f if w is None else w
        elif i is None and w is None:
            i = w = b / 2
        elif i is None:
            assert w is not None
            i = b - w
        elif w is None:
            w = b - i
        if i < -1e-12 or w < -1e-12:
            raise ScheduleError(f"{owner}: i and w must fit inside b={b:g} (got i={i:g}, w={w:g})")
        i, w = max(i, 0.0), max(w, 0.0)
        values = {
            "f": f,
            "i": i,
            "w": w,
            "b": i + w if b is None else b,
            "activation_bytes": _number(owner, "activation_bytes", self.activation_bytes),
            "output_bytes": _number(owner, "output_bytes", self.output_bytes),
            "static_bytes": _number(owner, "static_bytes", self.static_bytes),
            "workspace_bytes": _number(owner, "workspace_bytes", self.workspace_bytes),
            "i_saved_bytes": _number(owner, "i_saved_bytes", self.i_saved_bytes),
            "optimizer": _number(owner, "optimizer", self.optimizer),
        }
        wgrad = self.weight_grad_bytes
        values["weight_grad_bytes"] = values["activation_bytes"] if wgrad is None else _number(owner, "wgrad", wgrad)
        i_work = self.i_workspace_bytes
        values["i_workspace_bytes"] = (
            values["workspace_bytes"] if i_work is None else _number(owner, "i_workspace_bytes", i_work)
        )
        for key, value in values.items():
            object.__setattr__(self, key, value)

    static_for = staticmethod(static_bytes_for)
    """``LayerCost.static_for(params, optimizer="adam", precision="bf16")``: :func:`static_bytes_for`."""

    @property
    def time(self) -> float:
        """f + the cheaper of b and i + w: the layer's least compute per microbatch."""
        assert self.i is not None and self.w is not None and self.b is not None
        return self.f + min(self.b, self.i + self.w)

    def to_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in _FIELDS}


def with_optimizer(layers: Iterable[LayerCost], num_microbatches: int) -> list[LayerCost]:
    """``layers`` with each one's ``optimizer`` time spread over a step's ``num_microbatches``: its
    ``w`` and ``b`` (where each microbatch makes its weight gradients) grow by ``optimizer /
    num_microbatches`` and ``optimizer`` becomes 0, so that it is counted once.

    A step is the pipeline and then each rank's optimizer step, and the next step waits for the
    slowest rank: an embedding or a head holding as many parameters as several blocks makes the
    rank holding it slower than its compute says. Priced in W, the planner balances whole
    training steps, optimizer included (on every rank but the first, the next step's first
    actions overlap the optimizer step, as a bubble absorbs part of a W)."""
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ScheduleError(f"num_microbatches must be an int >= 1, got {num_microbatches!r}")
    out = []
    for layer in as_layers(layers):
        share = layer.optimizer / num_microbatches
        assert layer.w is not None and layer.b is not None and layer.i is not None
        out.append(replace(layer, w=layer.w + share, b=layer.b + share, i=layer.i, optimizer=0.0))
    return out


def as_layers(layers: Iterable[LayerCost]) -> list[LayerCost]:
    """``layers`` checked: LayerCost objects with distinct names, at least one."""
    out = list(layers)
    if not out:
        raise ScheduleError("plan_pipeline needs at least one layer")
    seen: dict[str, int] = {}
    for k, layer in enumerate(out):
        if not isinstance(layer, LayerCost):
            raise ScheduleError(f"layers[{k}] is a {type(layer).__name__}, not a LayerCost")
        if layer.name in seen:
            raise ScheduleError(f"layers {seen[layer.name]} and {k} are both named {layer.name!r}; names must differ")
        seen[layer.name] = k
    return out


# ------------------------------------------------------------------ byte sizes

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(value: str | float) -> float:
    """A byte size: a number (``80e9``) or a number with a unit (``2GiB``, ``80 GB``, ``512MiB``).

    Decimal units (kB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB) powers of
    1024; a bare ``G`` or ``M`` is refused as ambiguous. Case does not matter.
    """
    if isinstance(value, bool):
        raise ScheduleError(f"a byte size must be a number or text such as 80GiB, not {value!r}")
    if isinstance(value, int | float):
        return _number("byte size", "the value", value)
    if str(value).strip().startswith("-") and _SIZE.match(str(value).strip()[1:]):
        raise ScheduleError(f"a byte size must be >= 0, got {value!r}")
    match = _SIZE.match(str(value))
    if match is None:
        raise ScheduleError(f"cannot read {value!r} as bytes: give a number (80e9) or one with a unit (80GiB, 80GB)")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit not in _UNITS:
        hint = f" (say {match.group(1)}{unit.upper()}iB or {match.group(1)}{unit.upper()}B)" if unit in "kmgt" else ""
        raise ScheduleError(f"cannot read {value!r} as bytes: unknown unit {match.group(2)!r}{hint}")
    return number * _UNITS[unit]


def format_bytes(value: float) -> str:
    """``value`` bytes for people: ``1.50 GiB``, ``512.0 MiB``, ``12 B``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


# ------------------------------------------------------------------ files


def _layer_from(record: Mapping[str, Any], where: str) -> LayerCost:
    unknown = sorted(set(record) - set(_FIELDS))
    if unknown:
        raise ScheduleError(f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(_FIELDS)}")
    if "name" not in record or "f" not in record:
        raise ScheduleError(f"{where}: every layer needs a name and f")
    kwargs = {k: v for k, v in record.items() if v is not None and v != ""}
    try:
        return LayerCost(**kwargs)
    except TypeError as exc:
        raise ScheduleError(f"{where}: {exc}") from None
    except ScheduleError as exc:
        raise ScheduleError(f"{where}: {exc}") from None


def _kind(path: str, text: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext in (".json", ".csv"):
        return ext[1:]
    return "json" if text.lstrip()[:1] in ("{", "[") else "csv"


def _read_text(path: str | os.PathLike[str]) -> tuple[str, str]:
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8-sig") as handle:
            return name, handle.read()
    except OSError as exc:
        raise ScheduleError(f"{name}: cannot read the layers file ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise ScheduleError(f"{name}: not a UTF-8 text file") from None


def _parse(name: str, text: str) -> tuple[list[LayerCost], dict[str, Any]]:
    return _parse_json(name, text) if _kind(name, text) == "json" else _parse_csv(name, text)


def _parse_json(name: str, text: str) -> tuple[list[LayerCost], dict[str, Any]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ScheduleError(f"{name}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
    meta: dict[str, Any] = {}
    if isinstance(data, dict):
        fmt = data.get("format", LAYERS_FORMAT)
        if fmt != LAYERS_FORMAT:
            raise ScheduleError(f"{name}: format {fmt!r} is not a layers file ({LAYERS_FORMAT!r})")
        meta = dict(data.get("meta") or {})
        data = data.get("layers")
    if not isinstance(data, list):
        raise ScheduleError(f"{name}: expected a list of layers (or an object with a 'layers' list)")
    layers = []
    for k, record in enumerate(data):
        if not isinstance(record, dict):
            raise ScheduleError(f"{name}: layer {k} is not an object")
        layers.append(_layer_from(record, f"{name}: layer {k}"))
    return layers, meta


def _parse_csv(name: str, text: str) -> tuple[list[LayerCost], dict[str, Any]]:
    meta: dict[str, Any] = {}
    body: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            key, sep, raw = stripped[1:].partition("=")
            if sep and not body:
                meta[key.strip()] = _meta_value(raw.strip())
            continue
        if stripped:
            body.append(line)
    if not body:
        raise ScheduleError(f"{name}: no header row (name,f,i,w,activation_bytes,output_bytes,static_bytes)")
    reader = csv.DictReader(io.StringIO("\n".join(body)))
    reader.fieldnames = [h.strip() for h in (reader.fieldnames or [])]
    layers = [_csv_row(name, k, row) for k, row in enumerate(reader)]
    return layers, meta


def _csv_row(name: str, k: int, row: Mapping[str | None, Any]) -> LayerCost:
    # Layer k counted from 0, as in JSON files and in plans (not the file's row number).
    record: dict[str, Any] = {}
    for key, raw in row.items():
        if key is None:
            raise ScheduleError(f"{name}: layer {k} has more cells than the header")
        cell = (raw or "").strip()
        if key == "name" or cell == "":
            record[key] = cell
            continue
        try:
            record[key] = float(cell)
        except ValueError:
            raise ScheduleError(f"{name}: layer {k}: {key}={cell!r} is not a number") from None
    return _layer_from(record, f"{name}: layer {k}")


def _meta_value(raw: str) -> Any:
    try:
        return float(raw)
    except ValueError:
        return raw


def read_layers(path: str | os.PathLike[str]) -> list[LayerCost]:
    """The layers in a layers file (JSON or CSV, see the module docs), in model order."""
    name, text = _read_text(path)
    layers, _ = _parse(name, text)
    if not layers:
        raise ScheduleError(f"{name}: holds no layers")
    return as_layers(layers)


def read_layers_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``meta`` of a layers file (``time_unit``, ``comm``, ...); empty when it has none."""
    name, text = _read_text(path)
    return _parse(name, text)[1]


def write_layers(
    path: str | os.PathLike[str], layers: Sequence[LayerCost], meta: Mapping[str, Any] | None = None
) -> str:
    """Write ``layers`` as a layers file: JSON for a ``.json`` name, CSV for ``.csv``. Returns the path."""
    name = os.fspath(path)
    checked = as_layers(layers)
    ext = os.path.splitext(name)[1].lower()
    if ext not in (".json", ".csv"):
        raise ScheduleError(f"{name}: a layers file is .json or .csv")
    if ext == ".json":
        data = {
            "format": LAYERS_FORMAT,
            "version": 1,
            "meta": dict(meta or {}),
            "layers": [x.to_dict() for x in checked],
        }
        text = json.dumps(data, indent=1) + "\n"
    else:
        out = io.StringIO()
        for key, value in (meta or {}).items():
            if "\n" in str(key) or "\n" in str(value) or "=" in str(key):
                raise ScheduleError(f"meta {key!r}: a CSV comment holds one key=value line")
            out.write(f"# {key}={value}\n")
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(_FIELDS)
        for layer in checked:
            writer.writerow([layer.name, *(repr(float(getattr(layer, k))) for k in _FIELDS[1:])])
        text = out.getvalue()
    with open(name, "w", encoding="utf-8") as handle:
        handle.write(text)
    return name
