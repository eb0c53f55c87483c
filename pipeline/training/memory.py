"""A model's memory on a GPU, measured: the memory check's figure where the device can say.

The estimate (pipeline/training/models.estimate_training_bytes) is a lower bound: it leaves out the
backward pass's transient tensors, cuDNN's and cuBLAS's workspaces, allocator slack and the CUDA
graphs' pool. On CUDA a trial says instead: the model alone on one slot with its whole batch, stepped
as a trainer steps it (eager steps, then its training and validation graphs captured and replayed),
and its peak is the most the caching allocator held (`torch.cuda.max_memory_allocated`; the CUDA
context, outside the allocator, is not in it).

One child process tries every distinct model of a run in turn on the run's first slot. Models that
differ only in learning rate, seed or name weigh the same and are tried once. Peaks are cached in the
rate cache, beside each model's rates and under the same key (rates.cache_key), so a sweep or a second
run tries nothing. CPU slots, and runs whose rates a node agent measures on its own host, keep the
estimate.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path

from pipeline.runtime.child import Child, tell_parent
from pipeline.runtime.lifetime import child_started, children_context
from pipeline.training.group import GroupSpec, GroupStep
from pipeline.training.members import ModelSpec
from pipeline.training.rates import Measurement, cache_key, describe_hardware, read_cache, write_cache

TRIAL_STEPS = 2  # replayed training steps after the capture: a graph's replay allocates nothing new


@dataclass(frozen=True)
class TrialPeaks:
    """The trial's report: each model's peak allocated bytes, in the order asked."""

    peaks: list[int]


@dataclass(frozen=True)
class TrialFailed:
    model: str
    traceback: str


def measure_peaks(models: list[ModelSpec], how: Measurement, cache_path: Path) -> dict[str, int]:
    """Each model's peak allocated bytes for a training step alone on one CUDA slot of `how.devices`
    (validation's forward included), from the cache or tried now."""
    hardware = describe_hardware(how.device_kind, how.devices[:1], how.threads)
    cache = read_cache(Path(cache_path))
    keyed = {m.name: cache_key(GroupSpec(m.name, (m,)), how, hardware) for m in models}
    entries = {}
    for name, key in keyed.items():
        entry = next((e for e in cache if e["key"] == key), None)
        if entry is None:
            entry = {"key": key, "images_per_s": {}}  # its rates, if ever measured, go beside
            cache.append(entry)
        entries[name] = entry
    untried = {}  # one model per entry without a peak
    for m in models:
        if "peak_allocated_bytes" not in entries[m.name]:
            untried.setdefault(id(entries[m.name]), m)
    if untried:
        for m, peak in zip(untried.values(), _trial(list(untried.values()), how)):
            entries[m.name]["peak_allocated_bytes"] = peak
        write_cache(Path(cache_path), cache)
    return {name: entry["peak_allocated_bytes"] for name, entry in entries.items()}


def _trial(models: list[ModelSpec], how: Measurement) -> list[int]:
    child = Child(_try_models, (models, how), "memory-trial", children_context())
    try:
        report = child.receive(how.report_s)
    except TimeoutError:
        raise RuntimeError(f"the memory trial of {', '.join(m.name for m in models)} on {how.devices[0]} sent "
                           f"nothing in {how.report_s:g} s (timeouts.report_s); check the device") from None
    finally:
        child.stop(5)  # it exits once it reported
    if isinstance(report, TrialFailed):
        raise RuntimeError(f"the memory trial of model {report.model} on {how.devices[0]} failed:\n"
                           f"{report.traceback}")
    return report.peaks


def _try_models(models: list[ModelSpec], how: Measurement, *, to_parent, from_parent) -> None:
    """Process entry point (runtime.child.Child): each model in turn, alone, on `how.devices[0]`."""
    child_started("memory")
    import numpy as np
    import torch

    device = torch.device(how.devices[0])
    torch.cuda.set_device(device)
    peaks, name = [], models[0].name
    try:
        for m in models:
            name = m.name
            peaks.append(_peak(m, how, device, torch, np))
    except BaseException:
        tell_parent(to_parent, TrialFailed(name, traceback.format_exc()))
        raise
    to_parent.send(TrialPeaks(peaks))


def _peak(m: ModelSpec, how: Measurement, device, torch, np) -> int:
    """Bytes the allocator held at most while `m` trained and validated, over what it held before."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step = GroupStep(GroupSpec(m.name, (m,)), how.num_classes, how.image_sizes, device, 100, how.precision,
                     cuda_graphs=how.cuda_graphs)
    side = how.image_sizes[m.input]
    random = np.random.default_rng(0)
    images = random.integers(0, 256, (how.batch_size, side, side, 3), dtype=np.uint8)
    labels = torch.from_numpy(random.integers(0, how.num_classes, how.batch_size)).to(device)
    for _ in range(step.steps_before_replay + TRIAL_STEPS):
        step.train({m.input: (step.normalise(images), labels)})
    for _ in range(step.steps_before_replay + 1):  # validation's graphs share the training graphs' pool
        step.predict({m.input: step.normalise(images)})
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del step
    return peak
