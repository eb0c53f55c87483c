"""Rate measurement for the scheduler: each group's training rate (images/s;
every model of a group trains on every image) on 1..k device slots, measured
by short real runs and cached on disk; the scheduler's rate table
(pipeline/scheduler/cluster.py) is made of them. A group of one is a model;
a group of several holds one slot, and is measured packed or fused as it
will train (with trainer.grouping=auto, both, to choose).

A run on k slots starts k trainer processes (forked: children_context) that step the
group with `GroupStep`, data-parallel (DDP over NCCL on CUDA, gloo on CPU) when
k > 1, each rank taking its 1/k share of every batch, exactly as the trainer
does: uint8 NHWC batches normalised on the device, forward, backward, SGD
step. The batches are synthetic and already in memory, so a measurement
times training, never input. Rate = images per batch / median step time,
where a step's time is that of its slowest rank (the allreduce makes every
rank wait for it); the median ignores the odd step stalled by the OS or a
collective's first use. What the warm-up steps took beyond that pace is the
group's start: the seconds its trainers spend compiling (trainer.compile)
and capturing graphs before they step at their rate, which plans count once
per flotilla a group starts in.

Where the ranks run is the measurement's `RateHost` (`Measurement.where`):
by default this process, on its own devices; on real hosts the driver passes
a node agent's (pipeline/orchestration/agent.py), so the ranks are that
agent's children on the host that will train, and the driver gets the rates
back as a typed answer (`Measured`, naming the host and process that
measured).

The cache is a JSON file of entries keyed by what decides the rate: the
members' modules (their model configs) and optimisers, whether they fuse, the
classes, image sizes, batch size, precision, CUDA graphs, compilation and the hardware of the host
that measures (device kind and name, cores, threads per trainer, torch
version: described there). Learning rates, seeds and names do not change the speed
and are left out, so a sweep is measured once. Each entry also records who
measured each slot count (`measured_by`: host name and pid), out of the key.
"""
from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from pipeline.delivery.collective import LocalRendezvous
from pipeline.runtime.child import Child, messages, tell_parent
from pipeline.runtime.files import write_whole
from pipeline.runtime.lifetime import child_started, children_context, how_it_ended
from pipeline.scheduler.cluster import RateTable
from pipeline.runtime.errors import UserError
from pipeline.training.group import (MIN_ROWS, GroupSpec, GroupStep, Precision, StepInHand, graph_safe_arguments,
                                     join_process_group, least_batch, rank_rows)
from pipeline.training.members import array_fusion, canonical


# A process measured side by side steps on for the others at most this many times its timed steps
# (then it waits, idle, for StopStepping): were the others slower still, they would be timed partly alone.
BUSY_STEPS_FACTOR = 100


@dataclass(frozen=True)
class StepTimes:
    """A measuring rank's report: its steps' durations."""

    rank: int
    warmup: list[float]  # untimed ones (compiling, graph capture: the group's start)
    seconds: list[float]  # timed ones


@dataclass(frozen=True)
class StopStepping:
    """To a process measured side by side, once every one has reported: it has kept the device busy
    for the others until then, and now ends."""


@dataclass(frozen=True)
class RankFailed:
    rank: int
    traceback: str


class RateError(UserError):
    """A rate measurement that cannot be made as asked, or a cache that cannot be read."""


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """What every measurement of a run shares."""

    num_classes: int
    image_sizes: dict[str, int]  # sink -> side of its images in px
    batch_size: int  # images per step, split over the slots (as a flotilla's batch is)
    device_kind: str
    devices: list[str]  # the slots to use, in rank order ("cuda:<i>", or "cpu" repeated); k slots use the first k
    steps: int  # timed steps per run, after `warmup` untimed ones
    warmup: int
    threads: int  # torch threads per trainer process
    precision: Precision = Precision.fp32
    cuda_graphs: bool = False  # as the trainers will step (trainer.cuda_graphs)
    compile: bool = False  # ... and trainer.compile
    report_s: float = 600.0  # a rank silent this long is taken as hung (timeouts.report_s)
    where: RateHost | None = None  # the host whose devices are measured (None: this process's); never sent on


@dataclass(frozen=True)
class MeasuredBy:
    """The process that ran a measurement (its ranks are its children) and the host it runs on."""

    host: str  # socket.gethostname() there
    pid: int


@dataclass(frozen=True)
class Pace:
    """A group's measured training on some slots: its rate, and its start (what its warm-up steps took
    beyond that rate: compiling, graph capture)."""

    images_per_s: float
    start_s: float


@dataclass(frozen=True)
class Measured:
    """A host's answer to a measurement: the group's pace on each slot count asked."""

    paces: dict[int, Pace]
    by: MeasuredBy


@dataclass(frozen=True)
class HostHardware:
    """A host's answer to `RateHost.hardware`: describe_hardware run there."""

    hardware: dict
    by: MeasuredBy


class RateHost(Protocol):
    """Where rates are measured: `Here` (this process's devices), or a node agent's host
    (pipeline/orchestration/agent.py). Both calls run on that host; `how.where` is not sent."""

    def hardware(self, how: Measurement) -> HostHardware: ...

    def measure(self, group: GroupSpec, slot_counts: list[int], how: Measurement) -> Measured: ...


def measured_by_me() -> MeasuredBy:
    return MeasuredBy(socket.gethostname(), os.getpid())


@dataclass(frozen=True)
class Here:
    """Rates measured by this process, on its own devices (in a node agent, for a driver elsewhere:
    `abandon` is set when that driver is gone, and a measurement under way stops)."""

    abandon: threading.Event | None = None

    def hardware(self, how: Measurement) -> HostHardware:
        return HostHardware(describe_hardware(how.device_kind, how.devices, how.threads), measured_by_me())

    def measure(self, group: GroupSpec, slot_counts: list[int], how: Measurement) -> Measured:
        return Measured(measure_rates(group, slot_counts, how, self.abandon), measured_by_me())


def measure_rates(group: GroupSpec, slot_counts: list[int], how: Measurement,
                  abandon: threading.Event | None = None) -> dict[int, Pace]:
    """The pace of `group` trained on each of `slot_counts` slots, on this process's devices. When
    `abandon` is set (an agent's driver is gone), a measurement under way stops and its ranks are killed."""
    _check_request(group, slot_counts, how)
    return {slots: pace(how.batch_size, _step_seconds(group, how.devices[:slots], how, abandon))
            for slots in slot_counts}


def pace(batch_size: int, reports: list[StepTimes]) -> Pace:
    """A run's pace from its ranks' reports, a step taking as long as its slowest rank: the whole batch over
    the median timed step, and the warm-up's seconds beyond as many steps at that median (none below 0)."""
    slowest = lambda steps: [max(ranks) for ranks in zip(*steps)]
    median = statistics.median(slowest([r.seconds for r in reports]))
    warmup = slowest([r.warmup for r in reports])
    return Pace(batch_size / median, max(0.0, sum(warmup) - len(warmup) * median))


def measure_rate_table(groups: list[GroupSpec], max_slots: int, how: Measurement, cache_path: Path,
                       measured_by: dict[str, dict[str, dict]] | None = None) -> RateTable:
    """The scheduler's rate table: each group's rate on 1..max_slots slots (a group of several: on 1),
    measured where `how.where` says (default: here).

    Rates already in the cache at `cache_path` are read from it; the rest are measured and added.
    `measured_by`, if given, gets group -> slot count -> {host, pid} of the process that measured each
    rate (this run's measurer, or the one that cached it; none for entries older than the record)."""
    where = how.where or Here()
    hardware = where.hardware(how).hardware  # the measuring host's: the cache keys on it, not on this process
    cache = read_cache(Path(cache_path))
    table = RateTable()
    for group in groups:
        counts = list(range(1, max_slots + 1)) if len(group.members) == 1 else [1]
        _check_request(group, counts, how, devices_here=how.where is None)  # a remote host checks its own
        entry = cache_entry(cache, cache_key(group, how, hardware))
        missing = [k for k in counts if str(k) not in entry["images_per_s"]]
        if missing:
            measured = where.measure(group, missing, how)
            entry["images_per_s"].update({str(k): p.images_per_s for k, p in measured.paces.items()})
            entry.setdefault("start_s", {}).update({str(k): p.start_s for k, p in measured.paces.items()})
            entry.setdefault("measured_by", {}).update({str(k): asdict(measured.by) for k in missing})
            write_cache(Path(cache_path), cache)  # after each group: an interrupted measurement keeps its work
        # its start on the most slots it was measured on: it starts on fewer, if anything, as fast
        table.add(group.name, [entry["images_per_s"][str(k)] for k in counts], entry["start_s"][str(counts[-1])])
        if measured_by is not None:
            by = entry.get("measured_by", {})
            measured_by[group.name] = {str(k): by[str(k)] for k in counts if str(k) in by}
    return table


def measure_side_by_side(groups: list[GroupSpec], how: Measurement, cache_path: Path) -> Pace:
    """The pace of `groups` trained side by side on one device (`how.devices[0]`), each in a process of its
    own with `how.threads` threads: a device's sub-slots (trainer.slots_per_device). Each process steps on
    until all have reported, so every timed step shares the device as a flotilla's would. The pace is the
    slowest process's rate (a flotilla's members train on every image of its stream) and the longest start.
    Cached as rates are, under every group's key; measured here, on this process's devices."""
    hardware = describe_hardware(how.device_kind, how.devices[:1], how.threads)
    for group in groups:
        _check_request(group, [1], how)
    cache = read_cache(Path(cache_path))
    entry = cache_entry(cache, {"side_by_side": sorted((_group_key(g, how) for g in groups), key=canonical),
                                **_settings_key(how, hardware)})
    processes = str(len(groups))
    if processes not in entry["images_per_s"]:
        paces = [pace(how.batch_size, [report]) for report in _side_by_side_steps(groups, how)]
        entry["images_per_s"][processes] = min(p.images_per_s for p in paces)
        entry.setdefault("start_s", {})[processes] = max(p.start_s for p in paces)
        entry.setdefault("measured_by", {})[processes] = asdict(measured_by_me())
        write_cache(Path(cache_path), cache)
    return Pace(entry["images_per_s"][processes], entry["start_s"][processes])


def cache_entry(cache: list[dict], key: dict) -> dict:
    """The cache's entry for `key`, added empty if it has none."""
    entry = next((e for e in cache if e["key"] == key), None)
    if entry is None:
        entry = {"key": key, "images_per_s": {}}
        cache.append(entry)
    return entry


def cache_key(group: GroupSpec, how: Measurement, hardware: dict) -> dict:
    return {**_group_key(group, how), **_settings_key(how, hardware)}


def _group_key(group: GroupSpec, how: Measurement) -> dict:
    """What of a group decides its rate: its members' modules, optimisers and image sizes (on a GPU with
    graphs, and whether each member's update is captured in them: graph_safe_arguments), its fused arrays,
    the CUDA streams it steps on (named only above 1: the rates and memory peaks cached before streams keep
    their keys)."""
    import torch

    graphed = how.device_kind == "cuda" and how.cuda_graphs
    captured = lambda m: [graph_safe_arguments(m, torch.device("cuda")) is not None] if graphed else []
    members = sorted([canonical(m.model), m.optimizer_kind, how.image_sizes[m.input], *captured(m)]
                     for m in group.members)
    arrays = sorted([len(unit), array_fusion(unit)] for unit in group.units() if len(unit) > 1)
    streams = {"cuda_streams": group.side_by_side} if group.side_by_side > 1 else {}
    return {"members": members, "fused_arrays": arrays, **streams}


def _settings_key(how: Measurement, hardware: dict) -> dict:
    """What of a measurement decides a rate beside the group: the batch, precision, graphs, compilation and
    the hardware that measures."""
    return {"num_classes": how.num_classes, "batch_size": how.batch_size, "precision": str(how.precision),
            "cuda_graphs": how.cuda_graphs, "compile": how.compile, **hardware}


def describe_hardware(device_kind: str, devices: list[str], threads: int) -> dict:
    import torch

    if device_kind == "cuda":
        _check_gpus(devices)  # before asking for a GPU's name: a clear error for one this machine lacks
        device_name = torch.cuda.get_device_name(devices[0])
    else:
        device_name = cpu_model()
    return {"device_kind": device_kind, "device_name": device_name, "cores": len(os.sched_getaffinity(0)),
            "threads": threads, "torch": torch.__version__}


def format_table(table: RateTable) -> str:
    """Group x slots: images/s, and the speedup over 1 slot; then each group's start (seconds)."""
    most_slots = max((len(rates) for rates in table.rates.values()), default=0)
    header = ["group"] + [f"{k} slot{'s' if k > 1 else ''}" for k in range(1, most_slots + 1)] + ["start s"]
    rows = [header]
    for model in table.rates:
        one_slot = table.rate(model, 1)
        cells = [model]
        for k in range(1, most_slots + 1):
            rate = table.rate(model, k)
            if rate == 0:  # it cannot run on k slots
                cells.append("-")
            elif k == 1 or one_slot == 0:
                cells.append(f"{rate:.1f}")
            else:
                cells.append(f"{rate:.1f} ({rate / one_slot:.2f}x)")
        rows.append([*cells, f"{table.start(model):.1f}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    return "\n".join(["training images/s on k slots (speedup vs 1 slot), and seconds before the first step at that "
                      "rate (compiling, graph capture)", *lines])


def save_table(table: RateTable, path: Path) -> None:
    """Per group, as a cache entry has them: images/s on each slot count, and its start."""
    write_whole(Path(path), json.dumps({group: {"images_per_s": {str(k): rate for k, rate in enumerate(rates, 1)},
                                                "start_s": table.start(group)}
                                        for group, rates in table.rates.items()}, indent=1))


def _check_request(group: GroupSpec, slot_counts: list[int], how: Measurement, devices_here: bool = True) -> None:
    """`devices_here`: the devices are this machine's, and checked against what it has."""
    devices = how.devices
    if how.device_kind == "cuda":
        if devices_here:
            _check_gpus(devices)
    elif any(d != "cpu" for d in devices):
        raise RateError(f"devices {devices} are not all CPU slots; with device_kind='cpu' list each as 'cpu'")
    if not slot_counts or any(not isinstance(k, int) or k < 1 for k in slot_counts):
        raise RateError(f"slot counts must be positive integers, got {slot_counts}; e.g. [1, 2]")
    if max(slot_counts) > len(devices):
        raise RateError(f"cannot measure rates on {max(slot_counts)} slots: only {len(devices)} device(s) given "
                        f"({devices}); measure on at most {len(devices)} slots or pass more devices")
    if len(group.members) > 1 and max(slot_counts) > 1:
        raise RateError(f"group {group.name} holds one slot; measure it on [1]")
    for m in group.members:
        if m.input not in how.image_sizes:
            raise RateError(f"no image size for sink {m.input!r} of model {m.name!r}; image_sizes has "
                            f"{sorted(how.image_sizes)}: add the side in px of the images it trains on")
    for name, value, least in [("steps", how.steps, 1), ("warmup", how.warmup, 0), ("threads", how.threads, 1)]:
        if not isinstance(value, int) or value < least:
            raise RateError(f"{name} must be an integer >= {least}, got {value!r}")
    if not isinstance(how.batch_size, int) or how.batch_size < least_batch(max(slot_counts)):
        raise RateError(f"batch_size={how.batch_size!r} is too small for {max(slot_counts)} slots: each slot "
                        f"needs at least {MIN_ROWS} images; use batch_size >= {least_batch(max(slot_counts))}")


def _check_gpus(devices: list[str]) -> None:
    import torch

    visible = torch.cuda.device_count()
    valid = {f"cuda:{i}" for i in range(visible)}
    if any(d not in valid for d in devices):
        raise RateError(f"devices {devices} are not all visible GPUs: this machine has {visible} "
                        f"({sorted(valid) or 'none'}); list those, or use device_kind='cpu'")
    if len(set(devices)) < len(devices):
        raise RateError(f"devices {devices} repeat a GPU, but NCCL needs one GPU per rank; list each once")


def _step_seconds(group: GroupSpec, devices: list[str], how: Measurement,
                  abandon: threading.Event | None) -> list[StepTimes]:
    """Each rank's steps' durations (seconds), in the order the ranks report."""
    rendezvous = LocalRendezvous()
    init_method = rendezvous.next()  # one group: every rank meets through the same file
    context = children_context()
    # each rank's step in hand, shared: a rank that hangs is named with where it is
    in_hand = [StepInHand(context, group, how.warmup + how.steps) for _ in devices]
    ranks: list[Child] = []
    grace_s = 5.0  # they exit once they reported; one that does not is killed
    try:
        for rank in range(len(devices)):
            ranks.append(Child(_train_steps, (group, rank, devices, init_method, how, in_hand[rank], False),
                               f"rates-{group.name}-{rank}", context))
        return _rank_reports(ranks, in_hand, f"{group.name} ({group.describe()}) on {len(devices)} slot(s)", how,
                             abandon)
    except BaseException:
        grace_s = 0.0  # a rank that failed, hung or waits on one will not end by itself
        raise
    finally:
        for child in ranks:
            child.stop(grace_s)
        rendezvous.close()


def _side_by_side_steps(groups: list[GroupSpec], how: Measurement) -> list[StepTimes]:
    """Each group's steps' durations, every group in a process of its own (world 1) on `how.devices[0]`,
    all at once; each keeps stepping after its report until all have reported (StopStepping)."""
    context = children_context()
    in_hand = [StepInHand(context, g, how.warmup + how.steps) for g in groups]
    processes: list[Child] = []
    try:
        for g, hand in zip(groups, in_hand):
            processes.append(Child(_train_steps, (g, 0, how.devices[:1], "", how, hand, True),
                                   f"rates-{g.name}-side-by-side", context))
        what = f"{', '.join(g.name for g in groups)} side by side on {how.devices[0]}"
        return _rank_reports(processes, in_hand, what, how, None)
    finally:
        for child in processes:
            child.send(StopStepping())
        for child in processes:
            child.stop(5)


def _rank_reports(ranks: list[Child], in_hand: list[StepInHand], what: str, how: Measurement,
                  abandon: threading.Event | None) -> list[StepTimes]:
    """Each rank's report, in the order they come; a rank that fails, dies or hangs fails the
    measurement of `what`, named."""
    deadline, reported = time.monotonic() + how.report_s, []
    while True:
        # Looked at before reading: a rank that has ended has said all it will.
        dead = [f"{rank.name} {how_it_ended(rank.exitcode)}" for rank in ranks if rank.exitcode not in (None, 0)]
        over = time.monotonic() > deadline or all(rank.exitcode is not None for rank in ranks)
        for report in messages(ranks, 0 if dead or over else 1.0):
            if isinstance(report, RankFailed):
                raise RuntimeError(f"measuring {what} failed in rank {report.rank}:\n{report.traceback}")
            reported.append(report)
        if len(reported) == len(ranks):
            return reported
        if abandon is not None and abandon.is_set():
            raise RuntimeError(f"measuring {what}: abandoned, the driver that asked for it is gone")
        if dead:
            raise RuntimeError(f"measuring {what}: {'; '.join(dead)}")
        if over:
            where = "; ".join(f"{rank.name} {hand.describe()}" for rank, hand in zip(ranks, in_hand))
            raise RuntimeError(f"measuring {what}: no report in {how.report_s:g} s (timeouts.report_s): {where}; "
                               "lower rates.steps or check the devices")


def _train_steps(group: GroupSpec, rank: int, devices: list[str], rendezvous: str, how: Measurement,
                 in_hand: StepInHand, busy_until_stopped: bool, *, to_parent, from_parent) -> None:
    """Process entry point (runtime.child.Child): `warmup` + `steps` training steps; reports the timed
    ones' durations. `busy_until_stopped`: then steps on until its parent says StopStepping."""
    child_started("rates")
    try:
        import numpy as np
        import torch
        import torch.distributed as dist

        torch.set_num_threads(how.threads)
        device, world = torch.device(devices[rank]), len(devices)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if world > 1:
            join_process_group(rendezvous, rank, world, device, how.report_s, group.name)  # as long as a report
        # stepping on for the others, it may step far more often than it times (its schedule spans them all)
        most_steps = (how.warmup + how.steps) * (BUSY_STEPS_FACTOR if busy_until_stopped else 1)
        step = GroupStep(group, how.num_classes, how.image_sizes, device, most_steps,
                         precision=how.precision, world=world, threads=how.threads, in_hand=in_hand,
                         cuda_graphs=how.cuda_graphs, compile=how.compile)
        warmup = how.warmup + step.steps_before_replay  # a trainer captures its graphs once a run
        random, rows = np.random.default_rng(rank), rank_rows(rank, world)  # its share, as a trainer takes it
        batches = {}
        for sink in group.inputs:
            side = how.image_sizes[sink]
            images = random.integers(0, 256, (how.batch_size, side, side, 3), dtype=np.uint8)[rows]
            labels = torch.from_numpy(random.integers(0, how.num_classes, how.batch_size)[rows].copy())
            batches[sink] = (images, labels)

        def train() -> None:
            step.train({s: (step.normalise(x), y.to(device, non_blocking=True)) for s, (x, y) in batches.items()})
            _synchronize(torch, device)  # CUDA runs asynchronously: the clock must wait for the step

        step_seconds = []  # warm-up's, then the timed ones
        for number in range(warmup + how.steps):
            in_hand.begin(number)
            _synchronize(torch, device)
            started = time.perf_counter()
            train()
            step_seconds.append(time.perf_counter() - started)
        # Report first: tearing down a gloo group can hang once the peer has
        # exited, and the parent kills what has not ended soon after the reports.
        to_parent.send(StepTimes(rank, step_seconds[:warmup], step_seconds[warmup:]))
        if busy_until_stopped:
            for _ in range(most_steps - len(step_seconds)):
                if from_parent.poll():
                    break
                train()
            from_parent.poll(None)  # ending first would leave the others the device to themselves
        if world > 1:
            dist.destroy_process_group()
    except BaseException:
        tell_parent(to_parent, RankFailed(rank, traceback.format_exc()))
        raise


def _synchronize(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_model() -> str:
    """This host's CPU model name: the hardware a CPU rate was measured on (and benchmarks' header)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def read_cache(path: Path) -> list[dict]:
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


def write_cache(path: Path, entries: list[dict]) -> None:
    write_whole(path, json.dumps(entries, indent=1))
