"""The run's slot groups: which models train together in one trainer process,
packed or fused, and whether they fit a slot's memory.

The scheduler's rule (pipeline/scheduler/groups.py) decides who shares a slot
from each model's cost: its measured seconds per image when rates were
measured, else an estimate from its multiply-adds. Whether a group's family
fuses is `trainer.grouping`: `fuse`, `pack`, or with `auto` the faster of the
two as measured (and cached) on one slot: fusion pays on GPUs and may lose
on CPUs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from pipeline.orchestration.devices import MEMORY_HEADROOM, SlotError
from pipeline.scheduler.cluster import RateTable
from pipeline.scheduler.groups import Candidate, Grouping, form_groups, group_name
from pipeline.training.group import GroupSpec, ModelSpec
from pipeline.training.rates import Measurement, measure_rate_table


@dataclass(frozen=True)
class ModelSize:
    """What a model weighs, from one build at its image size."""

    params: int
    state_bytes: int  # parameters, gradients, momentum, buffers
    activation_bytes: int  # saved for backward, per step on one slot (its whole batch)
    flops: float  # multiply-adds of one image's training step


def measure_sizes(models: list[ModelSpec], num_classes: int, image_sizes: dict[str, int],
                  batch_size: int) -> dict[str, ModelSize]:
    from pipeline.training.models import build_model, count_parameters, estimate_step_flops, estimate_training_parts

    sizes = {}
    for m in models:
        side = image_sizes[m.input]
        net = build_model(m.arch, m.depth, m.width, m.growth_rate, num_classes, image_size=side)
        state, activations = estimate_training_parts(net, side, batch_size)
        sizes[m.name] = ModelSize(count_parameters(net), state, activations, estimate_step_flops(net, side))
    return sizes


def plan_groups(models: list[ModelSpec], sizes: dict[str, ModelSize], slots: int, grouping: Grouping,
                single_rates: RateTable | None) -> list[GroupSpec]:
    """The groups sharing `slots` slots; with `single_rates`, balanced by measured cost. Fusion is
    set as `grouping` says; `auto` fuses nothing yet (`choose_fusion` decides by measuring)."""
    def cost(m: ModelSpec) -> float:
        if single_rates is not None:
            return 1 / single_rates.rate(m.name, 1)
        return sizes[m.name].flops

    named = {m.name: m for m in models}
    candidates = [Candidate(m.name, m.slots, m.family, cost(m)) for m in models]
    return [GroupSpec(group_name(names, i), tuple(named[n] for n in names), grouping == Grouping.fuse)
            for i, names in enumerate(form_groups(candidates, slots, grouping))]


def choose_fusion(groups: list[GroupSpec], how: Measurement, cache: Path) -> tuple[list[GroupSpec], dict]:
    """trainer.grouping=auto: each group with a family to fuse is measured packed and fused on one slot
    and trains as the faster. Returns the groups and, per group measured, both rates (images/s)."""
    chosen, measured = [], {}
    for group in groups:
        if all(len(unit) == 1 for unit in replace(group, fuse=True).units()):
            chosen.append(group)  # nothing to fuse
            continue
        variants = [replace(group, fuse=False), replace(group, fuse=True)]
        rates = [measure_rate_table([v], 1, how, cache).rate(group.name, 1) for v in variants]
        measured[group.name] = {"packed": rates[0], "fused": rates[1]}
        chosen.append(variants[rates[1] > rates[0]])
    return chosen, measured


def group_bytes(group: GroupSpec, sizes: dict[str, ModelSize]) -> int:
    """A group's memory on one of its slots: every member's state, and the activations of the largest
    unit stepped at once (members step in turn; a fused array holds all its members' at once).
    A data-parallel model holds its 1/g share of the batch's activations."""
    state = sum(sizes[m.name].state_bytes for m in group.members)
    activations = max(sum(sizes[m.name].activation_bytes for m in unit) for unit in group.units())
    return state + math.ceil(activations / group.slots)


def check_group_memory(groups: list[GroupSpec], sizes: dict[str, ModelSize], slot_bytes: int) -> None:
    for group in groups:
        need = group_bytes(group, sizes) * MEMORY_HEADROOM
        if need > slot_bytes:
            what = f"model {group.name}" if len(group.members) == 1 else \
                f"group {group.name} ({len(group.members)} models: {', '.join(m.name for m in group.members)})"
            raise SlotError(
                f"{what} needs about {need / 2**30:.2f} GiB per slot to train (estimate x{MEMORY_HEADROOM} "
                f"headroom) but a slot has {slot_bytes / 2**30:.2f} GiB; lower pipeline.batch_size, make the "
                "models smaller (depth/width), raise trainer.slots (fewer models per slot), use "
                "trainer.grouping=pack (a fused array holds all its members' activations at once), or set "
                "trainer.slot_memory_gb")
