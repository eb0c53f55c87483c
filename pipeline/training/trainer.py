"""A trainer: one process per device slot, training the group placed there.

It knows torch, the reading ends of rings (pipeline/delivery/stream.py) and
checkpoints; never Dask. Its group (pipeline/training/group.py) may read
several sinks, a ring each: it takes one message of each, in step (hubs
publish every sink's batch i before batch i + 1). A model on g slots runs g trainers
under DDP, each taking its 1/g share of every batch. Typed reports
(reports.py) go to the driver up one pipe; the driver's commands
(`ReleaseMember`, `SaveCheckpoint`) come down another (runtime/child.py) and
are read before each message and while waiting for one.

Checkpoints are the scheduler's to ask for (every scheduler.checkpoint_every
epochs, a model's final one, and on a stop): after each epoch rank 0 keeps a
copy of every member's state (on a GPU a clone there, moved to host memory on
its checkpoint writer's thread), and writes it when the driver says so.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import math
import threading
import time
import traceback
import zlib
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pipeline.delivery.stream import MessageKind
from pipeline.runtime.child import tell_parent
from pipeline.runtime.files import write_whole, written_whole
from pipeline.runtime.lifetime import child_started
from pipeline.training.group import (GroupSpec, GroupStep, Precision, StepInHand, join_process_group, least_batch,
                                     rank_rows, shard_weight)
from pipeline.training.reports import (CheckpointSaved, ResumedEarlier, TrainerDone, TrainerError, TrainReport,
                                      ValReport, validation_loss)

MAX_SPANS_PER_EPOCH = 500  # steps of an epoch kept for the timeline (bounded report size)
STAGING_BUFFERS = 2  # pinned buffers per sink: one being copied to the GPU while the next fills
KEPT_EPOCHS = 2  # epochs' ends whose states rank 0 keeps: the driver's last heard of, and the next
CHECKPOINTS_KEPT = 2  # per model: the newest, and the one before (a trainer may die while writing the next)
BEST_CHECKPOINT = "best.json"  # per model: its checkpoint of highest validation accuracy, kept whatever is pruned


@dataclass(frozen=True, kw_only=True)  # many fields: called by name, never by position
class TrainingSetup:
    """What every trainer of a run shares."""

    num_classes: int
    total_steps: int  # the run's training steps (RunInputs.total_steps): the learning-rate schedules' length
    steps_per_epoch: int  # an epoch's steps (StepInHand's count)
    threads: int
    precision: Precision
    cuda_graphs: bool  # each step a replayed CUDA graph, where GroupStep can
    compile: bool  # each unit's forward compiled by torch.compile (trainer.compile)
    checkpoint_dir: Path
    record_checksums: bool
    consume_only: bool  # take each batch (one copy, as a real step's device transfer) and train nothing
    collective_s: float  # timeouts.collective_s: a DDP collective not done in this long fails, naming it


@dataclass(frozen=True, kw_only=True)
class TrainerSpec:
    """One trainer: the run's setup, and what is its own."""

    setup: TrainingSetup
    group: GroupSpec
    image_sizes: dict[str, int]  # sink -> side of its images (picks each model's stem)
    start_epoch: int  # epochs trained before; > 0 resumes every member from its checkpoint
    rank: int  # within the group's data-parallel ranks (a group of several has one)
    rendezvous: str  # init_method of the process group (used when the group spans slots)
    device: str  # "cpu" or "cuda:<i>"


@dataclass(frozen=True)
class ReleaseMember:
    """Driver -> trainer: `model` has left the group (converged or stopped); free it, train the others."""

    model: str


@dataclass(frozen=True)
class SaveCheckpoint:
    """Driver -> the group's rank 0: write `models`' state after `epochs` epochs (their last finished)."""

    models: tuple[str, ...]
    epochs: int



def checkpoint_path(checkpoint_dir: str | Path, model: str, epochs: int) -> Path:
    return Path(checkpoint_dir) / model / f"epoch{epochs}.pt"


def saved_epochs(checkpoint_dir: str | Path, model: str) -> list[int]:
    """The epochs after which `model` has a checkpoint, oldest first."""
    return sorted(int(path.stem[len("epoch"):]) for path in (Path(checkpoint_dir) / model).glob("epoch*.pt"))


def better_checkpoint(best: tuple[int, float] | None, epochs: int, accuracy: float) -> bool:
    """Whether the checkpoint after `epochs` epochs, at validation `accuracy`, replaces `best` (epochs,
    accuracy) as the model's best: a higher accuracy (the earliest of equals stays), or that epoch done again."""
    return best is None or accuracy > best[1] or epochs == best[0]


def note_best(checkpoint_dir: str | Path, model: str, epochs: int, accuracy: float) -> int:
    """The epochs of `model`'s best checkpoint, now that its checkpoint after `epochs` epochs, at
    `accuracy`, is written: <model>/best.json says which."""
    path = Path(checkpoint_dir) / model / BEST_CHECKPOINT
    best = json.loads(path.read_text()) if path.exists() else None
    if better_checkpoint(best and (best["epochs"], best["val_accuracy"]), epochs, accuracy):
        best = {"epochs": epochs, "val_accuracy": accuracy}
        write_whole(path, json.dumps(best))
    return best["epochs"]


def trainer_main(spec: TrainerSpec, readers: dict, in_hand: StepInHand, *, to_parent, from_parent) -> None:
    """Process entry point (runtime.child.Child): train until the rings say STOP, reporting to the
    driver and taking its commands between batches."""
    child_started("trainer")
    reports = _OneAtATime(to_parent)  # the training loop's, the checkpoint writer's and a failure's
    trainer = None
    try:
        trainer = Trainer(spec, reports, from_parent, in_hand)
        trainer.consume(readers)
    except BaseException:  # the driver names the group and shows the traceback, once
        failure = TrainerError(spec.group.name, spec.rank, traceback.format_exc())
        if trainer is not None:  # the checkpoints asked for come first: told of the failure, the driver stops it
            concurrent.futures.wait(trainer.writing)
        tell_parent(reports, failure)
        raise SystemExit(1) from None


class DeviceFeed:
    """Copies each batch out of its ring buffer onto the device, and hands the buffer back only once the
    copy has finished. On a GPU the copy goes through pinned staging memory, asynchronously; a CUDA
    event marks its end. On CPU the copy is synchronous and the buffer goes back at once.

    `new_event` makes the copy-done marker (anything with record() and query()); tests inject their own.
    """

    def __init__(self, device, new_event=None):
        import torch

        self.torch, self.device = torch, device
        self.on_gpu = device.type == "cuda"
        self.new_event = new_event or ((lambda: torch.cuda.Event()) if self.on_gpu else None)
        self.pending: deque = deque()  # (event, what to call once it has passed), oldest first
        # sink -> its pinned buffers, [images, labels, event of their last copy], next to use first
        self.staging: dict[str, deque] = {}

    def _stage(self, sink: str, images: np.ndarray) -> list:
        """The sink's next pinned buffers (pinned: the only host memory a GPU copies from
        asynchronously), made with its first batch, remade if a larger one comes; they go to the back."""
        buffers = self.staging.get(sink)
        if buffers is None or len(buffers[0][1]) < len(images):
            self.flush()
            torch = self.torch
            buffers = self.staging[sink] = deque(
                [torch.empty(images.shape, dtype=torch.uint8).pin_memory(),
                 torch.empty(len(images), dtype=torch.int64).pin_memory(), None] for _ in range(STAGING_BUFFERS))
        buffers.rotate(-1)
        return buffers[-1]

    def copy(self, sink: str, images: np.ndarray, labels: np.ndarray, release) -> tuple:
        """(uint8 NHWC images, labels) on the device; `release` is called once they no longer need the buffer."""
        torch = self.torch
        self.collect()
        if not self.on_gpu:
            x, y = torch.from_numpy(images.copy()), torch.from_numpy(labels.copy())
        else:
            staged = self._stage(sink, images)
            host_x, host_y, busy = staged
            if busy is not None:
                busy.synchronize()  # its previous copy must be done before it is overwritten (it always is by now)
            count = len(labels)
            # numpy copies from the read-only ring (torch.from_numpy would warn that it is not writable)
            np.copyto(host_x[:count].numpy(), images)
            np.copyto(host_y[:count].numpy(), labels)
            x = host_x[:count].to(self.device, non_blocking=True)
            y = host_y[:count].to(self.device, non_blocking=True)
        if self.new_event is None:
            release()
        else:
            event = self.new_event()
            event.record()
            self.pending.append((event, release))
            if self.on_gpu:
                staged[2] = event
        return x, y

    def collect(self) -> None:
        """Hand back every buffer whose copy has finished."""
        while self.pending and self.pending[0][0].query():
            self.pending.popleft()[1]()

    def flush(self) -> None:
        """Wait for every copy and hand back every buffer (at the end of a split)."""
        while self.pending:
            event, release = self.pending.popleft()
            event.synchronize()
            release()


class Trainer:
    def __init__(self, spec: TrainerSpec, reports, commands=None, in_hand: StepInHand | None = None):
        """`reports`: where it sends its reports (the driver's pipe), from the training loop and from the
        thread that writes checkpoints; `commands`: the pipe it reads the driver's commands from (None: no
        driver)."""
        import torch

        self.torch, self.spec, self.reports, self.commands = torch, spec, reports, commands
        torch.set_num_threads(spec.setup.threads)
        self.device = torch.device(spec.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # No cuDNN autotuning: each new shape (an epoch's last batch, validation batches) is tuned again,
            # 16 s of a 20 s default run on an H100 for no faster step (docs/benchmarks.md, GPU section).
            torch.backends.cudnn.benchmark = False
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        self.world = spec.group.slots
        self.collectives = contextlib.nullcontext  # a step runs collectives only under DDP
        if self.world > 1:
            self.collectives = join_process_group(spec.rendezvous, spec.rank, self.world, self.device,
                                                  spec.setup.collective_s, spec.group.name)
        setup = spec.setup
        self.step = GroupStep(spec.group, setup.num_classes, spec.image_sizes, self.device,
                              setup.total_steps, precision=setup.precision, world=self.world,
                              threads=setup.threads,
                              in_hand=in_hand,  # where its steps are, for the driver if it hangs
                              cuda_graphs=setup.cuda_graphs, compile=setup.compile)
        self.models = {m.name: m for m in spec.group.members}
        self.feed = DeviceFeed(self.device)
        self.checksums: dict[str, list[tuple[int, int, int, int, int]]] = {s: [] for s in spec.group.inputs}
        self.epoch = self._resume() if spec.start_epoch else 0  # the group's own count, in any flotilla
        # rank 0: model -> epochs -> (a call that builds its checkpoint from its state then, kept: KeptStates; its
        # accuracy), for the KEPT_EPOCHS last finished epochs (on a stop, the driver asks for the last one it heard
        # of; the trainer may have finished the next meanwhile)
        self.finished: dict[str, dict[int, tuple]] = {}
        # rank 0's checkpoints are written on a thread of their own while the group trains on
        self.writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoints")
        self.writing: list[concurrent.futures.Future] = []
        self.val_probs: dict[str, list] = {name: [] for name in self.members}  # rank 0's, batch by batch
        self.val_labels: dict[str, list] = {sink: [] for sink in spec.group.inputs}
        self._reset_epoch()

    @property
    def members(self) -> list[str]:
        """The group's models still training here."""
        return self.step.names

    def _resume(self) -> int:
        """Every member from its checkpoint after `start_epoch` epochs, or, if a trainer died before it
        wrote that one, the newest before it that every member has (none: from the start); the epochs it
        resumes after."""
        directory, start = self.spec.setup.checkpoint_dir, self.spec.start_epoch
        common = set.intersection(*({e for e in saved_epochs(directory, name) if e <= start}
                                    for name in self.members))
        epochs = max(common, default=0)
        if epochs < start and self.spec.rank == 0:
            self.reports.send(ResumedEarlier(self.spec.group.name, tuple(self.members), start, epochs))
        for name in self.members if epochs else ():
            state = self.torch.load(checkpoint_path(directory, name, epochs), map_location=self.device,
                                    weights_only=True)
            self.step.load(name, state)
        return epochs

    def _reset_epoch(self) -> None:
        """Training counters, reported and cleared at the end of each epoch's training split."""
        self.loss_sums = {name: self.torch.zeros((), device=self.device) for name in self.members}
        self.seen, self.steps_begun, self.step_time, self.wait_time = 0, 0, 0.0, 0.0
        self.spans: list[tuple[float, float]] = []  # (start, end) of steps, time.time(), for the timeline

    def _obey(self) -> None:
        """The driver's commands so far (sent before the batches they apply to)."""
        self.written()
        while self.commands is not None and self.commands.poll():
            command = self.commands.recv()
            if isinstance(command, SaveCheckpoint):
                self._save(command.models, command.epochs)
            elif isinstance(command, ReleaseMember) and command.model in self.members:
                self.step.release(command.model)
                self.finished.pop(command.model, None)
                del self.loss_sums[command.model], self.val_probs[command.model]

    def consume(self, readers: dict) -> None:
        sinks = sorted(readers)
        waited = time.perf_counter()
        for messages in zip(*(readers[s].messages(idle=self._obey) for s in sinks)):
            self.wait_time += time.perf_counter() - waited
            self._obey()
            batch = dict(zip(sinks, messages))
            first = messages[0]
            if any((m.kind, m.split, m.epoch, m.index) != (first.kind, first.split, first.epoch, first.index)
                   for m in messages):
                raise RuntimeError("the rings of this group are out of step: "
                                   + ", ".join(f"{s} {m.kind.name} {m.split}/{m.epoch}/{m.index}"
                                               for s, m in batch.items()))
            if self.spec.setup.record_checksums:
                for sink, m in batch.items():
                    self.checksums[sink].append((int(m.kind), m.split, m.epoch, m.index, zlib.crc32(
                        m.labels.tobytes(), zlib.crc32(m.images.tobytes()))))
            if first.kind == MessageKind.BATCH:
                started, wall_started = time.perf_counter(), time.time()
                if first.split == 0:
                    self._train_step(batch)
                else:
                    self._validate(batch)
                self.step_time += time.perf_counter() - started
                if len(self.spans) < MAX_SPANS_PER_EPOCH:
                    self.spans.append((wall_started, time.time()))
            else:
                for m in messages:
                    m.release()
                self.feed.flush()
                if first.kind == MessageKind.END and first.split == 0:
                    self._report_train()
                elif first.kind == MessageKind.END:
                    self._finish_validation()
                    self.epoch += 1
            waited = time.perf_counter()
        self.written(wait=True)
        self.writer.shutdown()
        self.reports.send(TrainerDone(self.spec.group.name, self.spec.rank, self.checksums))

    def _on_device(self, batch: dict, rows=slice(None)) -> dict[str, tuple]:
        """Each sink's (uint8 images, labels) on the device; the ring buffers go back once copied."""
        return {sink: self.feed.copy(sink, m.images[rows], m.labels[rows], m.release)
                for sink, m in batch.items()}

    def _train_step(self, batch: dict) -> None:
        count = len(next(iter(batch.values())).labels)
        if count < least_batch(self.world):
            for m in batch.values():
                m.release()
            return
        rows = rank_rows(self.spec.rank, self.world)
        copied = self._on_device(batch, rows)
        rows_here = len(range(count)[rows])
        self.seen += rows_here
        if self.spec.setup.consume_only or not self.members:
            return
        if self.step.in_hand:
            self.step.in_hand.begin(self.steps_begun, self.epoch)
        self.steps_begun += 1
        inputs = {sink: (self.step.normalise(x), y) for sink, (x, y) in copied.items()}
        with self.collectives():
            losses = self.step.train(inputs, weight=shard_weight(rows_here, self.world, count))
        for name, loss in losses.items():
            self.loss_sums[name] += loss * rows_here  # stays on the device: read once, at the end of the split

    def _validate(self, batch: dict) -> None:
        if self.spec.rank != 0:  # one rank per model evaluates; the others only keep pace
            for m in batch.values():
                m.release()
            return
        copied = self._on_device(batch)
        if self.spec.setup.consume_only:
            return
        for sink, (_, y) in copied.items():
            self.val_labels[sink].append(y)
        probs = self.step.predict({sink: self.step.normalise(x) for sink, (x, _) in copied.items()})
        for name, p in probs.items():
            self.val_probs[name].append(p)

    def _report_train(self) -> None:
        compile_s = self.step.take_compile_s()  # this split's and the last validation's
        for number, name in enumerate(self.members):  # the group's step and wait times are every member's
            loss = float(self.loss_sums[name]) / max(self.seen, 1)
            self.reports.send(TrainReport(name, self.spec.rank, self.epoch, loss, self.seen, self.step_time,
                                          self.wait_time, self.spans if number == 0 else [],
                                          lr=self.step.rate(name) if self.spec.rank == 0 else None,
                                          compile_s=compile_s))
        self._reset_epoch()

    def _finish_validation(self) -> None:
        reports = self._validation() if self.spec.rank == 0 else []
        self._step_schedules(reports)
        if self.spec.rank != 0:
            return
        self._keep_states({report.model: report.accuracy for report in reports})
        for report in reports:  # after the states: the driver may ask for a checkpoint at once
            self.reports.send(report)

    def _validation(self) -> list[ValReport]:
        """Rank 0: each member's validation of the epoch, from its softmax batch by batch."""
        torch = self.torch
        labels = {sink: torch.cat(ys).cpu().numpy() if ys else np.zeros(0, np.int64)
                  for sink, ys in self.val_labels.items()}
        reports = []
        for name in self.members:
            chunks = self.val_probs[name]
            probs = (torch.cat(chunks).cpu().numpy() if chunks
                     else np.zeros((0, self.spec.setup.num_classes), np.float32))
            truth = labels[self.models[name].input]
            accuracy = float((probs.argmax(1) == truth).mean()) if len(truth) else float("nan")
            reports.append(ValReport(name, self.epoch, accuracy, probs, truth))
            self.val_probs[name] = []
        self.val_labels = {sink: [] for sink in self.val_labels}
        return reports

    def _step_schedules(self, reports: list[ValReport]) -> None:
        """The schedules that step on a metric, on their members' validation losses (from rank 0's `reports`),
        before the states after the epoch are kept: a checkpoint holds the rate its next epoch trains at."""
        names = self.step.stepped_on_validation
        if not names or self.spec.setup.consume_only:
            return
        losses = {r.model: validation_loss(r.probs, r.labels) for r in reports if r.model in names}
        if self.world > 1:  # a model alone on its slots: every rank steps on rank 0's loss, or their rates part
            torch = self.torch
            sent = torch.tensor([losses.get(name, math.nan) for name in names], dtype=torch.float64,
                                device=self.device)
            with self.collectives():
                torch.distributed.broadcast(sent, src=0)
            losses = dict(zip(names, sent.tolist()))
        self.step.step_schedules(losses)

    def _keep_states(self, accuracies: dict[str, float]) -> None:
        """A copy of every member's state after this epoch: the checkpoints the driver may ask for, while the
        models train on (a stop mid-epoch saves the last finished epoch, not half of the next). On a GPU the
        copy is made there and moved to host memory on the writer thread (KeptStates), so the loop goes on at
        once. It first waits for the last epoch's copy and the writes asked for since, and lets the oldest copy
        go before it makes the new one (no command is read in between): the copies hold at most one epoch's
        states on the device and KEPT_EPOCHS epochs' in host memory (group_plan counts them)."""
        self.written(wait=True)
        epochs = self.epoch + 1
        for finished in self.finished.values():
            finished.pop(epochs - KEPT_EPOCHS, None)
        kept = self.step.kept_states()
        self.writing.append(self.writer.submit(kept.to_host))  # before any write of it: the writer keeps order
        for name in kept.names:
            self.finished.setdefault(name, {})[epochs] = (functools.partial(kept.member, name), accuracies[name])

    def _save(self, models: tuple[str, ...], epochs: int) -> None:
        """checkpoints/<model>/epoch<k>.pt after k epochs, a plain model's state (it loads without the group),
        written on the writer thread, in order after the copies and writes asked for before, while the group
        trains on; CheckpointSaved follows each."""
        written = []
        for name in models:
            kept = self.finished.get(name, {}).get(epochs)
            if kept is None:
                raise RuntimeError(f"the driver asked for {name}'s checkpoint after {epochs} epochs, but this "
                                   f"trainer keeps its state after {sorted(self.finished.get(name, {}))}")
            written.append((name, *kept))
        self.writing.append(self.writer.submit(self._write, written, epochs))

    def _write(self, written: list[tuple], epochs: int) -> None:
        """On the writer thread: each (model, a call that builds its state, its accuracy) to its checkpoint."""
        for name, state_of, accuracy in written:
            state = {**state_of(), "epochs_done": epochs, "val_accuracy": accuracy,
                     "member": asdict(self.models[name])}
            with written_whole(checkpoint_path(self.spec.setup.checkpoint_dir, name, epochs)) as file:
                self.torch.save(state, file)  # never a half-written checkpoint
            best = note_best(self.spec.setup.checkpoint_dir, name, epochs, accuracy)
            for older in saved_epochs(self.spec.setup.checkpoint_dir, name)[:-CHECKPOINTS_KEPT]:
                if older != best:
                    checkpoint_path(self.spec.setup.checkpoint_dir, name, older).unlink(missing_ok=True)
            self.reports.send(CheckpointSaved(self.spec.group.name, name, epochs))

    def written(self, wait: bool = False) -> None:
        """Raises here what failed on the writer thread; with `wait`, once every write asked for is done."""
        if wait:
            concurrent.futures.wait(self.writing)
        done = [future for future in self.writing if future.done()]
        self.writing = [future for future in self.writing if not future.done()]
        for future in done:
            future.result()


class _OneAtATime:
    """The driver's pipe, shared by the training loop and the checkpoint writer's thread: a message is sent
    whole before the next."""

    def __init__(self, pipe):
        self.pipe, self.lock = pipe, threading.Lock()

    def send(self, message) -> None:
        with self.lock:
            self.pipe.send(message)
