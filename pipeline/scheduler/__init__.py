"""FLEET scheduler: pure-logic state machine, planner, policies, simulator.

A driver sends events (`ProfileMeasured`, `EpochFinished`, `ModelConverged`,
`SlotFreed`, `TrainerFailed`) to `Scheduler.handle` and carries out the
decisions it returns (`FormFlotilla`, `AssignSlots`, `Start`, `Checkpoint`,
`Stop`). See docs/scheduler.md.
"""

from pipeline.scheduler.events import (AssignSlots, Checkpoint, Decision, EpochFinished, Event, FormFlotilla,
                                       ModelConverged, ProfileMeasured, SlotFreed, Start, Stop, TrainerFailed)
from pipeline.scheduler.machine import Scheduler
from pipeline.scheduler.planner import assign_slots, greedy_flotilla
from pipeline.scheduler.policies import POLICIES, Baseline, FleetG, FleetL, Homogeneous, Policy, Shared, make_policy
from pipeline.scheduler.cluster import Cluster, Profile, Slot

__all__ = [
    "AssignSlots", "Baseline", "Checkpoint", "Cluster", "Decision", "EpochFinished", "Event", "FleetG", "FleetL",
    "FormFlotilla", "Homogeneous", "ModelConverged", "POLICIES", "Policy", "Profile", "ProfileMeasured",
    "Scheduler", "Shared", "Slot", "SlotFreed", "Start", "Stop", "TrainerFailed", "assign_slots", "greedy_flotilla",
    "make_policy",
]
