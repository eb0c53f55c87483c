"""Exact solver for small instances of the FLEET-G decision process.

What "optimum" means here: the schedule is a sequence of rounds. Each round
starts on an idle cluster with one flotilla (any subset of the unconverged
groups, each on any slot count it can run on, placeable with every group
inside one node), flowing once its members have started (the longest
`RateTable.start`), runs it under the shared execution rules (lockstep at the
slowest active member's rate capped by the CPUs, converged members leave,
stop once fewer than `min_active_fraction` of its slots are active, then
`checkpoint_seconds` until the slots are back) and ends; the next round
starts from the groups still unconverged. The optimum is the least total
time over all such sequences, found by exhaustive search (memoised on the
epochs each group still needs; exact branch-and-bound pruning with a lower
bound). FLEET-G picks one of these flotillas per round greedily, so its
simulated time cannot fall below the optimum while each of its flotillas is
one stream; the scheduler may split one into multi_broadcast streams, each
at its own pace, which this search does not model.
"""

from __future__ import annotations

from functools import lru_cache
from itertools import product

from pipeline.scheduler.planner import fits, flotilla_rate
from pipeline.scheduler.simulate import Instance, lower_bound

MAX_GROUPS, MAX_SLOTS = 6, 8


def run_round(members: dict[str, int], epochs_left: dict[str, int], instance: Instance,
              min_active_fraction: float) -> tuple[float, dict[str, int]]:
    """Duration of one round of flotilla `members`, and the epochs left after it."""
    left = dict(epochs_left)
    active = dict(members)
    total_slots, elapsed = sum(members.values()), max(instance.table.start(m) for m in members)
    prep = instance.cluster.prep_rate_per_slot
    while True:
        rate = flotilla_rate(active, instance.table, prep)
        step = min(left[m] for m in active)  # epochs until the next member converges
        elapsed += step * instance.images_per_epoch / rate
        for group in active:
            left[group] -= step
        active = {m: g for m, g in active.items() if left[m] > 0}
        if not active or sum(active.values()) < min_active_fraction * total_slots - 1e-9:
            return elapsed + instance.checkpoint_seconds, left


def optimal_time(instance: Instance, min_active_fraction: float = 0.8) -> float:
    """Least end-to-end time over all round sequences (see module doc)."""
    groups = sorted(instance.epochs)
    cluster, table = instance.cluster, instance.table
    if len(groups) > MAX_GROUPS or cluster.total_slots > MAX_SLOTS:
        raise ValueError(
            f"exact search is for up to {MAX_GROUPS} groups and {MAX_SLOTS} slots, got {len(groups)} groups "
            f"and {cluster.total_slots} slots; use a smaller instance or the greedy policies")
    k = cluster.slots_per_node
    nodes = [k] * cluster.nodes
    choices = [[0, *table.slot_counts(m, k)] for m in groups]
    plans = [counts for counts in product(*choices) if any(counts) and fits([g for g in counts if g], nodes)]

    @lru_cache(maxsize=None)
    def best(left: tuple[int, ...]) -> float:
        if not any(left):
            return 0.0
        options = []
        for counts in plans:
            if any(g and not e for g, e in zip(counts, left)):
                continue
            members = {m: g for m, g in zip(groups, counts) if g}
            duration, after = run_round(members, dict(zip(groups, left)), instance, min_active_fraction)
            after_left = tuple(after[m] for m in groups)
            options.append((duration + lower_bound(instance, after), duration, after_left))
        options.sort()
        result = float("inf")
        for estimate, duration, after_left in options:
            if estimate >= result:
                break
            result = min(result, duration + best(after_left))
        return result

    return best(tuple(instance.epochs[m] for m in groups))
