"""Runs the stage graph on Dask: one task per batch, a bounded number in
flight, results handed back in batch order.

A batch task is a pure function of (graph, seed, split, epoch, index), so a
task lost with a dying worker is simply run again by Dask elsewhere and
yields the same bytes: no batch is lost or duplicated.
"""
from __future__ import annotations

import copy
import importlib.util
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import dask
from dask.distributed import (Client, LocalCluster, Security, WorkerPlugin, get_worker, performance_report,
                              wait)
from distributed.core import Status
from distributed.protocol.pickle import dumps
from hydra.utils import to_absolute_path
from rich.console import Console

from pipeline.data.graph import BatchOutput, StageGraph
from pipeline.data.handoff import HANDOFF_PREFIX, SharedArray
from pipeline.runtime.errors import UserError
from pipeline.runtime.hang import Patience, Stall
from pipeline.runtime.lifetime import STOP_SIGNALS, remove_shm
from stages.base import BatchContext, OnError, Split
from stages.cache import Cache


def run_batch(graph_id: str, seed: int, sequence: int, split: Split, epoch: int, index: int, part: int, parts: int,
              on_error: OnError, share_as: str | None) -> BatchOutput:
    """Share `part` of `parts` of one batch through the graph `graph_id`; with `share_as`,
    the sinks' arrays are left in this node's shared memory under that name prefix."""
    started = time.time()
    context = BatchContext(seed=seed, split=split, epoch=epoch, index=index, sequence=sequence, part=part,
                           parts=parts, on_error=on_error, node=_worker_node())
    try:
        output = _GRAPHS[graph_id][0].run(context)
    except UserError as err:  # the user's data or stage, not a failed task: raised where the batch is taken
        return BatchOutput({}, {}, user_error=str(err))  # (its message: a user's subclass may not unpickle)
    worker = get_worker()
    output.worker, output.worker_threads = f"worker {worker.name}", worker.state.nthreads
    output.started, output.ended = started, time.time()
    if share_as:
        for sink, batch in output.batches.items():
            batch.data = SharedArray.write(f"{share_as}-{sink}", batch.data)
    return output


def _worker_node(worker=None) -> int:
    """The node of `worker` (this one by default): the i of its resource node-<i> (0 without one)."""
    return next((int(name.removeprefix(NODE_RESOURCE)) for name in (worker or get_worker()).state.total_resources
                 if name.startswith(NODE_RESOURCE)), 0)


@contextmanager
def cache_kept(client: Client, graph: StageGraph) -> Iterator[None]:
    """The graph's cache stores (one per node) live while this does: on exit they are removed from
    every host of the cluster."""
    try:
        yield
    finally:
        if graph.cache:
            if client.status == "running":
                client.run(_remove_cache, graph.cache)
            _remove_cache(graph.cache)


def _remove_cache(cache: Cache) -> None:
    cache.close()
    for prefix in cache.prefixes():
        remove_shm(prefix)


_GRAPHS: dict[str, list] = {}  # in each worker process: graph id -> [graph, executors holding it]


class GraphOnWorkers(WorkerPlugin):
    """Puts a stage graph (it holds the file list) once on every worker of `node` (None: every worker),
    a worker that joins later (a restarted one) included. Batch tasks name the graph instead of depending
    on a Dask key: a dependency would make the scheduler place every task where that key is held, not by
    load. Executors sharing keys share the graph id; it leaves a worker with the last of them."""

    def __init__(self, graph_id: str, graph: StageGraph, node: int | None):
        self.graph_id, self.graph, self.node = graph_id, graph, node
        self.held = False  # by this worker (each has its own copy of the plugin)

    def setup(self, worker) -> None:
        if self.node is None or _worker_node(worker) == self.node:
            _GRAPHS.setdefault(self.graph_id, [self.graph, 0])[1] += 1
            self.held = True

    def teardown(self, worker) -> None:
        if not self.held:
            return
        held = _GRAPHS[self.graph_id]
        held[1] -= 1
        if held[1] == 0:
            del _GRAPHS[self.graph_id]


log = logging.getLogger(__name__)


class LeaveTheStopToTheDriver(WorkerPlugin):
    """A terminal's Ctrl-C or hangup, and a SIGTERM from `timeout`, Slurm or systemd, reach every process of
    the run: the workers of a LocalCluster made here ignore them (the driver stops them in order, through
    their nannies, which kill a worker that does not stop) instead of dying in the middle of a batch.
    And a worker told to close does not report as an error the heartbeat its own close cut off."""

    def setup(self, worker) -> None:
        for signum in STOP_SIGNALS:  # (a worker runs its event loop in its main thread)
            signal.signal(signum, signal.SIG_IGN)
        logging.getLogger("distributed.worker").addFilter(HeartbeatCutByClose(worker))


class HeartbeatCutByClose(logging.Filter):
    """Drops distributed's "Failed to communicate with scheduler during heartbeat" (a traceback at ERROR)
    once its worker is closing: the close shuts the connections a heartbeat in flight waits on
    (dask/distributed#7105), which says nothing wrong. While the worker runs, the record stays."""

    def __init__(self, worker) -> None:
        super().__init__()
        self.worker = worker

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.getMessage().startswith("Failed to communicate with scheduler during heartbeat")
                    and self.worker.status in (Status.closing, Status.closing_gracefully, Status.closed))


SAMPLES_KEPT = 2000  # queue and latency samples a producer keeps (evenly thinned beyond twice this)


def keep_sample(samples: list, sample) -> list:
    """`samples` with `sample` added, halved (every other one) once it outgrows twice SAMPLES_KEPT."""
    samples.append(sample)
    return samples[::2] if len(samples) > 2 * SAMPLES_KEPT else samples


NODE_RESOURCE = "node-"  # then the node's number: the Dask worker resource that ties a worker to its node


def node_resource(node: int) -> str:
    """The Dask worker resource that ties a worker to node `node`."""
    return f"{NODE_RESOURCE}{node}"


def remove_node_workers(client: Client, node: int) -> None:
    """Tells the Dask scheduler that node `node`'s workers are gone (its host was lost), as it would find
    out by itself only after `distributed.scheduler.worker-ttl` for a host cut off: their tasks are
    computed again elsewhere, and no broadcast (a plugin registered, `client.run`) waits for them. Should
    the host come back, its workers hear they were removed and close."""
    resource = node_resource(node)

    async def remove(dask_scheduler) -> None:  # runs in the scheduler: defined here, sent by value
        gone = [address for address, worker in dask_scheduler.workers.items() if resource in worker.resources]
        for address in gone:
            await dask_scheduler.remove_worker(address, stimulus_id=f"{resource}-lost", close=False)

    client.run_on_scheduler(remove)


def scheduler_workers(client: Client) -> dict[str, dict]:
    """Address -> what the scheduler knows of that worker (name, resources, nthreads), asked of the scheduler
    now. Not `client.scheduler_info()`: it returns the client's cached copy, which the client's own periodic
    refresh (every `distributed.client.scheduler-info-interval`, asking for no workers) can overwrite between
    the fresh answer and its return: a read then finds no workers at all."""
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]


def node_workers(client: Client, node: int | None) -> list[str] | None:
    """The addresses of node `node`'s Dask workers (None: every worker, as Dask takes it)."""
    if node is None:
        return None
    return [address for address, info in scheduler_workers(client).items()
            if node_resource(node) in (info.get("resources") or {})]


def add_worker_plugin(client: Client, plugin: WorkerPlugin, name: str, workers: list[str] | None) -> None:
    """`plugin` on `workers` (None: every worker) now, and on every worker that joins later (where it acts
    only if it is for that worker's node). Dask's own registration broadcasts to every worker and fails
    after its connect timeout if one is on a host cut off and not yet removed: a node's hub needs none of
    the other nodes' workers."""
    if workers is None:
        client.register_plugin(plugin, name=name)
        return
    pickled = dumps(plugin)

    async def add(dask_scheduler) -> dict:  # runs in the scheduler: defined here, sent by value
        dask_scheduler.worker_plugins[name] = pickled  # what a joining worker is given
        return await dask_scheduler.broadcast(msg={"op": "plugin-add", "plugin": pickled, "name": name},
                                              workers=workers, on_error="return")

    failed = {address: answer for address, answer in client.run_on_scheduler(add).items()
              if not (isinstance(answer, dict) and answer.get("status") == "OK")}
    if failed:
        raise RuntimeError(f"the Dask plugin {name} could not be set up on worker(s) {failed}")


def remove_worker_plugin(client: Client, name: str, workers: list[str] | None) -> None:
    """add_worker_plugin undone: off `workers` (None: every worker) and off the workers that join later.
    A worker that cannot be reached any more (its host lost) is left as it is."""
    if workers is None:
        client.unregister_worker_plugin(name)
        return

    async def remove(dask_scheduler) -> None:
        dask_scheduler.worker_plugins.pop(name, None)
        await dask_scheduler.broadcast(msg={"op": "plugin-remove", "name": name}, workers=workers,
                                       on_error="ignore")

    client.run_on_scheduler(remove)


class Executor:
    """Use as a context manager: on exit it waits for tasks still running and
    removes whatever they left in shared memory. With `node`, batch tasks run
    only on that node's workers; with `parts` > 1, each task makes share
    `part` of its batch. Executors given the same `shared_keys` (and graph)
    share their batch tasks through Dask: a batch one of them has made, or is
    making, is not made again while some executor still holds it; each keeps
    its last `retain` batches for the others. `sequence` keys the epochs'
    shuffles (each flotilla reads its own sequence); on exit, tasks still
    running get `drain_s` to finish writing. A batch awaited without result
    for `patience.warn_s` is described to `on_wait` (a line: the task, its
    state, the workers), and fails with HangError after `patience.stall_s`."""

    def __init__(self, client: Client, graph: StageGraph, seed: int, on_error: OnError, in_flight: int,
                 node: int | None = None, part: int = 0, parts: int = 1, shared_keys: str | None = None,
                 retain: int = 0, sequence: int = 0, drain_s: float = 60.0, patience: Patience = Patience(),
                 on_wait: Callable[[str], None] = log.warning):
        self.client, self.graph, self.seed, self.on_error, self.in_flight = client, graph, seed, on_error, in_flight
        self.sequence, self.drain_s, self.patience, self.on_wait = sequence, drain_s, patience, on_wait
        self.part, self.parts, self.node = part, parts, node
        self.resources = {node_resource(node): 1} if node is not None else None
        self.run_id = shared_keys or uuid.uuid4().hex[:8]
        self.retained: deque = deque(maxlen=retain)  # futures kept after use, for executors sharing keys
        # The prefetch queue: (time.time(), batches made and waiting) as the consumer comes for the next.
        # One batch of the in_flight window is the consumer's, so in_flight - 1 can wait.
        self.prefetch_capacity = in_flight - 1
        self.ready: list[tuple[float, int]] = []
        self.plugin = f"graph-{self.run_id}-{uuid.uuid4().hex[:8]}"
        workers = node_workers(client, node)  # the only ones its tasks run on
        add_worker_plugin(client, GraphOnWorkers(self.run_id, graph, node), self.plugin, workers)
        here = socket.gethostname()
        same_node = all(host == here for host in client.run(socket.gethostname, workers=workers).values())
        # Shared tasks are taken by several executors: their results come through Dask, not a hand-off file.
        self.share_prefix = f"{HANDOFF_PREFIX}-{os.getpid()}-{self.run_id}" if same_node and not shared_keys else None
        self.pending: dict = {}

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc) -> None:
        try:  # a run stopped early: let tasks already running finish writing
            wait(list(self.pending.values()), timeout=self.drain_s)
        except TimeoutError:
            pass
        self.pending.clear()
        self.retained.clear()
        if self.client.status == "running":  # a closed client's cluster took the graph with it
            remove_worker_plugin(self.client, self.plugin, node_workers(self.client, self.node))
        if self.share_prefix:
            remove_shm(self.share_prefix)

    def batches(self, split: Split, epoch: int, then: tuple[Split, int] | None = None
                ) -> Iterator[tuple[int, BatchOutput]]:
        """(index, output) for every batch of the split's epoch, in index order.
        With `then` (the split and epoch expected next), that split's first
        batches are submitted as this one drains: the workers do not idle while
        the trainers finish an epoch. A guess that turns out wrong costs those tasks."""
        total = self.graph.source.num_batches(split)
        following = self.graph.source.num_batches(then[0]) if then else 0
        for index in range(total):
            if self.prefetch_capacity:  # (a split's first take may find a whole window, prefetched: full)
                waiting = min(self.prefetch_capacity, sum(f.done() for f in self.pending.values()))
                self.ready = keep_sample(self.ready, (time.time(), waiting))
            for ahead in range(index, index + self.in_flight):
                if ahead < total:
                    self._submit(split, epoch, ahead)
                elif ahead - total < following:
                    self._submit(then[0], then[1], ahead - total)
            future = self.pending.pop((split, epoch, index))
            output = self._result(future)
            if output.user_error is not None:
                raise UserError(output.user_error)
            self.retained.append(future)
            for batch in output.batches.values():
                if isinstance(batch.data, SharedArray):
                    batch.data = batch.data.take()
            yield index, output
        for ahead in range(min(following, self.in_flight)):  # this split is done: the next one's window
            self._submit(then[0], then[1], ahead)

    def _result(self, future) -> BatchOutput:
        """The batch task's output, waited for by a callback as it is done, not by future.result(timeout=):
        that timeout, racing a worker's death, once raised Dask's own UnboundLocalError in place of the batch
        (sync() leaves its result unset; dask/distributed#8514) and stopped a run a killed worker costs a
        recomputation only."""
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        stall = Stall(self.patience)
        while not done.wait(min(1.0, self.patience.warn_s)):
            stall.check(lambda: self._whereabouts(future.key), self.on_wait)
        return future.result()

    def _whereabouts(self, key: str) -> str:
        """What the batch task `key` waits for, as the scheduler sees it, and the likely fix."""
        state, worker = self.client.run_on_scheduler(  # a lambda pickles by value: no import on the scheduler
            lambda dask_scheduler: (lambda ts: (ts.state, ts.processing_on and ts.processing_on.name) if ts
                                    else ("unknown", None))(dask_scheduler.tasks.get(key)))
        workers = {info.get("name", address): sorted(info.get("resources") or {})
                   for address, info in scheduler_workers(self.client).items()}
        task = f"batch task {key}"
        if state == "processing":
            return f"{task} runs on worker {worker} and has not finished: a stage is stuck (a file read that hangs?)"
        if self.resources is None or state != "no-worker":
            return f"{task} is {state} on the Dask scheduler, with {len(workers)} worker(s): they are all busy or gone"
        resource = node_resource(self.node)
        held = ", ".join(f"{name} {res or '(no resources)'}" for name, res in sorted(workers.items(), key=str))
        return (f"{task} needs a Dask worker with the resource {resource} and none of the {len(workers)} "
                f"worker(s) has it ({held or 'no workers'}); start node {self.node}'s workers (`dask worker "
                f"<scheduler> --resources {resource}=<threads>` or its agent `python -m pipeline.node <scheduler> "
                f"--node {self.node}`) or lower cluster.nodes")

    def _submit(self, split: Split, epoch: int, index: int) -> None:
        if (split, epoch, index) in self.pending:
            return
        name = f"{split.value}-{epoch}-{index}-{self.part}"
        share_as = f"{self.share_prefix}-{name}" if self.share_prefix else None
        self.pending[split, epoch, index] = self.client.submit(
            run_batch, self.run_id, self.seed, self.sequence, split, epoch, index, self.part, self.parts,
            self.on_error, share_as, key=f"batch-{self.run_id}-{name}", pure=False, resources=self.resources)


def worker_count(workers: int | str) -> int:
    return len(os.sched_getaffinity(0)) if workers == "auto" else workers


def in_flight_window(in_flight: int | str, threads: int) -> int:
    """cluster.in_flight for a producer on a node of `threads` worker threads: `auto` is two batch tasks a
    thread, so that each thread finds its next task waiting as it finishes one."""
    return 2 * threads if in_flight == "auto" else in_flight


LOOPBACK = "127.0.0.1"
DASHBOARD = f"{LOOPBACK}:8787"  # cluster.dashboard: Dask's usual port (another is taken when it is in use)


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for Dask's TLS security (cluster.tls.*): the CA that signed every certificate of the
    cluster, and this host's certificate and private key, which clients, workers and the scheduler present."""

    ca_file: str
    cert: str
    key: str

    @staticmethod
    def configured(tls) -> TlsFiles | None:
        """The files cluster.tls names (pipeline.config.check has checked them), or None: no TLS. A relative
        path is read from where the command ran, as dataset.root is (a job may run in its own folder)."""
        return TlsFiles(*map(to_absolute_path, (tls.ca_file, tls.cert, tls.key))) if tls.ca_file else None

    def security(self) -> Security:
        return Security(tls_ca_file=self.ca_file, tls_client_cert=self.cert, tls_client_key=self.key,
                        require_encryption=True)


def connect(address: str, tls: TlsFiles | None, timeout: str = "30s") -> Client:
    """A client of the scheduler at `address`: every client of a run connects here, with TLS when configured."""
    return Client(address, timeout=timeout, security=tls.security() if tls else None)


# glibc's settings for Dask worker processes: keep freed memory for the next batch
# task. A task frees its batch's images (tens of MB) when it ends; with Dask's
# worker environment (MALLOC_TRIM_THRESHOLD_=64 KiB, and a malloc arena of the
# task thread's own, which shrinks whenever it can) the next task faults every
# page in again: 100 page faults and 0.2 CPU-ms per image at 224 px, a fifth of
# the worker's CPU (docs/benchmarks.md). One arena, blocks up to 32 MiB from the
# heap, and up to 128 MiB of it kept free: no faults after the first task.
WORKER_MALLOC = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
                 "MALLOC_TRIM_THRESHOLD_": str(128 << 20)}
# The local cluster's Dask settings (its scheduler and nannies run in this process,
# its workers inherit them). Dask's own wake its event loops 50 times a second to
# time them and 10 times a second to sample memory: 8% of a core with nothing to
# do, 0.05 CPU-ms per image at 224 px; these take 1.6%. The workers' sampling
# profiler would cost CPU for nothing.
CLUSTER_CONFIG = {"distributed.admin.tick.interval": "1s", "distributed.admin.system-monitor.interval": "2s",
                  "distributed.worker.memory.monitor-interval": "500ms", "distributed.worker.profile.enabled": False,
                  **{f"distributed.nanny.pre-spawn-environ.{name}": value for name, value in WORKER_MALLOC.items()}}


WORKERS_START_S = 120  # local workers start in seconds; one that never does is not waited for for ever


@contextmanager
def dask_client(address: str | None, workers: int | str, threads_per_worker: int, nodes: int = 1,
                tls: TlsFiles | None = None, dashboard: bool = False) -> Iterator[Client]:
    """A client of the scheduler at `address` (with TLS, `tls`), or of a LocalCluster
    made here and closed on exit (each Hydra multirun job gets its own). The local
    cluster listens on loopback only, its dashboard off unless `dashboard`. Its
    workers are split evenly into `nodes` simulated nodes: worker w carries the
    resource node-<n> of its node."""
    if address:
        with connect(address, tls, timeout="20s") as client:
            yield client
        return
    count = worker_count(workers)
    if not 1 <= nodes <= count:
        raise UserError(f"cluster.nodes={nodes} needs at least one worker per node, but cluster.workers gives "
                         f"{count}; set cluster.nodes between 1 and {count} or raise cluster.workers")
    with dask.config.set(CLUSTER_CONFIG), \
            LocalCluster(n_workers=0, threads_per_worker=threads_per_worker, processes=True, host=LOOPBACK,
                         dashboard_address=DASHBOARD if dashboard else None, silence_logs=logging.ERROR,
                         # without the dashboard the scheduler still serves HTTP (health, metrics), on 8787 unless
                         # told otherwise, and warns on stderr when another cluster holds it: any free port
                         scheduler_kwargs=None if dashboard else {"dashboard_address": f"{LOOPBACK}:0"}) as cluster, \
            Client(cluster) as client:
        client.register_plugin(LeaveTheStopToTheDriver())
        for w in range(count):
            node = w * nodes // count
            spec = copy.deepcopy(cluster.new_spec)
            spec["options"]["resources"] = {node_resource(node): threads_per_worker}
            cluster.worker_spec[f"n{node}-w{w}"] = spec
        cluster.scale(count)
        _wait_for_local_workers(cluster, client, count)
        yield client


def _wait_for_local_workers(cluster: LocalCluster, client: Client, count: int) -> None:
    """Until the `count` local workers have started. A worker whose process ends as it starts (Dask logs its
    error) fails the run at once; one that never starts, after WORKERS_START_S."""
    deadline = time.monotonic() + WORKERS_START_S
    unguarded = ("Called from a script of your own? Put the call under `if __name__ == \"__main__\":` (the "
                 "workers are new processes that import the script), or give a running scheduler as "
                 "cluster.address")
    while True:
        try:
            client.wait_for_workers(count, timeout=0.5)
            return
        except TimeoutError:
            pass
        failed = sorted(name for name, nanny in list(cluster.workers.items()) if nanny.status == Status.failed)
        if failed:  # an unguarded script: each worker runs it again, and its own cluster's workers fail
            raise UserError(f"local Dask worker {failed[0]} failed to start: its process ended as it began (Dask "
                            f"logs why above). {unguarded}")
        if time.monotonic() > deadline:
            raise UserError(f"the {count} local Dask worker(s) did not start in {WORKERS_START_S:g} s. {unguarded}")


def dask_performance_report(client: Client, path: Path, console: Console):
    """Dask's performance report of what runs inside (inline: opens offline), or
    nothing, said once, when the scheduler cannot draw it (a remote one without bokeh)."""
    if not client.run_on_scheduler(lambda: importlib.util.find_spec("bokeh") is not None):
        console.print(f"[yellow]note[/] no {path.name}: install bokeh (pip install 'bokeh>=3.1') where the Dask "
                      "scheduler runs for Dask's performance report")
        return nullcontext()
    return performance_report(filename=str(path), mode="inline")


def node_threads(client: Client, nodes: int) -> dict[int, int]:
    """Worker threads of each node; every node must have some."""
    threads = {node: 0 for node in range(nodes)}
    for info in scheduler_workers(client).values():
        for node in range(nodes):
            if node_resource(node) in (info.get("resources") or {}):
                threads[node] += info["nthreads"]
    empty = [node for node, count in threads.items() if not count]
    if empty:
        raise UserError(f"cluster.nodes={nodes} but no Dask worker carries the resource "
                         f"{node_resource(empty[0])}; start each node's workers with "
                         f"`dask worker <scheduler> --resources {node_resource(empty[0])}=<threads>`")
    return threads
