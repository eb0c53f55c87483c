"""Places the ensemble's models on device slots.

Today every model trains at once in a single flotilla fed by the shared
pipeline; the FLEET scheduler (pipeline/scheduler) will decide flotillas and
slot counts instead and hand back the same `Plan`.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from pipeline.trainer import ModelSpec


class PlanError(ValueError):
    pass


@dataclass(frozen=True)
class Placement:
    model: ModelSpec
    devices: tuple[str, ...]  # one per slot, rank order: "cpu" or "cuda:<i>"


@dataclass(frozen=True)
class Plan:
    device_kind: str  # "cuda" or "cpu"
    slots: int  # device slots available
    flotillas: list[list[Placement]]

    @property
    def trainers(self) -> int:
        return sum(len(p.devices) for flotilla in self.flotillas for p in flotilla)


def resolve_device(requested: str, cuda_available: bool) -> str:
    if requested not in ("auto", "cpu", "cuda"):
        raise PlanError(f"trainer.device must be auto, cpu or cuda, got {requested!r}")
    if requested == "cuda" and not cuda_available:
        raise PlanError("trainer.device=cuda but no CUDA device is visible; use trainer.device=auto or cpu")
    return "cuda" if requested == "cuda" or (requested == "auto" and cuda_available) else "cpu"


def plan_single_flotilla(models: list[ModelSpec], device_kind: str, gpu_count: int, slots: int | str) -> Plan:
    """All models in one flotilla; a model's ranks on distinct slots, trainers
    spread round-robin (several share a slot when the slots run out)."""
    requested = sum(m.slots for m in models)
    if slots == "auto":
        available = gpu_count if device_kind == "cuda" else requested
    elif isinstance(slots, int) and slots >= 1:
        available = slots
    else:
        raise PlanError(f"trainer.slots must be a positive integer or 'auto', got {slots!r}")
    if device_kind == "cuda" and available > gpu_count:
        raise PlanError(f"trainer.slots={available} but this machine has {gpu_count} GPU(s); lower trainer.slots")
    placements, next_slot = [], 0
    for index, model in enumerate(models):
        if not 1 <= model.slots <= available:
            raise PlanError(f"ensemble.models[{index}].slots={model.slots} ({model.name}) cannot be met: "
                            f"{available} slot(s) available; set it between 1 and {available} "
                            "or raise trainer.slots")
        slot_ids = [(next_slot + rank) % available for rank in range(model.slots)]
        next_slot = (next_slot + model.slots) % available
        devices = tuple(f"cuda:{i}" if device_kind == "cuda" else "cpu" for i in slot_ids)
        placements.append(Placement(model, devices))
    return Plan(device_kind, available, [placements])


def slot_memory_bytes(plan: Plan, configured_gb: float | None, gpu_memory: int | None) -> int:
    """Memory one trainer may use: the configured amount, or its share of its
    GPU (or of this machine's RAM on CPU)."""
    if configured_gb is not None:
        return int(configured_gb * 2**30)
    sharing = math.ceil(plan.trainers / plan.slots)
    if plan.device_kind == "cuda":
        return int(gpu_memory or 0) // sharing
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram // max(plan.trainers, 1)


def check_memory(plan: Plan, needs: dict[str, int], slot_bytes: int) -> None:
    """`needs`: estimated training bytes per model on one of its slots."""
    for flotilla in plan.flotillas:
        for placement in flotilla:
            need = needs[placement.model.name]
            if need > slot_bytes:
                raise PlanError(
                    f"model {placement.model.name} needs about {need / 2**30:.2f} GiB per slot to train "
                    f"but a slot has {slot_bytes / 2**30:.2f} GiB; lower pipeline.batch_size, make the model "
                    "smaller (depth/width), give it more slots (its slots key), or set trainer.slot_memory_gb")
