"""How the batches of a flotilla reach its trainers (DESIGN.md section 4,
after Pittman et al., SC18): pure planning, no processes.

A plan splits the flotilla's members into delivery groups; each group is fed
one sequence of batches, at its own pace. A group has one hub per node that
hosts its trainers: the hub writes each batch once into that node's
shared-memory rings (zero-copy reads for every trainer there), and the hubs
of a group exchange batches over the group's own process group:

* single_broadcast: one group; its producer hub has whole batches made by its
  node's Dask workers and broadcasts them to the other hubs.
* all_shared: one group; every hub has one share of each batch made by its
  node's workers; an all-gather gives every hub the whole batch.
* multi_broadcast: `broadcast_groups` groups of members of similar speed,
  each a single broadcast of its own, each at its own pace.
* duplicated: one group per member (the baseline: every model its own pipeline).
"""
from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass



class Topology(enum.StrEnum):
    """How a flotilla's batches reach its trainers (config key `topology`)."""

    auto = "auto"  # chosen per flotilla (choose_topology)
    single_broadcast = "single_broadcast"
    all_shared = "all_shared"
    multi_broadcast = "multi_broadcast"
    duplicated = "duplicated"


TOPOLOGIES = tuple(t for t in Topology if t is not Topology.auto)  # the ones a plan lays out
SPREAD_FOR_GROUPS = 2.0  # auto: members this many times apart in speed get groups of their own


@dataclass(frozen=True)
class HubPlan:
    """Where one hub of a plan runs and what it makes."""

    rank: int  # in the flotilla's process group of hubs
    group: int
    node: int
    part: int | None  # share of each batch it makes (0..parts-1), None: it only receives


@dataclass(frozen=True)
class DeliveryGroup:
    members: tuple[str, ...]
    hubs: tuple[int, ...]  # ranks; for a broadcast, the producer first
    gather: bool  # all_shared: all-gather of shares, else a broadcast from hubs[0]

    @property
    def parts(self) -> int:
        return len(self.hubs) if self.gather else 1


@dataclass(frozen=True)
class DeliveryPlan:
    topology: Topology
    groups: tuple[DeliveryGroup, ...]
    hubs: tuple[HubPlan, ...]

    def hub_of(self, member: str, node: int) -> HubPlan:
        group = next(i for i, g in enumerate(self.groups) if member in g.members)
        return next(h for h in self.hubs if h.group == group and h.node == node)


def plan_delivery(topology: Topology, placement: dict[str, tuple[int, ...]], broadcast_groups: int = 2,
                  rates: dict[str, float] | None = None) -> DeliveryPlan:
    """`placement`: member -> the node of each of its trainers; `rates`:
    members' measured images/s, to group similar speeds (multi_broadcast)."""
    members = list(placement)
    if topology == Topology.duplicated:
        partition = [[m] for m in members]
    elif topology == Topology.multi_broadcast:
        by_speed = sorted(members, key=lambda m: -(rates or {}).get(m, 0.0))  # stable: config order on ties
        count = min(broadcast_groups, len(members))
        bounds = [-(-len(members) * i // count) for i in range(count + 1)]  # larger groups first
        partition = [by_speed[bounds[i]:bounds[i + 1]] for i in range(count)]
    else:
        partition = [members]
    groups, hubs = [], []
    for index, group_members in enumerate(partition):
        trainers = Counter(node for m in group_members for node in placement[m])
        # The producer sits where most of the group's trainers are: least traffic.
        nodes = sorted(trainers, key=lambda node: (-trainers[node], node))
        gather = topology == Topology.all_shared
        ranks = tuple(range(len(hubs), len(hubs) + len(nodes)))
        for position, node in enumerate(nodes):
            part = position if gather else (0 if position == 0 else None)
            hubs.append(HubPlan(ranks[position], index, node, part))
        groups.append(DeliveryGroup(tuple(group_members), ranks, gather))
    return DeliveryPlan(topology, tuple(groups), tuple(hubs))


def choose_topology(nodes: int, producer_rate: float | None, member_rates: dict[str, float] | None
                    ) -> tuple[Topology, str]:
    """topology=auto for one flotilla: (topology, why). `nodes`: nodes hosting
    its trainers; `producer_rate`: images/s one node's workers make;
    `member_rates`: each member's training images/s, if measured."""
    rates = sorted((member_rates or {}).values())
    if len(rates) >= 2 and rates[0] > 0 and rates[-1] / rates[0] >= SPREAD_FOR_GROUPS:
        return Topology.multi_broadcast, (f"members' speeds differ {rates[-1] / rates[0]:.1f}x: groups of similar speed, "
                                   "each fed at its own pace, instead of all held to the slowest")
    if nodes == 1:
        return Topology.single_broadcast, ("all trainers on one node: one producer writes each batch once into shared "
                                    "memory for all of them")
    # Trainers on a shared stream move together: the flotilla takes batches at its slowest member's rate.
    demand = rates[0] if rates else None
    if producer_rate is not None and demand is not None and producer_rate >= demand:
        return Topology.single_broadcast, (f"one node's workers make {producer_rate:.0f} images/s, the flotilla takes "
                                    f"{demand:.0f}: one producer suffices and moves the fewest bytes")
    made = "unknown" if producer_rate is None else f"{producer_rate:.0f} images/s"
    taken = "unknown" if demand is None else f"{demand:.0f} images/s"
    return Topology.all_shared, (f"{nodes} nodes; one node's workers make {made}, the flotilla takes {taken}: every "
                          "node's workers make a share of each batch")
