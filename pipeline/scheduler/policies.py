"""Scheduling policies: which flotillas to form on the free slots, and when.

Selected by name (Hydra: `scheduler=shared|fleet_e|fleet_g|fleet_l|baseline|homogeneous`).
A policy only chooses flotillas, which waiting groups join a running one
(`join`, with `join_running`) and, if `elastic`, which running groups to
restart on more slots or, on their plateau, on fewer; the state machine (`machine.py`) applies the rules
every policy shares (convergence releases slots, stop below
`min_active_fraction` active slots, resume from checkpoints).
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass
from typing import ClassVar

from pipeline.scheduler.planner import (TOLERANCE, assign_slots, fits, free_by_node, free_per_node, greedy_flotilla,
                                        join_running, longest_first, lookahead_flotilla, share_streams, spread_slots)
from pipeline.scheduler.cluster import Cluster, PlacementError, RateTable, Slot


@dataclass
class Shared:
    """Data sharing without scheduling (the SC18 setting): every group at once
    in one flotilla, on the slots its config asks for, until each converges.
    Needs no rate table."""

    slots: dict[str, int]  # group -> slots it asks for (its models' ensemble.models[].slots)
    min_active_fraction: float = 0.0  # the flotilla runs until its last group converges
    waits_for_idle_cluster: ClassVar[bool] = True
    needs_rates: ClassVar[bool] = False
    elastic: ClassVar[bool] = False
    join_running: ClassVar[bool] = False

    def form(self, pending: list[str], table: RateTable, cluster: Cluster, free_slots: list[Slot],
             rng: random.Random) -> list[dict[str, int]]:
        members = {group: self.slots[group] for group in pending}
        if not fits(list(members.values()), free_per_node(free_slots)):
            raise PlacementError(
                f"scheduler=shared puts every group on its own slots at once: {sum(members.values())} slots "
                f"asked, {len(free_slots)} free; raise trainer.slots, lower the models' slots, or use "
                "scheduler=fleet_g to train them in turns")
        return [members]


@dataclass
class FleetG:
    """FLEET-G: one flotilla over the whole cluster at a time; when it stops,
    re-plan globally from all unconverged groups."""

    min_active_fraction: float = 0.8
    tolerance: float = TOLERANCE  # a member may be this much slower than the flotilla's target rate
    lookahead: int = 8  # up to this many waiting groups, pick the flotilla by lookahead (0: greedy alone)
    waits_for_idle_cluster: ClassVar[bool] = True
    needs_rates: ClassVar[bool] = True
    elastic: ClassVar[bool] = False
    join_running: ClassVar[bool] = False

    def form(self, pending: list[str], table: RateTable, cluster: Cluster, free_slots: list[Slot],
             rng: random.Random) -> list[dict[str, int]]:
        plan = lookahead_flotilla if len(pending) <= self.lookahead else greedy_flotilla
        flotilla = plan(pending, table, cluster, free_per_node(free_slots), self.tolerance)
        return [flotilla] if flotilla else []


@dataclass
class FleetL(FleetG):
    """FLEET-L: same greedy, but released slots are refilled at once with new
    flotillas (as many as the free slots take) next to the flotillas still
    running; with `join_running`, a
    waiting group of like rate first joins a running flotilla's stream at its
    next epoch boundary (`join`). No lookahead: it scores whole-cluster
    rounds, which is FLEET-G's execution."""

    lookahead: int = 0
    join_running: bool = False  # a waiting group of like rate joins a running stream (scheduler.join_running)
    waits_for_idle_cluster: ClassVar[bool] = False

    def form(self, pending: list[str], table: RateTable, cluster: Cluster, free_slots: list[Slot],
             rng: random.Random) -> list[dict[str, int]]:
        """Greedy flotillas, one after another, until the free slots or the waiting groups run out: no
        slot idles while a group waits."""
        flotillas: list[dict[str, int]] = []
        free, waiting = list(free_slots), list(pending)
        while waiting and free:
            flotilla = greedy_flotilla(waiting, table, cluster, free_per_node(free), self.tolerance)
            if not flotilla:
                break
            flotillas.append(flotilla)
            used = {s for slots in assign_slots({m: g for f in flotillas for m, g in f.items()}, free_slots).values()
                    for s in slots}  # where the machine will place them all, by the same rule
            free = [s for s in free_slots if s not in used]
            waiting = [m for m in waiting if m not in flotilla]
        return flotillas

    def join(self, pending: list[str], table: RateTable, cluster: Cluster, free_slots: list[Slot],
             running: dict[int, tuple[int, dict[str, int]]]) -> dict[str, int]:
        """Waiting groups into running flotillas of like rate, at their next epoch boundary."""
        return join_running(pending, table, cluster, free_slots, running, self.tolerance)


@dataclass
class FleetE:
    """FLEET-E (elastic), the recommended policy: no slot waits and no group
    waits for another.

    * Free slots are refilled at once (as FLEET-L), with the waiting groups
      expected to take longest first (`longest_first`), one slot each while
      groups wait, since one slot is the most work per slot under sublinear
      scaling; slots left over go to the groups they speed up most.
    * Only groups whose own pipeline would hold them back share a stream
      (`share_streams`): sharing pays in CPU, and lockstep costs the faster
      members of a flotilla their speed. With `join_running`, such a group,
      waiting, joins a running stream of like rate at its next epoch
      boundary (`join`).
    * A flotilla runs on as members leave (their slots are refilled); once no
      group waits, a running group that would train faster on the idle slots
      is restarted there from the checkpoint of the epoch it just finished
      (`resize`), so the tail of the run uses the whole cluster, if the time
      it would save on the images it has left (at most) outweighs starting
      again (its start: compiling, graph capture).
    * Training phases (Wei and Shudo), with `phase_threshold` > 0: a group
      whose training loss fell by less than that fraction in its last epoch
      is on its plateau. It is planned on its smallest slot count
      (`by_phase`), and gives up the slots above it, by restarting there, as
      soon as a group whose loss still falls could train faster on them.
    """

    tolerance: float = TOLERANCE  # a stream's members are within this fraction of its fastest's rate
    min_gain: float = 0.1  # a restart on more slots must raise the group's rate by this fraction
    phase_threshold: float = 0.0  # loss drop per epoch below which a group is on its plateau; 0: phases unused
    join_running: bool = False  # a CPU-held waiting group joins a running stream (scheduler.join_running)
    min_active_fraction: float = 0.0  # flotillas never stop for members leaving
    waits_for_idle_cluster: ClassVar[bool] = False
    needs_rates: ClassVar[bool] = True
    elastic: ClassVar[bool] = True

    def form(self, pending: list[str], table: RateTable, cluster: Cluster, free_slots: list[Slot],
             rng: random.Random) -> list[dict[str, int]]:
        nodes, members = free_per_node(free_slots), {}
        for group in longest_first(pending, table, cluster):
            slots = table.slot_counts(group, cluster.slots_per_node)[0]
            if fits([*members.values(), slots], nodes):
                members[group] = slots
        return share_streams(spread_slots(members, table, nodes), table, cluster, self.tolerance)

    def join(self, pending: list[str], table: RateTable, cluster: Cluster, free_slots: list[Slot],
             running: dict[int, tuple[int, dict[str, int]]]) -> dict[str, int]:
        """Waiting groups that their own pipeline would hold back join a running stream of like rate,
        longest first."""
        return join_running(longest_first(pending, table, cluster), table, cluster, free_slots, running,
                            self.tolerance, held_only=True)

    def by_phase(self, table: RateTable, loss_drops: dict[str, float | None]) -> RateTable:
        """`table` with every group on its plateau limited to its smallest runnable slot count."""
        if not self.phase_threshold:
            return table
        limited = RateTable(dict(table.rates), dict(table.starts))
        for group, drop in loss_drops.items():
            if drop is not None and drop < self.phase_threshold and group in table.rates:
                rates = table.rates[group]
                smallest = next(i for i, r in enumerate(rates) if r > 0)
                limited.rates[group] = tuple(r if i == smallest else 0.0 for i, r in enumerate(rates))
        return limited

    def resize(self, group: str, slots: tuple[Slot, ...], table: RateTable, cluster: Cluster,
               free_slots: list[Slot], running: dict[str, tuple[Slot, ...]],
               images_left: float | None = None) -> str | None:
        """Why `group`, running on `slots` while no group waits, should restart now, or None (`table` is
        the planning table, `by_phase`): "plateau", on fewer slots, if it holds more than `table` allows
        and another `running` group on its node could use them; "resized", on more, if its rate on the
        most slots it could get (the idle ones and its own, within one node) beats its rate now by
        `min_gain` and, where `images_left` (the most it has left to train) is known, the time that saves
        on them is more than its start."""
        now, k, node = len(slots), cluster.slots_per_node, slots[0].node
        room = free_by_node(free_slots)
        if now not in table.slot_counts(group, k):
            given_up = room.get(node, 0) + now - table.slot_counts(group, k)[0]
            gains = any(self._gains(other, len(held), len(held) + given_up, table, k)
                        for other, held in running.items() if other != group and held[0].node == node)
            return "plateau" if gains else None
        room[node] = room.get(node, 0) + now
        return "resized" if self._gains(group, now, max(room.values()), table, k, images_left) else None

    def _gains(self, group: str, now: int, most: int, table: RateTable, slots_per_node: int,
               images_left: float | None = None) -> bool:
        """Whether `group` on up to `most` slots beats its rate on `now` by `min_gain`, and saves more
        than its start on `images_left` (if given). Its rate there is at the count the planner would give it
        (spread_slots), not the best count it cannot reach: on rates that dip (1 slot faster than 2), that
        restarted it every epoch on as many slots as before."""
        counts = table.slot_counts(group, min(most, slots_per_node))
        if not counts:
            return False
        best = table.rate(group, spread_slots({group: counts[0]}, table, [min(most, slots_per_node)])[group])
        rate = table.rate(group, now)
        if rate <= 0 or best <= (1 + self.min_gain) * rate:  # (0: on its plateau, held to fewer slots)
            return False
        return images_left is None or images_left / rate - images_left / best > table.start(group)


@dataclass
class Baseline:
    """Each group alone on one slot with its own pipeline; a random waiting
    group takes each free slot."""

    min_active_fraction: float = 0.0  # a one-group flotilla ends with its group
    waits_for_idle_cluster: ClassVar[bool] = False
    needs_rates: ClassVar[bool] = True
    elastic: ClassVar[bool] = False
    join_running: ClassVar[bool] = False

    def form(self, pending: list[str], table: RateTable, cluster: Cluster, free_slots: list[Slot],
             rng: random.Random) -> list[dict[str, int]]:
        return [{group: slots} for group, slots in _random_fill(pending, table, cluster, free_slots, rng)]


@dataclass
class Homogeneous:
    """Data sharing without FLEET (Pittman et al.): a random subset of groups,
    one slot each, shares one pipeline; the next subset starts when the whole
    previous one has converged."""

    min_active_fraction: float = 0.0
    waits_for_idle_cluster: ClassVar[bool] = True
    needs_rates: ClassVar[bool] = True
    elastic: ClassVar[bool] = False
    join_running: ClassVar[bool] = False

    def form(self, pending: list[str], table: RateTable, cluster: Cluster, free_slots: list[Slot],
             rng: random.Random) -> list[dict[str, int]]:
        flotilla = dict(_random_fill(pending, table, cluster, free_slots, rng))
        return [flotilla] if flotilla else []


def _random_fill(pending: list[str], table: RateTable, cluster: Cluster, free_slots: list[Slot],
                 rng: random.Random) -> list[tuple[str, int]]:
    """Random waiting groups, each on its smallest runnable slot count (1 for
    most), while they fit the free slots."""
    order = list(pending)
    rng.shuffle(order)
    nodes, chosen = free_per_node(free_slots), []
    for group in order:
        slots = table.slot_counts(group, cluster.slots_per_node)[0]
        if fits([*(g for _, g in chosen), slots], nodes):
            chosen.append((group, slots))
    return chosen


Policy = Shared | FleetE | FleetG | FleetL | Baseline | Homogeneous


class PolicyName(enum.StrEnum):
    """scheduler.policy (set by scheduler=<name>)."""

    shared = "shared"
    fleet_e = "fleet_e"
    fleet_g = "fleet_g"
    fleet_l = "fleet_l"
    baseline = "baseline"
    homogeneous = "homogeneous"


POLICIES = {PolicyName.shared: Shared, PolicyName.fleet_e: FleetE, PolicyName.fleet_g: FleetG,
            PolicyName.fleet_l: FleetL, PolicyName.baseline: Baseline, PolicyName.homogeneous: Homogeneous}


def make_policy(name: PolicyName, min_active_fraction: float = 0.8,
                requested_slots: dict[str, int] | None = None, phase_threshold: float = 0.0,
                join_running: bool = False) -> Policy:
    """The policy called `name`; `min_active_fraction` applies to fleet_g/fleet_l only, `requested_slots`
    (group -> slots) to shared only, `phase_threshold` to fleet_e only, `join_running` to fleet_l and
    fleet_e."""
    if name == PolicyName.shared:
        return Shared(dict(requested_slots or {}))
    if name == PolicyName.fleet_g:
        return FleetG(min_active_fraction=min_active_fraction)
    if name == PolicyName.fleet_l:
        return FleetL(min_active_fraction=min_active_fraction, join_running=join_running)
    if name == PolicyName.fleet_e:
        return FleetE(phase_threshold=phase_threshold, join_running=join_running)
    return POLICIES[name]()
