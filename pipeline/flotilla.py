"""The trainer processes of a flotilla and the streams that feed them.

Owns their lifecycle: processes are spawned on entry and always stopped,
shared memory always unlinked, on exit, whatever happened in between. A
member can leave early (converged, or stopped by the scheduler): its readers
are detached and its processes stopped while the others train on.
"""
from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import zlib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from pipeline.trainer import ModelSpec, TrainerSpec, trainer_main
from pipeline.transport.base import MessageKind, StreamLayout, StreamWriter
from pipeline.transport.shm import SharedMemoryTransport
from stages.base import Batch, Spec, Split


@dataclass(frozen=True)
class Member:
    model: ModelSpec
    devices: tuple[str, ...]  # one per slot, rank order: "cpu" or "cuda:<i>"
    start_epoch: int = 0  # epochs trained before: resume from its checkpoint


@dataclass(frozen=True)
class TrainingSetup:
    """What every trainer of a run shares."""

    num_classes: int
    epochs: int  # the most epochs a model trains
    steps_per_epoch: int
    threads: int
    checkpoint_dir: Path
    record_checksums: bool


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Flotilla:
    def __init__(self, members: list[Member], sinks: dict[str, Spec], batch_size: int, ring_slots: int,
                 setup: TrainingSetup):
        self.members = {m.model.name: m for m in members}
        self.record_checksums = setup.record_checksums
        self.context = mp.get_context("spawn")  # fork is unsafe with threads (Dask, torch)
        self.reports = self.context.Queue()
        self.processes: dict[str, list[mp.Process]] = defaultdict(list)
        self.readers: dict[str, list[int]] = defaultdict(list)  # model -> its reader numbers on its stream
        self.errors: dict[str, str] = {}  # model -> traceback of a trainer that failed
        self.transport = SharedMemoryTransport(ring_slots, self.context, alive=self._reader_alive)
        self.writers: dict[str, StreamWriter] = {}
        self.sent_checksums: dict[str, list] = defaultdict(list)
        readers_per_stream: dict[str, int] = defaultdict(int)
        for member in members:
            readers_per_stream[member.model.input] += len(member.devices)
        try:
            for stream, readers in readers_per_stream.items():
                layout = StreamLayout(batch_size, sinks[stream].item_shape)
                self.writers[stream] = self.transport.open_stream(stream, layout, readers)
            self._spawn(members, sinks, setup)
        except BaseException:
            self.close()
            raise

    def _spawn(self, members: list[Member], sinks: dict[str, Spec], setup: TrainingSetup) -> None:
        next_reader: dict[str, int] = defaultdict(int)
        for member in members:
            model = member.model
            rendezvous = f"tcp://127.0.0.1:{_free_port()}"
            for rank, device in enumerate(member.devices):
                spec = TrainerSpec(model, setup.num_classes, sinks[model.input].item_shape[0], setup.epochs,
                                   member.start_epoch, setup.steps_per_epoch, rank, rendezvous, device,
                                   setup.threads, str(setup.checkpoint_dir), setup.record_checksums)
                reader = next_reader[model.input]
                next_reader[model.input] += 1
                process = self.context.Process(target=trainer_main,
                                               args=(spec, self.writers[model.input].reader(reader), self.reports),
                                               name=f"trainer-{model.name}-{rank}", daemon=True)
                process.start()
                self.processes[model.name].append(process)
                self.readers[model.name].append(reader)

    def _reader_alive(self, stream: str, reader: int) -> bool:
        for name, member in self.members.items():
            if member.model.input == stream and reader in self.readers[name]:
                return name not in self.failed_members()
        return False

    def failed_members(self) -> dict[str, str]:
        """Members with a trainer that reported an error or died: name -> why."""
        failed = {name: self.errors[name] for name in self.members if name in self.errors}
        for name in self.members:
            dead = [p for p in self.processes[name] if p.exitcode is not None]
            if dead and name not in failed:
                failed[name] = f"{dead[0].name} exited with code {dead[0].exitcode}"
        return failed

    def __enter__(self) -> Flotilla:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def streams(self) -> set[str]:
        """Streams some member still reads."""
        return {member.model.input for member in self.members.values()}

    def publish(self, split: Split, epoch: int, index: int, streams: dict[str, Batch]) -> None:
        split_id = list(Split).index(split)
        for stream in self.streams:
            batch = streams[stream]
            self.writers[stream].publish(MessageKind.BATCH, split_id, epoch, index, batch.data, batch.labels)
            if self.record_checksums:
                crc = zlib.crc32(batch.labels.tobytes(), zlib.crc32(batch.data.tobytes()))
                self.sent_checksums[stream].append((int(MessageKind.BATCH), split_id, epoch, index, crc))

    def end(self, split: Split, epoch: int) -> None:
        self._mark(MessageKind.END, list(Split).index(split), epoch)

    def stop(self) -> None:
        self._mark(MessageKind.STOP, 0, 0)

    def _mark(self, kind: MessageKind, split_id: int, epoch: int) -> None:
        empty_crc = zlib.crc32(b"", zlib.crc32(b""))
        for stream in self.streams:
            self.writers[stream].publish(kind, split_id, epoch, 0)
            if self.record_checksums:
                self.sent_checksums[stream].append((int(kind), split_id, epoch, 0, empty_crc))

    def remove(self, name: str) -> None:
        """Stop a member's trainers now; its last checkpoint is its state."""
        member = self.members.pop(name, None)
        if member is None:  # already gone (it failed)
            return
        for reader in self.readers[name]:
            self.writers[member.model.input].detach(reader)
        _stop_processes(self.processes[name])

    def poll(self, timeout: float | None = None) -> list[dict]:
        """Reports from trainers so far (waiting up to `timeout` for the first)."""
        events = []
        try:
            events.append(self.reports.get(timeout=timeout) if timeout else self.reports.get_nowait())
            while True:
                events.append(self.reports.get_nowait())
        except queue.Empty:
            pass
        for event in events:
            if event["event"] == "error":
                self.errors[event["model"]] = f"rank {event['rank']} raised:\n{event['traceback']}"
        return [event for event in events if event["event"] != "error"]

    def join(self, timeout: float) -> None:
        for processes in self.processes.values():
            for process in processes:
                process.join(timeout)

    def close(self) -> None:
        _stop_processes([p for processes in self.processes.values() for p in processes])
        self.transport.close()
        self.reports.close()
        self.reports.join_thread()


def _stop_processes(processes: list[mp.Process]) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(5)
        if process.is_alive():
            process.kill()
            process.join()
