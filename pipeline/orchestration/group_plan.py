"""The run's slot groups: which models train together in one trainer process,
packed or fused, and whether they fit a slot's memory.

The scheduler's rule (pipeline/scheduler/slot_groups.py) decides who shares a slot
from each model's cost: its measured seconds per image when rates were
measured, else an estimate from its multiply-adds. Whether a group's family
fuses is `trainer.grouping`: `fuse`, `pack`, or with `auto` the faster of the
two as measured (and cached) on one slot: fusion pays on GPUs and may lose
on CPUs. On a GPU `auto` also measures each way's units on several CUDA
streams side by side (`stream_counts`). `auto` then measures whether a
device's models train faster in several processes side by side on it
(sub-slots, `choose_sub_slots`): on a GPU, one process steps its models one
after another from one thread and is bound by kernel launches.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from pipeline.orchestration.devices import MEMORY_HEADROOM, SlotError
from pipeline.scheduler.cluster import RateTable
from pipeline.scheduler.slot_groups import Candidate, Grouping, form_groups, group_name
from pipeline.training.group import GroupSpec
from pipeline.training.members import ModelSpec
from pipeline.training.rates import Measurement, measure_rate_table, measure_side_by_side
from pipeline.training.trainer import KEPT_EPOCHS


@dataclass(frozen=True)
class ModelSize:
    """What a model weighs, from one build at its image size (on CUDA, its activations as measured)."""

    params: int
    state_bytes: int  # parameters, gradients, the optimiser's state, buffers
    activation_bytes: int  # saved for backward, per step on one slot (its whole batch)
    flops: float  # multiply-adds of one image's training step
    # A measured step's peak beyond its state and activations (cuBLAS's and cuDNN's workspaces, the graphs'
    # pool, the backward pass's transients), measured on a GPU: a process that steps its models in turn
    # holds it once, one on several CUDA streams once per stream (group_bytes).
    workspace_bytes: int = 0
    # One copy of its state (no gradients) kept from an epoch's end (trainer._keep_states), and how many of
    # them its slot holds: on a GPU one, until the checkpoint writer has moved it to host memory, which holds
    # KEPT_EPOCHS of them (check_host_memory); on CPU, whose slots share host memory, KEPT_EPOCHS.
    kept_copy_bytes: int = 0
    copies_on_slot: int = 1

    @property
    def kept_on_slot_bytes(self) -> int:
        return self.kept_copy_bytes * self.copies_on_slot


def measure_sizes(models: list[ModelSpec], num_classes: int, image_sizes: dict[str, int],
                  batch_size: int, device_kind: str) -> dict[str, ModelSize]:
    from pipeline.training.members import build_module, canonical, optimizer_state_bytes
    from pipeline.training.models import (count_parameters, estimate_step_flops, estimate_training_bytes,
                                          kept_state_bytes)

    copies_on_slot = 1 if device_kind == "cuda" else KEPT_EPOCHS
    nets: dict[str, object] = {}  # a grid's members weigh the same: one build per shape
    sizes: dict[str, ModelSize] = {}  # ...and per kind of optimiser (ModelSpec.optimizer_kind)
    by_name = {}
    for m in models:
        side = image_sizes[m.input]
        if m.shape not in nets:
            nets[m.shape] = build_module(m, num_classes, side)
        net = nets[m.shape]
        key = canonical([m.shape, m.optimizer_kind])
        if key not in sizes:
            optimizer_bytes = optimizer_state_bytes(m, net)
            state, activations = estimate_training_bytes(net, side, batch_size, optimizer_bytes)
            sizes[key] = ModelSize(count_parameters(net), state, activations, estimate_step_flops(net, side),
                                   kept_copy_bytes=kept_state_bytes(net, optimizer_bytes),
                                   copies_on_slot=copies_on_slot)
        by_name[m.name] = sizes[key]
    return by_name


def with_measured_peaks(sizes: dict[str, ModelSize], peaks: dict[str, int]) -> dict[str, ModelSize]:
    """`sizes` with what each measured model's peak (pipeline/training/memory.py) holds beyond its estimated
    state and activations as its workspace. The activations stay estimated: they scale with the members of
    a fused array, the workspaces do not."""
    return {name: replace(size, workspace_bytes=max(peaks[name] - size.state_bytes - size.activation_bytes, 0))
            if name in peaks else size for name, size in sizes.items()}


def plan_groups(models: list[ModelSpec], sizes: dict[str, ModelSize], slots: int, grouping: Grouping,
                single_rates: RateTable | None) -> list[GroupSpec]:
    """The groups sharing `slots` slots, packed; with `single_rates`, balanced by measured cost."""
    def cost(m: ModelSpec) -> float:
        if single_rates is not None:
            return 1 / single_rates.rate(m.name, 1)
        return sizes[m.name].flops

    named = {m.name: m for m in models}
    candidates = [Candidate(m.name, m.slots, m.fuses_with, cost(m)) for m in models]
    return [GroupSpec(group_name(names, i), tuple(named[n] for n in names))
            for i, names in enumerate(form_groups(candidates, slots, grouping))]


def fused(group: GroupSpec, sizes: dict[str, ModelSize], slot_bytes: int, lanes: int) -> GroupSpec:
    """`group` with its families fused into the largest arrays that fit a slot (a fused array holds
    all its members' activations at once), and on CPU no larger than one per thread (`lanes`: units
    step side by side there, pipeline/training/group.py); packed if no array of two or more fits."""
    for size in range(-(-group.largest_family // lanes), 1, -1):
        candidate = replace(group, array_size=size)
        if group_bytes(candidate, sizes, lanes) * MEMORY_HEADROOM <= slot_bytes:
            return candidate
    return group


def choose_sharing(groups: list[GroupSpec], grouping: Grouping, sizes: dict[str, ModelSize], slot_bytes: int,
                   lanes: int, how: Measurement, cache: Path) -> tuple[list[GroupSpec], dict]:
    """How each group shares its slot, as trainer.grouping says: `fuse` fuses every family that fits; `auto`
    measures each group with a family to fuse packed and fused on one slot, on a GPU each way on 1, 2, 4, ...
    CUDA streams (`stream_counts`), and keeps the fastest. Returns the groups and, per group measured, the
    rates (images/s): packed and fused on one stream, and on a GPU each way's by streams."""
    if grouping == Grouping.fuse:
        return [fused(g, sizes, slot_bytes, lanes) for g in groups], {}
    if grouping != Grouping.auto:
        return groups, {}
    chosen, measured = [], {}
    for group in groups:
        variant = fused(group, sizes, slot_bytes, lanes)
        ways = {"packed": group, "fused": variant} if variant.array_size > 1 else {"packed": group}
        counts = {way: stream_counts(g, sizes, slot_bytes) if how.device_kind == "cuda" else [1]
                  for way, g in ways.items()}
        if sum(map(len, counts.values())) == 1:
            chosen.append(group)  # nothing to fuse, and no streams to try (on CPU, or one unit)
            continue
        rates = {way: {n: measure_rate_table([replace(ways[way], cuda_streams=n)], 1, how, cache).rate(group.name, 1)
                       for n in ns} for way, ns in counts.items()}
        way, streams = max(((w, n) for w in rates for n in rates[w]), key=lambda pick: rates[pick[0]][pick[1]])
        chosen.append(replace(ways[way], cuda_streams=streams))
        record = measured[group.name] = {}
        if variant.array_size > 1:
            record.update(packed=rates["packed"][1], fused=rates["fused"][1], array_size=variant.array_size)
        if any(len(ns) > 1 for ns in counts.values()):
            record["cuda_streams"] = {w: {str(n): rate for n, rate in by.items()} for w, by in rates.items()}
    return chosen, measured


MOST_STREAMS = 8  # a GPU's streams a group's units are tried on: enough to overlap small kernels


def stream_counts(group: GroupSpec, sizes: dict[str, ModelSize], slot_bytes: int) -> list[int]:
    """The CUDA streams `group`'s units may step on side by side: 1 (in turn), 2, 4, ... up to one per unit,
    at most MOST_STREAMS, while the units stepped at once fit the slot (each stream holds its own step's
    activations and workspace)."""
    return [n for n in doublings(len(group.units())) if n == 1 or n <= MOST_STREAMS
            and group_bytes(replace(group, cuda_streams=n), sizes) * MEMORY_HEADROOM <= slot_bytes]


def doublings(most: int) -> list[int]:
    """1, 2, 4, ... and `most` itself: the counts grouping=auto tries of streams or processes."""
    return sorted({*(2 ** i for i in range(most.bit_length())), most})


def choose_sub_slots(models: list[ModelSpec], groups: list[GroupSpec], sizes: dict[str, ModelSize], devices: int,
                     most: int, split: Callable[[int], tuple[Measurement, int]],
                     cache: Path) -> tuple[int, list[GroupSpec], dict[str, float]]:
    """grouping=auto's last choice: whether the models of each of `devices` devices train faster in one
    trainer process (`groups`, packed or fused as measured) or in n side by side (trainer.slots_per_device=n),
    grouped again over n times the slots. `split(n)`: how a process of n on a device is measured (its share
    of a CPU slot's threads) and its slot's memory. Tried for n = 2, 4, ... up to the largest group (each
    model its own process), at most `most`, while the groups fit their slots. A layout is timed on one
    device: its first n groups side by side (groups balance their cost), the slowest setting the pace as it
    sets a flotilla's. Returns the fastest n, its groups, and each layout's images/s by n."""
    largest = max(len(g.members) for g in groups)
    how, _ = split(1)
    if largest == 1 or most < 2:
        return 1, groups, {}
    paces, layouts = {1: measure_rate_table(groups[:1], 1, how, cache).rate(groups[0].name, 1)}, {1: groups}
    for n in doublings(largest)[1:]:
        if n > most:
            break
        how, slot_bytes = split(n)
        lanes = how.threads if how.device_kind == "cpu" else 1
        layout = plan_groups(models, sizes, devices * n, Grouping.auto, None)
        layout, _ = choose_sharing(layout, Grouping.auto, sizes, slot_bytes, lanes, how, cache)
        if any(group_bytes(g, sizes, lanes) * MEMORY_HEADROOM > slot_bytes for g in layout):
            break  # more processes have less memory each
        paces[n], layouts[n] = measure_side_by_side(layout[:n], how, cache).images_per_s, layout
    best = max(paces, key=paces.get)
    return best, layouts[best], {str(n): pace for n, pace in paces.items()}


def group_bytes(group: GroupSpec, sizes: dict[str, ModelSize], lanes: int = 1) -> int:
    """A group's memory on one of its slots: every member's state and the copies of it kept from epochs'
    ends (ModelSize.kept_on_slot_bytes), the activations of the units
    stepped at once (the largest one, or the largest side by side: on CPU `lanes`, one per thread, on a GPU
    one per stream of the group's; a fused array holds all its members' activations), and as many of the largest
    members' workspaces (once for a process that steps its units in turn; on a GPU each stream has its own
    graph pool and cuBLAS workspace). A data-parallel model holds its 1/g share of the batch's activations."""
    at_once = max(lanes, group.side_by_side)
    state = sum(sizes[m.name].state_bytes + sizes[m.name].kept_on_slot_bytes for m in group.members)
    units = sorted((sum(sizes[m.name].activation_bytes for m in unit) for unit in group.units()), reverse=True)
    workspaces = sorted((sizes[m.name].workspace_bytes for m in group.members), reverse=True)
    return state + math.ceil(sum(units[:at_once]) / group.slots) + sum(workspaces[:at_once])


def check_group_memory(groups: list[GroupSpec], sizes: dict[str, ModelSize], slot_bytes: int,
                       lanes: int = 1) -> None:
    for group in groups:
        need = group_bytes(group, sizes, lanes) * MEMORY_HEADROOM
        if need > slot_bytes:
            what = f"model {group.name}" if len(group.members) == 1 else \
                f"group {group.name} ({len(group.members)} models: {', '.join(m.name for m in group.members)})"
            raise SlotError(
                f"{what} needs about {need / 2**30:.2f} GiB per slot to train (x{MEMORY_HEADROOM} "
                f"headroom) but a slot has {slot_bytes / 2**30:.2f} GiB; lower pipeline.batch_size, make the "
                "models smaller (depth/width), raise trainer.slots (fewer models per slot), use "
                "trainer.grouping=pack (a fused array holds all its members' activations at once), or set "
                "trainer.slot_memory_gb")


def check_host_memory(groups: list[GroupSpec], sizes: dict[str, ModelSize], slots: int, room: int) -> None:
    """On GPU slots each member's states from its KEPT_EPOCHS last epochs' ends are kept in host memory (the
    checkpoints its trainer may be asked for): those of the groups that train at once on this host's `slots`
    (at most the largest `slots` groups) must fit `room`, with headroom."""
    kept = sorted((sum(sizes[m.name].kept_copy_bytes for m in g.members) for g in groups), reverse=True)
    need = KEPT_EPOCHS * sum(kept[:slots]) * MEMORY_HEADROOM
    if need > room:
        raise SlotError(
            f"the trainers on this host's {slots} GPU slot(s) keep each model's state from its last {KEPT_EPOCHS} "
            f"epochs' ends in host memory, for its checkpoints: about {need / 2**30:.2f} GiB (x{MEMORY_HEADROOM} "
            f"headroom) for these models, but the trainers have {room / 2**30:.2f} GiB of this host's memory; "
            "train fewer or smaller models in one run (ensemble.models), or free memory on this host")
