"""The device slots of a run (GPUs, or CPU slots) and whether models fit them."""
from __future__ import annotations

import enum
import os

from pipeline.scheduler.cluster import Slot
from pipeline.training.members import ModelSpec
from pipeline.runtime.errors import UserError

# The memory estimate counts what autograd keeps; peaks measured 1.2-2.8x
# higher (workspaces, allocator slack), so a group must fit with this margin
# (pipeline/orchestration/group_plan.py checks it).
MEMORY_HEADROOM = 1.5
# A trainer process's CUDA context and the kernels its libraries load, outside torch's allocator: what each
# process sharing a GPU costs it beside its slot's tensors. Measured on an H100 (torch 2.11.0+cu130,
# 2026-11-27, docs/benchmarks.md): 527 MiB once CUDA starts, 767 MiB after a bf16 convolution's and a
# linear layer's step (cuDNN and cuBLAS loaded). A measured peak (pipeline/training/memory.py) leaves it out.
CUDA_CONTEXT_BYTES = 768 * 2**20


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
                 nodes: int = 1, hosts: bool = False, per_device: int = 1) -> dict[Slot, str]:
    """Slot -> device: `per_device` slots on every GPU (trainer.slots_per_device: processes sharing it), or on
    CPU `trainer.slots` CPU slots (auto: as many as the models ask for together, rounded up to fill `nodes`
    evenly), split evenly into `nodes` nodes: simulated ones sharing this machine's `gpu_count` GPUs, or
    with `hosts` real hosts of `gpu_count` GPUs each. A node's slots take its GPUs in turn, so that fewer
    models than slots spread over the GPUs. On CPU `per_device` splits threads, not slots (trainer_threads)."""
    if hosts:
        gpu_count *= nodes
    if slots == "auto":
        count = gpu_count * per_device if device_kind == "cuda" else -(-sum(m.slots for m in models) // nodes) * nodes
    else:
        count = slots
    if device_kind == "cuda" and count > gpu_count * per_device:
        raise SlotError(f"trainer.slots={count} but {'the hosts have' if hosts else 'this machine has'} "
                        f"{gpu_count} GPU(s)" + (f" of {per_device} slots (trainer.slots_per_device)"
                                                 if per_device > 1 else "") + "; lower trainer.slots")
    if count % nodes:
        raise SlotError(f"{count} slots do not split evenly into cluster.nodes={nodes}; "
                        f"set trainer.slots to a multiple of {nodes}")
    for index, model in enumerate(models):
        if not 1 <= model.slots <= count:
            raise SlotError(f"ensemble.models[{index}].slots={model.slots} ({model.name}) cannot be met: "
                            f"{count} slot(s) available; set it between 1 and {count} or raise trainer.slots")
        if model.slots > 1 and per_device > 1:
            raise SlotError(f"ensemble.models[{index}].slots={model.slots} ({model.name}): a model trains "
                            f"data-parallel on whole devices (NCCL: one rank per GPU), but "
                            f"trainer.slots_per_device={per_device} shares them; set its slots to 1 or "
                            "trainer.slots_per_device=1")
    per_node = count // nodes
    node_gpus = gpu_count // nodes if hosts else gpu_count  # the GPUs a node's slots take in turn

    def device(i: int) -> str:
        if device_kind != "cuda":
            return "cpu"
        return f"cuda:{(i % per_node if hosts else i) % node_gpus}"

    return {Slot(i // per_node, i % per_node): device(i) for i in range(count)}


def trainer_threads(device_kind: DeviceKind, threads: int, per_device: int) -> int:
    """Torch threads of one trainer process: trainer.threads, which on CPU the `per_device` processes of a
    device slot split (at least one each; a GPU's sub-slots each keep theirs: they feed the GPU)."""
    return max(1, threads // per_device) if device_kind == "cpu" else threads


def most_sub_slots(device_kind: DeviceKind, threads: int, devices: int) -> int:
    """The most trainer processes trainer.grouping=auto tries on a device: on CPU, one per thread of its
    slot (a process has one at least); on a GPU, one per two of the cores this process may use (the others
    preprocess), shared out over the `devices` GPUs."""
    return threads if device_kind == "cpu" else len(os.sched_getaffinity(0)) // 2 // devices


def slot_memory_bytes(device_kind: str, slots: int, configured_gb: float | None, gpu_memory: int | None,
                      per_device: int = 1) -> int:
    """Memory one trainer may use: the configured amount; its GPU's share (`per_device` processes share it,
    each with its CUDA context); or on CPU its share of this machine's RAM."""
    if configured_gb is not None:
        return int(configured_gb * 2**30)
    if device_kind == "cuda":
        return int(gpu_memory or 0) // per_device - (CUDA_CONTEXT_BYTES if per_device > 1 else 0)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // slots
