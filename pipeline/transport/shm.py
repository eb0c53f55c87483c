"""Same-node transport: a ring of slots in one shared-memory segment per stream.

The driver writes each batch once into a slot; every reader maps the segment
and gets numpy views of the slot (no copy). Per reader, two semaphores count
slots filled and slots handed back; the writer takes a free slot from every
reader before reusing it, so a slow reader throttles the writer instead of
letting messages pile up: memory is the ring and nothing else.
"""
from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import uuid
from collections.abc import Callable, Iterator
from multiprocessing.shared_memory import SharedMemory

import numpy as np

from pipeline.transport.base import Message, MessageKind, StreamLayout, StreamReader, StreamWriter, Transport

HEADER_FIELDS = 5  # kind, split, epoch, index, count
HEADER_BYTES = 64  # header padded to a cache line


def _slot_bytes(layout: StreamLayout) -> int:
    labels = 8 * layout.batch_capacity
    images = layout.item_bytes * layout.batch_capacity
    return -(-(HEADER_BYTES + labels + images) // 64) * 64


def _slot_views(buf, layout: StreamLayout, slot: int, writable: bool):
    base = slot * _slot_bytes(layout)
    header = np.ndarray((HEADER_FIELDS,), np.int64, buf, base)
    labels = np.ndarray((layout.batch_capacity,), np.int64, buf, base + HEADER_BYTES)
    images = np.ndarray((layout.batch_capacity, *layout.item_shape), np.uint8, buf,
                        base + HEADER_BYTES + 8 * layout.batch_capacity)
    if not writable:
        for view in (header, labels, images):
            view.flags.writeable = False
    return header, labels, images


class ShmReader(StreamReader):
    def __init__(self, segment: str, layout: StreamLayout, slots: int, filled, free):
        self.segment, self.layout, self.slots = segment, layout, slots
        self.filled, self.free = filled, free

    def messages(self) -> Iterator[Message]:
        # Mapped directly (not via SharedMemory) so that this process never
        # registers, and so never unlinks, a segment the writer owns. The map
        # closes when the last view of it is gone.
        with open(f"/dev/shm/{self.segment}", "rb") as file:
            buf = mmap.mmap(file.fileno(), self.slots * _slot_bytes(self.layout), access=mmap.ACCESS_READ)
        for seq in range(1 << 62):
            self.filled.acquire()
            header, labels, images = _slot_views(buf, self.layout, seq % self.slots, writable=False)
            kind, split, epoch, index, count = (int(v) for v in header)
            yield Message(MessageKind(kind), split, epoch, index, images[:count], labels[:count], self.free.release)
            if kind == MessageKind.STOP:
                return


class ShmWriter(StreamWriter):
    def __init__(self, name: str, layout: StreamLayout, consumers: int, slots: int, context,
                 alive: Callable[[str, int], bool]):
        self.name, self.layout, self.slots = name, layout, slots
        self.segment = SharedMemory(name=f"ensemble-{os.getpid()}-{uuid.uuid4().hex[:8]}-{name}",
                                    create=True, size=slots * _slot_bytes(layout))
        self.filled = [context.Semaphore(0) for _ in range(consumers)]
        self.free = [context.Semaphore(slots) for _ in range(consumers)]
        self.alive = alive
        self.attached = set(range(consumers))
        self.seq = 0

    def reader(self, consumer: int) -> ShmReader:
        return ShmReader(self.segment.name, self.layout, self.slots, self.filled[consumer], self.free[consumer])

    def publish(self, kind: MessageKind, split: int, epoch: int, index: int,
                images: np.ndarray | None = None, labels: np.ndarray | None = None) -> None:
        count = 0 if images is None else len(images)
        if count > self.layout.batch_capacity:
            raise ValueError(f"stream {self.name}: batch of {count} exceeds its capacity {self.layout.batch_capacity}")
        for consumer in sorted(self.attached):
            while not self.free[consumer].acquire(timeout=1.0):
                if not self.alive(self.name, consumer):  # its trainer died: the others go on
                    self.detach(consumer)
                    break
        header, slot_labels, slot_images = _slot_views(self.segment.buf, self.layout, self.seq % self.slots, True)
        if count:
            slot_images[:count] = images
            slot_labels[:count] = labels
        header[:] = (int(kind), split, epoch, index, count)
        del header, slot_labels, slot_images
        for consumer in self.attached:
            self.filled[consumer].release()
        self.seq += 1

    def detach(self, consumer: int) -> None:
        self.attached.discard(consumer)

    def close(self) -> None:
        self.segment.close()
        self.segment.unlink()


class SharedMemoryTransport(Transport):
    """`slots` messages of buffer per stream; `alive(stream, reader)` tells
    whether a reader still runs (asked while the writer waits on it): a dead
    reader is detached instead of holding the stream forever."""

    def __init__(self, slots: int, context=None, alive: Callable[[str, int], bool] = lambda stream, reader: True):
        if slots < 2:
            raise ValueError(f"transport.slots must be >= 2 (one being read, one being written), got {slots}")
        self.slots, self.alive = slots, alive
        self.context = context or mp.get_context("spawn")
        self.writers: list[ShmWriter] = []

    def open_stream(self, name: str, layout: StreamLayout, consumers: int) -> ShmWriter:
        writer = ShmWriter(name, layout, consumers, self.slots, self.context, self.alive)
        self.writers.append(writer)
        return writer

    def close(self) -> None:
        while self.writers:
            self.writers.pop().close()
