"""Messages between the scheduler and whoever drives it (simulator or real run).

Events go in (`Scheduler.handle`), decisions come out. Every event carries
the driver's clock in seconds: the scheduler never reads a clock itself.
Every decision carries its `cause` (as Dask's `stimulus_id`): the event that
produced it, or the start or resume of the run, so that a run's decision log
can be traced back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.scheduler.cluster import Slot
from pipeline.scheduler.topology import Streams, Topology

# ---------------------------------------------------------------- events in


@dataclass(frozen=True)
class RatesMeasured:
    """Images/s of `group` on 1, 2, ... slots, and the seconds it takes to start (RateTable). Planning
    starts once every group has one."""

    time: float
    group: str
    rates: tuple[float, ...]
    start_s: float = 0.0


@dataclass(frozen=True)
class EpochFinished:
    """`group` completed epoch number `epoch` (1-based) and validated."""

    time: float
    group: str
    epoch: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class GroupConverged:
    """The driver's convergence test (e.g. early stopping on `metrics`) fired for `group`, or successive
    halving culled it (`reason` "culled"): either way it leaves and its slots are freed."""

    time: float
    group: str
    reason: str = "converged"


@dataclass(frozen=True)
class SlotFreed:
    """The trainer on `slot` has exited (after a `Stop`); the slot may be reused."""

    time: float
    slot: Slot


@dataclass(frozen=True)
class TrainerFailed:
    """A trainer of `group` crashed on `slot`; the group resumes from its last checkpoint."""

    time: float
    group: str
    slot: Slot
    error: str = ""


@dataclass(frozen=True)
class NodeLost:
    """Node `node` is gone (its host killed, powered off or cut off): its slots are lost until it
    returns; the groups training there count a failure, and every flotilla it was part of stops. All
    of their groups resume from their last checkpoints on the slots left."""

    time: float
    node: int


@dataclass(frozen=True)
class NodeReturned:
    """Node `node`, lost before, is back (its agent started again): its slots are free."""

    time: float
    node: int


@dataclass(frozen=True)
class PrepCostMeasured:
    """The pipeline's preprocessing cost as the run measures it: worker core-seconds per image (a probe
    before the first plan, then the run's own stage timings after each epoch). Flotillas planned after
    it are capped by what the nodes' cores preprocess at that cost."""

    time: float
    seconds_per_image: float


Event = (RatesMeasured | EpochFinished | GroupConverged | SlotFreed | TrainerFailed | NodeLost | NodeReturned
         | PrepCostMeasured)

# ------------------------------------------------------------- decisions out


@dataclass(frozen=True)
class Caused:
    """What every decision carries: its cause (`cause_of`), set by the scheduler as it returns the decision.
    Keyword-only, so it follows each decision's own fields; left out of equality."""

    cause: str = field(default="", compare=False, kw_only=True)


@dataclass(frozen=True)
class FormFlotilla(Caused):
    """Create the preprocessing that feeds these groups, laid out as `topology`.

    `members` maps group -> slot count; `streams` splits them into the
    sequences of batches they read in lockstep (one, but for multi_broadcast
    and duplicated), and `why` says why this topology; `rate` is the planned
    images/s of its slowest stream: that stream's slowest member's measured
    rate, capped by the preprocessing and network the topology gives it
    (`topology.stream_rate`), nan before rates are measured; `start_s` the
    planned seconds before it flows, its members' longest start (RateTable).
    """

    flotilla: int
    members: dict[str, int]
    rate: float
    topology: Topology
    streams: Streams
    why: str = ""
    start_s: float = 0.0


@dataclass(frozen=True)
class AssignSlots(Caused):
    """`group` trains data-parallel on `slots` (all on one node)."""

    flotilla: int
    group: str
    slots: tuple[Slot, ...]


@dataclass(frozen=True)
class Start(Caused):
    """Start the trainers of `group`; resume from the checkpoint after `resume_epoch` epochs if > 0."""

    flotilla: int
    group: str
    resume_epoch: int


@dataclass(frozen=True)
class Join(Caused):
    """`group` (its slots assigned just before) joins the stream of running flotilla `flotilla` at that
    stream's next epoch boundary: its trainers become readers of the flotilla's stream from the next
    epoch on; they resume from the checkpoint after `resume_epoch` epochs if > 0."""

    flotilla: int
    group: str
    resume_epoch: int


@dataclass(frozen=True)
class Checkpoint(Caused):
    """Save `group` after `epoch` completed epochs (`final` when it has converged)."""

    flotilla: int
    group: str
    epoch: int
    final: bool = False


@dataclass(frozen=True)
class Stop(Caused):
    """Stop the trainers of `group` and release its slots (send `SlotFreed` for each).

    `reason` is "converged", "culled", "flotilla stopped", "failed" or "node <i> lost". `flotilla_ends`
    is set on the last member: the flotilla's pipeline can be torn down.
    """

    flotilla: int
    group: str
    reason: str
    flotilla_ends: bool


Decision = FormFlotilla | AssignSlots | Start | Join | Checkpoint | Stop


def cause_of(event: Event) -> str:
    """An event as a decision's cause: its kind, its subject and its time, e.g.
    "EpochFinished(group=group0, epoch=3) at 12.345 s"."""
    subject = ", ".join(f"{name}={value}" for name, value in vars(event).items() if name not in ("time", "metrics"))
    return f"{type(event).__name__}({subject}) at {event.time:.3f} s"
