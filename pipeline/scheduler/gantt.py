"""Who held which slot when: the bars of a schedule, read from its decisions as
they come, the same way in the simulator and in real runs, and their chart."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.scheduler.cluster import Slot
from pipeline.scheduler.events import AssignSlots, Decision, Join, Start, Stop


@dataclass(frozen=True)
class Bar:
    """`model` of `flotilla` held `slot` from `start` to `end` (seconds)."""

    slot: Slot
    model: str
    flotilla: int
    start: float
    end: float

    def to_json(self) -> dict:
        return {"slot": [self.slot.node, self.slot.index], "model": self.model, "flotilla": self.flotilla,
                "start": self.start, "end": self.end}

    @classmethod
    def from_json(cls, saved: dict) -> Bar:
        return cls(Slot(*saved["slot"]), saved["model"], saved["flotilla"], saved["start"], saved["end"])


class Gantt:
    """A model's bars open when it starts (or joins) on the slots assigned to it, and close when it is
    stopped."""

    def __init__(self, bars: list[Bar] | None = None):
        self.bars: list[Bar] = list(bars or [])  # closed
        self.assigned: dict[str, tuple[Slot, ...]] = {}
        self.running: dict[str, tuple[int, float]] = {}  # model -> (flotilla, since)

    def saw(self, decision: Decision, now: float) -> None:
        if isinstance(decision, AssignSlots):
            self.assigned[decision.model] = decision.slots
        elif isinstance(decision, (Start, Join)):
            self.running[decision.model] = (decision.flotilla, now)
        elif isinstance(decision, Stop) and decision.model in self.running:
            self.bars += self._bars(decision.model, now)
            del self.running[decision.model]

    def until(self, now: float) -> list[Bar]:
        """The bars so far, those of models still running ending `now`."""
        return self.bars + [bar for model in self.running for bar in self._bars(model, now)]

    def close(self, now: float) -> None:
        """The schedule ends `now`, with the models still running (a run stopped before its end)."""
        self.bars, self.running = self.until(now), {}

    def _bars(self, model: str, now: float) -> list[Bar]:
        flotilla, since = self.running[model]
        return [Bar(slot, model, flotilla, since, now) for slot in self.assigned[model]]


def gantt_figure(bars: list[Bar], slots: Sequence[Slot], title: str, hours: bool = False):
    """One row per slot, one bar per model on it, coloured by flotilla (a matplotlib Figure)."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure  # a bare Figure renders with Agg and keeps no pyplot state

    rows = {slot: i for i, slot in enumerate(slots)}
    unit = 3600.0 if hours else 1.0
    fig = Figure(figsize=(8, min(2 + 0.12 * len(rows), 12)), dpi=80)
    ax = fig.subplots()
    colours = colormaps["tab20"].colors
    for bar in bars:
        ax.barh(rows[bar.slot], (bar.end - bar.start) / unit, left=bar.start / unit, height=0.85,
                color=colours[bar.flotilla % len(colours)], edgecolor="black", linewidth=0.2)
        if len(rows) <= 16:
            ax.text((bar.start + bar.end) / 2 / unit, rows[bar.slot], bar.model, ha="center", va="center",
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


def utilisation(bars: list[Bar], slots: int, end: float) -> float:
    """Busy slot-seconds over all slot-seconds until `end`."""
    return sum(bar.end - bar.start for bar in bars) / (slots * end) if end > 0 else 0.0
