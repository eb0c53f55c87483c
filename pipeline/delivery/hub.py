"""A hub: where a stream of a flotilla meets one node, a process of its own.

A producing hub has its node's Dask workers make batches, or one share of
each batch (all_shared); the hubs of a stream then exchange them over the
stream's process group (broadcast or all-gather, pipeline/delivery/collective.py),
and every hub writes each batch once into its node's shared-memory rings,
which its trainers read. The driver sends one command per split and one to
stop; the hub reports each batch it published, and what it moved (typed
messages, messages.py).
"""
from __future__ import annotations

import time
import traceback
import zlib
from contextlib import ExitStack
from dataclasses import dataclass, replace

import numpy as np

from pipeline.data.executor import Executor, TlsFiles, connect, keep_sample
from pipeline.data.graph import StageGraph
from pipeline.delivery.messages import (BatchPublished, HubFailed, HubHung, HubStopped, HubUserError, HubWaiting,
                                        RunSplit, SplitDone, StopStreams)
from pipeline.delivery.ring import Ring
from pipeline.delivery.stream import MessageKind
from pipeline.delivery.plan import HubPlan, StreamPlan
from pipeline.runtime.child import tell_parent
from pipeline.runtime.errors import UserError
from pipeline.runtime.lifetime import child_started
from pipeline.runtime.hang import HangError, Patience
from stages.base import Batch, Split

# multi_broadcast: a producer keeps this many in_flight's worth of batches it has used, so a stream up
# to that far behind takes them instead of making them again (memory: that many batches per producer).
SHARED_WINDOW = 4


@dataclass(frozen=True, kw_only=True)  # many fields: called by name, never by position
class HubSpec:
    hub: HubPlan
    stream: StreamPlan
    stream_ranks: tuple[tuple[int, ...], ...]  # every stream's hubs: their process groups are made in this order
    world: int  # hubs of the flotilla
    rendezvous: str  # init_method of the hubs' process group
    device: str  # "cpu" (gloo) or "cuda:<i>" (NCCL) for the exchange
    scheduler: str  # Dask scheduler address
    graph: StageGraph  # the part of the graph that feeds the stream's sinks
    seed: int
    on_error: str
    in_flight: int
    rings: dict[str, Ring]  # sink -> this node's ring for the stream's trainers here
    record_checksums: bool
    shared_keys: str | None  # multi_broadcast: the streams' producers share batch tasks under these keys
    sequence: int  # the flotilla's own sequence of epochs: its shuffles are its own
    drain_s: float  # timeouts.drain_s: what running batch tasks get to finish when the hub closes
    patience: Patience  # timeouts.warn_s, stall_s: a batch task awaited this long is described, then fails
    collective_s: float  # timeouts.collective_s: the hubs' process group's collectives fail after this
    tls: TlsFiles | None  # Dask's TLS files of the hub's host (its NodeProcesses fills them in); None: no TLS


def hub_main(spec: HubSpec, abort, serving, *, to_parent, from_parent) -> None:
    """Process entry point (runtime.child.Child): serves the driver's commands, tells it its events.
    `abort` (an Event) ends it between batches; it sets `serving` (an Event) once it takes commands (its
    process group met, its Dask client connected). A failure is told to the driver, which reports it once;
    the process then exits with code 1 without a traceback of its own."""
    child_started("hub")
    try:
        Hub(spec, to_parent, abort).serve(from_parent, serving)
    except UserError as err:  # the user's data or stage, named: the driver stops the run with its message
        tell_parent(to_parent, HubUserError(spec.hub.rank, str(err)))
        raise SystemExit(1) from None
    except HangError as err:  # a known wait that ran out: its message says it all, no traceback needed
        tell_parent(to_parent, HubHung(spec.hub.rank, str(err)))
        raise SystemExit(1) from None
    except BaseException:
        tell_parent(to_parent, HubFailed(spec.hub.rank, traceback.format_exc()))
        raise SystemExit(1) from None


class Hub:
    def __init__(self, spec: HubSpec, events, abort):
        self.spec, self.events, self.abort = spec, events, abort
        self.link = None
        if spec.world > 1:
            from pipeline.delivery.collective import StreamLink, init_process_group, make_groups

            if spec.device.startswith("cuda"):
                import torch

                torch.cuda.set_device(spec.device)  # NCCL's buffers and streams on this hub's GPU, not GPU 0
            init_process_group(spec.rendezvous, spec.hub.rank, spec.world, spec.device, spec.collective_s,
                               "the flotilla's hubs")
            groups = make_groups(spec.stream_ranks, spec.collective_s)
            if len(spec.stream.hubs) > 1:
                item_shapes = {name: s.item_shape for name, s in spec.graph.sinks.items()}
                self.link = StreamLink(groups[spec.hub.stream], spec.stream.hubs, item_shapes,
                                       spec.graph.source.batch_size, spec.stream.gather, spec.device,
                                       spec.collective_s)
        self.writers = {sink: ring.writer() for sink, ring in spec.rings.items()}
        self.sent: dict[str, list] = {sink: [] for sink in spec.rings}
        self.publish_wait_s = self.exchange_s = 0.0
        self.occupancy: list[tuple[float, int]] = []  # (time.time(), batches held by the slowest reader)
        self.latency_ms: list[float] = []  # per batch: exchange + writing into the rings (waits included)

    def serve(self, commands, serving) -> None:
        spec = self.spec
        try:
            with ExitStack() as stack:
                executor = None
                if spec.hub.part is not None:  # a producer
                    client = stack.enter_context(connect(spec.scheduler, spec.tls))
                    executor = stack.enter_context(Executor(client, spec.graph, spec.seed, spec.on_error,
                                                            spec.in_flight, node=spec.hub.node, part=spec.hub.part,
                                                            parts=spec.stream.parts, shared_keys=spec.shared_keys,
                                                            retain=SHARED_WINDOW * spec.in_flight
                                                            if spec.shared_keys else 0,
                                                            sequence=spec.sequence, drain_s=spec.drain_s,
                                                            patience=spec.patience, on_wait=self._waiting))
                serving.set()
                for command in iter(commands.recv, StopStreams()):
                    assert isinstance(command, RunSplit), command
                    self._split(executor, command.split, command.epoch)
                if not self.abort.is_set():
                    self._mark(MessageKind.STOP, 0, 0)
                    self.events.send(HubStopped(spec.hub.rank, self._summary(executor)))
        finally:
            if spec.world > 1:
                import torch.distributed as dist

                dist.destroy_process_group()

    def _split(self, executor, split: Split, epoch: int) -> None:
        cpu_started = time.process_time()
        split_id = list(Split).index(split)
        # The driver runs a flotilla's epochs in order, TRAIN then VAL: what comes next is known.
        then = (Split.VAL, epoch) if split is Split.TRAIN else (Split.TRAIN, epoch + 1)
        made = executor.batches(split, epoch, then) if executor else None
        for index in range(self.spec.graph.source.num_batches(split)):
            if self.abort.is_set():  # the flotilla is closing: leave, letting the executor clean up
                return
            output, sinks = None, None
            if made is not None:
                made_index, output = next(made)
                assert made_index == index
                sinks = {name: (batch.data, batch.labels) for name, batch in output.batches.items()}
            exchange_started = started = time.perf_counter()
            if self.link and self.spec.stream.gather:
                sinks = self.link.all_gather(self.spec.hub.rank, index, sinks)
            elif self.link:
                sinks = self.link.broadcast(self.spec.hub.rank, index, sinks)
            self.exchange_s += time.perf_counter() - started
            started = time.perf_counter()
            for sink, writer in self.writers.items():
                self._sample(writer)
                images, labels = sinks[sink]
                writer.publish(MessageKind.BATCH, split_id, epoch, index, images, labels)
                if self.spec.record_checksums:
                    crc = zlib.crc32(labels.tobytes(), zlib.crc32(images.tobytes()))
                    self.sent[sink].append((int(MessageKind.BATCH), split_id, epoch, index, crc))
            self.publish_wait_s += time.perf_counter() - started
            self.latency_ms = keep_sample(self.latency_ms, 1000 * (time.perf_counter() - exchange_started))
            self.events.send(BatchPublished(self.spec.hub.rank, split, index, _stats_only(output)))
        self._mark(MessageKind.END, split_id, epoch)
        self.events.send(SplitDone(self.spec.hub.rank, split, time.process_time() - cpu_started))

    def _waiting(self, what: str) -> None:
        self.events.send(HubWaiting(self.spec.hub.rank, what))

    def _mark(self, kind: MessageKind, split_id: int, epoch: int) -> None:
        empty_crc = zlib.crc32(b"", zlib.crc32(b""))
        for sink, writer in self.writers.items():
            writer.publish(kind, split_id, epoch, 0)
            if self.spec.record_checksums:
                self.sent[sink].append((int(kind), split_id, epoch, 0, empty_crc))

    def _sample(self, writer) -> None:
        self.occupancy = keep_sample(self.occupancy, (time.time(), writer.occupancy()))

    def _summary(self, executor) -> dict:
        link = self.link
        return {"node": self.spec.hub.node, "stream": self.spec.hub.stream, "part": self.spec.hub.part,
                "ring_bytes": sum(w.bytes_written for w in self.writers.values()),
                "sent_bytes": link.bytes_sent if link else 0, "received_bytes": link.bytes_received if link else 0,
                "exchange_s": self.exchange_s, "publish_wait_s": self.publish_wait_s,
                "ring_depth": {sink: ring.depth for sink, ring in self.spec.rings.items()},
                "occupancy": self.occupancy, "latency_ms": self.latency_ms, "sent_checksums": self.sent,
                "in_flight": self.spec.in_flight, "prefetch_capacity": executor.prefetch_capacity if executor else 0,
                "tasks_ready": executor.ready if executor else []}


def _stats_only(output):
    """A batch task's measurements without its image bytes, for the driver's records."""
    if output is None:
        return None
    return replace(output, batches={name: Batch(np.empty(0, np.uint8), batch.labels, [])
                                  for name, batch in output.batches.items()})
