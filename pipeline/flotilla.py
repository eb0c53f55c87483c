"""The trainer processes of a flotilla and the streams that feed them.

Owns their lifecycle: processes are spawned on entry and always stopped,
shared memory always unlinked, on exit, whatever happened in between.
"""
from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import zlib
from collections import defaultdict
from pathlib import Path

from pipeline.planner import Placement
from pipeline.trainer import TrainerSpec, trainer_main
from pipeline.transport.base import MessageKind, StreamLayout, StreamWriter
from pipeline.transport.shm import SharedMemoryTransport
from stages.base import Batch, Spec, Split


class TrainerFailed(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Flotilla:
    def __init__(self, placements: list[Placement], sinks: dict[str, Spec], batch_size: int, num_classes: int,
                 epochs: int, steps_per_epoch: int, ring_slots: int, threads: int, checkpoint_dir: Path,
                 record_checksums: bool):
        self.placements, self.sinks = placements, sinks
        self.record_checksums = record_checksums
        self.context = mp.get_context("spawn")  # fork is unsafe with threads (Dask, torch)
        self.reports = self.context.Queue()
        self.processes: list[mp.Process] = []
        self.transport = SharedMemoryTransport(ring_slots, self.context, alive=self._all_alive)
        self.writers: dict[str, StreamWriter] = {}
        self.sent_checksums: dict[str, list] = defaultdict(list)
        readers_per_stream: dict[str, int] = defaultdict(int)
        for placement in placements:
            readers_per_stream[placement.model.input] += len(placement.devices)
        try:
            for stream, readers in readers_per_stream.items():
                layout = StreamLayout(batch_size, sinks[stream].item_shape)
                self.writers[stream] = self.transport.open_stream(stream, layout, readers)
            self._spawn(num_classes, epochs, steps_per_epoch, threads, checkpoint_dir, record_checksums)
        except BaseException:
            self.close()
            raise

    def _spawn(self, num_classes, epochs, steps_per_epoch, threads, checkpoint_dir, record_checksums) -> None:
        next_reader: dict[str, int] = defaultdict(int)
        for placement in self.placements:
            model = placement.model
            rendezvous = f"tcp://127.0.0.1:{_free_port()}"
            for rank, device in enumerate(placement.devices):
                spec = TrainerSpec(model, num_classes, self.sinks[model.input].item_shape[0], epochs,
                                   steps_per_epoch, rank, rendezvous, device, threads, str(checkpoint_dir),
                                   record_checksums)
                reader = self.writers[model.input].reader(next_reader[model.input])
                next_reader[model.input] += 1
                process = self.context.Process(target=trainer_main, args=(spec, reader, self.reports),
                                               name=f"trainer-{model.name}-{rank}", daemon=True)
                process.start()
                self.processes.append(process)

    def _all_alive(self) -> bool:
        return all(p.exitcode is None for p in self.processes)

    def __enter__(self) -> Flotilla:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def publish(self, split: Split, epoch: int, index: int, streams: dict[str, Batch]) -> None:
        split_id = list(Split).index(split)
        for stream, writer in self.writers.items():
            batch = streams[stream]
            writer.publish(MessageKind.BATCH, split_id, epoch, index, batch.data, batch.labels)
            if self.record_checksums:
                crc = zlib.crc32(batch.labels.tobytes(), zlib.crc32(batch.data.tobytes()))
                self.sent_checksums[stream].append((int(MessageKind.BATCH), split_id, epoch, index, crc))

    def end(self, split: Split, epoch: int) -> None:
        self._mark(MessageKind.END, list(Split).index(split), epoch)

    def stop(self) -> None:
        self._mark(MessageKind.STOP, 0, 0)

    def _mark(self, kind: MessageKind, split_id: int, epoch: int) -> None:
        empty_crc = zlib.crc32(b"", zlib.crc32(b""))
        for stream, writer in self.writers.items():
            writer.publish(kind, split_id, epoch, 0)
            if self.record_checksums:
                self.sent_checksums[stream].append((int(kind), split_id, epoch, 0, empty_crc))

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
                raise TrainerFailed(f"trainer of model {event['model']} (rank {event['rank']}) failed:\n"
                                    f"{event['traceback']}")
        return events

    def dead_trainers(self) -> list[str]:
        return [f"{p.name} (exit code {p.exitcode})" for p in self.processes if p.exitcode not in (None, 0)]

    def join(self, timeout: float) -> None:
        for process in self.processes:
            process.join(timeout)

    def close(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join()
        self.transport.close()
        self.reports.close()
        self.reports.join_thread()

