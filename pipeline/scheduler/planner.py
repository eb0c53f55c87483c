"""Flotilla creation and slot assignment (FLEET steps 1 and 2).

A flotilla is a dict model -> slot count. All functions are pure.
"""

from __future__ import annotations

from collections import defaultdict

from pipeline.scheduler.profile import Cluster, Profile, Slot

TOLERANCE = 0.2  # a member may be this much slower than the target (fraction)


def flotilla_rate(members: dict[str, int], profile: Profile, prep_rate_per_slot: float) -> float:
    """Images/s of a flotilla: its slowest member's rate, capped by the
    preprocessing that the cores of its slots can supply (one shared pipeline)."""
    slowest = min(profile.rate(model, slots) for model, slots in members.items())
    return min(slowest, prep_rate_per_slot * sum(members.values()))


def fits(slot_counts: list[int], free_per_node: list[int]) -> bool:
    """Whether models needing these slot counts can be placed, each within one
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
    """Best-fit decreasing: models needing most slots first; each goes to the
    node with the fewest free slots that still holds it (lowest node on ties),
    so a multi-slot model stays within one node and small models share nodes."""
    by_node: dict[int, list[Slot]] = defaultdict(list)
    for slot in sorted(free_slots):
        by_node[slot.node].append(slot)
    placement = {}
    for model in sorted(members, key=lambda m: -members[m]):
        need = members[model]
        nodes = [n for n in sorted(by_node) if len(by_node[n]) >= need]
        if not nodes:
            raise ValueError(
                f"model {model!r} needs {need} slots on one node but the free slots are "
                f"{sorted(map(str, free_slots))}; plan with `fits` before assigning")
        node = min(nodes, key=lambda n: len(by_node[n]))
        placement[model], by_node[node] = tuple(by_node[node][:need]), by_node[node][need:]
    return placement


def free_per_node(free_slots: list[Slot]) -> list[int]:
    counts: dict[int, int] = defaultdict(int)
    for slot in free_slots:
        counts[slot.node] += 1
    return list(counts.values())


def greedy_flotilla(pending: list[str], profile: Profile, cluster: Cluster, free_nodes: list[int],
                    tolerance: float = TOLERANCE, refined: bool = True) -> dict[str, int]:
    """FLEET's greedy flotilla creation on the free slots (`free_nodes`: free
    slots per node). See docs/scheduler.md for the worked example.

    1. Reference: the pending model with the highest rate on its smallest
       runnable slot count (usually 1 slot) -- unless a *critical* model
       exists (`critical_model`), which then joins first on its fastest slot
       count. The reference's rate is the target.
    2. Every (model, slot count) pair of the other pending models is ranked by
       the distance of its rate to the target, |rate - target| / target, then
       by fewer slots, then by `pending` order. Walking that ranking, a pair
       joins if its model is not in yet, its rate is at least
       (1 - tolerance) * target, and the flotilla still fits the free slots.
    3. Slots still free go to the slowest member while that speeds it up
       (`upgrade_bottleneck`).
    Ranking by distance keeps member rates similar (rule a); walking until the
    ranking or the slots run out packs as many models as fit (rule b).
    Faster pairs may always join: they cost the flotilla no speed.
    `refined=False` is the slides' rule alone (no critical model, no
    tolerance, no upgrade), kept to measure what the refinements gain.
    """
    k = cluster.slots_per_node
    startable = [(profile.rate(m, g), -i, m, g) for i, m in enumerate(pending)
                 for g in profile.slot_counts(m, k)[:1] if fits([g], free_nodes)]
    if not startable:
        return {}
    _, _, reference, reference_slots = max(startable)
    if refined:
        reference, reference_slots = (critical_model(pending, profile, cluster, free_nodes)
                                      or (reference, reference_slots))
    target = profile.rate(reference, reference_slots)
    members = {reference: reference_slots}
    ranking = sorted((abs(profile.rate(m, g) - target) / target, g, i, m)
                     for i, m in enumerate(pending) if m != reference
                     for g in profile.slot_counts(m, k))
    for _, g, _, model in ranking:
        if (model not in members and (not refined or profile.rate(model, g) >= (1 - tolerance) * target)
                and fits([*members.values(), g], free_nodes)):
            members[model] = g
    return upgrade_bottleneck(members, profile, cluster, free_nodes) if refined else members


def critical_model(pending: list[str], profile: Profile, cluster: Cluster,
                   free_nodes: list[int]) -> tuple[str, int] | None:
    """The slowest model and its fastest slot count, if it is critical: with
    equal work left for every pending model (convergence is unknown ahead),
    it would finish after the whole set packed perfectly on the free slots
    (each model on its most slot-efficient count). Such a model must start
    now, as fast as it can, or it becomes the tail of the run."""
    k = min(cluster.slots_per_node, max(free_nodes))
    fastest = {m: max((profile.rate(m, g), -g) for g in profile.slot_counts(m, k))
               for m in pending if profile.slot_counts(m, k)}
    if not fastest:
        return None
    packed = sum(1 / max(profile.rate(m, g) / g for g in profile.slot_counts(m, cluster.slots_per_node))
                 for m in pending) / sum(free_nodes)
    slowest = min(fastest, key=lambda m: fastest[m])
    rate, minus_slots = fastest[slowest]
    return (slowest, -minus_slots) if 1 / rate > packed else None


def upgrade_bottleneck(members: dict[str, int], profile: Profile, cluster: Cluster,
                       free_nodes: list[int]) -> dict[str, int]:
    """Spend slots left over after the ranking: give the slowest member one
    more slot while that raises the flotilla rate and still fits."""
    members = dict(members)
    while True:
        slowest = min(members, key=lambda m: (profile.rate(m, members[m]), m))
        more = members[slowest] + 1
        if (profile.rate(slowest, more) <= profile.rate(slowest, members[slowest])
                or not fits([*members.values(), 1], free_nodes)
                or not fits([g for m, g in members.items() if m != slowest] + [more], free_nodes)):
            return members
        members[slowest] = more
