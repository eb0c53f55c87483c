"""The driver's watchdog over a flotilla's hubs while they deliver a split.

The flotilla thread feeds it every hub event and asks it each round. A hub
that has published nothing for `timeouts.warn_s` is described once (the
trainer whose full ring holds it back, or what the hub said it waits for);
after `timeouts.stall_s` the run fails with HangError naming it. A hub held
back by trainers that compile (trainer.compile) waits as long as they do.
"""
from __future__ import annotations

from collections.abc import Callable

from rich.markup import escape

from pipeline.delivery.messages import BatchPublished, SplitDone
from pipeline.runtime.hang import Patience, Stall
from pipeline.orchestration.flotilla import Flotilla


class SplitWatch:
    def __init__(self, flotilla: Flotilla, patience: Patience, say: Callable[[str], None]):
        self.flotilla, self.say = flotilla, say
        self.stalls = {hub.rank: Stall(patience) for hub in flotilla.plan.hubs}  # hubs not done with the split
        self.told: dict[int, str] = {}  # what each hub said it waits for, as last printed

    def saw(self, event: BatchPublished | SplitDone) -> None:
        if isinstance(event, SplitDone):
            self.stalls.pop(event.hub, None)
        elif event.hub in self.stalls:
            self.stalls[event.hub].moved()

    def check(self) -> None:
        """Says what is awaited, or raises HangError, for each hub without progress for too long."""
        for hub, what in self.flotilla.waiting.items():  # a hub's own words come as soon as it has them
            self._tell(hub, what)
        for hub, stall in self.stalls.items():
            stall.check(lambda: self._explain(hub), lambda line: self.say(f"[yellow]{escape(line)}[/]"),
                        lambda: self._compiling(hub))

    def _compiling(self, hub: int) -> bool:
        """Whether trainers hold `hub` back in a step that compiles (their first of a batch shape, which
        takes as long as compiling does); which ones is said once."""
        compiling = sorted({lag.process for lag in self.flotilla.laggards() if lag.hub == hub and lag.compiling})
        if compiling:
            self._tell(hub, f"trainer {', '.join(compiling)} compiling (trainer.compile)")
        return bool(compiling)

    def _tell(self, hub: int, what: str) -> None:
        """Says what `hub` waits for, unless that is what it last said."""
        if self.told.get(hub) != what:
            self.told[hub] = what
            self.say(f"[yellow]waiting[/] hub {hub} (node {self.flotilla.plan.hubs[hub].node}): {escape(what)}")

    def _explain(self, hub: int) -> str:
        where = f"flotilla {self.flotilla.id}: hub {hub} (node {self.flotilla.plan.hubs[hub].node})"
        behind = [lag for lag in self.flotilla.laggards() if lag.hub == hub]
        if behind:
            return f"{where} cannot publish: " + "; ".join(
                f"trainer {lag.process} (pid {lag.pid}, {lag.state}, {lag.where}) holds all {lag.depth} buffers of "
                f"its ring of sink {lag.sink}" for lag in behind) + \
                ". A trainer that stopped taking batches is stuck or stopped (SIGSTOP, a debugger), or its " \
                "steps are that slow"
        said = self.flotilla.waiting.get(hub)
        if said:
            return f"{where} waits: {said}"
        return f"{where} has published nothing: it waits for its batch tasks or its stream's exchange"
