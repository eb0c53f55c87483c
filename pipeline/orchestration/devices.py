"""The device slots of a run (GPUs, or CPU slots) and whether models fit them."""
from __future__ import annotations

import enum
import os

from pipeline.scheduler.cluster import Slot
from pipeline.training.members import ModelSpec
from stages.base import UserError

# The memory estimate counts what autograd keeps; peaks measured 1.2-2.8x
# higher (workspaces, allocator slack), so a group must fit with this margin
# (pipeline/orchestration/grouping.py checks it).
MEMORY_HEADROOM = 1.5


class DeviceKind(enum.StrEnum):
    """trainer.device: where trainers run."""

    auto = "auto"  # CUDA if a GPU is visible, else CPU slots
    cuda = "cuda"
    cpu = "cpu"


class SlotError(UserError):
    pass


def resolve_device(requested: DeviceKind, cuda_available: bool) -> DeviceKind:
    """`auto` resolved: cuda or cpu."""
    if requested == DeviceKind.cuda and not cuda_available:
        raise SlotError("trainer.device=cuda but no CUDA device is visible; use trainer.device=auto or cpu")
    return DeviceKind.cuda if requested == DeviceKind.cuda or (requested == DeviceKind.auto and cuda_available) \
        else DeviceKind.cpu


def slot_devices(device_kind: DeviceKind, gpu_count: int, slots: int | str, models: list[ModelSpec],
                 nodes: int = 1, hosts: bool = False) -> dict[Slot, str]:
    """Slot -> device: every GPU, or on CPU `trainer.slots` CPU slots (auto: as
    many as the models ask for together, rounded up to fill `nodes` evenly),
    split evenly into `nodes` nodes: simulated ones sharing this machine's
    `gpu_count` GPUs, or with `hosts` real hosts of `gpu_count` GPUs each."""
    if hosts:
        gpu_count *= nodes
    if slots == "auto":
        count = gpu_count if device_kind == "cuda" else -(-sum(m.slots for m in models) // nodes) * nodes
    else:
        count = slots
    if device_kind == "cuda" and count > gpu_count:
        raise SlotError(f"trainer.slots={count} but {'the hosts have' if hosts else 'this machine has'} "
                        f"{gpu_count} GPU(s); lower trainer.slots")
    if count % nodes:
        raise SlotError(f"{count} slots do not split evenly into cluster.nodes={nodes}; "
                        f"set trainer.slots to a multiple of {nodes}")
    for index, model in enumerate(models):
        if not 1 <= model.slots <= count:
            raise SlotError(f"ensemble.models[{index}].slots={model.slots} ({model.name}) cannot be met: "
                            f"{count} slot(s) available; set it between 1 and {count} or raise trainer.slots")
    per_node = count // nodes
    return {Slot(i // per_node, i % per_node): (f"cuda:{i % per_node if hosts else i}" if device_kind == "cuda"
                                                 else "cpu") for i in range(count)}


def slot_memory_bytes(device_kind: str, slots: int, configured_gb: float | None, gpu_memory: int | None) -> int:
    """Memory one trainer may use: the configured amount, its GPU's, or on
    CPU its share of this machine's RAM."""
    if configured_gb is not None:
        return int(configured_gb * 2**30)
    if device_kind == "cuda":
        return int(gpu_memory or 0)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // slots
