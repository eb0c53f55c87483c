"""Flotilla creation and slot assignment (FLEET steps 1 and 2).

A flotilla is a dict group -> slot count. All functions are pure.
"""

from __future__ import annotations

from collections import defaultdict

from pipeline.scheduler.cluster import Cluster, RateTable, Slot

TOLERANCE = 0.2  # a member may be this much slower than the target (fraction)


def flotilla_rate(members: dict[str, int], table: RateTable, prep_rate_per_slot: float) -> float:
    """Images/s of a flotilla: its slowest member's rate, capped by the
    preprocessing that the cores of its slots can supply (one shared pipeline)."""
    slowest = min(table.rate(group, slots) for group, slots in members.items())
    return min(slowest, prep_rate_per_slot * sum(members.values()))


def fits(slot_counts: list[int], free_per_node: list[int]) -> bool:
    """Whether groups needing these slot counts can be placed, each within one
    node, by best-fit decreasing (the same rule `assign_slots` uses)."""
    free = sorted(free_per_node)
    for need in sorted(slot_counts, reverse=True):
        node = next((i for i, n in enumerate(free) if n >= need), None)
        if node is None:
            return False
        free[node] -= need
        free.sort()
    return True


def assign_slots(members: dict[str, int], free_slots: list[Slot]) -> dict[str, tuple[Slot, ...]]:
    """Best-fit decreasing: groups needing most slots first; each goes to the
    node with the fewest free slots that still holds it (lowest node on ties),
    so a multi-slot group stays within one node and small groups share nodes."""
    by_node: dict[int, list[Slot]] = defaultdict(list)
    for slot in sorted(free_slots):
        by_node[slot.node].append(slot)
    placement = {}
    for group in sorted(members, key=lambda m: -members[m]):
        need = members[group]
        nodes = [n for n in sorted(by_node) if len(by_node[n]) >= need]
        if not nodes:
            raise ValueError(
                f"group {group!r} needs {need} slots on one node but the free slots are "
                f"{sorted(map(str, free_slots))}; plan with `fits` before assigning")
        node = min(nodes, key=lambda n: len(by_node[n]))
        placement[group], by_node[node] = tuple(by_node[node][:need]), by_node[node][need:]
    return placement


def free_by_node(free_slots: list[Slot]) -> dict[int, int]:
    """Node -> its free slots (nodes with none left out)."""
    counts: dict[int, int] = defaultdict(int)
    for slot in free_slots:
        counts[slot.node] += 1
    return dict(counts)


def free_per_node(free_slots: list[Slot]) -> list[int]:
    return list(free_by_node(free_slots).values())


def greedy_flotilla(pending: list[str], table: RateTable, cluster: Cluster, free_nodes: list[int],
                    tolerance: float = TOLERANCE, reference: tuple[str, int] | None = None) -> dict[str, int]:
    """FLEET's greedy flotilla creation on the free slots (`free_nodes`: free
    slots per node). See docs/scheduler.md for the worked example.

    1. Reference: `reference` (group, slot count) if given; else the critical
       group (`critical_group`) on its fastest slot count if there is one;
       else the pending group with the highest rate on its smallest runnable
       slot count (usually 1 slot). The reference's rate is the target.
    2. Every (group, slot count) pair of the other pending groups is ranked by
       the distance of its rate to the target, |rate - target| / target, then
       by fewer slots, then by `pending` order. Walking that ranking, a pair
       joins if its group is not in yet, its rate is at least
       (1 - tolerance) * target, and the flotilla still fits the free slots.
    3. Slots still free go to the slowest member while that speeds it up
       (`upgrade_bottleneck`).
    Ranking by distance keeps member rates similar (rule a); walking until the
    ranking or the slots run out packs as many groups as fit (rule b).
    Faster pairs may always join: they cost the flotilla no speed.
    """
    k = cluster.slots_per_node
    if reference is None:
        startable = [(table.rate(m, g), -i, m, g) for i, m in enumerate(pending)
                     for g in table.slot_counts(m, k)[:1] if fits([g], free_nodes)]
        if not startable:
            return {}
        _, _, *fastest = max(startable)
        reference = critical_group(pending, table, cluster, free_nodes) or tuple(fastest)
    reference_group, reference_slots = reference
    target = table.rate(reference_group, reference_slots)
    members = {reference_group: reference_slots}
    ranking = sorted((abs(table.rate(m, g) - target) / target, g, i, m)
                     for i, m in enumerate(pending) if m != reference_group
                     for g in table.slot_counts(m, k))
    for _, g, _, group in ranking:
        if (group not in members and table.rate(group, g) >= (1 - tolerance) * target
                and fits([*members.values(), g], free_nodes)):
            members[group] = g
    return upgrade_bottleneck(members, table, cluster, free_nodes)


def lookahead_flotilla(pending: list[str], table: RateTable, cluster: Cluster, free_nodes: list[int],
                       tolerance: float = TOLERANCE) -> dict[str, int]:
    """The best of the greedy's flotillas, one per possible reference (every
    pending group on every slot count that fits), scored by the completion
    time of the whole remaining schedule rather than by rate.

    Convergence is not known ahead, so every pending group is assumed to have
    the same work left (one unit of images): a flotilla then takes
    1 / rate, and its score is that plus `remaining_time` of the groups it
    leaves out. Cost: (groups x slot counts)^2 x groups greedy walks, so the
    policies use it only for small pending sets (`FleetG.lookahead`).
    """
    k = cluster.slots_per_node
    candidates = [greedy_flotilla(pending, table, cluster, free_nodes, tolerance, (m, g))
                  for m in pending for g in table.slot_counts(m, k) if fits([g], free_nodes)]
    if not candidates:
        return {}
    prep = cluster.prep_rate_per_slot

    def score(flotilla: dict[str, int]) -> float:
        rest = [m for m in pending if m not in flotilla]
        return 1 / flotilla_rate(flotilla, table, prep) + remaining_time(rest, table, cluster, tolerance)

    return min(candidates, key=score)


def remaining_time(pending: list[str], table: RateTable, cluster: Cluster, tolerance: float = TOLERANCE) -> float:
    """Time (per unit of work left in every group) to train `pending` from an
    idle cluster, round after round: each round takes the greedy flotilla,
    over all references, that minimises its own time plus `lower_bound` of
    the groups left after it."""
    k, whole = cluster.slots_per_node, [cluster.slots_per_node] * cluster.nodes
    prep, total = cluster.prep_rate_per_slot, 0.0
    while pending:
        candidates = [greedy_flotilla(pending, table, cluster, whole, tolerance, (m, g))
                      for m in pending for g in table.slot_counts(m, k)]
        options = []
        for flotilla in candidates:
            rest = [m for m in pending if m not in flotilla]
            time = 1 / flotilla_rate(flotilla, table, prep)
            options.append((time + lower_bound(rest, table, cluster), time, rest))
        _, time, pending = min(options, key=lambda o: o[:2])
        total += time
    return total


def lower_bound(pending: list[str], table: RateTable, cluster: Cluster) -> float:
    """`work_bound` with one unit of work left in every pending group."""
    return work_bound(dict.fromkeys(pending, 1.0), table, cluster)


def work_bound(work: dict[str, float], table: RateTable, cluster: Cluster) -> float:
    """Time no schedule can beat for `work` (group -> images left): no group beats its fastest rate,
    and the slot-seconds cannot beat every group on its most slot-efficient count spread over all
    slots. Whatever runs at once and whoever shares a stream: the CPUs are left out."""
    work = {m: w for m, w in work.items() if w > 0}
    if not work:
        return 0.0
    k = cluster.slots_per_node
    alone = max(w / max(table.rates[m][:k]) for m, w in work.items())
    packed = sum(w / max(table.rate(m, g) / g for g in table.slot_counts(m, k)) for m, w in work.items())
    return max(alone, packed / cluster.total_slots)


def critical_group(pending: list[str], table: RateTable, cluster: Cluster,
                   free_nodes: list[int]) -> tuple[str, int] | None:
    """The slowest group and its fastest slot count, if it is critical: with
    equal work left for every pending group (convergence is unknown ahead),
    it would finish after the whole set packed perfectly on the free slots
    (each group on its most slot-efficient count). Such a group must start
    now, as fast as it can, or it becomes the tail of the run."""
    k = min(cluster.slots_per_node, max(free_nodes))
    fastest = {m: max((table.rate(m, g), -g) for g in table.slot_counts(m, k))
               for m in pending if table.slot_counts(m, k)}
    if not fastest:
        return None
    packed = sum(1 / max(table.rate(m, g) / g for g in table.slot_counts(m, cluster.slots_per_node))
                 for m in pending) / sum(free_nodes)
    slowest = min(fastest, key=lambda m: fastest[m])
    rate, minus_slots = fastest[slowest]
    return (slowest, -minus_slots) if 1 / rate > packed else None


def upgrade_bottleneck(members: dict[str, int], table: RateTable, cluster: Cluster,
                       free_nodes: list[int]) -> dict[str, int]:
    """Spend slots left over after the ranking: give the slowest member one
    more slot while that raises the flotilla rate and still fits."""
    members = dict(members)
    while True:
        slowest = min(members, key=lambda m: (table.rate(m, members[m]), m))
        more = members[slowest] + 1
        if (table.rate(slowest, more) <= table.rate(slowest, members[slowest])
                or not fits([*members.values(), 1], free_nodes)
                or not fits([g for m, g in members.items() if m != slowest] + [more], free_nodes)):
            return members
        members[slowest] = more


def longest_first(pending: list[str], table: RateTable, cluster: Cluster) -> list[str]:
    """`pending` with the groups expected to take longest first. Convergence is
    unknown ahead, so every group is assumed to have the same work left and
    the slowest on its smallest runnable slot count comes first (ties: `pending` order)."""
    k = cluster.slots_per_node
    return sorted(pending, key=lambda m: table.rate(m, table.slot_counts(m, k)[0]))


def spread_slots(members: dict[str, int], table: RateTable, free_nodes: list[int]) -> dict[str, int]:
    """Slots left over go, one at a time, to the member whose time per unit
    of work drops most with one more slot, while one still fits."""
    members = dict(members)
    while True:
        gains = []
        for group, slots in members.items():
            more = slots + 1
            if table.rate(group, more) > table.rate(group, slots) and fits(
                    [g for m, g in members.items() if m != group] + [more], free_nodes):
                gains.append((1 / table.rate(group, slots) - 1 / table.rate(group, more), group))
        if not gains:
            return members
        members[max(gains)[1]] += 1


def share_streams(members: dict[str, int], table: RateTable, cluster: Cluster,
                  tolerance: float = TOLERANCE) -> list[dict[str, int]]:
    """Flotillas for `members` (group -> slots): a group whose pipeline alone
    would hold it below its training rate (its slots' cores preprocess less)
    shares one stream with CPU-held groups of like rate (each within
    `tolerance` of the flotilla's fastest), which together have the cores of all
    their slots; every other group has a stream of its own, since lockstep
    would only slow it down."""
    prep = cluster.prep_rate_per_slot
    held = sorted((m for m, g in members.items() if table.rate(m, g) > prep * g),
                  key=lambda m: -table.rate(m, members[m]))
    flotillas = [{m: g} for m, g in members.items() if m not in held]
    sharing: dict[str, int] = {}
    for group in held:
        if sharing and table.rate(group, members[group]) < (1 - tolerance) * max(
                table.rate(m, g) for m, g in sharing.items()):
            flotillas.append(sharing)
            sharing = {}
        sharing[group] = members[group]
    return flotillas + ([sharing] if sharing else [])


def join_running(pending: list[str], table: RateTable, cluster: Cluster, free_slots: list[Slot],
                 running: dict[int, tuple[int, dict[str, int]]], tolerance: float = TOLERANCE,
                 held_only: bool = False) -> dict[str, int]:
    """Waiting groups placed into running flotillas (FLEET-L joining a running stream), in `pending`
    order: group -> flotilla. `running`: flotilla -> (its node, its members' slot counts). A group
    joins, on its smallest slot count and on the flotilla's node, the flotilla whose rate is nearest its
    own, if the flotilla's rate with it stays within `tolerance` of both its rate before and the group's
    own: nobody slows by more than a member of a flotilla may. With `held_only`, only groups whose own
    pipeline would hold them back (see `share_streams`) join: sharing pays in CPU alone.
    """
    prep, k = cluster.prep_rate_per_slot, cluster.slots_per_node
    room, members = free_by_node(free_slots), {fid: dict(m) for fid, (_, m) in running.items()}
    placed: dict[str, int] = {}
    for group in pending:
        slots = table.slot_counts(group, k)[0]
        own = table.rate(group, slots)
        if held_only and own <= prep * slots:
            continue
        options = []
        for fid, (node, _) in running.items():
            if room.get(node, 0) < slots:
                continue
            before = flotilla_rate(members[fid], table, prep)
            after = flotilla_rate({**members[fid], group: slots}, table, prep)
            if after >= (1 - tolerance) * max(before, own):
                options.append((abs(own - before), fid, node))
        if options:
            _, fid, node = min(options)
            placed[group] = fid
            members[fid][group] = slots
            room[node] -= slots
    return placed
