"""Scheduling policies: which flotillas to form on the free slots, and when.

Selected by name (Hydra: `scheduler=shared|fleet_g|fleet_l|baseline|homogeneous`).
A policy only chooses flotillas; the state machine (`machine.py`) applies the
rules every policy shares (convergence releases slots, stop below
`min_active_fraction` active slots, resume from checkpoints).
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass
from typing import ClassVar

from pipeline.scheduler.planner import TOLERANCE, fits, free_per_node, greedy_flotilla, lookahead_flotilla
from pipeline.scheduler.cluster import Cluster, PlacementError, RateTable, Slot


@dataclass
class Shared:
    """Data sharing without scheduling (the SC18 setting): every model at once
    in one flotilla, on the slots its config asks for, until each converges.
    Needs no rate table."""

    slots: dict[str, int]  # model -> slots it asks for (ensemble.models[].slots)
    min_active_fraction: float = 0.0  # the flotilla runs until its last model converges
    waits_for_idle_cluster: ClassVar[bool] = True
    needs_rates: ClassVar[bool] = False

    def form(self, pending: list[str], table: RateTable, cluster: Cluster, free_slots: list[Slot],
             rng: random.Random) -> list[dict[str, int]]:
        group = {model: self.slots[model] for model in pending}
        if not fits(list(group.values()), free_per_node(free_slots)):
            raise PlacementError(
                f"scheduler=shared puts every model on its own slots at once: {sum(group.values())} slots "
                f"asked, {len(free_slots)} free; raise trainer.slots, lower the models' slots, or use "
                "scheduler=fleet_g to train them in turns")
        return [group]


@dataclass
class FleetG:
    """FLEET-G: one flotilla over the whole cluster at a time; when it stops,
    re-plan globally from all unconverged models."""

    min_active_fraction: float = 0.8
    tolerance: float = TOLERANCE  # a member may be this much slower than the flotilla's target rate
    lookahead: int = 8  # up to this many waiting models, pick the flotilla by lookahead (0: greedy alone)
    waits_for_idle_cluster: ClassVar[bool] = True
    needs_rates: ClassVar[bool] = True

    def form(self, pending: list[str], table: RateTable, cluster: Cluster, free_slots: list[Slot],
             rng: random.Random) -> list[dict[str, int]]:
        plan = lookahead_flotilla if len(pending) <= self.lookahead else greedy_flotilla
        flotilla = plan(pending, table, cluster, free_per_node(free_slots), self.tolerance)
        return [flotilla] if flotilla else []


@dataclass
class FleetL(FleetG):
    """FLEET-L: same greedy, but released slots are refilled at once with a
    new flotilla of unconverged models, next to the flotillas still running.
    No lookahead: it scores whole-cluster rounds, which is FLEET-G's execution."""

    lookahead: int = 0
    waits_for_idle_cluster: ClassVar[bool] = False


@dataclass
class Baseline:
    """Each model alone on one slot with its own pipeline; a random waiting
    model takes each free slot."""

    min_active_fraction: float = 0.0  # a one-model flotilla ends with its model
    waits_for_idle_cluster: ClassVar[bool] = False
    needs_rates: ClassVar[bool] = True

    def form(self, pending: list[str], table: RateTable, cluster: Cluster, free_slots: list[Slot],
             rng: random.Random) -> list[dict[str, int]]:
        return [{model: slots} for model, slots in _random_fill(pending, table, cluster, free_slots, rng)]


@dataclass
class Homogeneous:
    """Data sharing without FLEET (Pittman et al.): a random subset of models,
    one slot each, shares one pipeline; the next subset starts when the whole
    previous one has converged."""

    min_active_fraction: float = 0.0
    waits_for_idle_cluster: ClassVar[bool] = True
    needs_rates: ClassVar[bool] = True

    def form(self, pending: list[str], table: RateTable, cluster: Cluster, free_slots: list[Slot],
             rng: random.Random) -> list[dict[str, int]]:
        flotilla = dict(_random_fill(pending, table, cluster, free_slots, rng))
        return [flotilla] if flotilla else []


def _random_fill(pending: list[str], table: RateTable, cluster: Cluster, free_slots: list[Slot],
                 rng: random.Random) -> list[tuple[str, int]]:
    """Random waiting models, each on its smallest runnable slot count (1 for
    most), while they fit the free slots."""
    order = list(pending)
    rng.shuffle(order)
    nodes, chosen = free_per_node(free_slots), []
    for model in order:
        slots = table.slot_counts(model, cluster.slots_per_node)[0]
        if fits([*(g for _, g in chosen), slots], nodes):
            chosen.append((model, slots))
    return chosen


Policy = Shared | FleetG | FleetL | Baseline | Homogeneous


class PolicyName(enum.StrEnum):
    """scheduler.policy (set by scheduler=<name>)."""

    shared = "shared"
    fleet_g = "fleet_g"
    fleet_l = "fleet_l"
    baseline = "baseline"
    homogeneous = "homogeneous"


POLICIES = {PolicyName.shared: Shared, PolicyName.fleet_g: FleetG, PolicyName.fleet_l: FleetL,
            PolicyName.baseline: Baseline, PolicyName.homogeneous: Homogeneous}


def make_policy(name: PolicyName, min_active_fraction: float = 0.8,
                requested_slots: dict[str, int] | None = None) -> Policy:
    """The policy called `name`; `min_active_fraction` applies to fleet_g/fleet_l
    only, `requested_slots` (model -> slots) to shared only."""
    if name == PolicyName.shared:
        return Shared(dict(requested_slots or {}))
    if name in (PolicyName.fleet_g, PolicyName.fleet_l):
        return POLICIES[name](min_active_fraction=min_active_fraction)
    return POLICIES[name]()
