"""Shared-memory delivery: every reader gets every message once, in order,
bit-identical; a slow reader holds the writer back; nothing is left behind."""
import multiprocessing as mp
import os
import time
import zlib

import numpy as np
import pytest

from pipeline.delivery.stream import MessageKind, MessageLayout
from pipeline.delivery.ring import Ring

LAYOUT = MessageLayout(batch_capacity=4, item_shape=(8, 8, 3))
CTX = mp.get_context("spawn")


def read_all(reader, results, delay):
    """Consumer process: checksum every message, optionally slowly."""
    seen = []
    for message in reader.messages():
        seen.append((int(message.kind), message.index, zlib.crc32(message.images.tobytes()),
                     message.labels.tolist(), time.monotonic()))
        time.sleep(delay)
        message.release()
    results.put((delay, seen))


def batches(count):
    rng = np.random.default_rng(0)
    for index in range(count):
        n = 3 if index == count - 1 else 4  # a short last batch
        yield index, rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8), np.arange(n) + index


def segments():
    return {name for name in os.listdir("/dev/shm") if name.startswith(f"ensemble-{os.getpid()}-")}


def test_every_reader_gets_every_message_in_order_and_bit_identical():
    ring = Ring("s", LAYOUT, readers=3, depth=3, context=CTX)
    writer = ring.writer()
    results = CTX.Queue()
    readers = [CTX.Process(target=read_all, args=(ring.reader(i), results, 0.0)) for i in range(3)]
    for process in readers:
        process.start()
    sent = []
    for index, images, labels in batches(25):
        writer.publish(MessageKind.BATCH, 0, 0, index, images, labels)
        sent.append((int(MessageKind.BATCH), index, zlib.crc32(images.tobytes()), labels.tolist()))
    writer.publish(MessageKind.STOP, 0, 0, 0)
    received = [results.get(timeout=30)[1] for _ in readers]
    for process in readers:
        process.join(10)
    ring.close()
    for seen in received:
        assert [s[:4] for s in seen[:-1]] == sent
        assert seen[-1][0] == MessageKind.STOP
    assert segments() == set()


def test_a_spare_reader_attached_mid_stream_gets_every_message_from_the_next_on_while_the_first_reads_on():
    ring = Ring("s", LAYOUT, readers=1, depth=3, context=CTX, spare=2)
    writer = ring.writer()
    results = CTX.Queue()
    first = CTX.Process(target=read_all, args=(ring.reader(0), results, 0.0))
    first.start()
    sent = []
    for index, images, labels in batches(11):
        if index == 3:  # a trainer joins: it starts, and waits for its first message...
            spare = ring.take_spare()
            joiner = CTX.Process(target=read_all, args=(ring.reader(spare), results, 0.01))
            joiner.start()
        if index == 7:  # ...which is the first after the next boundary of the stream
            ring.attach(spare)
        writer.publish(MessageKind.BATCH, 0, 0, index, images, labels)
        sent.append((int(MessageKind.BATCH), index, zlib.crc32(images.tobytes()), labels.tolist()))
    writer.publish(MessageKind.STOP, 0, 0, 0)
    received = dict(results.get(timeout=30) for _ in range(2))
    for process in (first, joiner):
        process.join(10)
    ring.close()
    assert [s[:4] for s in received[0.0][:-1]] == sent  # (index 7 sat in buffer 1 of 3: the joiner's first)
    assert [s[:4] for s in received[0.01][:-1]] == sent[7:]
    assert ring.spares == [2] and segments() == set()


def test_slow_reader_holds_the_writer_to_the_ring_size():
    depth = 2
    ring = Ring("s", LAYOUT, readers=2, depth=depth, context=CTX)
    writer = ring.writer()
    results = CTX.Queue()
    readers = [CTX.Process(target=read_all, args=(ring.reader(i), results, delay)) for i, delay in
               enumerate((0.0, 0.05))]
    for process in readers:
        process.start()
    published_at = []
    for index, images, labels in batches(20):
        writer.publish(MessageKind.BATCH, 0, 0, index, images, labels)
        published_at.append(time.monotonic())
    writer.publish(MessageKind.STOP, 0, 0, 0)
    slow = dict(results.get(timeout=30) for _ in readers)[0.05]
    for process in readers:
        process.join(10)
    ring.close()
    # Message i + depth can only be written once the slow reader released message i.
    for i in range(len(published_at) - depth):
        assert published_at[i + depth] >= slow[i][4]
    assert [s[1] for s in slow[:-1]] == list(range(20))


def test_a_detached_reader_is_not_waited_for():
    ring = Ring("s", LAYOUT, readers=2, depth=2, context=CTX)
    writer = ring.writer()
    results = CTX.Queue()
    live = CTX.Process(target=read_all, args=(ring.reader(1), results, 0.0))
    live.start()
    for index, images, labels in batches(5):  # reader 0 never reads: the ring fills, then it is dropped
        if index == 2:  # the next message would wait on reader 0 forever
            assert writer.occupancy() == 2  # reader 0 holds the whole ring
            ring.detach(0)  # as the driver does when its trainer dies
        writer.publish(MessageKind.BATCH, 0, 0, index, images, labels)
    writer.publish(MessageKind.STOP, 0, 0, 0)
    seen = results.get(timeout=30)[1]
    live.join(10)
    ring.close()
    assert writer.attached == [1]
    assert [s[1] for s in seen[:-1]] == list(range(5))
    assert segments() == set()


def test_oversized_batch_is_refused():
    ring = Ring("s", LAYOUT, readers=1, depth=2, context=CTX)
    with pytest.raises(ValueError, match="exceeds its capacity 4"):
        ring.writer().publish(MessageKind.BATCH, 0, 0, 0, np.zeros((5, 8, 8, 3), np.uint8), np.zeros(5, np.int64))
    ring.close()
