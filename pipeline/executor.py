"""Runs the stage graph on Dask: one task per batch, a bounded number in
flight, results handed back in batch order.

A batch task is a pure function of (graph, seed, split, epoch, index), so a
task lost with a dying worker is simply run again by Dask elsewhere and
yields the same bytes: no batch is lost or duplicated.
"""
from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import dask
from dask.distributed import Client, LocalCluster, get_worker, wait

from pipeline.graph import BatchOutput, StageGraph
from pipeline.transport.handoff import SharedArray, remove_all
from stages.base import BatchContext, Split


def run_batch(graph: StageGraph, seed: int, split: Split, epoch: int, index: int, on_error: str,
              share_as: str | None) -> BatchOutput:
    """One batch through the graph; with `share_as`, the streams' arrays are
    left in this node's shared memory under that name prefix."""
    started = time.time()
    output = graph.run(BatchContext(seed=seed, split=split, epoch=epoch, index=index, on_error=on_error))
    output.worker, output.started, output.ended = f"worker {get_worker().name}", started, time.time()
    if share_as:
        for stream, batch in output.streams.items():
            batch.data = SharedArray.write(f"{share_as}-{stream}", batch.data)
    return output


class Executor:
    """Use as a context manager: on exit it waits for tasks still running and
    removes whatever they left in shared memory."""

    def __init__(self, client: Client, graph: StageGraph, seed: int, on_error: str, in_flight: int):
        if in_flight < 1:
            raise ValueError(f"cluster.in_flight must be >= 1 batch, got {in_flight}")
        self.client, self.graph, self.seed, self.on_error, self.in_flight = client, graph, seed, on_error, in_flight
        # Every worker gets the graph once (it holds the file list), not with every task.
        self.graph_future = client.scatter(graph, broadcast=True, hash=False)
        self.run_id = uuid.uuid4().hex[:8]
        here = socket.gethostname()
        same_node = all(host == here for host in client.run(socket.gethostname).values())
        self.share_prefix = f"ensemble-out-{os.getpid()}-{self.run_id}" if same_node else None
        self.pending: dict = {}

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc) -> None:
        try:  # a run stopped early: let tasks already running finish writing
            wait(list(self.pending.values()), timeout=60)
        except TimeoutError:
            pass
        self.pending.clear()
        if self.share_prefix:
            remove_all(self.share_prefix)

    def batches(self, split: Split, epoch: int) -> Iterator[tuple[int, BatchOutput]]:
        """(index, output) for every batch of the split's epoch, in index order."""
        total = self.graph.source.num_batches(split)
        submitted = 0
        for index in range(total):
            while submitted < min(total, index + self.in_flight):
                key = f"batch-{self.run_id}-{split.value}-{epoch}-{submitted}"
                share_as = f"{self.share_prefix}-{split.value}-{epoch}-{submitted}" if self.share_prefix else None
                self.pending[submitted] = self.client.submit(
                    run_batch, self.graph_future, self.seed, split, epoch, submitted, self.on_error, share_as,
                    key=key, pure=False)
                submitted += 1
            output = self.pending.pop(index).result()
            for batch in output.streams.values():
                if isinstance(batch.data, SharedArray):
                    batch.data = batch.data.take()
            yield index, output


def worker_count(workers: int | str) -> int:
    if workers == "auto":
        return len(os.sched_getaffinity(0))
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"cluster.workers must be a positive integer or 'auto', got {workers!r}")
    return workers


@contextmanager
def dask_client(address: str | None, workers: int | str, threads_per_worker: int) -> Iterator[Client]:
    """A client of the scheduler at `address`, or of a LocalCluster made here
    and closed on exit (each Hydra multirun job gets its own)."""
    if address:
        with Client(address, timeout="20s") as client:
            yield client
        return
    # Workers inherit this config: their sampling profiler would cost CPU for nothing.
    with dask.config.set({"distributed.worker.profile.enabled": False}), \
            LocalCluster(n_workers=worker_count(workers), threads_per_worker=threads_per_worker, processes=True,
                         dashboard_address=":0", silence_logs=logging.ERROR) as cluster, Client(cluster) as client:
        yield client
