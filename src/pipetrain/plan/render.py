"""Timeline pictures (PNG/SVG through matplotlib) and a text grid aligned to time.

One row per rank, one box per action coloured by kind, in one shade per stage of the rank (its
1st, 2nd, ... stage, as in the Zero Bubble and DualPipe figures), the action (``2F0``: stage 2's
forward of microbatch 0) inside a box when it fits (on two lines, ``2`` over ``F0``, when only
that fits; the microbatch alone when not even that), bubbles left empty, SEND/RECV in a thin lane
under each row. The legend names every kind and every shade drawn, with the stages each shade
stands for. Simulated and measured timelines draw the same way; several can be stacked on one
time axis to compare them.
matplotlib is imported only inside the drawing functions, so planning works without it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from pipetrain.plan.errors import ScheduleError
from pipetrain.plan.timeline import Timeline, TimelineEvent

__all__ = ["KIND_COLOURS", "format_time_grid", "picture_target", "render_timeline", "render_timelines"]

KIND_COLOURS: dict[str, str] = {
    "F": "#4C8BD6",  # forward: blue
    "B": "#E0703A",  # full backward: orange
    "I": "#F2A93B",  # input-gradient backward: amber
    "W": "#5DB55A",  # weight-gradient backward: green
    "OVERLAP_F_B": "#9467BD",  # overlapped forward + backward: purple
    "SEND_F": "#9E9E9E",
    "RECV_F": "#C4C4C4",
    "SEND_B": "#9E9E9E",
    "RECV_B": "#C4C4C4",
    "UNSHARD": "#7F7F7F",
    "RESHARD": "#7F7F7F",
    "REDUCE_GRAD": "#7F7F7F",
}
_LEGEND = {
    "F": "F forward",
    "B": "B backward",
    "I": "I input grad",
    "W": "W weight grad",
    "OVERLAP_F_B": "F&B overlapped",
}
_COMPUTE = frozenset({"F", "B", "I", "W", "OVERLAP_F_B"})
_LEFT, _RIGHT = 0.07, 0.985  # the time axes' share of the figure's width
_COMM = frozenset({"SEND_F", "RECV_F", "SEND_B", "RECV_B"})


def _shade(colour: str, chunk: int) -> str:
    """The kind's colour, darker for a rank's second stage, lighter for its third, and so on."""
    r, g, b = (int(colour[k : k + 2], 16) for k in (1, 3, 5))
    if chunk == 0:
        return colour
    if chunk % 2 == 1:
        f = 0.62 ** ((chunk + 1) // 2)
        r, g, b = (int(c * f) for c in (r, g, b))
    else:
        f = 0.45 ** (chunk // 2)
        r, g, b = (int(255 - (255 - c) * f) for c in (r, g, b))
    return f"#{r:02x}{g:02x}{b:02x}"


def _chunks(timeline: Timeline) -> dict[tuple[int, int], int]:
    """(rank, stage) -> position of the stage among the rank's stages (0 = its first)."""
    per_rank: dict[int, set[int]] = {}
    for e in timeline.events:
        if e.kind in _COMPUTE:
            per_rank.setdefault(e.rank, set()).add(e.stage)
    return {(r, s): k for r, stages in per_rank.items() for k, s in enumerate(sorted(stages))}


def box_labels(e: TimelineEvent) -> list[str]:
    """What a compute box may show, best first: the action, the action on two lines, the microbatch.

    ``2F0`` (or ``2`` over ``F0``); an overlapped pair ``0F7|7B3`` (or one action per line). The
    last resort, the microbatch alone (``0``, ``7|3``), leaves the stage to the shade and the legend.
    """
    if e.kind == "OVERLAP_F_B":
        parts = e.action[1 : e.action.rfind(")")].split(";")
        short = "|".join(part.lstrip("0123456789")[1:] or part for part in parts)
        return ["|".join(parts), "\n".join(parts), short]
    if e.microbatch is None:
        return [e.action]
    head = str(e.stage)
    rest = e.action[len(head) :] if e.action.startswith(head) else f"{e.kind}{e.microbatch}"
    return [e.action, f"{head}\n{rest}", str(e.microbatch)]


# Advance widths in DejaVu Sans (matplotlib's default font), in ems; other characters ~0.64.
_EM = {"W": 1.0, "I": 0.3, "|": 0.34, "F": 0.58, "B": 0.69, "\n": 0.0}


def _text_size(text: str, fontsize: float) -> tuple[float, float]:
    """(width, height) of ``text`` in inches at ``fontsize`` points: widest line, lines × 1.2 em."""
    lines = text.split("\n")
    widest = max(sum(_EM.get(c, 0.64) for c in line) for line in lines)
    return widest * fontsize / 72, len(lines) * 1.2 * fontsize / 72


def fit_label(e: TimelineEvent, width_in: float, height_in: float, fontsize: float) -> tuple[str, float] | None:
    """The first of :func:`box_labels` that fits a box of ``width_in`` × ``height_in`` inches, and its size.

    The action on one line, then on two, at ``fontsize`` or a little smaller; then either form
    smaller still (not under 5.5 pt); the microbatch alone last.
    """
    normal, small = fontsize, max(5.5, 0.85 * fontsize)
    tiny = max(5.5, 0.72 * fontsize)
    labels = box_labels(e)
    action, microbatch = labels[:2], labels[2:]
    tries = [(text, size) for text in action for size in (normal, small)]
    tries += [(text, tiny) for text in action] + [(text, size) for text in microbatch for size in (normal, small, tiny)]
    for text, size in tries:
        w, h = _text_size(text, size)
        if w + 0.5 * size / 72 <= width_in and h <= height_in:
            return text, size
    return None


def _unit_label(timeline: Timeline) -> str:
    return f"time ({timeline.unit})" if timeline.unit else "time (cost-model units)"


def _kinds(timeline: Timeline) -> set[str]:
    """Legend keys of what a timeline shows: compute kinds, "comm", "other"."""
    out: set[str] = set()
    for e in timeline.events:
        if e.kind in _COMPUTE:
            out.add(e.kind)
        elif e.kind in _COMM:
            if e.end > e.start:
                out.add("comm")
        elif e.end > e.start:
            out.add("other")
    return out


def _draw(ax: Any, timeline: Timeline, *, x_max: float, fontsize: float) -> None:
    """Draw one timeline into ``ax`` (whose place in the figure is already set)."""
    from matplotlib.patches import Rectangle

    t0 = timeline.start
    chunks = _chunks(timeline)
    has_comm = any(e.kind in _COMM for e in timeline.events)
    box_bottom, box_top = (0.30, 0.95) if has_comm else (0.08, 0.92)
    fig_w, fig_h = ax.figure.get_size_inches()
    where = ax.get_position()
    in_per_unit = fig_w * where.width / x_max
    box_h_in = fig_h * where.height / timeline.num_ranks * (box_top - box_bottom)
    for e in timeline.events:
        y = timeline.num_ranks - 1 - e.rank  # rank 0 on top
        start, width = e.start - t0, max(e.end - e.start, 0.0)
        if e.kind in _COMPUTE:
            colour = _shade(KIND_COLOURS.get(e.kind, "#777777"), chunks.get((e.rank, e.stage), 0))
            ax.add_patch(
                Rectangle(
                    (start, y + box_bottom),
                    width,
                    box_top - box_bottom,
                    facecolor=colour,
                    edgecolor="white",
                    linewidth=0.6,
                )
            )
            fitted = fit_label(e, width * in_per_unit, box_h_in, fontsize)
            if fitted is not None:
                dark = chunks.get((e.rank, e.stage), 0) % 2 == 1 or e.kind == "OVERLAP_F_B"
                ax.text(
                    start + width / 2,
                    y + (box_bottom + box_top) / 2,
                    fitted[0],
                    ha="center",
                    va="center",
                    fontsize=fitted[1],
                    linespacing=1.0,
                    color="white" if dark else "#1A1A1A",
                    clip_on=True,
                )
        elif e.kind in _COMM:
            if width <= 0:
                continue
            lane = 0.04 if e.kind.startswith("SEND") else 0.15
            ax.add_patch(
                Rectangle((start, y + lane), width, 0.09, facecolor=KIND_COLOURS[e.kind], edgecolor="none", alpha=0.6)
            )
        elif width > 0:
            ax.add_patch(Rectangle((start, y + box_bottom), width, box_top - box_bottom, facecolor="#7F7F7F"))
    ax.set_xlim(0, x_max)
    ax.set_ylim(0, timeline.num_ranks)
    ax.set_yticks([timeline.num_ranks - 1 - r + 0.5 for r in range(timeline.num_ranks)])
    ax.set_yticklabels([f"rank {r}" for r in range(timeline.num_ranks)], fontsize=max(fontsize, 8))
    ax.tick_params(axis="y", length=0)
    for r in range(1, timeline.num_ranks):
        ax.axhline(r, color="#E3E3E3", linewidth=0.6, zorder=0)
    ax.set_facecolor("#FFFFFF")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_xlabel(_unit_label(timeline), fontsize=9)
    if timeline.title:
        ax.set_title(timeline.title, fontsize=10.5, loc="left")


def _default_width(timelines: Sequence[Timeline], spans: list[float], shared: bool) -> float:
    """Inches: wide enough for most boxes' two-line labels (``12`` over ``F3``), 10 to 22."""
    need = 10.0
    for t, span in zip(timelines, spans, strict=True):
        durations = sorted(e.end - e.start for e in t.events if e.kind in _COMPUTE and e.end > e.start)
        if not durations:
            continue
        short = durations[len(durations) // 4]  # most boxes, not the tiny ones of a measured step
        digits = len(str(max(e.stage for e in t.events)))
        label_in = (0.64 * max(digits, 2) + 0.5) * 7.0 / 72 + 0.02  # "12" over "F3" at 7 pt, with margins
        need = max(need, (max(spans) if shared else span) / short * label_in / (_RIGHT - _LEFT) + 0.1)
    return min(need, 22.0)


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _shade_rule(timeline: Timeline, chunk: int) -> str:
    """Which stage the ``chunk``-th shade is on each rank: ``r+4``, ``7-r``, or the list by rank."""
    by_rank = {r: s for (r, s), k in _chunks(timeline).items() if k == chunk}
    if not by_rank:
        return ""
    for sign, word in ((1, "r"), (-1, "-r")):
        offsets = {s - sign * r for r, s in by_rank.items()}
        if len(offsets) == 1 and len(by_rank) > 1:
            c = offsets.pop()
            if sign == 1:
                return "r" if c == 0 else f"r+{c}" if c > 0 else f"r-{-c}"
            return f"{c}{word}"
    return "/".join(f"{by_rank[r]}" for r in sorted(by_rank)) + (" on ranks " + "/".join(map(str, sorted(by_rank))))


def shade_legend(timelines: Sequence[Timeline]) -> list[tuple[int, str]]:
    """(shade, legend text) for each shade drawn: which stage of its rank, and which stage that is."""
    used = sorted({k for t in timelines for k in _chunks(t).values()})
    if used == [0]:
        return []
    out = []
    for k in used:
        rules = {_shade_rule(t, k) for t in timelines} - {""}
        text = f"{_ordinal(k + 1)} stage of a rank"
        if len(rules) == 1:
            text += f" (rank r: stage {rules.pop()})"
        out.append((k, text))
    return out


def _legend_handles(kinds: set[str], shades: list[tuple[int, str]]) -> list[Any]:
    from matplotlib.patches import Patch

    compute = [k for k in _LEGEND if k in kinds]
    handles: list[Any] = []
    for kind in compute:  # each kind in every shade drawn
        tones = [_shade(KIND_COLOURS[kind], k) for k, _ in shades] or [KIND_COLOURS[kind]]
        handles.append((tuple(Patch(facecolor=c, edgecolor="white") for c in tones), _LEGEND[kind]))
    for k, text in shades:  # each shade in every kind drawn
        tones = [_shade(KIND_COLOURS[kind], k) for kind in compute] or [_shade(KIND_COLOURS["F"], k)]
        handles.append((tuple(Patch(facecolor=c, edgecolor="white") for c in tones), text))
    if "comm" in kinds:
        handles.append(((Patch(facecolor=KIND_COLOURS["SEND_F"], alpha=0.6),), "SEND / RECV in flight"))
    if "other" in kinds:
        handles.append(((Patch(facecolor="#7F7F7F"),), "UNSHARD / RESHARD / REDUCE_GRAD"))
    handles.append(((Patch(facecolor="white", edgecolor="#BBBBBB"),), "idle (bubble)"))
    return handles


def picture_target(path: str | os.PathLike[str], format: str | None = None) -> tuple[str, str]:
    """(file to write, format) for a picture, checked before anything is drawn.

    ``format`` (png, svg, pdf, ...) wins when given and the file is written at ``path`` as it is;
    otherwise the extension decides, and a name without one gets ".png" (matplotlib's own rule,
    made visible so callers can say which file they wrote). A format matplotlib cannot write is a
    ScheduleError naming the file, not a traceback from inside matplotlib; matplotlib missing is a
    ModuleNotFoundError that says which extra installs it.
    """
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] != "matplotlib":
            raise
        raise ModuleNotFoundError(
            "timeline pictures need matplotlib, which is not installed: pip install 'pipetrain[plot]'",
            name="matplotlib",
        ) from None

    name = os.fspath(path)
    ext = os.path.splitext(name)[1][1:].lower()
    fmt = (format or ext or "png").lower()
    known = FigureCanvasBase.get_supported_filetypes()
    if fmt not in known:
        raise ScheduleError(
            f"cannot write {name}: {fmt!r} is not a picture format matplotlib writes (use png, svg or pdf)"
        )
    if not format and not ext:
        name += ".png"
    return name, fmt


def render_timelines(
    timelines: Sequence[Timeline],
    path: str | os.PathLike[str],
    *,
    width: float | None = None,
    dpi: int = 150,
    share_time_axis: bool = True,
    format: str | None = None,
) -> str:
    """Draw several timelines stacked (e.g. measured over simulated, or every schedule).

    With ``share_time_axis`` all use one time scale, so lengths compare at a glance. The format
    (PNG, SVG, PDF) is ``format``, else the file extension (see :func:`picture_target`).
    Returns the path written.
    """
    if not timelines:
        raise ValueError("render_timelines needs at least one timeline")
    target, fmt = picture_target(path, format)

    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.legend_handler import HandlerTuple

    spans = [max(t.makespan, 1e-12) for t in timelines]
    fig_w = width if width is not None else _default_width(timelines, spans, share_time_axis)
    heights = [0.42 * t.num_ranks + 0.9 for t in timelines]
    shades = shade_legend(timelines)
    handles = _legend_handles(set().union(*(_kinds(t) for t in timelines)), shades)
    widest = max(len(h[0]) for h in handles)
    entry_in = max(2.1, 0.09 * max(len(h[1]) for h in handles) + 0.2 * widest)
    ncol = min(len(handles), max(2, int(fig_w / entry_in)))
    legend_rows = math.ceil(len(handles) / ncol)
    bottom = 0.55 + 0.22 * legend_rows
    fig_h = sum(heights) + 0.45 + bottom
    fig, axes = plt.subplots(
        len(timelines), 1, figsize=(fig_w, fig_h), squeeze=False, gridspec_kw={"height_ratios": heights}
    )
    fig.subplots_adjust(
        left=_LEFT, right=_RIGHT, top=1 - 0.45 / fig_h, bottom=bottom / fig_h, hspace=0.9 / max(heights)
    )
    longest = max(spans)
    for ax, t, span in zip(axes[:, 0], timelines, spans, strict=True):
        fontsize = 8.0 if t.num_ranks <= 16 else 6.5
        _draw(ax, t, x_max=longest if share_time_axis else span, fontsize=fontsize)
    fig.legend(
        handles=[h[0] for h in handles],
        labels=[h[1] for h in handles],
        handler_map={tuple: HandlerTuple(ndivide=None, pad=0)},
        handlelength=max(2.0, 0.9 * widest),
        loc="lower center",
        ncol=ncol,
        frameon=False,
        fontsize=8.5,
    )
    try:
        fig.savefig(target, dpi=dpi, format=fmt)
    finally:
        plt.close(fig)
    return target


def render_timeline(
    timeline: Timeline,
    path: str | os.PathLike[str],
    *,
    width: float | None = None,
    dpi: int = 150,
    format: str | None = None,
) -> str:
    """Draw one timeline to ``path`` (PNG, SVG or PDF: ``format``, else by extension); returns the path written."""
    return render_timelines([timeline], path, width=width, dpi=dpi, format=format)


def format_time_grid(timeline: Timeline, *, tick: float | None = None, max_columns: int = 400) -> str:
    """A text grid aligned to time: one row per rank, one column per ``tick`` of time.

    An action fills the columns it runs in: its label in the first, ``-`` after; ``.`` is
    idle. ``tick`` defaults to the shortest compute action (so F=1, B=2 gives one column per
    unit). SEND/RECV are not drawn (they run in the background).
    """
    compute = [e for e in timeline.events if e.kind in _COMPUTE or (e.kind not in _COMM and e.end > e.start)]
    if not compute:
        return "(empty timeline)"
    t0 = timeline.start
    if tick is None:
        positive = [e.end - e.start for e in compute if e.end > e.start]
        tick = min(positive) if positive else 1.0
    span = max(e.end for e in compute) - t0
    columns = math.ceil(span / tick - 1e-9)
    if columns > max_columns:
        tick = span / max_columns
        columns = max_columns
    labels = [e.action for e in compute]
    width = max(len(s) for s in labels) + 1
    grid = [["." * (width - 1) + " " for _ in range(columns)] for _ in range(timeline.num_ranks)]
    for e in compute:
        first = round((e.start - t0) / tick)
        last = max(first + 1, round((e.end - t0) / tick))
        row = grid[e.rank]
        for c in range(first, min(last, columns)):
            row[c] = (e.action if c == first else "-" * (width - 1)).ljust(width - 1) + " "
    unit = timeline.unit or "units"
    header = ""
    for c in range(columns):  # a time label where it fits, blank where the last one still runs
        if len(header) <= c * width:
            header = header.ljust(c * width) + f"{c * tick:.4g} "
    name_w = len(f"rank {timeline.num_ranks - 1}") + 2
    lines = [f"{'t/' + unit:<{name_w}}" + header.rstrip()]
    for rank in range(timeline.num_ranks):
        lines.append(f"{'rank ' + str(rank):<{name_w}}" + "".join(grid[rank]).rstrip())
    return "\n".join(lines)
