"""A model's memory on a GPU, measured: the memory check's figure where the device can say.

The estimate (pipeline/training/models.estimate_training_bytes) is a lower bound: it leaves out the
backward pass's transient tensors, cuDNN's and cuBLAS's workspaces, allocator slack and the CUDA
graphs' pool. On CUDA a trial says instead: the model alone on one slot with its whole batch, stepped
as a trainer steps it (eager steps, then its training and validation graphs captured and replayed),
and its peak is the most the caching allocator held (`torch.cuda.max_memory_allocated`; the CUDA
context, outside the allocator, is not in it).

Each distinct model is tried in a fresh child process on the run's first slot: the workspaces that
cuBLAS and cuDNN keep once per process count in every model's peak (tried in turn in one process, the
first model carried them all: measured on an H100, 167 MB for a ResNet-10 of width 16 against 47 MB for
width 24). A group's memory check counts them once, with its largest unit's activations. Models that
differ only in learning rate, seed or name weigh the same and are tried once. Peaks are cached in the
rate cache, beside each model's rates and under the same key (rates.cache_key), so a sweep or a second
run tries nothing. CPU slots, and runs whose rates a node agent measures on its own host, keep the
estimate. A model whose step alone runs out of memory is the user's to fix: a one-line RateError.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path

from pipeline.runtime.child import Child, tell_parent
from pipeline.runtime.lifetime import child_started, children_context
from pipeline.training.group import GroupSpec, GroupStep
from pipeline.training.members import ModelSpec
from pipeline.training.rates import (Measurement, RateError, cache_entry, cache_key, describe_hardware,
                                    read_cache, write_cache)

TRIAL_STEPS = 2  # replayed training steps after the capture: a graph's replay allocates nothing new


@dataclass(frozen=True)
class TrialPeak:
    """A trial's report: its model's peak allocated bytes."""

    bytes: int


@dataclass(frozen=True)
class TrialOutOfMemory:
    """The model's step alone did not fit the device: the allocator's own words, and the device's size."""

    message: str
    device_bytes: int


@dataclass(frozen=True)
class TrialFailed:
    traceback: str


def measure_peaks(models: list[ModelSpec], how: Measurement, cache_path: Path) -> dict[str, int]:
    """Each model's peak allocated bytes for a training step alone on one CUDA slot of `how.devices`
    (validation's forward included), from the cache or tried now."""
    hardware = describe_hardware(how.device_kind, how.devices[:1], how.threads)
    cache = read_cache(Path(cache_path))
    entries, untried = {}, {}  # untried: one model per entry without a peak
    for m in models:
        entry = entries[m.name] = cache_entry(cache, cache_key(GroupSpec(m.name, (m,)), how, hardware))
        if "peak_allocated_bytes" not in entry:
            untried.setdefault(id(entry), m)
    for m in untried.values():
        entries[m.name]["peak_allocated_bytes"] = _trial(m, how)
        write_cache(Path(cache_path), cache)  # after each model: an interrupted trial keeps its work
    return {name: entry["peak_allocated_bytes"] for name, entry in entries.items()}


def _trial(m: ModelSpec, how: Measurement) -> int:
    child = Child(_try, (m, how), f"memory-{m.name}", children_context())
    try:
        report = child.receive(how.report_s)
    except TimeoutError:
        raise RuntimeError(f"the memory trial of model {m.name} on {how.devices[0]} sent nothing in "
                           f"{how.report_s:g} s (timeouts.report_s); check the device") from None
    finally:
        child.stop(5)  # it exits once it reported
    if isinstance(report, TrialOutOfMemory):
        raise RateError(
            f"model {m.name} ran out of GPU memory training alone on {how.devices[0]} "
            f"({report.device_bytes / 2**30:.1f} GiB) with pipeline.batch_size={how.batch_size}: lower "
            "pipeline.batch_size, make the model smaller, use trainer.precision=bf16, or free the GPU of other "
            f"processes ({report.message.splitlines()[0]})")
    if isinstance(report, TrialFailed):
        raise RuntimeError(f"the memory trial of model {m.name} on {how.devices[0]} failed:\n{report.traceback}")
    return report.bytes


def _try(m: ModelSpec, how: Measurement, *, to_parent, from_parent) -> None:
    """Process entry point (runtime.child.Child): `m` alone on `how.devices[0]`, trained and validated;
    reports the most bytes the allocator held meanwhile."""
    child_started("memory")
    import torch

    try:
        import numpy as np

        device = torch.device(how.devices[0])
        torch.cuda.set_device(device)
        step = GroupStep(GroupSpec(m.name, (m,)), how.num_classes, how.image_sizes, device, 100,
                         precision=how.precision, cuda_graphs=how.cuda_graphs, compile=how.compile)
        side = how.image_sizes[m.input]
        random = np.random.default_rng(0)
        images = random.integers(0, 256, (how.batch_size, side, side, 3), dtype=np.uint8)
        labels = torch.from_numpy(random.integers(0, how.num_classes, how.batch_size)).to(device)
        for _ in range(step.steps_before_replay + TRIAL_STEPS):
            step.train({m.input: (step.normalise(images), labels)})
        for _ in range(step.steps_before_replay + 1):  # validation's graphs share the training graphs' pool
            step.predict({m.input: step.normalise(images)})
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    except torch.cuda.OutOfMemoryError as err:
        tell_parent(to_parent, TrialOutOfMemory(str(err), torch.cuda.get_device_properties(device).total_memory))
        return
    except BaseException:
        tell_parent(to_parent, TrialFailed(traceback.format_exc()))
        raise
    to_parent.send(TrialPeak(peak))
