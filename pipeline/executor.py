"""Runs the stage graph on Dask: one task per batch, a bounded number in
flight, results handed back in batch order.

A batch task is a pure function of (graph, seed, split, epoch, index), so a
task lost with a dying worker is simply run again by Dask elsewhere and
yields the same bytes: no batch is lost or duplicated.
"""
from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from dask.distributed import Client, LocalCluster

from pipeline.graph import BatchOutput, StageGraph
from stages.base import BatchContext, Split


def run_batch(graph: StageGraph, seed: int, split: Split, epoch: int, index: int, on_error: str) -> BatchOutput:
    return graph.run(BatchContext(seed=seed, split=split, epoch=epoch, index=index, on_error=on_error))


class Executor:
    def __init__(self, client: Client, graph: StageGraph, seed: int, on_error: str, in_flight: int):
        if in_flight < 1:
            raise ValueError(f"cluster.in_flight must be >= 1 batch, got {in_flight}")
        self.client, self.graph, self.seed, self.on_error, self.in_flight = client, graph, seed, on_error, in_flight
        # Every worker gets the graph once (it holds the file list), not with every task.
        self.graph_future = client.scatter(graph, broadcast=True, hash=False)
        self.run_id = uuid.uuid4().hex[:8]

    def batches(self, split: Split, epoch: int) -> Iterator[tuple[int, BatchOutput]]:
        """(index, output) for every batch of the split's epoch, in index order."""
        total = self.graph.source.num_batches(split)
        pending = {}
        submitted = 0
        try:
            for index in range(total):
                while submitted < min(total, index + self.in_flight):
                    pending[submitted] = self.client.submit(
                        run_batch, self.graph_future, self.seed, split, epoch, submitted, self.on_error,
                        key=f"batch-{self.run_id}-{split.value}-{epoch}-{submitted}", pure=False)
                    submitted += 1
                yield index, pending.pop(index).result()
        finally:
            for future in pending.values():  # stopped early (an error): drop the rest
                future.cancel()


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
    with LocalCluster(n_workers=worker_count(workers), threads_per_worker=threads_per_worker, processes=True,
                      dashboard_address=None, silence_logs=logging.ERROR) as cluster, Client(cluster) as client:
        yield client
