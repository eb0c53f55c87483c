"""`mode=profile`: a short profiling pass that writes the run's report
without training.

Called by pipeline/run.py with the run's ensemble and stage graph.

1. Pipeline pass: `profile.batches` training batches (epoch after epoch if the data
   set has fewer) through the stage graph on Dask, consumed by the driver as
   fast as it can: the input rate, stage timings and worker utilisation of
   the report.
2. Differential passes (DS-Analyzer's method), per model shape: a few timed
   training steps in this process, fed (a thread taking batches up to
   delivery.ring_depth ahead, as a hub fills its ring) through the same
   Dask hand-off by
   (a) in-memory synthetic batches, (b) decoded images held in memory (only
   the stages after decoding run), (c) the full graph from files. Time per
   image in each pass splits the trainer's stall into fetch (read + decode),
   preprocessing (the later stages) and transport (the hand-off of finished
   batches to the driver); docs/report.md has the formulas.

A Dask performance report of both (dask-report.html, inline: opens offline)
lies next to the report when bokeh is installed.
"""
from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
from omegaconf import DictConfig
from rich.console import Console

from pipeline.data.executor import (Executor, TlsFiles, cache_kept, dask_client, dask_performance_report,
                                    in_flight_window, worker_count)
from pipeline.data.graph import BatchOutput, StageGraph
from pipeline.runtime.hang import Patience
from pipeline.measure.recorder import RunRecorder
from pipeline.orchestration.devices import DeviceKind, resolve_device
from pipeline.report.build import DASK_REPORT
from pipeline.training.reports import TrainReport
from pipeline.training.group import GroupSpec, GroupStep, least_batch
from pipeline.training.members import ModelSpec, grouped
from stages.base import Batch, BatchContext, DataKind, Role, Split, Stage
from stages.read import ImageFolder

CACHED_BATCHES = 4  # distinct decoded batches held in memory for the cached pass, cycled: augmenting costs the same


def profile_run(cfg: DictConfig, models: list[ModelSpec], graph: StageGraph, total_steps: int, output_dir: Path,
                console: Console) -> dict:
    """Profile the configured pipeline and ensemble: the results of mode=profile (run.py writes them).
    `total_steps`, a real run's training steps, lays out the schedules the passes step on."""
    batches, steps, warmup = cfg.profile.batches, cfg.profile.steps, cfg.profile.warmup
    sides = graph.image_sizes
    image_sizes = {m.name: sides[m.input] for m in models}
    device = _device(cfg.trainer.device)
    workers = "remote" if cfg.cluster.address else worker_count(cfg.cluster.workers)
    families = grouped(models, lambda m: m.shape)  # models of one shape (module and sink) are measured once
    console.print(f"[bold]profile mode[/]  {batches} batches through the pipeline on "
                  f"{cfg.cluster.address or f'{workers} Dask workers'}, then {len(families)} model shape(s) x 3 "
                  f"differential passes of {steps} steps on {device}; no training (mode=train trains)")

    # The schedule of a real run's first steps: the passes train as a run would begin.
    trainees = {family: _Trainee(members[0], len(graph.source.class_names), image_sizes[members[0].name], device,
                                cfg.trainer.threads, total_steps) for family, members in families.items()}
    params = {m.name: trainees[m.shape].params for m in models}
    recorder = RunRecorder(models, params, image_sizes)
    differential: dict[str, dict] = {}
    drain_s, patience = cfg.timeouts.drain_s, Patience(cfg.timeouts.warn_s, cfg.timeouts.stall_s)
    with dask_client(cfg.cluster.address, cfg.cluster.workers, cfg.cluster.threads_per_worker,
                     tls=TlsFiles.configured(cfg.cluster.tls), dashboard=cfg.cluster.dashboard) as client, \
            cache_kept(client, graph), dask_performance_report(client, output_dir / DASK_REPORT, console):
        threads = sum(client.nthreads().values())
        in_flight = in_flight_window(cfg.cluster.in_flight, threads)
        with Executor(client, graph, cfg.seed, cfg.on_error, in_flight, drain_s=drain_s,
                      patience=patience) as executor:
            pass_started = time.perf_counter()
            for output in _batches(executor, batches):
                for path, reason in recorder.add_batch(output, train=True):
                    console.print(f"[yellow]warning[/] skipped {path}: {reason}")
            pass_s = time.perf_counter() - pass_started
            if executor.ready:
                recorder.add_queue("pipeline pass prefetch", executor.prefetch_capacity, executor.ready)
        console.print(f"pipeline pass: {recorder.train_images} images in {pass_s:.1f} s "
                      f"({recorder.train_images / pass_s:,.0f} img/s)")
        decoded = _fetch_outputs(graph, cfg.seed, cfg.on_error,
                                 min(CACHED_BATCHES, graph.source.num_batches(Split.TRAIN)))
        for family, members in families.items():
            trainee = trainees[family]
            sink = members[0].input
            measured = {}
            for kind, pass_graph in (("synthetic", _synthetic_graph(graph, sink, len(graph.source.class_names))),
                                     ("cached", _cached_graph(graph, sink, decoded)),
                                     ("files", _uncached_graph(graph, sink))):
                with Executor(client, pass_graph, cfg.seed, cfg.on_error, in_flight, drain_s=drain_s,
                              patience=patience) as executor:
                    feed = _ahead(_batches(executor, warmup + steps), cfg.delivery.ring_depth)
                    measured[kind] = trainee.train(feed, sink, warmup)
            rates = {f"{kind}_images_per_s": m.images / (m.wait_s + m.step_s) for kind, m in measured.items()}
            rates["compute_images_per_s"] = measured["synthetic"].images / measured["synthetic"].step_s
            console.print(f"{members[0].name}: " + ", ".join(
                f"{kind.removesuffix('_images_per_s')} {rate:,.0f}" for kind, rate in rates.items()) + " img/s")
            files = measured["files"]
            for index, model in enumerate(members):  # a grid's members share their shape's measurements
                differential[model.name] = rates
                recorder.joined(GroupSpec(model.name, (model,)), 0, (device,), 0)
                recorder.add_report(TrainReport(model.name, 0, 0, files.loss, files.images, files.step_s,
                                                files.wait_s, files.spans if index == 0 else []))

    results = {
        "mode": "profile",
        "profile_pass": {"batches": batches, "pass_s": pass_s, "steps": steps, "warmup": warmup,
                         "cached_batches": len(decoded)},
        "devices": {"kind": device, "slots": 1},
        "cluster": {"address": cfg.cluster.address or "local", "workers": workers, "threads": threads,
                    "in_flight": in_flight,
                    "worker_busy_pct": recorder.worker_busy_pct(pass_s)},
        **recorder.as_dict(pass_s),
        "differential": differential,
    }
    results["pipeline"]["cpu_s_per_epoch"] = _cpu_s_per_epoch(results["pipeline"]["stages"], graph.source)
    return results


def _device(requested: DeviceKind) -> str:
    import torch

    return "cuda:0" if resolve_device(requested, torch.cuda.is_available()) == DeviceKind.cuda else "cpu"


def _batches(executor: Executor, count: int) -> Iterator[BatchOutput]:
    """`count` training batches in order, epoch after epoch: a pass may be longer than an epoch.
    Each epoch's tail overlaps the next one's head, as in a run (on a small data set a pass that
    drained at every epoch boundary would cap the rate that more workers reach)."""
    epoch = 0
    while True:
        for _, output in executor.batches(Split.TRAIN, epoch, then=(Split.TRAIN, epoch + 1)):
            yield output
            count -= 1
            if count == 0:
                return
        epoch += 1


def _ahead(feed: Iterator[BatchOutput], depth: int) -> Iterator[BatchOutput]:
    """The batches of `feed`, taken by a thread up to `depth` ahead of the consumer: the hand-off
    overlaps training as in a run, where a hub fills a ring of delivery.ring_depth batches while
    the trainer processes train."""
    ready: queue.Queue = queue.Queue(depth)
    stop = threading.Event()
    done = object()

    def take() -> None:
        try:
            for output in feed:
                ready.put(output)
                if stop.is_set():
                    return
        except BaseException as err:  # raised in the consumer's thread
            ready.put(err)
        ready.put(done)

    thread = threading.Thread(target=take, name="profile-feed", daemon=True)
    thread.start()
    try:
        while (item := ready.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # a consumer that stopped early: unblock the thread so that it ends
            try:
                ready.get(timeout=0.1)
            except queue.Empty:
                pass


def _cpu_s_per_epoch(stages: dict, source: ImageFolder) -> float | None:
    """The pass's CPU per source image times an epoch's images (training and validation)."""
    images = max((s["items"] for s in stages.values()), default=0)
    cpu_s = sum(s["cpu_s"] for s in stages.values())
    return cpu_s / images * (source.num_items(Split.TRAIN) + source.num_items(Split.VAL)) if images else None


# --- Stand-in graphs for the differential passes -------------------------------------------------------------------

@dataclass
class _PassGraph(StageGraph):
    """Stages standing in for part of the real graph; batches per epoch are the real source's."""

    folder: ImageFolder | None = None

    @property
    def source(self) -> ImageFolder:
        return self.folder


@dataclass
class _Synthetic(Stage):
    """A sink that hands out one batch made in memory: no preprocessing at all."""

    images: np.ndarray
    labels: np.ndarray
    paths: list[str] = field(init=False)  # its items named once: a batch's share of the pass is none

    role: ClassVar[Role] = Role.SINK
    accepts: ClassVar[DataKind | None] = None

    def __post_init__(self) -> None:
        self.paths = [f"in memory, item {i}" for i in range(len(self.labels))]

    def __call__(self, batch: Batch | None, ctx: BatchContext) -> Batch:
        return Batch(self.images, self.labels, list(self.paths))


@dataclass
class _Replay(Stage):
    """A source that hands out a stage's outputs held in memory, cycling through them."""

    batches: list[Batch]

    role: ClassVar[Role] = Role.SOURCE
    accepts: ClassVar[DataKind | None] = None

    def __call__(self, batch: Batch | None, ctx: BatchContext) -> Batch:
        held = self.batches[ctx.index % len(self.batches)]
        return Batch(list(held.data), held.labels, list(held.paths))  # later stages may drop items in place


def _is_fetch(stage: Stage) -> bool:
    """Reads or decodes files: what the cached pass replaces by decoded images in memory."""
    return stage.role is Role.SOURCE or stage.accepts is DataKind.ENCODED


def _fetch_outputs(graph: StageGraph, seed: int, on_error: str, count: int) -> list[dict[str, Batch]]:
    """The first `count` training batches' outputs of the fetch stages that feed the others, made here."""
    fetch = [name for name, stage in graph.stages.items() if _is_fetch(stage)]
    feeding = {graph.inputs[name] for name, stage in graph.stages.items() if not _is_fetch(stage)} & set(fetch)
    held = []
    for index in range(count):
        ctx = BatchContext(seed=seed, split=Split.TRAIN, epoch=0, index=index, on_error=on_error)
        outputs: dict[str, Batch] = {}
        for name in fetch:  # topological order
            given = outputs[graph.inputs[name]] if graph.inputs[name] else None
            outputs[name] = graph.through(name, given, ctx, f"train batch {index} of epoch 0",
                                          graph.source.batch_size)
        held.append({name: outputs[name] for name in feeding})
    return held


def _uncached_graph(graph: StageGraph, sink: str) -> StageGraph:
    """The stages feeding `sink` but the cache, whose consumer reads its input instead: each batch read and
    decoded from its files (the pipeline pass before filled the cache with the very batches this pass takes,
    which it then served, and the files pass timed no file)."""
    sub = graph.feeding({sink})
    cache = sub.cache_name
    if cache is None:
        return sub
    return StageGraph({name: stage for name, stage in sub.stages.items() if name != cache},
                      {name: sub.inputs[cache] if given == cache else given
                       for name, given in sub.inputs.items() if name != cache},
                      {name: spec for name, spec in sub.specs.items() if name != cache})


def _cached_graph(graph: StageGraph, sink: str, decoded: list[dict[str, Batch]]) -> _PassGraph:
    """The stages feeding `sink`, with the fetch stages replaced by their outputs held in memory."""
    sub = graph.feeding({sink})
    stages: dict[str, Stage] = {}
    inputs: dict[str, str | None] = {}
    for name, stage in sub.stages.items():
        if not _is_fetch(stage):
            stages[name], inputs[name] = stage, sub.inputs[name]
        elif name in decoded[0] and any(sub.inputs[c] == name for c in sub.stages if not _is_fetch(sub.stages[c])):
            stages[name], inputs[name] = _Replay([held[name] for held in decoded]), None
    return _PassGraph(stages, inputs, {name: sub.specs[name] for name in stages}, folder=graph.source)


def _synthetic_graph(graph: StageGraph, sink: str, classes: int) -> _PassGraph:
    spec = graph.specs[sink]
    size = graph.source.batch_size
    images = np.random.default_rng(0).integers(0, 256, (size, *spec.item_shape), dtype=np.uint8)
    labels = np.arange(size, dtype=np.int64) % classes
    return _PassGraph({sink: _Synthetic(images, labels)}, {sink: None}, {sink: spec}, folder=graph.source)


# --- Training steps in this process ---------------------------------------------------------------------------------

@dataclass
class _Pass:
    images: int  # trained in the timed steps
    step_s: float  # inside training steps
    wait_s: float  # waiting for the next batch
    loss: float  # mean training loss
    spans: list[tuple[float, float]]  # (start, end) of each timed step, time.time(), for the timeline


class _Trainee:
    """One model trained as pipeline.training.trainer does it (uint8 NHWC in, normalised
    on the device, the trainer's own step), on one device, fed by this process."""

    def __init__(self, model: ModelSpec, classes: int, image_size: int, device: str, threads: int,
                 total_steps: int):
        import torch

        from pipeline.training.models import count_parameters

        self.torch, self.device, self.threads, self.model = torch, torch.device(device), threads, model
        self.step = GroupStep(GroupSpec(model.name, (model,)), classes, {model.input: image_size}, self.device,
                              total_steps)
        self.params = count_parameters(self.step.units[0].module)

    def train(self, feed: Iterator[BatchOutput], sink: str, warmup: int) -> _Pass:
        torch = self.torch
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)  # as a trainer process has (trainer.threads)
        timed = _Pass(0, 0.0, 0.0, 0.0, [])
        loss_sum = 0.0
        try:
            waited = time.perf_counter()
            for number, output in enumerate(feed):
                batch = output.batches[sink]
                if len(batch.labels) < least_batch(1):  # trainers skip such a batch too
                    continue
                started, wall_started = time.perf_counter(), time.time()
                loss = self._step(batch.data, batch.labels)
                ended = time.perf_counter()
                if number >= warmup:
                    timed.images += len(batch.labels)
                    timed.wait_s += started - waited
                    timed.step_s += ended - started
                    timed.spans.append((wall_started, time.time()))
                    loss_sum += loss * len(batch.labels)
                waited = time.perf_counter()
        finally:
            torch.set_num_threads(before)
        timed.loss = loss_sum / timed.images if timed.images else math.nan
        return timed

    def _step(self, images: np.ndarray, labels: np.ndarray) -> float:
        x = self.step.normalise(images)
        y = self.torch.from_numpy(np.ascontiguousarray(labels)).to(self.device)
        losses = self.step.train({self.model.input: (x, y)})
        return float(losses[self.model.name])  # waits for the device: the step's time is its own
