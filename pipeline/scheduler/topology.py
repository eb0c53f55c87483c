"""Which topology feeds a flotilla, and what each costs (docs/topologies.md):
the scheduler's choice, made from its cluster model when it forms a
flotilla, so that the simulator and a real run choose alike. The delivery
layer (`pipeline.delivery.plan`) lays the chosen streams out in hubs.

A flotilla's members are split into *streams*: each stream is one sequence
of batches, made once and read by all its members in lockstep, at its own
pace. What a stream costs in the cluster model:

* CPU: the cores of a node are shared by the pipelines on it in proportion
  to the slots they hold (`Cluster.prep_rate_per_slot`). A stream is made by
  its *producer* node alone (single_broadcast, multi_broadcast, duplicated:
  the node with most of its slots) or by every node it trains on
  (all_shared), so it gets the preprocessing of its slots on those nodes.
* Transfer: a node that trains a stream but does not make all of it
  receives batches over the network, at most `Cluster.network_images_per_s`
  images/s (0: not limited): a whole batch per image under a broadcast, the
  other nodes' shares, (n - 1)/n of it, under all_shared.
"""

from __future__ import annotations

import enum
from collections import Counter

from pipeline.scheduler.cluster import Cluster, RateTable


class Topology(enum.StrEnum):
    """How a flotilla's batches reach its trainers (config key `topology`)."""

    auto = "auto"  # chosen per flotilla (choose_topology)
    single_broadcast = "single_broadcast"
    all_shared = "all_shared"
    multi_broadcast = "multi_broadcast"
    duplicated = "duplicated"


TOPOLOGIES = tuple(t for t in Topology if t is not Topology.auto)  # the ones a plan lays out
SPREAD_FOR_STREAMS = 2.0  # auto: members this many times apart in speed get streams of their own

Streams = tuple[tuple[str, ...], ...]  # a flotilla's members, split into streams


def split_streams(topology: Topology, members: list[str], rates: dict[str, float],
                  broadcast_streams: int) -> Streams:
    """The streams of a flotilla of `members` (in plan order) under `topology`; multi_broadcast
    makes `broadcast_streams` streams of members of like speed (`rates`), larger ones first."""
    if topology == Topology.duplicated:
        return tuple((m,) for m in members)
    if topology == Topology.multi_broadcast:
        by_speed = sorted(members, key=lambda m: -rates.get(m, 0.0))  # stable: plan order on ties
        count = min(broadcast_streams, len(members))
        bounds = [-(-len(members) * i // count) for i in range(count + 1)]
        return tuple(tuple(by_speed[bounds[i]:bounds[i + 1]]) for i in range(count))
    return (tuple(members),)


def stream_rate(stream: tuple[str, ...], slots: dict[str, tuple[int, ...]], topology: Topology,
                table: RateTable, cluster: Cluster) -> float:
    """Images/s of one stream: its slowest member's rate on its slots, capped by the preprocessing of
    the nodes that make it and by the network into the nodes that receive it. `slots`: member -> the
    node of each of its slots."""
    slowest = min(table.rate(m, len(slots[m])) for m in stream)
    per_node = Counter(node for m in stream for node in slots[m])
    gather = topology == Topology.all_shared
    producer = max(sorted(per_node), key=lambda node: per_node[node])  # most slots; lowest node on ties
    making = sum(per_node.values()) if gather else per_node[producer]
    rate = min(slowest, cluster.prep_rate_per_slot * making)
    if len(per_node) > 1 and cluster.network_images_per_s:
        received = (len(per_node) - 1) / len(per_node) if gather else 1.0  # of each image, per receiving node
        rate = min(rate, cluster.network_images_per_s / received)
    return rate


def choose_topology(members: dict[str, tuple[int, ...]], table: RateTable, cluster: Cluster,
                    setting: Topology = Topology.auto) -> tuple[Topology, str]:
    """The topology of a flotilla (`members`: group -> the node of each of its slots), and why:
    `setting` if fixed; else, for topology=auto, multi_broadcast when members' speeds differ
    `SPREAD_FOR_STREAMS`-fold (each stream at its own pace instead of all held to the slowest); on one
    node, single_broadcast (one producer, shared memory); across nodes, single_broadcast while its
    producer keeps up (fewest bytes moved), else all_shared (every node makes a share)."""
    if setting != Topology.auto:
        return setting, f"topology={setting}"
    nodes = {node for slots in members.values() for node in slots}
    if not all(m in table.rates for m in members):  # a policy that plans without rates
        if len(nodes) == 1:
            return Topology.single_broadcast, "all trainers on one node: one producer, shared memory"
        return Topology.all_shared, f"{len(nodes)} nodes, members' rates not measured: every node makes a share"
    rates = sorted(table.rate(m, len(slots)) for m, slots in members.items())
    if len(rates) >= 2 and rates[0] > 0 and rates[-1] / rates[0] >= SPREAD_FOR_STREAMS:
        return Topology.multi_broadcast, (f"members' speeds differ {rates[-1] / rates[0]:.1f}x: streams of similar "
                                          "speed, each fed at its own pace, instead of all held to the slowest")
    if len(nodes) == 1:
        return Topology.single_broadcast, ("all trainers on one node: one producer writes each batch once into "
                                           "shared memory for all of them")
    everyone = tuple(members)
    single = stream_rate(everyone, members, Topology.single_broadcast, table, cluster)
    if single >= rates[0]:
        return Topology.single_broadcast, (f"{len(nodes)} nodes; one producer node makes the {rates[0]:.0f} "
                                           "images/s the flotilla takes: it suffices and moves the fewest bytes")
    shared = stream_rate(everyone, members, Topology.all_shared, table, cluster)
    return Topology.all_shared, (f"{len(nodes)} nodes; one producer node makes {single:.0f} images/s, the flotilla "
                                 f"takes {rates[0]:.0f}: every node makes a share ({shared:.0f} images/s)")
