"""A trainer: one process per device slot, fed by a transport stream.

It knows torch, the reading end of a ring (pipeline/delivery/stream.py) and
checkpoints; never Dask. A model on g slots runs g trainers under DDP, each
taking its 1/g share of every batch. Typed reports (reports.py) go to the
driver through a queue.
"""
from __future__ import annotations

import math
import os
import time
import traceback
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.delivery.stream import MessageKind
from pipeline.training.reports import TrainerDone, TrainerError, TrainReport, ValReport

MAX_SPANS_PER_EPOCH = 500  # steps of an epoch kept for the timeline (bounded report size)

# ImageNet statistics: batches arrive as uint8 and are normalised on the device.
MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    arch: str
    depth: int
    width: int
    growth_rate: int
    lr: float
    momentum: float
    weight_decay: float
    slots: int
    input: str  # stream name


@dataclass(frozen=True)
class TrainerSpec:
    model: ModelSpec
    num_classes: int
    image_size: int  # side of the stream's images; picks the model's stem
    epochs: int  # the most epochs the model trains (the learning-rate schedule's length)
    start_epoch: int  # epochs trained before; > 0 resumes from the model's checkpoint
    steps_per_epoch: int  # for the learning-rate schedule
    rank: int  # within the model's data-parallel group
    rendezvous: str  # init_method of the model's process group (used when slots > 1)
    device: str  # "cpu" or "cuda:<i>"
    threads: int
    checkpoint_dir: str
    record_checksums: bool
    consume_only: bool  # take each batch (one copy, as a real step's device transfer) and train nothing


class SGDStep:
    """A training step as every trainer takes it (trainers, rate measurement, profile
    mode): a uint8 NHWC batch normalised on the device, cross-entropy, Nesterov SGD."""

    def __init__(self, net, model: ModelSpec, device):
        import torch

        self.torch, self.net, self.device = torch, net, device
        self.optimizer = torch.optim.SGD(net.parameters(), lr=model.lr, momentum=model.momentum,
                                         weight_decay=model.weight_decay, nesterov=True)
        self.mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(STD, device=device).view(1, 3, 1, 1)

    def normalise(self, images: np.ndarray):
        """uint8 NHWC (a view that may be released after) -> normalised float NCHW on the device."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")  # only read
            x = self.torch.from_numpy(images)
        x = x.to(self.device, non_blocking=True).permute(0, 3, 1, 2).float()
        return (x - self.mean) / self.std

    def __call__(self, x, y):
        """One step on a normalised batch; the loss, on the device."""
        loss = self.torch.nn.functional.cross_entropy(self.net(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return loss


def trainer_main(spec: TrainerSpec, reader, reports) -> None:
    """Process entry point: train until the stream says STOP."""
    try:
        Trainer(spec, reports).consume(reader)
    except BaseException:  # the driver names the model and shows the traceback, once
        reports.put(TrainerError(spec.model.name, spec.rank, traceback.format_exc()))
        raise SystemExit(1) from None


class Trainer:
    def __init__(self, spec: TrainerSpec, reports):
        import torch
        import torch.distributed as dist

        from pipeline.training.models import build_model

        self.torch, self.spec, self.reports = torch, spec, reports
        torch.set_num_threads(spec.threads)
        torch.manual_seed(0)  # members differ by architecture and hyper-parameters, not by luck of the init
        self.device = torch.device(spec.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        m = spec.model
        self.model = build_model(m.arch, m.depth, m.width, m.growth_rate, spec.num_classes,
                                 image_size=spec.image_size).to(self.device)
        self.model = self.model.to(memory_format=torch.channels_last)
        self.world = m.slots
        self.net = self.model
        if self.world > 1:
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", init_method=spec.rendezvous,
                                    rank=spec.rank, world_size=self.world)
            self.net = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self.step = SGDStep(self.net, m, self.device)
        self.optimizer = self.step.optimizer
        total_steps = max(1, spec.epochs * spec.steps_per_epoch)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * min(step, total_steps) / total_steps)))
        self.checksums: list[tuple[int, int, int, int, int]] = []
        self.epoch = spec.start_epoch  # the model's own epoch count, whichever flotilla it is in
        if spec.start_epoch:
            self._resume()
        self.val_probs: list[np.ndarray] = []  # rank 0's validation softmax and labels, batch by batch
        self.val_labels: list[np.ndarray] = []
        self._reset_epoch()

    def checkpoint_path(self, epochs_done: int) -> Path:
        return Path(self.spec.checkpoint_dir) / self.spec.model.name / f"epoch{epochs_done}.pt"

    def _resume(self) -> None:
        path = self.checkpoint_path(self.spec.start_epoch)
        if not path.is_file():
            raise RuntimeError(f"cannot resume {self.spec.model.name} after {self.spec.start_epoch} epochs: "
                               f"{path} is missing")
        state = self.torch.load(path, map_location=self.device, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])

    def _reset_epoch(self) -> None:
        """Training counters, reported and cleared at the end of each epoch's training split."""
        self.loss_sum, self.seen, self.step_time, self.wait_time = 0.0, 0, 0.0, 0.0
        self.spans: list[tuple[float, float]] = []  # (start, end) of steps, time.time(), for the timeline

    def consume(self, reader) -> None:
        waited = time.perf_counter()
        for message in reader.messages():
            self.wait_time += time.perf_counter() - waited
            if self.spec.record_checksums:
                self.checksums.append((int(message.kind), message.split, message.epoch, message.index,
                                       zlib.crc32(message.labels.tobytes(), zlib.crc32(message.images.tobytes()))))
            if message.kind == MessageKind.BATCH:
                started, wall_started = time.perf_counter(), time.time()
                if self.spec.consume_only:
                    self._take(message)
                elif message.split == 0:
                    self._train_step(message)
                else:
                    self._validate(message)
                self.step_time += time.perf_counter() - started
                if len(self.spans) < MAX_SPANS_PER_EPOCH:
                    self.spans.append((wall_started, time.time()))
            else:
                message.release()
                if message.kind == MessageKind.END and message.split == 0:
                    self._report_train()
                elif message.kind == MessageKind.END:
                    self._finish_validation()
                    self.epoch += 1
            waited = time.perf_counter()
        self.reports.put(TrainerDone(self.spec.model.name, self.spec.rank, self.checksums))

    def _take(self, message) -> None:
        self.torch.tensor(message.images, device=self.device)  # the one copy a real step makes
        if message.split == 0:
            self.seen += len(message.labels)
        message.release()

    def _train_step(self, message) -> None:
        torch = self.torch
        count = len(message.labels)
        # Every rank sees every batch and takes rows rank, rank+g, ...; a batch
        # too small to give each rank two rows (batch norm needs two) is
        # skipped by all ranks alike, like a DataLoader's drop_last remainder.
        rows = slice(self.spec.rank, None, self.world)
        if count < 2 * self.world:
            message.release()
            return
        x = self.step.normalise(message.images[rows])
        y = torch.from_numpy(message.labels[rows].copy()).to(self.device)
        message.release()  # x and y are copies on the device: the slot may be reused
        self.net.train()
        loss = self.step(x, y)
        self.schedule.step()
        self.loss_sum += float(loss.detach()) * len(y)
        self.seen += len(y)

    def _validate(self, message) -> None:
        if self.spec.rank != 0:  # one rank per model evaluates; the others only keep pace
            message.release()
            return
        torch = self.torch
        x = self.step.normalise(message.images)
        labels = message.labels.copy()
        message.release()
        self.model.eval()
        with torch.no_grad():
            self.val_probs.append(torch.softmax(self.model(x).float(), dim=1).cpu().numpy())
        self.val_labels.append(labels)

    def _report_train(self) -> None:
        self.reports.put(TrainReport(self.spec.model.name, self.spec.rank, self.epoch, self.loss_sum / max(self.seen, 1),
                                     self.seen, self.step_time, self.wait_time, self.spans))
        self._reset_epoch()

    def _finish_validation(self) -> None:
        if self.spec.rank != 0:
            return
        probs = np.concatenate(self.val_probs) if self.val_probs else np.zeros((0, self.spec.num_classes), np.float32)
        labels = np.concatenate(self.val_labels) if self.val_labels else np.zeros(0, np.int64)
        accuracy = float((probs.argmax(1) == labels).mean()) if len(labels) else float("nan")
        self._checkpoint(accuracy)  # before the report: the driver may stop this process once it has it
        self.reports.put(ValReport(self.spec.model.name, self.epoch, accuracy, probs, labels))
        self.val_probs, self.val_labels = [], []

    def _checkpoint(self, accuracy: float) -> None:
        """checkpoints/<model>/epoch<k>.pt after k epochs. The one before is
        kept too: the scheduler may resume from it if this trainer dies before
        its report of epoch k reaches the driver."""
        epochs_done = self.epoch + 1
        path = self.checkpoint_path(epochs_done)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        self.torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                         "schedule": self.schedule.state_dict(), "epochs_done": epochs_done,
                         "val_accuracy": accuracy, "spec": self.spec.model.__dict__}, tmp)
        os.replace(tmp, path)  # never a half-written checkpoint
        self.checkpoint_path(epochs_done - 2).unlink(missing_ok=True)
