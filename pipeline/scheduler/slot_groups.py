"""Slot groups: which models share a slot's trainer process (seeds 004 Pack and 001 HFTA).

When the models outnumber the slots, several train in one trainer process on
the same delivered batch: packed (each its own module and optimiser, stepped
in turn) or, for models of one family (one module config, stream and loss;
they differ in optimiser, schedule and seed), as a fused array. The scheduler then places groups as it
places models: a group of one is a model, a group of several holds one slot.
Pure: it sees names, costs and family keys, never torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pipeline.scheduler.cluster import PlacementError

BALANCE_SLACK = 1e-9  # a float sum of equal costs may exceed the ideal load by rounding


class Grouping(enum.StrEnum):
    """trainer.grouping: how models that share a slot train."""

    auto = "auto"  # share slots only when models outnumber them; fuse where measured faster than packed
    separate = "separate"  # one model per slot, never shared
    pack = "pack"  # models that share a slot step in turn, each its own module and optimiser
    fuse = "fuse"  # as pack, but models of one family on a slot train as one fused array


@dataclass(frozen=True)
class Candidate:
    """What grouping needs to know of a model."""

    name: str
    slots: int  # it asks for (data-parallel when > 1: it keeps them to itself)
    family: str  # models of one family may fuse (ModelSpec.fuses_with)
    cost: float  # seconds per image on one slot, measured or estimated: only ratios matter


def form_groups(models: list[Candidate], slots: int, grouping: Grouping) -> list[tuple[str, ...]]:
    """The groups that share out `slots` slots, each a tuple of model names.

    Data-parallel models stay alone on their slots. The others share what is
    left only if they outnumber it (and grouping allows): each slot gets about
    the same cost, and a family stays on as few slots as balance allows (a
    fused array is faster the larger it is). The rule: walk the models by
    family (dearest family first); a model joins the slot where its family
    already is while that slot stays within the ideal load, else the least
    loaded slot.
    """
    parallel = [m for m in models if m.slots > 1]
    single = [m for m in models if m.slots == 1]
    left = slots - sum(m.slots for m in parallel)
    groups = [(m.name,) for m in parallel]
    if grouping == Grouping.separate or len(single) <= left:
        return groups + [(m.name,) for m in single]
    if left < 1:
        raise PlacementError(
            f"the data-parallel models take {slots - left} of the {slots} slots and leave none for the other "
            f"{len(single)}; lower their slots keys or raise trainer.slots")
    family_cost: dict[tuple, float] = {}
    for m in single:
        family_cost[m.family] = family_cost.get(m.family, 0.0) + m.cost
    order = sorted(single, key=lambda m: (-family_cost[m.family], repr(m.family), -m.cost, m.name))
    ideal = sum(m.cost for m in single) / left
    loads, members = [0.0] * left, [[] for _ in range(left)]
    home: dict[tuple, int] = {}  # family -> the slot it joined last
    for m in order:
        slot = home.get(m.family)
        if slot is None or loads[slot] + m.cost > ideal * (1 + BALANCE_SLACK):
            slot = min(range(left), key=lambda s: (loads[s], s))
        loads[slot] += m.cost
        members[slot].append(m.name)
        home[m.family] = slot
    return groups + [tuple(names) for names in members if names]


def group_name(members: tuple[str, ...], index: int) -> str:
    """A group of one is named after its model; a larger one after its place in the run."""
    return members[0] if len(members) == 1 else f"group{index}"
