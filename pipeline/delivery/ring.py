"""Same-node delivery: a ring of `depth` batch buffers in one shared-memory
segment per sink of a stream.

The driver creates a ring (segment, semaphores, detach flags) before it
spawns anyone; the hub writes each batch once into a buffer; every trainer
maps the segment and gets numpy views of the buffer (no copy). Per reader,
two semaphores count buffers filled and buffers handed back; the writer takes a
free buffer from every attached reader before reusing it, so a slow reader
throttles the writer instead of letting messages pile up: memory is the
ring and nothing else.

A ring may keep spare readers for trainers that join its running stream
(scheduler.join_running): one attaches at the writer's next message, and
reads from there on; the others go on untouched.
"""
from __future__ import annotations

import mmap
import os
import uuid
from collections.abc import Iterator
from multiprocessing.shared_memory import SharedMemory

import numpy as np

from pipeline.delivery.stream import Message, MessageKind, MessageLayout, StreamReader, StreamWriter
from pipeline.runtime.lifetime import SHM_DIR

HEADER_FIELDS = 5  # kind, split, epoch, index, count
HEADER_BYTES = 64  # header padded to a cache line
DETACH_POLL_S = 1.0  # how often a writer waiting on a reader checks that it is still attached
IDLE_POLL_S = 0.05  # how often a reader waiting for a message does its `idle` work


def _buffer_bytes(layout: MessageLayout) -> int:
    labels = 8 * layout.batch_capacity
    images = layout.item_bytes * layout.batch_capacity
    return -(-(HEADER_BYTES + labels + images) // 64) * 64


def _buffer_views(buf, layout: MessageLayout, buffer: int, writable: bool):
    base = buffer * _buffer_bytes(layout)
    header = np.ndarray((HEADER_FIELDS,), np.int64, buf, base)
    labels = np.ndarray((layout.batch_capacity,), np.int64, buf, base + HEADER_BYTES)
    images = np.ndarray((layout.batch_capacity, *layout.item_shape), np.uint8, buf,
                        base + HEADER_BYTES + 8 * layout.batch_capacity)
    if not writable:
        for view in (header, labels, images):
            view.flags.writeable = False
    return header, labels, images


def _map(segment: str, size: int, writable: bool) -> mmap.mmap:
    # Mapped directly (not via SharedMemory) so that no process but the owner
    # registers, and so unlinks, the segment. The map closes with its last view.
    with open(os.path.join(SHM_DIR, segment), "r+b" if writable else "rb") as file:
        return mmap.mmap(file.fileno(), size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)


class Ring:
    """One sink's ring of a stream on one node, for `readers` readers from the start and `spare` more that may
    attach later. Picklable: the driver owns it (and unlinks it on close); hub and trainers get copies."""

    def __init__(self, name: str, layout: MessageLayout, readers: int, depth: int, context, spare: int = 0):
        consumers = readers + spare
        self.name, self.layout, self.consumers, self.depth = name, layout, consumers, depth
        self.size = depth * _buffer_bytes(layout)
        owned = SharedMemory(name=f"ensemble-{os.getpid()}-{uuid.uuid4().hex[:8]}-{name}", create=True,
                             size=self.size)
        self.segment = owned.name
        self._owned: SharedMemory | None = owned
        self.filled = [context.Semaphore(0) for _ in range(consumers)]
        self.free = [context.Semaphore(depth) for _ in range(consumers)]
        self.detached = context.Array("b", consumers, lock=False)  # set by the driver: that reader is gone
        self.detached[readers:] = [1] * spare  # spares wait detached until one attaches
        self.attaching = context.Array("b", consumers, lock=False)  # set by the driver, cleared by the writer
        self.first = context.Array("q", consumers, lock=False)  # the writer's sequence number where each began
        self.spares = list(range(readers, consumers))  # not yet attached (the owner's copy counts)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_owned": None}

    def reader(self, consumer: int) -> ShmReader:
        return ShmReader(self.segment, self.layout, self.depth, self.filled[consumer], self.free[consumer],
                         self.first, consumer)

    def take_spare(self) -> int:
        """A spare reader for a trainer that joins the running stream; it gets messages once `attach`ed."""
        if not self.spares:
            raise ValueError(f"ring {self.name} has no spare reader left")
        return self.spares.pop(0)

    def attach(self, consumer: int) -> None:
        """Deliver to spare reader `consumer` from the writer's next message on (the writer is between
        messages or waits for one: a reader never sees part of a split before it)."""
        self.attaching[consumer] = 1

    def writer(self) -> RingWriter:
        """The writing end, in the process that publishes (one per ring)."""
        return RingWriter(self)

    def detach(self, consumer: int) -> None:
        """Stop delivering to `consumer` (its trainer stopped or died); the others go on."""
        self.detached[consumer] = 1

    def close(self) -> None:
        if self._owned is not None:
            self._owned.close()
            self._owned.unlink()
            self._owned = None


class ShmReader(StreamReader):
    def __init__(self, segment: str, layout: MessageLayout, depth: int, filled, free, first, consumer: int):
        self.segment, self.layout, self.depth = segment, layout, depth
        self.filled, self.free, self.first, self.consumer = filled, free, first, consumer

    def messages(self, idle=None) -> Iterator[Message]:
        buf = _map(self.segment, self.depth * _buffer_bytes(self.layout), writable=False)
        seq = None
        while True:
            while not self.filled.acquire(timeout=IDLE_POLL_S if idle else None):
                idle()
            if seq is None:  # the first message tells where it began: set before it was filled
                seq = self.first[self.consumer]
            header, labels, images = _buffer_views(buf, self.layout, seq % self.depth, writable=False)
            kind, split, epoch, index, count = (int(v) for v in header)
            yield Message(MessageKind(kind), split, epoch, index, images[:count], labels[:count], self.free.release)
            if kind == MessageKind.STOP:
                return
            seq += 1


class RingWriter(StreamWriter):
    def __init__(self, ring: Ring):
        self.ring = ring
        self.buf = _map(ring.segment, ring.size, writable=True)
        self.seq = 0
        self.bytes_written = 0
        self.joinable = list(ring.spares)  # spare readers not attached yet: all of them when the hub starts

    @property
    def attached(self) -> list[int]:
        return [c for c in range(self.ring.consumers) if not self.ring.detached[c]]

    def occupancy(self) -> int:
        """Buffers the furthest-behind attached reader has yet to hand back."""
        return max((self.ring.depth - self.ring.free[c].get_value() for c in self.attached), default=0)

    def publish(self, kind: MessageKind, split: int, epoch: int, index: int,
                images: np.ndarray | None = None, labels: np.ndarray | None = None) -> None:
        layout = self.ring.layout
        count = 0 if images is None else len(images)
        if count > layout.batch_capacity:
            raise ValueError(f"ring {self.ring.name}: batch of {count} exceeds its capacity {layout.batch_capacity}")
        for consumer in [c for c in self.joinable if self.ring.attaching[c]]:  # a joiner reads from this message on
            self.ring.first[consumer], self.ring.detached[consumer], self.ring.attaching[consumer] = self.seq, 0, 0
            self.joinable.remove(consumer)
        for consumer in self.attached:
            while not self.ring.free[consumer].acquire(timeout=DETACH_POLL_S):
                if self.ring.detached[consumer]:  # its trainer is gone: the others go on
                    break
        header, buffer_labels, buffer_images = _buffer_views(self.buf, layout, self.seq % self.ring.depth, True)
        if count:
            buffer_images[:count] = images
            buffer_labels[:count] = labels
            self.bytes_written += images.nbytes + labels.nbytes
        header[:] = (int(kind), split, epoch, index, count)
        del header, buffer_labels, buffer_images
        for consumer in self.attached:
            self.ring.filled[consumer].release()
        self.seq += 1
