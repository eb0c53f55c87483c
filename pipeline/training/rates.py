"""Rate measurement for the FLEET scheduler: each model's training rate
(images/s) on 1..k device slots, measured by short real runs and cached on
disk; the scheduler's rate table (pipeline/scheduler/cluster.py) is made of them.

A run on k slots starts k trainer processes (spawned) that train the model
data-parallel (DDP over NCCL on CUDA, gloo on CPU), each rank taking its 1/k
share of every batch, exactly as `pipeline.training.trainer` does: uint8 NHWC batches
copied to the device and normalised there, forward, backward, SGD step. The
batches are synthetic and already in memory, so a measurement times training,
never input. Rate = images per batch / median step time, where a step's time
is that of its slowest rank (the allreduce makes every rank wait for it); the
median ignores the odd step stalled by the OS or a collective's first use.

The cache is a JSON file of entries keyed by what decides the rate: the
model's shape (arch, depth, width, growth rate, classes), image size, batch
size, and the hardware (device kind and name, cores, threads per trainer,
torch version). Learning rate and friends do not change the speed and are
left out, so a hyper-parameter sweep is measured once.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import queue
import statistics
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from pipeline.delivery.collective import rendezvous_at
from pipeline.scheduler.cluster import RateTable
from stages.base import UserError
from pipeline.training.trainer import ModelSpec, SGDStep


@dataclass(frozen=True)
class StepTimes:
    """A measuring rank's report: its timed steps' durations."""

    rank: int
    seconds: list[float]


@dataclass(frozen=True)
class RankFailed:
    rank: int
    traceback: str


class RateError(UserError):
    """A rate measurement that cannot be made as asked, or a cache that cannot be read."""


def measure_rates(model: ModelSpec, num_classes: int, image_size: int, batch_size: int, slot_counts: list[int],
                  device_kind: str, devices: list[str], steps: int, warmup: int, threads: int,
                  report_s: float = 600.0) -> dict[int, float]:
    """Images/s of `model` trained on each of `slot_counts` slots.

    batch_size: images per step, split over the slots (as a flotilla's batch is).
    devices: the slots to use, in rank order ("cuda:<i>", or "cpu" repeated);
        a run on k slots uses the first k.
    steps: timed steps per run, after `warmup` untimed ones.
    threads: torch threads per trainer process.
    report_s: a rank silent this long is taken as hung (timeouts.report_s).
    """
    _check_request(slot_counts, device_kind, devices, batch_size, steps, warmup, threads)
    return {slots: batch_size / _median_step_seconds(model, num_classes, image_size, batch_size,
                                                     devices[:slots], steps, warmup, threads, report_s)
            for slots in slot_counts}


def measure_rate_table(models: list[ModelSpec], num_classes: int, image_sizes: dict[str, int], batch_size: int,
                       max_slots: int, device_kind: str, devices: list[str], steps: int, warmup: int, threads: int,
                       cache_path: Path, report_s: float = 600.0) -> RateTable:
    """The scheduler's rate table: each model's rate on 1..max_slots slots.

    image_sizes: input side in px of each model, by name. Rates already in the
    cache at `cache_path` are read from it; the rest are measured and added.
    """
    _check_request(list(range(1, max_slots + 1)), device_kind, devices, batch_size, steps, warmup, threads)
    hardware = describe_hardware(device_kind, devices, threads)
    cache = _read_cache(Path(cache_path))
    table = RateTable()
    for model in models:
        if model.name not in image_sizes:
            raise RateError(f"no image size for model {model.name!r}; image_sizes has "
                            f"{sorted(image_sizes)}: add the side in px of the images it trains on")
        key = cache_key(model, num_classes, image_sizes[model.name], batch_size, hardware)
        entry = next((e for e in cache if e["key"] == key), None)
        if entry is None:
            entry = {"key": key, "images_per_s": {}}
            cache.append(entry)
        missing = [k for k in range(1, max_slots + 1) if str(k) not in entry["images_per_s"]]
        if missing:
            measured = measure_rates(model, num_classes, image_sizes[model.name], batch_size, missing,
                                     device_kind, devices, steps, warmup, threads, report_s)
            entry["images_per_s"].update({str(k): rate for k, rate in measured.items()})
            _write_json(Path(cache_path), cache)  # after each model: an interrupted measurement keeps its work
        table.add(model.name, [entry["images_per_s"][str(k)] for k in range(1, max_slots + 1)])
    return table


def cache_key(model: ModelSpec, num_classes: int, image_size: int, batch_size: int, hardware: dict) -> dict:
    return {"arch": model.arch, "depth": model.depth, "width": model.width, "growth_rate": model.growth_rate,
            "num_classes": num_classes, "image_size": image_size, "batch_size": batch_size, **hardware}


def describe_hardware(device_kind: str, devices: list[str], threads: int) -> dict:
    import torch

    if device_kind == "cuda":
        device_name = torch.cuda.get_device_name(devices[0])
    else:
        device_name = _cpu_model()
    return {"device_kind": device_kind, "device_name": device_name, "cores": len(os.sched_getaffinity(0)),
            "threads": threads, "torch": torch.__version__}


def format_table(table: RateTable) -> str:
    """Model x slots: images/s, and the speedup over 1 slot."""
    most_slots = max((len(rates) for rates in table.rates.values()), default=0)
    header = ["model"] + [f"{k} slot{'s' if k > 1 else ''}" for k in range(1, most_slots + 1)]
    rows = [header]
    for model in table.rates:
        one_slot = table.rate(model, 1)
        cells = [model]
        for k in range(1, most_slots + 1):
            rate = table.rate(model, k)
            if rate == 0:  # the model cannot run on k slots
                cells.append("-")
            elif k == 1 or one_slot == 0:
                cells.append(f"{rate:.1f}")
            else:
                cells.append(f"{rate:.1f} ({rate / one_slot:.2f}x)")
        rows.append(cells)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    return "\n".join(["training images/s on k slots (speedup vs 1 slot)", *lines])


def save_table(table: RateTable, path: Path) -> None:
    _write_json(Path(path), {model: {str(k): rate for k, rate in enumerate(rates, 1)}
                             for model, rates in table.rates.items()})


def _check_request(slot_counts: list[int], device_kind: str, devices: list[str], batch_size: int, steps: int,
                   warmup: int, threads: int) -> None:
    if device_kind == "cuda":
        _check_gpus(devices)
    elif any(d != "cpu" for d in devices):
        raise RateError(f"devices {devices} are not all CPU slots; with device_kind='cpu' list each as 'cpu'")
    if not slot_counts or any(not isinstance(k, int) or k < 1 for k in slot_counts):
        raise RateError(f"slot counts must be positive integers, got {slot_counts}; e.g. [1, 2]")
    if max(slot_counts) > len(devices):
        raise RateError(f"cannot measure rates on {max(slot_counts)} slots: only {len(devices)} device(s) given "
                        f"({devices}); measure on at most {len(devices)} slots or pass more devices")
    for name, value, least in [("steps", steps, 1), ("warmup", warmup, 0), ("threads", threads, 1)]:
        if not isinstance(value, int) or value < least:
            raise RateError(f"{name} must be an integer >= {least}, got {value!r}")
    if not isinstance(batch_size, int) or batch_size < 2 * max(slot_counts):
        # batch norm needs two images per rank, as in the trainer
        raise RateError(f"batch_size={batch_size!r} is too small for {max(slot_counts)} slots: each slot "
                        f"needs at least 2 images; use batch_size >= {2 * max(slot_counts)}")


def _check_gpus(devices: list[str]) -> None:
    import torch

    visible = torch.cuda.device_count()
    valid = {f"cuda:{i}" for i in range(visible)}
    if any(d not in valid for d in devices):
        raise RateError(f"devices {devices} are not all visible GPUs: this machine has {visible} "
                        f"({sorted(valid) or 'none'}); list those, or use device_kind='cpu'")
    if len(set(devices)) < len(devices):
        raise RateError(f"devices {devices} repeat a GPU, but NCCL needs one GPU per rank; list each once")


def _median_step_seconds(model: ModelSpec, num_classes: int, image_size: int, batch_size: int, devices: list[str],
                         steps: int, warmup: int, threads: int, report_s: float) -> float:
    context = mp.get_context("spawn")  # fork is unsafe with threads (torch)
    reports = context.Queue()
    rendezvous = rendezvous_at()
    processes = [context.Process(target=_train_steps, name=f"rates-{model.name}-{rank}",
                                 args=(model, num_classes, image_size, batch_size, rank, devices, rendezvous,
                                       steps, warmup, threads, reports), daemon=True)
                 for rank in range(len(devices))]
    try:
        for process in processes:
            process.start()
        step_seconds = [_next_report(reports, processes, model, len(devices), report_s) for _ in processes]
    finally:
        for process in filter(lambda p: p.pid is not None, processes):  # those started
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join()
        reports.close()
        reports.join_thread()
    return statistics.median(max(ranks) for ranks in zip(*step_seconds))


def _next_report(reports, processes, model: ModelSpec, slots: int, report_s: float) -> list[float]:
    deadline = time.monotonic() + report_s
    while True:
        try:
            report = reports.get(timeout=1)
        except queue.Empty:
            dead = [f"{p.name} (exit code {p.exitcode})" for p in processes if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"measuring {model.name} on {slots} slot(s): {', '.join(dead)} died "
                                   "without a report (out of memory?)") from None
            if time.monotonic() > deadline or all(p.exitcode is not None for p in processes):
                raise RuntimeError(f"measuring {model.name} on {slots} slot(s): a rank sent no report in "
                                   f"{report_s:g} s (timeouts.report_s); lower rates.steps or check the "
                                   "devices") from None
            continue
        if isinstance(report, RankFailed):
            raise RuntimeError(f"measuring {model.name} on {slots} slot(s) failed in rank {report.rank}:\n"
                               f"{report.traceback}")
        return report.seconds


def _train_steps(model: ModelSpec, num_classes: int, image_size: int, batch_size: int, rank: int,
                 devices: list[str], rendezvous: str, steps: int, warmup: int, threads: int, reports) -> None:
    """Process entry point: `warmup` + `steps` training steps; reports the timed ones' durations."""
    try:
        import numpy as np
        import torch
        import torch.distributed as dist

        from pipeline.training.models import build_model

        torch.set_num_threads(threads)
        torch.manual_seed(0)
        device, world = torch.device(devices[rank]), len(devices)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        net = build_model(model.arch, model.depth, model.width, model.growth_rate, num_classes,
                          image_size=image_size).to(device, memory_format=torch.channels_last)
        if world > 1:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=rendezvous,
                                    rank=rank, world_size=world)
            net = torch.nn.parallel.DistributedDataParallel(
                net, device_ids=[device.index] if device.type == "cuda" else None)
        # This rank's share of the batch: rows rank, rank + world, ..., as the trainer takes them.
        random = np.random.default_rng(rank)
        images = random.integers(0, 256, (batch_size, image_size, image_size, 3), dtype=np.uint8)[rank::world]
        labels = torch.from_numpy(random.integers(0, num_classes, batch_size)[rank::world].copy())
        train_step = SGDStep(net, model, device)
        net.train()
        step_seconds = []
        for step in range(warmup + steps):
            _synchronize(torch, device)
            started = time.perf_counter()
            train_step(train_step.normalise(images), labels.to(device, non_blocking=True))
            _synchronize(torch, device)  # CUDA runs asynchronously: the clock must wait for the step
            if step >= warmup:
                step_seconds.append(time.perf_counter() - started)
        # Report first: tearing down a gloo group can hang once the peer has
        # exited, and the parent kills what has not ended soon after the reports.
        reports.put(StepTimes(rank, step_seconds))
        if world > 1:
            dist.destroy_process_group()
    except BaseException:
        reports.put(RankFailed(rank, traceback.format_exc()))
        raise


def _synchronize(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _read_cache(path: Path) -> list[dict]:
    if not path.exists():
        return []
    try:
        entries = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RateError(f"rate cache {path} is not valid JSON ({error}); delete it to measure again") \
            from None
    if not isinstance(entries, list) or not all(isinstance(e, dict) and {"key", "images_per_s"} <= e.keys()
                                                for e in entries):
        raise RateError(f"rate cache {path} is not a list of {{key, images_per_s}} entries; "
                        "delete it to measure again")
    return entries


def _write_json(path: Path, content) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(content, indent=1))
    os.replace(tmp, path)  # never a half-written file
