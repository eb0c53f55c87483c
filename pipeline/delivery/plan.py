"""How the batches of a flotilla reach its trainers (docs/topologies.md,
after Pittman et al., SC18): pure planning, no processes.

The scheduler splits a flotilla's members into streams
(`pipeline.scheduler.topology`): each stream is one sequence of batches,
read by its members in lockstep, at its own pace. This module lays each
stream out in hubs: one per node that hosts the stream's trainers. A hub
writes each batch once into that node's shared-memory rings (zero-copy reads
for every trainer there), and the hubs of a stream exchange batches over the
stream's own process group:

* single_broadcast: one stream; its producer hub has whole batches made by
  its node's Dask workers and broadcasts them to the other hubs.
* all_shared: one stream; every hub has one share of each batch made by its
  node's workers; an all-gather gives every hub the whole batch.
* multi_broadcast: `broadcast_streams` streams of members of similar speed,
  each a single broadcast of its own, each at its own pace.
* duplicated: one stream per member (the baseline: every model its own pipeline).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from pipeline.scheduler.topology import Streams, Topology


@dataclass(frozen=True)
class HubPlan:
    """Where one hub of a plan runs and what it makes."""

    rank: int  # in the flotilla's process group of hubs
    stream: int  # its index in the plan's streams
    node: int
    part: int | None  # share of each batch it makes (0..parts-1), None: it only receives


@dataclass(frozen=True)
class StreamPlan:
    """One stream laid out: its members and the ranks of its hubs."""

    members: tuple[str, ...]
    hubs: tuple[int, ...]  # ranks; for a broadcast, the producer first
    gather: bool  # all_shared: all-gather of shares, else a broadcast from hubs[0]

    @property
    def parts(self) -> int:
        return len(self.hubs) if self.gather else 1


@dataclass(frozen=True)
class DeliveryPlan:
    topology: Topology
    streams: tuple[StreamPlan, ...]
    hubs: tuple[HubPlan, ...]

    def joined(self, member: str) -> DeliveryPlan:
        """The plan of one stream with `member` joined to it (its trainers read the stream's hubs)."""
        (stream,) = self.streams
        return replace(self, streams=(replace(stream, members=(*stream.members, member)),))

    def hub_of(self, member: str, node: int) -> HubPlan:
        stream = next(i for i, s in enumerate(self.streams) if member in s.members)
        return next(h for h in self.hubs if h.stream == stream and h.node == node)


def plan_delivery(topology: Topology, placement: dict[str, tuple[int, ...]], streams: Streams) -> DeliveryPlan:
    """Hubs for a flotilla the scheduler formed (`FormFlotilla`): `topology`, its members split into
    `streams`, `placement`: member -> the node of each of its trainers."""
    if topology == Topology.auto:
        raise ValueError("plan_delivery lays out a chosen topology; the scheduler resolves topology=auto")
    laid_out, hubs = [], []
    for index, members in enumerate(streams):
        trainers = Counter(node for m in members for node in placement[m])
        # The producer sits where most of the stream's trainers are: least traffic.
        nodes = sorted(trainers, key=lambda node: (-trainers[node], node))
        gather = topology == Topology.all_shared
        ranks = tuple(range(len(hubs), len(hubs) + len(nodes)))
        for position, node in enumerate(nodes):
            part = position if gather else (0 if position == 0 else None)
            hubs.append(HubPlan(ranks[position], index, node, part))
        laid_out.append(StreamPlan(tuple(members), ranks, gather))
    return DeliveryPlan(topology, tuple(laid_out), tuple(hubs))
