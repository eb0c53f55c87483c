"""Who held which slot when: the bars of a schedule, read from its decisions as
they come, the same way in the simulator and in real runs (their chart:
`pipeline.report.plots.gantt_figure`)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.scheduler.cluster import Slot
from pipeline.scheduler.events import AssignSlots, Decision, Join, Start, Stop


@dataclass(frozen=True)
class Bar:
    """`group` of `flotilla` held `slot` from `start` to `end` (seconds)."""

    slot: Slot
    group: str
    flotilla: int
    start: float
    end: float

    def to_json(self) -> dict:
        return {"slot": [self.slot.node, self.slot.index], "group": self.group, "flotilla": self.flotilla,
                "start": self.start, "end": self.end}

    @classmethod
    def from_json(cls, saved: dict) -> Bar:
        return cls(Slot(*saved["slot"]), saved["group"], saved["flotilla"], saved["start"], saved["end"])


class Gantt:
    """A group's bars open when it starts (or joins) on the slots assigned to it, and close when it is
    stopped."""

    def __init__(self, bars: list[Bar] | None = None):
        self.bars: list[Bar] = list(bars or [])  # closed
        self.assigned: dict[str, tuple[Slot, ...]] = {}
        self.running: dict[str, tuple[int, float]] = {}  # group -> (flotilla, since)

    def saw(self, decision: Decision, now: float) -> None:
        if isinstance(decision, AssignSlots):
            self.assigned[decision.group] = decision.slots
        elif isinstance(decision, (Start, Join)):
            self.running[decision.group] = (decision.flotilla, now)
        elif isinstance(decision, Stop) and decision.group in self.running:
            self.bars += self._bars(decision.group, now)
            del self.running[decision.group]

    def until(self, now: float) -> list[Bar]:
        """The bars so far, those of groups still running ending `now`."""
        return self.bars + [bar for group in self.running for bar in self._bars(group, now)]

    def close(self, now: float) -> None:
        """The schedule ends `now`, with the groups still running (a run stopped before its end)."""
        self.bars, self.running = self.until(now), {}

    def _bars(self, group: str, now: float) -> list[Bar]:
        flotilla, since = self.running[group]
        return [Bar(slot, group, flotilla, since, now) for slot in self.assigned[group]]


def utilisation(bars: list[Bar], slots: int, end: float) -> float:
    """Busy slot-seconds over all slot-seconds until `end`."""
    return sum(bar.end - bar.start for bar in bars) / (slots * end) if end > 0 else 0.0
