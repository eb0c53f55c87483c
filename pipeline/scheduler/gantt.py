"""Who held which slot when: the bars of a schedule, read from its decisions as
they come, the same way in the simulator and in real runs (their chart:
`pipeline.report.plots.gantt_figure`)."""

from __future__ import annotations

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


def utilisation(bars: list[Bar], slots: int, end: float) -> float:
    """Busy slot-seconds over all slot-seconds until `end`."""
    return sum(bar.end - bar.start for bar in bars) / (slots * end) if end > 0 else 0.0
