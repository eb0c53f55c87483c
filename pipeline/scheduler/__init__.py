"""The FLEET scheduler: pure logic (state machine, planner, policies, simulator,
exact solver). No Dask, no torch, no files: events in, decisions out.

A driver sends events (`RatesMeasured`, `PrepCostMeasured`, `EpochFinished`,
`GroupConverged`, `SlotFreed`, `TrainerFailed`, `NodeLost`, `NodeReturned`) to
`Scheduler.handle` and carries out the decisions it returns (`FormFlotilla`,
`AssignSlots`, `Start`, `Join`, `Checkpoint`, `Stop`); the simulator drives the same code. See docs/scheduler.md.

What it places are groups: the models that share a trainer per slot
(pipeline/training/group.py; slot_groups.py says who shares). A model alone is a
group of one, as every model of the simulator is.

May import: `pipeline.runtime.errors` (for `UserError`) and nothing else of the project;
every layer above may use its types (`Slot`, `RateTable`, `Cluster`).
"""

from pipeline.scheduler.events import (AssignSlots, Checkpoint, Decision, EpochFinished, Event, FormFlotilla,
                                       GroupConverged, Join, NodeLost, NodeReturned, PrepCostMeasured, RatesMeasured,
                                       SlotFreed, Start, Stop, TrainerFailed)
from pipeline.scheduler.machine import Scheduler
from pipeline.scheduler.planner import assign_slots, greedy_flotilla
from pipeline.scheduler.policies import (POLICIES, Baseline, FleetE, FleetG, FleetL, Homogeneous, Policy, Shared,
                                         make_policy)
from pipeline.scheduler.cluster import Cluster, RateTable, Slot

__all__ = [
    "AssignSlots", "Baseline", "Checkpoint", "Cluster", "Decision", "EpochFinished", "Event", "FleetE", "FleetG",
    "FleetL", "FormFlotilla", "GroupConverged", "Homogeneous", "Join", "NodeLost", "NodeReturned", "POLICIES",
    "Policy", "PrepCostMeasured", "RateTable", "RatesMeasured", "Scheduler", "Shared", "Slot", "SlotFreed", "Start",
    "Stop", "TrainerFailed", "assign_slots", "greedy_flotilla", "make_policy",
]
