"""Counterexample reports: a readable step table and a timeline picture.

With async scheduling or speculative decoding the step table marks each
entry's in-flight placeholders (``~p``) and its drafts with how many were
accepted (``dk:a``), and says which plans were in flight; the picture adds a
band of bars, one per plan from its schedule to its update (they overlap
when a plan is in flight while the next is made), and writes ``a/k`` in the
cells of steps that verified drafts.

The admission gates show too: a request waiting for its structured-output
grammar has a state (and colour) of its own, the steps scheduled while the
scheduler was paused are hatched and marked ``[paused new]`` / ``[paused all]``
in the table, an entry that runs encoder inputs says ``e[0,2]`` and one whose
grammar refused drafts ``!n``, and a plan that freed encoder-cache entries
lists them.

The KV connector and hybrid groups show as well: a request waiting for its
asynchronous load (WAITING_FOR_REMOTE_KVS) and a finished request still
holding its blocks (an asynchronous save, or an abort during a load) have
states (and colours) of their own; the table lists each plan's loads
(``[load r1 0-8 async]``), the worker's reports in its result (``[recv r1]``,
``[sent r3]``, ``[failed r2]``, ``[invalid 7]``) and the blocks held by
finished requests after it (``[held r3:2]``).

The picture is drawn with matplotlib (the ``plots`` extra), imported only when
a picture is drawn, on the Agg backend (no display): a row per request, a
column per step, each cell coloured by what the request was doing in that
step, KV-pool usage as a line below, and the failing step marked. Without
matplotlib, :func:`timeline_png` raises :class:`PlotUnavailable` and the
caller writes everything else.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from schedspec.spec.interface import PauseState, RequestStatus, ScheduledRequest, ScheduleKind, SchedSpecError
from schedspec.check.records import Failure, StepRecord

if TYPE_CHECKING:  # pragma: no cover - types only; matplotlib is imported when drawing
    from matplotlib.figure import Figure

#: What a request can be doing in one step, in the order of the picture's colour scale.
STATES: tuple[str, ...] = ("absent", "waiting", "prefill", "decode", "preempted", "finished", "grammar",
                           "remote_kv", "held")

#: state -> colour (hex). "absent" is the background: not yet added.
COLORS: dict[str, str] = {
    "absent": "#ffffff",
    "waiting": "#cfcfcf",
    "prefill": "#4285f4",
    "decode": "#34a853",
    "preempted": "#ea4335",
    "finished": "#3c3c3c",
    "usage": "#e09e00",
    "failure": "#d93025",
    "grammar": "#c27ba0",
    "paused": "#7f6000",
    "remote_kv": "#46bdc6",
    "held": "#8e7cc3",
}
#: the two lanes of the in-flight band (even and odd steps)
FLIGHT_COLORS: tuple[str, str] = ("#9fc5f8", "#b6d7a8")

#: The legend's words for each state.
STATE_LABELS: dict[str, str] = {
    "waiting": "waiting",
    "prefill": "prefill (chunk)",
    "decode": "decode",
    "preempted": "preempted",
    "finished": "finished",
    "grammar": "waiting for its grammar",
    "remote_kv": "waiting for remote KV (async load)",
    "held": "finished, blocks held (save or load pending)",
}

PLOTS_HINT = "matplotlib is not installed (pip install 'schedspec[plots]')"


class PlotUnavailable(SchedSpecError, ImportError):
    """A picture was asked for but matplotlib cannot be imported."""


def require_matplotlib() -> None:
    """Import matplotlib on the Agg backend, or raise :class:`PlotUnavailable`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
    except ImportError as exc:
        raise PlotUnavailable(f"{PLOTS_HINT}: {exc}") from None


def new_figure(width: float, height: float) -> Figure:
    """A matplotlib Figure bound to an Agg canvas (no pyplot, no display)."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _entry_text(rec: StepRecord, s: ScheduledRequest) -> str:
    """``r1:run 9+3``, then ``chunk`` for a partial prefill, ``~2`` for two
    in-flight placeholders, ``d3:1`` for three drafts of which one was
    accepted (``d3`` when the output is unknown)."""
    kind = {ScheduleKind.NEW: "new", ScheduleKind.RESUMED: "res", ScheduleKind.RUNNING: "run"}[s.kind]
    tag = "" if s.samples else " chunk"
    if s.num_output_placeholders:
        tag += f" ~{s.num_output_placeholders}"
    if s.spec_token_ids:
        sampled = rec.result.sampled.get(s.request_id) if rec.result is not None else None
        tag += f" d{len(s.spec_token_ids)}" + (f":{len(sampled) - 1}" if sampled else "")
    if s.encoder_inputs:
        tag += f" e[{','.join(map(str, s.encoder_inputs))}]"
    if s.num_invalid_spec_tokens:
        tag += f" !{s.num_invalid_spec_tokens}"
    return f"{s.request_id}:{kind} {s.num_computed_tokens}+{s.num_scheduled_tokens}{tag}"


def step_table(records: list[StepRecord], failure: Failure | None = None) -> str:
    """One line per plan. With async scheduling a plan's line also says which
    plans were in flight once it was scheduled and which one its engine step
    updated; ``~p`` marks p in-flight placeholders and ``dk:a`` k drafts with a
    accepted."""
    lines = [
        f"{'step':>4}  {'free':>4}  scheduled (request:kind computed+n)          preempted  finished",
        "-" * 88,
    ]
    for rec in records:
        sched = ", ".join(_entry_text(rec, s) for s in rec.plan.scheduled) or "-"
        flight = ""
        if len(rec.in_flight) > 1 or (rec.updated is not None and rec.updated != rec.step):
            flight = f"  [in flight {','.join(map(str, rec.in_flight))}"
            flight += f"; updated {rec.updated}]" if rec.updated is not None else "]"
        gates = ""
        if rec.view_after.pause_state != PauseState.UNPAUSED:
            gates += f"  [paused {'all' if rec.view_after.pause_state == PauseState.PAUSED_ALL else 'new'}]"
        if rec.plan.freed_encoder_inputs:
            gates += f"  [encoder freed {','.join(rec.plan.freed_encoder_inputs)}]"
        gates += kv_text(rec)
        lines.append(
            f"{rec.step:>4}  {rec.view_after.kv.num_free_blocks:>4}  {sched:<42} "
            f"{','.join(rec.plan.preempted_ids) or '-':<10} {','.join(rec.plan.finished_ids) or '-'}{flight}{gates}"
        )
    if failure is not None:
        lines.append("-" * 88)
        lines.append(failure.describe())
    return "\n".join(lines) + "\n"


def kv_text(rec: StepRecord) -> str:
    """The KV connector's part of a step's line: the plan's loads, the
    worker's reports in its result, the blocks held by finished requests
    after it ("" without any)."""
    out = ""
    if rec.plan.kv_loads:
        out += "  [load " + ", ".join(f"{ld.request_id} {ld.start}-{ld.end}" + (" async" if ld.asynchronous else "")
                                     for ld in rec.plan.kv_loads) + "]"
    r = rec.result
    if r is not None:
        for label, ids in (("recv", r.finished_recving), ("sent", r.finished_sending), ("failed", r.failed_recving)):
            if ids:
                out += f"  [{label} {','.join(ids)}]"
        if r.invalid_block_ids:
            out += f"  [invalid {','.join(map(str, r.invalid_block_ids))}]"
    held = rec.view_after.kv_held_by_finished
    if held:
        out += "  [held " + ", ".join(f"{rid}:{len(blocks)}" for rid, blocks in sorted(held.items())) + "]"
    return out


def cell_states(records: list[StepRecord]) -> tuple[list[str], list[list[str]], list[float]]:
    """The picture's data: request ids in order of appearance, one column of
    states per step (a state per request, from :data:`STATES`), and the
    fraction of usable KV blocks in use after each step."""
    order: list[str] = []
    for rec in records:
        for rid in (list(rec.view_after.requests) + list(rec.view_after.finished) + list(rec.plan.scheduled_ids)
                    + list(rec.view_after.kv_held_by_finished)):
            if rid not in order:
                order.append(rid)
    grid: list[list[str]] = []
    usage: list[float] = []
    seen: set[str] = set()
    for rec in records:
        col: list[str] = []
        planned = {s.request_id: s for s in rec.plan.scheduled}
        for rid in order:
            if rid in planned:
                entry = planned[rid]
                decode = not entry.is_prefill_chunk and entry.num_scheduled_tokens <= 1 + len(entry.spec_token_ids)
                col.append("decode" if decode else "prefill")
            elif rid in rec.plan.preempted_ids:
                col.append("preempted")
            elif rid in rec.view_after.requests:
                st = rec.view_after.requests[rid].status
                col.append("preempted" if st == RequestStatus.PREEMPTED else "waiting" if st == RequestStatus.WAITING
                           else "grammar" if st == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
                           else "remote_kv" if st == RequestStatus.WAITING_FOR_REMOTE_KVS else "decode")
            elif rid in rec.view_after.kv_held_by_finished:
                col.append("held")  # finished, its blocks held for a save or a load in flight
            elif rid in rec.view_after.finished or rid in seen:
                col.append("finished")  # finished or aborted: gone from the scheduler
            else:
                col.append("absent")
        # a request that finished in this step's update shows its last state
        # here and "finished" from the next step on
        seen.update(planned, rec.view_after.requests, rec.view_after.finished)
        grid.append(col)
        kv = rec.view_after.kv
        usable = max(kv.num_blocks - 1, 1)
        usage.append(1.0 - kv.num_free_blocks / usable)
    return order, grid, usage


def in_flight_spans(records: list[StepRecord]) -> list[tuple[int, int, int]]:
    """(step, first column, last column) of every plan: from the record where
    it was scheduled to the record whose engine step updated it (the last
    column when it is still in flight). In sync mode each span is one column;
    with async scheduling consecutive spans overlap."""
    spans: list[tuple[int, int, int]] = []
    for i, rec in enumerate(records):
        end = next((j for j in range(i, len(records)) if records[j].updated == rec.step), len(records) - 1)
        spans.append((rec.step, i, end))
    return spans


def paused_columns(records: list[StepRecord]) -> list[int]:
    """The columns of the steps scheduled while the scheduler was paused."""
    return [i for i, rec in enumerate(records) if rec.view_after.pause_state != PauseState.UNPAUSED]


def draft_counts(records: list[StepRecord]) -> dict[tuple[int, str], tuple[int, int]]:
    """(column, request id) -> (drafts verified, drafts accepted) of every
    entry with drafts whose output is known."""
    out: dict[tuple[int, str], tuple[int, int]] = {}
    for i, rec in enumerate(records):
        for s in rec.plan.scheduled:
            if s.spec_token_ids and rec.result is not None and s.request_id in rec.result.sampled:
                out[(i, s.request_id)] = (len(s.spec_token_ids), len(rec.result.sampled[s.request_id]) - 1)
    return out


def _title(failure: Failure | None, failed_step: int | None) -> str:
    if failure is None:
        return "schedspec timeline" + (f" (failing step {failed_step})" if failed_step is not None else "")
    what = failure.kind
    if failure.violations:
        what += " of " + ", ".join(sorted({v.invariant_id for v in failure.violations}))
    message = " ".join((failure.violations[0].message if failure.violations else failure.message).split())
    if len(message) > 110:
        message = message[:107] + "..."
    return f"{failure.scheduler}: {what} at step {failure.step}\n{message}"


def timeline_figure(
    records: list[StepRecord], *, failure: Failure | None = None, failed_step: int | None = None
) -> Figure:
    """The counterexample timeline as a matplotlib Figure (not yet saved).

    Top: a row per request (in order of appearance), a column per step, the
    cell's colour what the request did in that step; a cell whose step
    verified drafts says ``accepted/drafts``. With async scheduling a middle
    band shows each plan as a bar from its schedule to its update, so plans in
    flight together overlap. Bottom, on the same step axis: the KV pool's usage
    after each step. The failing step (``failed_step``, else ``failure.step``)
    is a red band across all of them.
    """
    require_matplotlib()
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter, MaxNLocator, PercentFormatter

    if failed_step is None and failure is not None:
        failed_step = failure.step
    order, grid, usage = cell_states(records)
    n_steps, n_rows = max(len(records), 1), max(len(order), 1)
    width = min(max(7.5, 3.2 + 0.3 * n_steps), 20.0)
    height = min(max(2.0, 0.26 * n_rows + 1.0), 10.0) + 1.9
    spans = in_flight_spans(records)
    overlapping = any(last > first for _, first, last in spans)
    if overlapping:
        height += 0.9
    fig = new_figure(width, height)
    grid_h = height - 1.9 - (0.9 if overlapping else 0.0)
    flight_ax = None
    if overlapping:
        ax, flight_ax, kv_ax = fig.subplots(3, 1, sharex=True, height_ratios=[grid_h, 0.8, 1.3])
    else:
        ax, kv_ax = fig.subplots(2, 1, sharex=True, height_ratios=[grid_h, 1.3])

    index = {s: i for i, s in enumerate(STATES)}
    values = [[index[grid[x][y]] for x in range(len(grid))] for y in range(len(order))] or [[0]]
    cmap = ListedColormap([COLORS[s] for s in STATES])
    norm = BoundaryNorm([i - 0.5 for i in range(len(STATES) + 1)], cmap.N)
    ax.pcolormesh(
        [x - 0.5 for x in range(len(values[0]) + 1)],
        [y - 0.5 for y in range(len(values) + 1)],
        values, cmap=cmap, norm=norm, edgecolors="#f0f0f0", linewidth=0.6,
    )
    ax.set_ylim(len(values) - 0.5, -0.5)  # first request on top
    ax.set_yticks(range(len(order)), order, fontsize=8 if n_rows <= 20 else 6)
    ax.set_ylabel("request")
    ax.tick_params(labelbottom=False)
    rows = {rid: y for y, rid in enumerate(order)}
    for (col, rid), (drafts, accepted) in draft_counts(records).items():
        ax.text(col, rows[rid], f"{accepted}/{drafts}", ha="center", va="center", fontsize=6, color="#ffffff")
    if flight_ax is not None:
        for step, first, last in spans:
            lane = step % 2
            flight_ax.barh(lane, last - first + 0.8, left=first - 0.4, height=0.7,
                           color=FLIGHT_COLORS[lane], edgecolor="#666666", linewidth=0.5)
            flight_ax.text(first - 0.3, lane, str(step), va="center", ha="left", fontsize=6)
        flight_ax.set_ylim(1.6, -0.6)
        flight_ax.set_yticks([])
        flight_ax.set_ylabel("plans in\nflight", fontsize=8)
        flight_ax.tick_params(labelbottom=False)

    steps = [rec.step for rec in records]

    def step_label(x: float, _pos: int) -> str:
        i = int(round(x))
        return str(steps[i]) if 0 <= i < len(steps) and abs(x - i) < 1e-6 else ""

    kv_ax.xaxis.set_major_locator(MaxNLocator(nbins=min(n_steps, 20), integer=True))
    kv_ax.xaxis.set_major_formatter(FuncFormatter(step_label))
    xs = list(range(len(usage)))
    kv_ax.plot(xs, [100.0 * u for u in usage], color=COLORS["usage"], marker="o", markersize=3, linewidth=1.6)
    kv_ax.fill_between(xs, [100.0 * u for u in usage], color=COLORS["usage"], alpha=0.2, linewidth=0)
    kv_ax.set_ylim(0, 105)
    kv_ax.yaxis.set_major_formatter(PercentFormatter())
    kv_ax.set_yticks([0, 50, 100])
    kv_ax.set_ylabel("KV pool\nused")
    kv_ax.set_xlabel("step")
    kv_ax.grid(axis="y", color="#e6e6e6", linewidth=0.6)
    kv_ax.set_xlim(-0.5, n_steps - 0.5)

    handles: list[Patch | Line2D] = [
        Patch(facecolor=COLORS[s], edgecolor="#999999", label=STATE_LABELS[s]) for s in STATE_LABELS
    ]
    handles.append(Patch(facecolor=COLORS["absent"], edgecolor="#999999", label="not added yet"))
    handles.append(Line2D([], [], color=COLORS["usage"], marker="o", markersize=3, label="KV-pool usage"))
    paused = paused_columns(records)
    for col in paused:  # hatched across the grid and the pool, over the cells
        for a in (ax, kv_ax):
            a.axvspan(col - 0.5, col + 0.5, facecolor="none", edgecolor=COLORS["paused"], hatch="///",
                      linewidth=0, zorder=4)
    if paused:
        handles.append(Patch(facecolor="none", edgecolor=COLORS["paused"], hatch="///", label="scheduler paused"))
    if flight_ax is not None:
        handles.append(Patch(facecolor=FLIGHT_COLORS[0], edgecolor="#666666", label="plan: schedule to update"))
    if failed_step is not None and failed_step in steps:
        col = steps.index(failed_step)
        for a in (ax, kv_ax) if flight_ax is None else (ax, flight_ax, kv_ax):
            a.axvspan(col - 0.5, col + 0.5, facecolor="none", edgecolor=COLORS["failure"], linewidth=2.0, zorder=5)
        ax.annotate(
            f"fails at step {failed_step}", xy=(col, -0.5), xytext=(0, 4), textcoords="offset points",
            ha="center", va="bottom", color=COLORS["failure"], fontsize=8, fontweight="bold", annotation_clip=False,
        )
        handles.append(Patch(facecolor="none", edgecolor=COLORS["failure"], linewidth=2.0, label=f"failing step ({failed_step})"))
    fig.legend(handles=handles, loc="outside right upper", fontsize=8, frameon=False)
    fig.suptitle(_title(failure, failed_step), fontsize=10, x=0.01, ha="left")
    fit_title(fig)
    return fig


def fit_title(fig: Figure, tries: int = 8) -> None:
    """Wrap the figure's title (its suptitle, left-aligned) until it ends
    left of the legend in the upper right and inside the figure: the title,
    the legend and the axes never overlap, whatever the title's length.
    Words are not broken; a word wider than the room makes the type smaller."""
    import textwrap

    title = getattr(fig, "_suptitle", None)  # matplotlib keeps the suptitle there
    if title is None:
        return
    original = title.get_text().split("\n")
    width: int | None = None
    for _ in range(tries):
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined,unused-ignore]
        box = title.get_window_extent(renderer)
        right = fig.bbox.x1 - 4
        for legend in fig.legends:
            lb = legend.get_window_extent(renderer)
            if lb.y1 > box.y0 and lb.y0 < box.y1:  # beside the title: end before it
                right = min(right, lb.x0 - 6)
        if box.x1 <= right or box.width <= 0:
            return
        longest = max(len(line) for line in title.get_text().split("\n"))
        fit = int(longest * (right - box.x0) / box.width) - 1
        width = max(min(fit, width - 3) if width is not None else fit, 12)
        lines = [w for line in original
                 for w in (textwrap.wrap(line, width, break_long_words=False, break_on_hyphens=False) or [""])]
        if max(len(line) for line in lines) > width:
            title.set_fontsize(title.get_fontsize() * 0.85)
        title.set_text("\n".join(lines))


def timeline_png(
    records: list[StepRecord],
    path: str | Path,
    *,
    failure: Failure | None = None,
    failed_step: int | None = None,
) -> Path:
    """Write the timeline picture (see :func:`timeline_figure`) as a PNG.

    Raises :class:`PlotUnavailable` (and writes nothing) without matplotlib."""
    fig = timeline_figure(records, failure=failure, failed_step=failed_step)
    out = Path(path)
    fig.savefig(out, format="png", dpi=110)
    return out


def legend() -> str:
    return ("timeline.png: a row per request (in order of appearance), a column per step; "
            "grey waiting, pink waiting for its grammar, blue prefill chunk, green decode (a/k: a of k drafts "
            "accepted), red preempted, black finished, teal waiting for remote KV (an async load), purple finished "
            "with its blocks held (a save or a load pending); with async scheduling a band of bars from each plan's "
            "schedule to its update; the orange line below is KV-pool usage; hatched columns are steps scheduled while the "
            "scheduler was paused; a red frame marks the failing step.")
