"""Collects what a run measured: the recorder behind results.json (the
summary table and the report render it: pipeline/report/)."""
from __future__ import annotations

import json
import math
import threading
import time
from collections import defaultdict, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from pipeline.data.graph import BatchOutput, StageTiming
from pipeline.runtime.files import write_whole, written_whole
from pipeline.training.reports import TrainerDone, TrainReport, ValReport, validation_loss
from pipeline.training.group import GroupSpec
from pipeline.training.members import ModelSpec
from pipeline.training.trainer import better_checkpoint


MAX_TIMELINE_SPANS = 50_000  # batch tasks and trainer steps kept for the timeline
RECENT_BATCHES = 32  # batch tasks the preprocessing cost per image is measured over


@dataclass
class ModelRecord:
    model: ModelSpec
    params: int
    image_size: int
    val_accuracy: dict[int, float] = field(default_factory=dict)  # by the model's epoch
    val_loss: dict[int, float] = field(default_factory=dict)  # cross-entropy of its validation softmax
    train_loss: dict[int, float] = field(default_factory=dict)
    epoch_train: dict[int, dict] = field(default_factory=dict)  # its lr, images/s and data stall, by epoch
    stints: list[dict] = field(default_factory=list)  # one per flotilla it trained in
    converged: str | None = None  # why it stopped training
    culled: bool = False  # successive halving stopped it (scheduler.halving)
    failures: list[str] = field(default_factory=list)  # what its failed trainers said
    last_probs: np.ndarray | None = None  # validation softmax of its latest epoch
    # Its softmax of epochs after its last checkpoint that the ensemble still waits on: if it resumes
    # from that checkpoint, the epochs it does again replace these instead of counting twice.
    recent_probs: dict[int, np.ndarray] = field(default_factory=dict)
    best_checkpoint: tuple[int, float] | None = None  # (epochs, val accuracy) of its best checkpoint so far
    best_probs: np.ndarray | None = None  # the validation softmax of that checkpoint
    images: int = 0
    step_s: float = 0.0  # rank 0, summed over epochs
    wait_s: float = 0.0
    compile_s: float = 0.0  # of step_s, its group's steps that compiled (trainer.compile)

    def as_dict(self) -> dict:
        m = self.model
        epochs = sorted(self.val_accuracy)
        last = self.stints[-1] if self.stints else {"devices": []}
        return {
            "name": m.name, "model": m.model, "optimizer": m.optimizer, "lr_scheduler": m.lr_scheduler,
            "loss": m.loss, "seed": m.seed, "input": m.input, "image_size": self.image_size, "params": self.params,
            "slots": len(last["devices"]), "devices": list(last["devices"]), "flotillas": self.stints,
            "group": last.get("group"), "group_mode": last.get("group_mode"),
            "epochs": len(epochs), "converged": self.converged, "culled": self.culled, "failures": self.failures,
            "val_accuracy": [self.val_accuracy[e] for e in epochs],
            "val_loss": [self.val_loss[e] for e in sorted(self.val_loss)],
            "final_val_accuracy": self.val_accuracy[epochs[-1]] if epochs else None,
            "best_checkpoint": dict(zip(("epochs", "val_accuracy"), self.best_checkpoint))
            if self.best_checkpoint else None,  # checkpoints/<name>/epoch<epochs>.pt, kept (best.json)
            "train_loss": [self.train_loss[e] for e in sorted(self.train_loss)],
            "images": self.images,  # trained on, all slots and epochs
            "images_per_s": self.images / self.step_s if self.step_s else None,
            "data_stall_pct": 100 * self.wait_s / (self.wait_s + self.step_s) if self.step_s else None,
            "compile_s": self.compile_s,
        }


class RunRecorder:
    """Collects measurements from every flotilla thread (hence the lock)."""

    def __init__(self, models: list[ModelSpec], params: dict[str, int], image_sizes: dict[str, int],
                 parts: dict[str, list[str]] | None = None):
        """`parts`: sub-ensembles reported beside the whole, by name (the jobs of a shared sweep run:
        pipeline/sharing.py)."""
        self.models = {m.name: ModelRecord(m, params[m.name], image_sizes[m.name]) for m in models}
        self.parts = {part: set(names) for part, names in (parts or {}).items()}
        # Per part and epoch, as for the whole: the sum of its members' softmax and the members in it, until
        # all are; then the part's accuracy and loss, which stand.
        self.part_pending: dict[str, dict[int, tuple[np.ndarray, set[str]]]] = {p: {} for p in self.parts}
        self.part_accuracy: dict[str, dict[int, float]] = {p: {} for p in self.parts}
        self.part_loss: dict[str, dict[int, float]] = {p: {} for p in self.parts}
        self.lock = threading.Lock()
        self.origin = time.time()  # timeline spans are seconds since this
        self.timeline: list[dict] = []
        self.stages: dict[str, StageTiming] = defaultdict(StageTiming)
        self.stage_walls: dict[str, list[float]] = defaultdict(list)  # per batch, for latency percentiles
        self.worker_task_s: dict[str, float] = defaultdict(float)  # time each Dask worker spent in batch tasks
        self.worker_threads: dict[str, int] = {}  # each one's threads (a remote cluster's: its workers' own)
        self.recent: deque = deque(maxlen=RECENT_BATCHES)  # (worker seconds, images produced) per batch task
        # flotilla -> epoch of its sequence -> preprocessing CPU seconds (its batch tasks' and hubs')
        self.cpu_by_epoch: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
        self.cache_by_epoch: dict[int, list[int]] = defaultdict(lambda: [0, 0])  # epoch -> [hits, lookups]
        self.skipped: dict[str, str] = {}
        self.converted: dict[str, str] = {}
        # Per epoch the ensemble still waits on, the sum of the models' validation softmax and the models
        # in it: one array per epoch however many models (models may never all reach an epoch).
        self.epoch_probs: dict[int, tuple[np.ndarray, set[str]]] = {}
        self.val_labels: np.ndarray | None = None
        self.ensemble_accuracy: dict[int, float] = {}
        self.ensemble_loss: dict[int, float] = {}  # cross-entropy of the mean softmax, by epoch
        self.checksums: dict[str, list] = {}
        self.train_images = 0
        self.delivery: dict[int, dict] = {}  # flotilla -> its topology, why, and what each hub moved
        self.plans: dict[int, dict] = {}  # flotilla -> its planned images/s and the CPU model it was planned on
        self.queues: dict[str, dict] = {}  # name -> occupancy over time, the report's queue shape
        self._saved: dict[str, np.ndarray] = {}  # the arrays save_state last wrote

    def add_batch(self, output: BatchOutput, train: bool) -> list[tuple[str, str]]:
        """Folds a batch's timings in; returns the files it skipped for the first time.
        `train`: its images count as training images delivered (pipeline.images_per_s)."""
        with self.lock:
            for name, timing in output.timings.items():
                total = self.stages[name]
                total.wall_s += timing.wall_s
                total.cpu_s += timing.cpu_s
                total.items += timing.items
                total.bytes_in += timing.bytes_in
                total.bytes_out += timing.bytes_out
                self.stage_walls[name].append(timing.wall_s)
            produced = len(next(iter(output.batches.values())).labels) if output.batches else 0
            self.recent.append((sum(timing.wall_s for timing in output.timings.values()), produced))
            self._span(output.worker, "task", output.started, output.ended)
            self.worker_task_s[output.worker] += output.ended - output.started
            self.worker_threads[output.worker] = output.worker_threads
            if train:
                self.train_images += produced
            new = [(p, r) for p, r in output.skipped if p not in self.skipped]
            self.skipped.update(new)
            self.converted.update(dict(output.converted))
            return new

    def add_cpu(self, flotilla: int, epoch: int, cpu_s: float) -> None:
        """Preprocessing CPU seconds spent on epoch `epoch` of a flotilla's sequence (a batch task's, or a
        hub's over a split)."""
        with self.lock:
            self.cpu_by_epoch[flotilla][epoch] += cpu_s

    def add_cache(self, epoch: int, hits: int, lookups: int) -> None:
        """A batch task of epoch `epoch` found `hits` of the `lookups` images it looked up in the cache."""
        if lookups:
            with self.lock:
                counts = self.cache_by_epoch[epoch]
                counts[0] += hits
                counts[1] += lookups

    def seconds_per_image(self) -> float | None:
        """Worker seconds the pipeline spent per image it produced, over its last RECENT_BATCHES batch
        tasks: what preprocessing costs now (epochs after the first cost less with a cache)."""
        with self.lock:
            images = sum(produced for _, produced in self.recent)
            return sum(seconds for seconds, _ in self.recent) / images if images else None

    def delivery_plan(self, flotilla: int, plan, why: str) -> None:
        with self.lock:
            self.delivery[flotilla] = {"topology": plan.topology, "why": why, "streams": [], "hubs": {}}
        self.delivery_streams(flotilla, plan)

    def delivery_streams(self, flotilla: int, plan) -> None:
        """The streams of `flotilla`'s plan, as laid out or since a model joined a running one."""
        with self.lock:
            self.delivery[flotilla]["streams"] = [{"members": list(s.members), "hubs": list(s.hubs),
                                                   "gather": s.gather} for s in plan.streams]

    def add_queue(self, name: str, capacity: int, samples: list[tuple[float, int]]) -> dict:
        """A queue's occupancy, (time.time(), items held) samples, in the report's queue shape
        (statistics are the report's, pipeline/report/measurements.occupancy_stats)."""
        with self.lock:
            return self._queue(name, capacity, samples)

    def _queue(self, name: str, capacity: int, samples: list[tuple[float, int]]) -> dict:
        self.queues[name] = {"capacity": capacity, "t_s": [round(t - self.origin, 3) for t, _ in samples],
                             "filled": [held for _, held in samples]}
        return self.queues[name]

    def add_hub_summaries(self, flotilla: int, summaries: dict[int, dict]) -> None:
        """What each hub moved; its ring's and (a producer's) prefetch queue's occupancy."""
        with self.lock:
            for rank, summary in summaries.items():
                summary["occupancy"] = self._queue(f"flotilla {flotilla} hub {rank} ring",
                                                   max(summary["ring_depth"].values(), default=1),
                                                   summary.pop("occupancy"))
                ready = summary.pop("tasks_ready")
                if ready:
                    self._queue(f"flotilla {flotilla} hub {rank} prefetch", summary["prefetch_capacity"], ready)
                latency = summary.pop("latency_ms")
                summary["latency_ms"] = {f"p{q}": float(np.percentile(latency, q)) for q in (50, 95)} \
                    if latency else None
                self.delivery[flotilla]["hubs"][rank] = summary

    def joined(self, group: GroupSpec, flotilla: int, devices: tuple[str, ...], start_epoch: int,
               flotilla_epoch: int = 0, how: str | None = None) -> None:
        """The group starts in `flotilla`, after `start_epoch` epochs, at the flotilla's epoch
        `flotilla_epoch` (> 0 for a model that joined a running stream, `how`: "attached" to the running
        hub or "laid out again" with the members there): what its models did after that checkpoint
        (before a failure or a stop) is done again, and counts once."""
        with self.lock:
            for model in group.members:
                record = self.models[model.name]
                for epochs in (record.val_accuracy, record.val_loss, record.train_loss, record.epoch_train):
                    for epoch in [e for e in epochs if e >= start_epoch]:
                        del epochs[epoch]
                record.stints.append({
                    "flotilla": flotilla, "devices": list(devices), "start_epoch": start_epoch,
                    "flotilla_epoch": flotilla_epoch, "joined": how, "group": group.name,
                    "group_members": [m.name for m in group.members], "group_mode": group.mode,
                    "images": 0, "train_s": 0.0})  # trained on in this stint, and the time it took

    def planned(self, flotilla: int, images_per_s: float, start_s: float, prep_seconds_per_image: float) -> None:
        """The scheduler formed `flotilla` to run at `images_per_s` (NaN: planned without rates) after
        `start_s` seconds of its trainers' start, with preprocessing at `prep_seconds_per_image`
        core-seconds an image."""
        with self.lock:
            self.plans[flotilla] = {"planned_images_per_s": None if math.isnan(images_per_s) else images_per_s,
                                    "planned_start_s": start_s, "prep_seconds_per_image": prep_seconds_per_image}

    def epochs_before(self, flotilla: int, model: str, start_epoch: int) -> int:
        """Epochs `flotilla` ran before `model`, just joined after `start_epoch` epochs, joined it again (a
        resumed run forms it again): its sequence of shuffles goes on from there (0 for a new flotilla)."""
        with self.lock:
            stints = [s for s in self.models[model].stints if s["flotilla"] == flotilla]
            if len(stints) < 2:
                return 0
            return stints[0].get("flotilla_epoch", 0) + start_epoch - stints[0]["start_epoch"]

    def converged(self, model: str, reason: str) -> None:
        with self.lock:
            self.models[model].converged = reason

    def checkpointed(self, model: str, epochs: int) -> None:
        """`model` will resume from after `epochs` epochs at the earliest: its softmax of those is final.
        Its best checkpoint is chosen by the trainer's rule (`better_checkpoint`), which keeps that file."""
        with self.lock:
            record = self.models[model]
            recent = record.recent_probs
            for epoch in [e for e in recent if e < epochs]:
                del recent[epoch]
            accuracy = record.val_accuracy.get(epochs - 1)
            if accuracy is not None and max(record.val_accuracy) == epochs - 1 \
                    and better_checkpoint(record.best_checkpoint, epochs, accuracy):  # last_probs are that epoch's
                record.best_checkpoint, record.best_probs = (epochs, accuracy), record.last_probs

    def culled(self, model: str) -> None:
        with self.lock:
            self.models[model].culled = True

    def by_epoch(self, metric: str) -> dict[str, list[float]]:
        """Every model's `metric` (val_accuracy or val_loss) by epoch, its first epoch's first."""
        with self.lock:
            return {name: [values[e] for e in sorted(values)]
                    for name, values in ((name, getattr(r, metric)) for name, r in self.models.items())}

    def failed(self, model: str, why: str) -> None:
        with self.lock:
            self.models[model].failures.append(why)

    def accuracies(self, model: str) -> list[float]:
        with self.lock:
            record = self.models[model]
            return [record.val_accuracy[e] for e in sorted(record.val_accuracy)]

    def train_loss(self, model: str, epoch: int) -> float | None:
        """Mean training loss of `model`'s epoch `epoch` (0-based), if its report came in."""
        with self.lock:
            return self.models[model].train_loss.get(epoch)

    def epoch_metrics(self, model: str, epoch: int) -> dict[str, float | None]:
        """What `model`'s epoch `epoch` (0-based) measured, None where a report did not say (what tracking
        writes: pipeline/measure/tracking.py)."""
        with self.lock:
            record = self.models[model]
            return {"train_loss": record.train_loss.get(epoch), "val_accuracy": record.val_accuracy.get(epoch),
                    "val_loss": record.val_loss.get(epoch),
                    **record.epoch_train.get(epoch, dict.fromkeys(("lr", "images_per_s", "data_stall_pct")))}

    def add_checksums(self, flotilla: int, done: TrainerDone) -> None:
        with self.lock:
            for sink, checksums in done.checksums.items():
                self.checksums[f"{flotilla}/{done.group}/{done.rank}/{sink}"] = checksums

    def add_report(self, report: TrainReport | ValReport) -> None:
        with self.lock:
            record = self.models[report.model]
            if isinstance(report, ValReport):
                self._add_validation(record, report)
                return
            for start, end in report.spans:  # a group's steps come once, with its first member's report
                self._span(f"trainer {record.stints[-1]['group']}/{report.rank}", "step", start, end)
            if report.rank == 0:  # rank 0 speaks for its model's ranks
                stint = record.stints[-1]
                images = report.images * len(stint["devices"])
                record.train_loss[report.epoch] = report.loss
                busy = report.step_s + report.wait_s
                record.epoch_train[report.epoch] = {
                    "lr": report.lr, "images_per_s": images / report.step_s if report.step_s else None,
                    "data_stall_pct": 100 * report.wait_s / busy if busy else None}
                record.images += images
                record.step_s += report.step_s
                record.wait_s += report.wait_s
                record.compile_s += report.compile_s
                stint["images"] = stint.get("images", 0) + images  # (absent from older runs' state)
                stint["train_s"] = stint.get("train_s", 0.0) + report.step_s + report.wait_s

    def save_state(self, folder: Path) -> None:
        """What it has recorded, into `folder` (a stopped run's state/recorder): JSON, and the softmax
        arrays as .npy files. `load_state` takes it back."""
        with self.lock:
            arrays = {"val_labels": self.val_labels}
            for name, record in self.models.items():
                arrays[f"last-{name}"] = record.last_probs
                arrays[f"best-{name}"] = record.best_probs
                arrays.update({f"recent-{name}-{epoch}": probs for epoch, probs in record.recent_probs.items()})
            arrays.update({f"sum-{epoch}": total for epoch, (total, _) in self.epoch_probs.items()})
            arrays.update({f"part-{part}-sum-{epoch}": total for part, pending in self.part_pending.items()
                           for epoch, (total, _) in pending.items()})
            state = {
                "models": {name: {"val_accuracy": r.val_accuracy, "val_loss": r.val_loss, "train_loss": r.train_loss,
                                  "stints": r.stints, "converged": r.converged, "culled": r.culled,
                                  "failures": r.failures, "images": r.images,
                                  "step_s": r.step_s, "wait_s": r.wait_s, "compile_s": r.compile_s,
                                  "recent": sorted(r.recent_probs),
                                  "best_checkpoint": r.best_checkpoint}
                           for name, r in self.models.items()},
                "epoch_models": {epoch: sorted(models) for epoch, (_, models) in self.epoch_probs.items()},
                "ensemble_accuracy": self.ensemble_accuracy, "ensemble_loss": self.ensemble_loss,
                "parts": {part: {"accuracy": self.part_accuracy[part], "loss": self.part_loss[part],
                                 "pending": {epoch: sorted(models) for epoch, (_, models) in pending.items()}}
                          for part, pending in self.part_pending.items()},
                "origin": self.origin, "timeline": self.timeline,
                "stages": {name: asdict(t) for name, t in self.stages.items()}, "stage_walls": self.stage_walls,
                "worker_task_s": self.worker_task_s, "worker_threads": self.worker_threads,
                "skipped": self.skipped, "converted": self.converted,
                "checksums": self.checksums, "train_images": self.train_images, "delivery": self.delivery,
                "queues": self.queues, "cpu_by_epoch": self.cpu_by_epoch, "cache_by_epoch": self.cache_by_epoch,
                "plans": self.plans}
            text = _json(state)  # under the lock: flotilla threads go on changing what it holds
        folder.mkdir(parents=True, exist_ok=True)
        arrays = {key: array for key, array in arrays.items() if array is not None}
        for key, array in arrays.items():  # an array changes by being replaced: unchanged ones are on disk
            if self._saved.get(key) is not array:
                with written_whole(folder / f"{key}.npy") as file:
                    np.save(file, array, allow_pickle=False)
        write_whole(folder / "recorder.json", text)
        for path in folder.glob("*.npy"):
            if path.name[:-len(".npy")] not in arrays:
                path.unlink()
        self._saved = arrays

    def load_state(self, folder: Path) -> None:
        state = json.loads((folder / "recorder.json").read_text())
        array = lambda key: np.load(folder / f"{key}.npy", allow_pickle=False) \
            if (folder / f"{key}.npy").exists() else None
        by_epoch = lambda d: {int(epoch): value for epoch, value in d.items()}
        with self.lock:
            for name, saved in state["models"].items():
                record = self.models[name]
                record.val_accuracy, record.train_loss = by_epoch(saved["val_accuracy"]), by_epoch(saved["train_loss"])
                record.val_loss = by_epoch(saved.get("val_loss", {}))  # (absent from older runs' state)
                record.stints, record.converged = saved["stints"], saved["converged"]
                record.culled = saved.get("culled", False)  # (absent from older runs' state)
                record.failures = saved["failures"]
                record.images, record.step_s, record.wait_s = saved["images"], saved["step_s"], saved["wait_s"]
                record.compile_s = saved["compile_s"]
                record.last_probs = array(f"last-{name}")
                best = saved.get("best_checkpoint")  # (absent from older runs' state)
                record.best_checkpoint, record.best_probs = ((tuple(best), array(f"best-{name}")) if best
                                                             else (None, None))
                record.recent_probs = {epoch: array(f"recent-{name}-{epoch}") for epoch in saved["recent"]}
            self.epoch_probs = {int(epoch): (array(f"sum-{epoch}"), set(models))
                                for epoch, models in state["epoch_models"].items()}
            self.val_labels = array("val_labels")
            self.ensemble_accuracy = by_epoch(state["ensemble_accuracy"])
            self.ensemble_loss = by_epoch(state.get("ensemble_loss", {}))
            for part, saved in state.get("parts", {}).items():  # a shared sweep run's jobs (absent from older runs)
                self.part_accuracy[part], self.part_loss[part] = by_epoch(saved["accuracy"]), by_epoch(saved["loss"])
                self.part_pending[part] = {int(epoch): (array(f"part-{part}-sum-{epoch}"), set(models))
                                           for epoch, models in saved["pending"].items()}
            self.origin, self.timeline, self.train_images = state["origin"], state["timeline"], state["train_images"]
            self.stages.update({name: StageTiming(**t) for name, t in state["stages"].items()})
            self.stage_walls.update(state["stage_walls"])
            self.worker_task_s.update(state["worker_task_s"])
            self.worker_threads.update(state.get("worker_threads", {}))  # (absent from older runs': 1 each)
            self.skipped, self.converted, self.checksums = state["skipped"], state["converted"], state["checksums"]
            self.delivery = {int(f): info for f, info in state["delivery"].items()}
            self.queues = state["queues"]
            for flotilla, epochs in state.get("cpu_by_epoch", {}).items():  # absent from older runs
                self.cpu_by_epoch[int(flotilla)].update(by_epoch(epochs))
            self.cache_by_epoch.update(by_epoch(state.get("cache_by_epoch", {})))
            self.plans = by_epoch(state.get("plans", {}))

    def _cpu_s_by_epoch(self) -> dict:
        """Preprocessing CPU seconds per epoch, first epoch first: of the whole run (an epoch of every
        flotilla's sequence) and per flotilla (0 for an epoch it did not run); with a cache stage, the
        share of the images looked up each epoch that the cache held."""
        def listed(by_epoch: dict[int, float]) -> list[float]:
            return [by_epoch.get(epoch, 0.0) for epoch in range(max(by_epoch, default=-1) + 1)]

        run = defaultdict(float)
        for epochs in self.cpu_by_epoch.values():
            for epoch, cpu_s in epochs.items():
                run[epoch] += cpu_s
        hits = {epoch: hits / lookups for epoch, (hits, lookups) in self.cache_by_epoch.items()}
        return {"cpu_s_by_epoch": listed(run),
                "cpu_s_by_flotilla_epoch": {str(f): listed(epochs) for f, epochs in sorted(self.cpu_by_epoch.items())},
                **({"cache_hit_rate_by_epoch": listed(hits)} if hits else {})}

    def flotilla_rates(self) -> dict[str, dict]:
        """Each flotilla as planned and as it ran: measured, its slowest member's images/s over its time
        training, waits for batches included (what the plan's rate predicts)."""
        with self.lock:
            measured = defaultdict(list)
            for record in self.models.values():
                for stint in record.stints:
                    if stint.get("train_s"):
                        measured[stint["flotilla"]].append(stint["images"] / stint["train_s"])
            return {str(f): {**plan, "measured_images_per_s": min(measured[f], default=None)}
                    for f, plan in sorted(self.plans.items())}

    def worker_busy_pct(self, wall_s: float) -> dict[str, float]:
        """Share of the training time each worker's threads spent in batch tasks (each worker's own count:
        cluster.threads_per_worker is the local cluster's; a remote worker may have any)."""
        return {worker: 100 * busy / (wall_s * self.worker_threads.get(worker, 1))
                for worker, busy in self.worker_task_s.items()}

    def _span(self, lane: str, what: str, start: float, end: float) -> None:
        if len(self.timeline) < MAX_TIMELINE_SPANS:
            self.timeline.append({"lane": lane, "what": what, "start_s": round(start - self.origin, 4),
                                  "end_s": round(end - self.origin, 4)})

    def _add_validation(self, record: ModelRecord, report: ValReport) -> None:
        epoch = report.epoch
        record.val_accuracy[epoch] = report.accuracy
        record.last_probs = report.probs
        if self.val_labels is None:
            self.val_labels = report.labels
        if not np.array_equal(self.val_labels, report.labels):
            raise RuntimeError(f"model {report.model} saw validation labels in another order: "
                               "its rings are out of step")
        record.val_loss[epoch] = self._loss(report.probs, 1)
        for part, names in self.parts.items():  # before the whole's, which replaces record.recent_probs
            if report.model in names:
                self._fold(self.part_pending[part], self.part_accuracy[part], self.part_loss[part], len(names),
                           record, report)
        complete = self._fold(self.epoch_probs, self.ensemble_accuracy, self.ensemble_loss, len(self.models),
                              record, report)
        if complete:
            for other in self.models.values():
                other.recent_probs.pop(epoch, None)
        elif complete is False:
            record.recent_probs[epoch] = report.probs

    def _fold(self, pending: dict[int, tuple[np.ndarray, set[str]]], accuracy: dict[int, float],
              loss: dict[int, float], size: int, record: ModelRecord, report: ValReport) -> bool | None:
        """`report`'s softmax into an ensemble of `size` members: its accuracy and loss at an epoch once
        every member has reached it (`pending`: epoch -> the sum so far and who is in it). An epoch done
        again (resumed from a checkpoint before it) replaces its first softmax while the ensemble waits;
        once the ensemble has its accuracy, that stands. Whether the epoch is complete now; None when
        the report changes nothing."""
        epoch = report.epoch
        if epoch in accuracy:
            return None
        total, models = pending.get(epoch, (0.0, set()))
        if report.model in models:
            if epoch not in record.recent_probs:  # resumed from before its last checkpoint: the first stands
                return None
            total = total - as_counted(record.recent_probs[epoch])
        total, models = total + as_counted(report.probs), models | {report.model}
        if len(models) < size:
            pending[epoch] = (total, models)
            return False
        pending.pop(epoch, None)  # absent when one model makes the whole ensemble
        accuracy[epoch], loss[epoch] = self._accuracy(total), self._loss(total, size)
        return True

    def _kept_ensemble(self, records: list[ModelRecord]) -> dict | None:
        """The ensemble the run leaves in checkpoints/: each member's best checkpoint (its highest
        validation accuracy), against the best of those members. None until every member has one."""
        if not records or any(r.best_probs is None for r in records):
            return None
        total = np.sum([as_counted(r.best_probs) for r in records], axis=0)
        return {"val_accuracy": self._accuracy(total), "val_loss": self._loss(total, len(records)),
                "best_model_val_accuracy": max(r.best_checkpoint[1] for r in records),
                "epochs": {r.model.name: r.best_checkpoint[0] for r in records}}

    def _accuracy(self, summed_probs: np.ndarray) -> float:
        """Accuracy of the averaged softmax (the sum has the same argmax)."""
        labels = self.val_labels
        return float((summed_probs.argmax(1) == labels).mean()) if labels is not None and len(labels) \
            else float("nan")

    def _loss(self, summed_probs: np.ndarray, count: int) -> float:
        """validation_loss of the mean of `count` softmaxes."""
        labels = self.val_labels
        return validation_loss(summed_probs, labels, count) if labels is not None else float("nan")

    def _ensemble(self, records: list[ModelRecord], accuracy: dict[int, float], loss: dict[int, float]) -> dict:
        """What the ensemble of `records` measured: by epoch, at its members' last epochs, and kept."""
        finals = [r.val_accuracy[max(r.val_accuracy)] for r in records if r.val_accuracy]
        last = [r.last_probs for r in records if r.last_probs is not None]
        # every model's last epoch
        final = np.sum([as_counted(p) for p in last], axis=0) if len(last) == len(records) else None
        return {
            "val_accuracy": [accuracy[e] for e in sorted(accuracy)],
            "val_loss": [loss[e] for e in sorted(loss)],
            "final_val_accuracy": self._accuracy(final) if final is not None else None,
            "final_val_loss": self._loss(final, len(last)) if final is not None else None,
            "best_model_val_accuracy": max(finals) if finals else None,
            "kept": self._kept_ensemble(records),
        }

    def as_dict(self, wall_s: float) -> dict:
        models = [record.as_dict() for record in self.models.values()]
        epochs = max((m["epochs"] for m in models), default=0)
        busy = sum(t.cpu_s for t in self.stages.values())
        groups = {}  # each slot group as it last trained: its members then, packed or fused
        for record in self.models.values():
            if record.stints:
                stint = record.stints[-1]
                groups[stint["group"]] = {"members": stint["group_members"], "mode": stint["group_mode"],
                                          "devices": stint["devices"], "flotilla": stint["flotilla"]}
        return {
            "models": models,
            "groups": groups,
            "ensemble": self._ensemble(list(self.models.values()), self.ensemble_accuracy, self.ensemble_loss),
            **({"parts": {part: self._ensemble([self.models[n] for n in sorted(names)], self.part_accuracy[part],
                                               self.part_loss[part]) for part, names in self.parts.items()}}
               if self.parts else {}),
            "pipeline": {
                "train_images": self.train_images,
                "images_per_s": self.train_images / wall_s if wall_s else None,
                "cpu_s_per_epoch": busy / epochs if epochs else None,
                **self._cpu_s_by_epoch(),
                "occupancy": {name: queue for name, queue in self.queues.items() if len(queue["t_s"]) > 1},
                "stages": {name: {"wall_s": t.wall_s, "cpu_s": t.cpu_s, "items": t.items,
                                  "cpu_share_pct": 100 * t.cpu_s / busy if busy else None,
                                  "bytes_in": t.bytes_in, "bytes_out": t.bytes_out,
                                  "latency_ms": {f"p{q}": 1000 * float(np.percentile(self.stage_walls[name], q))
                                                 for q in (50, 95)}}
                           for name, t in self.stages.items()},
            },
            "delivery": {"flotillas": {str(flotilla): info for flotilla, info in self.delivery.items()},
                         "received": self.checksums,
                         "hubs": {
                             f"flotilla {f} {info['topology']} hub {rank} node {hub['node']}": {
                                 "bytes": hub["ring_bytes"] + hub["sent_bytes"], "latency_ms": hub["latency_ms"]}
                             for f, info in self.delivery.items() for rank, hub in info["hubs"].items()}},
            "timeline": self.timeline,
            "skipped": [{"path": p, "reason": r} for p, r in sorted(self.skipped.items())],
            "converted": [{"path": p, "what": w} for p, w in sorted(self.converted.items())],
        }


def write_json(path: Path, results: dict) -> None:
    write_whole(path, _json(results))


def _json(content) -> str:
    return json.dumps(content, indent=2, default=str)


def as_counted(probs: np.ndarray) -> np.ndarray:
    """A member's validation softmax as an ensemble counts it: a row that is not finite (a diverged member's
    NaN logits) as the uniform one, which predicts nothing, so the other members decide that image (a NaN
    in the sum made every image's argmax class 0). The member's own accuracy and loss keep what it made."""
    finite = np.isfinite(probs).all(axis=1, keepdims=True)
    return probs if finite.all() else np.where(finite, probs, np.float32(1 / probs.shape[1]))
