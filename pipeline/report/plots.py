"""Plots for the reports, rendered off-screen (Agg) to base64 PNG so that the
HTML embeds them and opens offline."""
from __future__ import annotations

import base64
import functools
import hashlib
import io
import pickle
from collections.abc import Sequence

from matplotlib import colormaps
from matplotlib.figure import Figure  # a bare Figure renders with Agg and keeps no pyplot state
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from pipeline.report.analysis import STALL_THRESHOLD_PCT, ModelRow, StageRow
from pipeline.scheduler.cluster import Cluster, Slot
from pipeline.scheduler.gantt import Bar, utilisation

PACE_COLOUR, OTHER_COLOUR, WALL_COLOUR = "#c0392b", "#2e86c1", "#aed6f1"


def _drawn_once(chart):
    """A chart of the run's pipeline, drawn once for the reports that repeat it: a shared sweep run's
    jobs' (pipeline/sharing.py). 0.2 s a chart; 5 of a report's 7 charts are such."""
    drawn: dict[str, str] = {}

    @functools.wraps(chart)
    def draw(*args) -> str:
        key = hashlib.sha1(pickle.dumps(args)).hexdigest()
        if key not in drawn:
            drawn.clear()  # the last input's only: a process writes its reports one after another
            drawn[key] = chart(*args)
        return drawn[key]
    return draw


def to_base64_png(fig: Figure) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=96, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


@_drawn_once
def stage_chart(stages: list[StageRow]) -> str:
    names = [s.name for s in stages][::-1]  # barh draws bottom-up: keep the pipeline's order top-down
    fig = Figure(figsize=(10, 0.45 * len(names) + 1.6))
    seconds, rates = fig.subplots(1, 2)
    seconds.barh(names, [s.wall_s for s in stages][::-1], color=WALL_COLOUR, label="wall s")
    seconds.barh(names, [s.cpu_s for s in stages][::-1], color=OTHER_COLOUR, height=0.5, label="CPU s")
    seconds.set_title("batch-task time per stage (all epochs)")
    seconds.set_xlabel("seconds")
    seconds.legend(loc="lower right")
    rates.barh(names, [s.items_per_s_per_core or 0 for s in stages][::-1], color=OTHER_COLOUR)
    rates.set_title("items/s per core (items / CPU s)")
    rates.set_xlabel("items/s")
    rates.set_yticklabels([])
    return to_base64_png(fig)


@_drawn_once
def epoch_cpu_chart(by_epoch: list[float], by_flotilla: dict[str, list[float]],
                    cache_hits: list[float] | None) -> str:
    """Preprocessing CPU seconds per epoch: the run's, and each flotilla's when there are several; and
    the share of images the cache held, when the pipeline has one."""
    fig = Figure(figsize=(10, 3.2))
    ax = fig.subplots()
    epochs = range(1, len(by_epoch) + 1)
    ax.bar(epochs, by_epoch, color=OTHER_COLOUR, label="run")
    if len(by_flotilla) > 1:
        for flotilla, seconds in by_flotilla.items():
            ax.plot(range(1, len(seconds) + 1), seconds, marker="o", label=f"flotilla {flotilla}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("epoch (of each flotilla's sequence)")
    ax.set_ylabel("CPU s")
    ax.set_title("preprocessing CPU per epoch (batch tasks and hubs, training and validation)")
    ax.legend(loc="upper left")
    if cache_hits:
        hits = ax.twinx()
        hits.plot(range(1, len(cache_hits) + 1), [100 * h for h in cache_hits], color=PACE_COLOUR, marker="s",
                  label="cache hits")
        hits.set_ylim(0, 105)
        hits.set_ylabel("cache hits %")
        hits.legend(loc="upper right")
    return to_base64_png(fig)


def stall_chart(models: list[ModelRow]) -> str:
    fig = Figure(figsize=(10, 0.45 * len(models) + 1.6))
    ax = fig.subplots()
    names = [m.name for m in models][::-1]
    ax.barh(names, [m.data_stall_pct or 0 for m in models][::-1],
            color=[PACE_COLOUR if m.sets_pace else OTHER_COLOUR for m in models][::-1])
    ax.axvline(STALL_THRESHOLD_PCT, color="grey", linestyle="--", label=f"{STALL_THRESHOLD_PCT:.0f}% threshold")
    ax.set_xlim(0, 100)
    ax.set_xlabel("data stall % (waiting for the next batch / (wait + step))")
    ax.set_title("data stall per trainer (red: sets its flotilla's pace)")
    ax.legend(loc="lower right")
    return to_base64_png(fig)


def accuracy_chart(models: list[ModelRow], ensemble: list[float]) -> str:
    fig = Figure(figsize=(10, 4))
    ax = fig.subplots()
    for m in models:
        ax.plot(range(1, len(m.val_accuracy) + 1), [100 * a for a in m.val_accuracy], marker="o", label=m.name)
    ax.plot(range(1, len(ensemble) + 1), [100 * a for a in ensemble], marker="s", color="black", linewidth=2.5,
            label="ensemble")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("epoch")
    ax.set_ylabel("validation accuracy %")
    ax.set_ylim(0, 100)
    ax.set_title("accuracy per epoch")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small")
    return to_base64_png(fig)


@_drawn_once
def occupancy_chart(occupancy: dict[str, dict]) -> str:
    fig = Figure(figsize=(10, 3.5))
    ax = fig.subplots()
    for name, queue in occupancy.items():
        ax.step(queue["t_s"], [100 * f / queue["capacity"] for f in queue["filled"]], where="post", label=name)
    ax.set_ylim(0, 105)
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("% full")
    ax.set_title("queue occupancy over time")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small")
    return to_base64_png(fig)


@_drawn_once
def gantt_chart(scheduler: dict) -> str:
    """The run's slots over time (results.json `scheduler`): each model's stints, coloured by flotilla."""
    cluster = Cluster(scheduler["cluster"]["nodes"], scheduler["cluster"]["slots_per_node"])
    bars = [Bar.from_json(saved) for saved in scheduler["gantt"]]
    end = max(bar.end for bar in bars)
    busy = utilisation(bars, cluster.total_slots, end)
    return to_base64_png(gantt_figure(bars, cluster.slots, f"slots over time: {end:.0f} s, utilisation {busy:.0%}"))


@_drawn_once
def timeline_chart(events: list[dict]) -> str:
    lanes = sorted({e["lane"] for e in events})
    colours = {"task": OTHER_COLOUR, "step": "#27ae60", "wait": PACE_COLOUR}
    fig = Figure(figsize=(12, 0.35 * len(lanes) + 1.6))
    ax = fig.subplots()
    for row, lane in enumerate(lanes):
        for what, colour in colours.items():
            spans = [(e["start_s"], e["end_s"] - e["start_s"]) for e in events
                     if e["lane"] == lane and e["what"] == what]
            ax.broken_barh(spans, (row - 0.4, 0.8), color=colour)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlabel("seconds since the run started")
    ax.set_title("timeline: batch tasks per worker, steps and waits per trainer")
    ax.legend(handles=[Patch(color=colour, label=what) for what, colour in colours.items()], loc="upper right",
              fontsize="small")
    return to_base64_png(fig)


def sweep_bar(labels: list[str], values: list[float | None], title: str, unit: str) -> str:
    fig = Figure(figsize=(4.2, 0.4 * len(labels) + 1.6))
    ax = fig.subplots()
    # rows by position, labelled: job numbers as categories would make matplotlib log that they look numeric
    ax.barh(range(len(labels)), [v or 0 for v in values][::-1], color=OTHER_COLOUR)
    ax.set_yticks(range(len(labels)), labels[::-1])
    for row, value in enumerate(values[::-1]):
        ax.annotate("n/a" if value is None else f"{value:,.3g}", (0, row), xytext=(3, 0),
                    textcoords="offset points", va="center", fontsize="small")
    ax.set_title(title)
    ax.set_xlabel(unit)
    return to_base64_png(fig)


SPLIT_PARTS = (("compute", "#27ae60"), ("transport", "#8e44ad"), ("preprocessing", "#f39c12"), ("fetch", PACE_COLOUR))


def stall_split_chart(splits: dict[str, dict]) -> str:
    """Per model, its time per image from files as stacked parts: compute, then the stall's
    transport, preprocessing and fetch (a part measured below zero by noise is drawn as zero)."""
    names = list(splits)[::-1]
    fig = Figure(figsize=(10, 0.45 * len(names) + 1.8))
    ax = fig.subplots()
    left = [0.0] * len(names)
    for part, colour in SPLIT_PARTS:
        widths = [max(_part_ms(splits[name], part), 0.0) for name in names]
        ax.barh(names, widths, left=left, color=colour, label=part)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel("ms per image (differential passes)")
    ax.set_title("where a trainer's time per image goes, reading from files")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small")
    return to_base64_png(fig)


def _part_ms(split: dict, part: str) -> float:
    if part == "compute":
        return 1000 / split["compute_images_per_s"] if split.get("compute_images_per_s") else 0.0
    return split[f"{part}_ms"] or 0.0


def gantt_figure(bars: list[Bar], slots: Sequence[Slot], title: str, hours: bool = False):
    """One row per slot, one bar per model on it, coloured by flotilla (a matplotlib Figure)."""
    rows = {slot: i for i, slot in enumerate(slots)}
    unit = 3600.0 if hours else 1.0
    fig = Figure(figsize=(8, min(2 + 0.12 * len(rows), 12)), dpi=80)
    ax = fig.subplots()
    colours = colormaps["tab20"].colors
    for bar in bars:
        ax.barh(rows[bar.slot], (bar.end - bar.start) / unit, left=bar.start / unit, height=0.85,
                color=colours[bar.flotilla % len(colours)], edgecolor="black", linewidth=0.2)
        if len(rows) <= 16:
            ax.text((bar.start + bar.end) / 2 / unit, rows[bar.slot], bar.group, ha="center", va="center",
                    fontsize=6)
    if len(rows) <= 32:
        ax.set_yticks(range(len(rows)), [str(s) for s in rows], fontsize=6)
    else:
        ax.set_yticks([])
    ax.invert_yaxis()
    ax.set_xlabel("hours" if hours else "seconds since the run started")
    ax.set_ylabel("slot")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig
