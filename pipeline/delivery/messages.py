"""What passes between a flotilla (the driver's side) and its hubs: commands
down, events up, each a typed message (they pickle across processes and hosts)."""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.data.graph import BatchOutput
from stages.base import Split


@dataclass(frozen=True)
class RunSplit:
    """Deliver every batch of `split` in epoch `epoch` of the flotilla's sequence."""

    split: Split
    epoch: int


@dataclass(frozen=True)
class StopStreams:
    """No more splits: send STOP down the rings and report what was moved."""


HubCommand = RunSplit | StopStreams


@dataclass(frozen=True)
class BatchPublished:
    """A batch is in the hub's rings. `made`: its batch task's measurements without the image
    bytes, from a producing hub (None from a hub that only receives)."""

    hub: int
    split: Split
    index: int
    made: BatchOutput | None


@dataclass(frozen=True)
class SplitDone:
    """The hub delivered every batch of the split; `cpu_s`: its process's CPU seconds meanwhile."""

    hub: int
    split: Split
    cpu_s: float


@dataclass(frozen=True)
class HubStopped:
    """The hub sent STOP; what it moved (the recorder's delivery record)."""

    hub: int
    summary: dict


@dataclass(frozen=True)
class HubFailed:
    hub: int
    traceback: str


@dataclass(frozen=True)
class HubWaiting:
    """The hub has waited timeouts.warn_s for a batch task: what it waits for (said once per wait)."""

    hub: int
    what: str


@dataclass(frozen=True)
class HubHung:
    """A wait of the hub ran out of its timeout (pipeline.runtime.hang.HangError): the message says which
    and the fix."""

    hub: int
    message: str


@dataclass(frozen=True)
class HubUserError:
    """The user's data or stage stopped a batch (a bad file under on_error=fail, a stage's output not as it
    declares): the run stops with the message, as with any of the user's mistakes (a UserError)."""

    hub: int
    message: str


HubEvent = BatchPublished | SplitDone | HubWaiting | HubStopped | HubFailed | HubHung | HubUserError
