"""How the batches of a flotilla reach its trainers (docs/topologies.md,
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

The scheduler chooses the topology and splits the members into streams
(`pipeline.scheduler.topology`); this module places their hubs.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from pipeline.scheduler.topology import Streams, Topology


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

    def joined(self, member: str) -> DeliveryPlan:
        """The plan of one group with `member` joined to it (its trainers read the group's hubs)."""
        (group,) = self.groups
        return replace(self, groups=(replace(group, members=(*group.members, member)),))

    def hub_of(self, member: str, node: int) -> HubPlan:
        group = next(i for i, g in enumerate(self.groups) if member in g.members)
        return next(h for h in self.hubs if h.group == group and h.node == node)


def plan_delivery(topology: Topology, placement: dict[str, tuple[int, ...]], streams: Streams) -> DeliveryPlan:
    """Hubs for a flotilla the scheduler formed (`FormFlotilla`): `topology`, its members split into
    `streams` (one delivery group each), `placement`: member -> the node of each of its trainers."""
    if topology == Topology.auto:
        raise ValueError("plan_delivery lays out a chosen topology; the scheduler resolves topology=auto")
    groups, hubs = [], []
    for index, group_members in enumerate(streams):
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
