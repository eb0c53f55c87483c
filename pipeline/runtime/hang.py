"""Never hang silently: a wait that stops making progress says what it waits
for (after `timeouts.warn_s`), then fails with `HangError` (after
`timeouts.stall_s`). Every layer uses it, so it imports nothing of the project.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


def shared_out(seconds: float, items):
    """Each of `items` with the time left of `seconds` for them all: a wait on each in turn gets what the
    ones before it left, so the whole never waits more than `seconds`."""
    deadline = time.monotonic() + seconds
    for item in items:
        yield item, max(deadline - time.monotonic(), 0.0)


class HangError(RuntimeError):
    """A wait ran out of its timeout: the message names what was awaited, the timeout's key and the fix."""


@dataclass(frozen=True)
class Patience:
    """How long a wait may go without progress (timeouts.warn_s, timeouts.stall_s; defaults: the config's)."""

    warn_s: float = 60.0  # then it says, once, what it waits for
    stall_s: float = 600.0  # then it fails


class Stall:
    """One wait, watched: call `moved` on progress and `check` while waiting."""

    def __init__(self, patience: Patience, clock: Callable[[], float] = time.monotonic):
        self.patience, self.clock = patience, clock
        self.since, self.warned = clock(), False

    def moved(self) -> None:
        self.since, self.warned = self.clock(), False

    def check(self, what: Callable[[], str], say: Callable[[str], None],
              busy: Callable[[], bool] = lambda: False) -> None:
        """`what()` (what is awaited, and the likely fix) is said once after warn_s, raised as HangError
        after stall_s. `busy()`, asked after warn_s, says whether the wait is for work known to take
        long (compiling): while it is, the wait counts as progress."""
        idle = self.clock() - self.since
        if idle >= self.patience.warn_s and busy():
            self.moved()
            return
        if idle >= self.patience.stall_s:
            raise HangError(f"{what()} (nothing moved for {idle:.0f} s: timeouts.stall_s="
                            f"{self.patience.stall_s:g}; raise it if this wait is legitimately that long)")
        if idle >= self.patience.warn_s and not self.warned:
            self.warned = True
            say(f"waiting {idle:.0f} s: {what()} (fails after timeouts.stall_s={self.patience.stall_s:g})")
