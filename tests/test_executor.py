"""Batch tasks on Dask: deterministic whatever the worker count, bounded in
flight, and a worker killed mid-epoch costs a recomputation, never a batch."""
import os
import re
import signal
import zlib

import dask
import pytest

from pipeline.data.executor import Executor, dask_client, node_workers, scheduler_workers
from pipeline.data.graph import build_graph
from stages.base import Split

pytestmark = pytest.mark.slow


def stages(root, slow=0.0):
    graph = {
        "read": {"_target_": "stages.read.ImageFolder", "root": str(root), "batch_size": 4, "val_per_class": 0.25},
        "decode": {"_target_": "stages.decode.Decode", "inputs": ["read"]},
        "crop": {"_target_": "stages.augment.RandomResizedCropFlip", "inputs": ["slow" if slow else "decode"],
                 "size": 32},
        "out": {"_target_": "stages.broadcast.Broadcast", "inputs": ["crop"]},
    }
    if slow:
        graph["slow"] = {"_target_": "tests.slow_stage.SlowDown", "inputs": ["decode"], "seconds": slow}
    return graph


def checksum(index, output):
    return index, zlib.crc32(output.batches["out"].data.tobytes()), output.batches["out"].labels.tolist()


def epoch_checksums(client, graph, seed, in_flight):
    with Executor(client, graph, seed=seed, on_error="skip", in_flight=in_flight) as executor:
        return [checksum(i, out) for i, out in executor.batches(Split.TRAIN, 0)]


def leftovers():
    """Hand-off files of this process's runs."""
    return {name for name in os.listdir("/dev/shm") if name.startswith(f"ensemble-out-{os.getpid()}-")}


def test_same_seed_same_batches_whatever_the_worker_count(tiny_dataset):
    graph = build_graph(stages(tiny_dataset), {"out"})
    runs = []
    for workers in (1, 2):
        with dask_client(None, workers, 1) as client:
            runs.append(epoch_checksums(client, graph, seed=5, in_flight=3))
    assert runs[0] == runs[1]
    assert [i for i, _, _ in runs[0]] == list(range(graph.source.num_batches(Split.TRAIN)))


def test_in_flight_tasks_are_bounded(tiny_dataset):
    graph = build_graph(stages(tiny_dataset), {"out"})
    with dask_client(None, 2, 1) as client:
        submitted = []
        real_submit = client.submit
        client.submit = lambda *a, **k: submitted.append(k["key"]) or real_submit(*a, **k)
        with Executor(client, graph, seed=0, on_error="skip", in_flight=2) as executor:
            ahead = [len(submitted) - index for index, _ in executor.batches(Split.TRAIN, 0)]
        client.submit = real_submit
    assert max(ahead) == 2


def _faults_of_a_batch_sized_allocation() -> int:
    """Minor page faults of filling a fresh 16 MB array, as a batch task fills its images."""
    import resource

    import numpy as np

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    np.ones(16 << 20, np.uint8)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_batch_tasks_reuse_the_memory_of_the_tasks_before():
    # Under Dask's own worker environment every task faulted its pages in again (about 520 here).
    with dask_client(None, 1, 1) as client:
        faults = [client.submit(_faults_of_a_batch_sized_allocation, pure=False).result() for _ in range(4)]
    assert max(faults[1:]) < 100, faults


def _log_filters_bound_to_this_worker() -> list[str]:
    import logging

    from dask.distributed import get_worker

    return [type(f).__name__ for f in logging.getLogger("distributed.worker").filters
            if getattr(f, "worker", None) is get_worker()]


def test_a_local_worker_drops_the_heartbeat_its_own_close_cut_off_and_no_other():
    """A local worker's close cuts the heartbeat in flight, and distributed logs that as an error with a
    traceback (seen in test_lifetime's stop, dask/distributed#7105). Mistakes caught: the filter not
    installed in the workers; the record dropped while the worker runs (a scheduler really lost)."""
    import logging
    from types import SimpleNamespace

    from distributed.core import Status

    from pipeline.data.executor import HeartbeatCutByClose

    with dask_client(None, 1, 1) as client:
        assert client.submit(_log_filters_bound_to_this_worker, pure=False).result() == ["HeartbeatCutByClose"]
    record = logging.LogRecord("distributed.worker", logging.ERROR, __file__, 0,
                               "Failed to communicate with scheduler during heartbeat.", (), None)
    other = logging.LogRecord("distributed.worker", logging.ERROR, __file__, 0, "Compute Failed", (), None)
    kept = {status.name: HeartbeatCutByClose(SimpleNamespace(status=status)).filter(record)
            for status in (Status.running, Status.closing, Status.closing_gracefully, Status.closed)}
    assert kept == {"running": True, "closing": False, "closing_gracefully": False, "closed": False}, kept
    assert HeartbeatCutByClose(SimpleNamespace(status=Status.closing)).filter(other)


def test_prefetch_queue_fills_when_the_consumer_is_slow_and_empties_when_it_is_fast(tiny_dataset):
    """A capacity that is not the fill the queue reaches (the report's full and mean % divide by it) fails."""
    from dask.distributed import wait

    graph = build_graph(stages(tiny_dataset, slow=0.1), {"out"})
    with dask_client(None, 1, 1) as client, Executor(client, graph, 0, "skip", in_flight=3) as executor:
        for _ in executor.batches(Split.TRAIN, 0):
            wait(list(executor.pending.values()))  # a slow trainer: back once the batches in flight are made
        slow = [held for _, held in executor.ready]
        executor.ready.clear()
        list(executor.batches(Split.TRAIN, 1))  # a fast one: it comes back while the worker makes the next
        fast = [held for _, held in executor.ready]
    total = graph.source.num_batches(Split.TRAIN)
    assert len(slow) == len(fast) == total  # a sample per take
    # Full from the second take on (nothing is submitted before the first), up to what the split has left:
    # of the 3 in flight, one is the consumer's.
    assert slow[1:] == [min(2, total - index) for index in range(1, total)]
    assert executor.prefetch_capacity == max(slow)
    assert sorted(fast)[len(fast) // 2] <= 1, fast  # a take or two stalled on busy cores may find both ready


def test_killed_worker_costs_a_recomputation_not_a_batch(tiny_dataset):
    graph = build_graph(stages(tiny_dataset, slow=0.4), {"out"})
    with dask_client(None, 1, 1) as client:
        expected = epoch_checksums(client, graph, seed=1, in_flight=4)
    before = leftovers()
    with dask_client(None, 2, 1) as client, Executor(client, graph, seed=1, on_error="skip", in_flight=4) as executor:
        pids = client.run(os.getpid)
        received, killed = [], None
        for index, out in executor.batches(Split.TRAIN, 0):
            received.append(checksum(index, out))
            if killed is None:
                busy = [addr for addr, keys in client.processing().items() if keys]
                killed = busy[0]
                os.kill(pids[killed], signal.SIGKILL)
    assert killed is not None
    assert received == expected
    assert leftovers() <= before  # hand-off files of the killed worker's tasks are gone too


def test_runs_on_an_existing_scheduler_given_its_address(tiny_dataset, tmp_path):
    """cluster.address: the `dask scheduler` / `dask worker` a user started."""
    import json
    import subprocess
    import sys
    import time

    scheduler_file = tmp_path / "scheduler.json"
    dask = [sys.executable, "-m", "distributed.cli.dask_scheduler"]
    processes = [subprocess.Popen(dask + ["--scheduler-file", str(scheduler_file), "--port", "0",
                                          "--dashboard-address", ":0", "--no-dashboard"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        deadline = time.monotonic() + 60
        while not scheduler_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        worker = [sys.executable, "-m", "distributed.cli.dask_worker", "--scheduler-file", str(scheduler_file),
                  "--nthreads", "1", "--no-dashboard"]
        processes.append(subprocess.Popen(worker, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        address = json.loads(scheduler_file.read_text())["address"]
        graph = build_graph(stages(tiny_dataset), {"out"})
        with dask_client(address, "auto", 1) as client:
            client.wait_for_workers(1, timeout=60)
            remote = epoch_checksums(client, graph, seed=2, in_flight=2)
        with dask_client(None, 1, 1) as client:
            local = epoch_checksums(client, graph, seed=2, in_flight=2)
        assert remote == local
    finally:
        for process in processes:
            process.terminate()
            process.wait(30)


def test_executors_sharing_keys_make_each_batch_once(tiny_dataset):
    """multi_broadcast's producers: same keys and graph, one task per batch between them."""
    graph = build_graph(stages(tiny_dataset), {"out"})
    with dask_client(None, 2, 1) as client, \
            Executor(client, graph, 0, "skip", 2, shared_keys="k", retain=16) as first, \
            Executor(client, graph, 0, "skip", 2, shared_keys="k", retain=16) as second:
        ahead = list(first.batches(Split.TRAIN, 0))  # the second lags a whole epoch (12 batches) behind
        behind = list(second.batches(Split.TRAIN, 0))
    assert [checksum(i, out) for i, out in ahead] == [checksum(i, out) for i, out in behind]
    assert [(out.worker, out.started) for _, out in ahead] == [(out.worker, out.started) for _, out in behind]


def test_the_next_split_is_submitted_while_this_one_drains(tiny_dataset):
    graph = build_graph(stages(tiny_dataset), {"out"})
    with dask_client(None, 1, 1) as client, Executor(client, graph, 3, "skip", 2) as executor:
        list(executor.batches(Split.TRAIN, 0, then=(Split.VAL, 0)))
        assert set(executor.pending) == {(Split.VAL, 0, 0), (Split.VAL, 0, 1)}  # in_flight of them, ready
        prefetched = [checksum(i, out) for i, out in executor.batches(Split.VAL, 0)]
    with dask_client(None, 1, 1) as client, Executor(client, graph, 3, "skip", 2) as executor:
        assert prefetched == [checksum(i, out) for i, out in executor.batches(Split.VAL, 0)]


def test_a_batch_task_no_worker_can_run_says_what_it_waits_for_then_fails(tiny_dataset):
    """Batch tasks for node 1 on a cluster whose only worker holds node-0: Dask leaves them 'no-worker'
    for ever. The wait says so once (the key, the resource, the workers there are), then fails naming
    timeouts.stall_s and the fix. A task that runs too long is named with its worker."""
    from pipeline.runtime.hang import HangError, Patience

    patience = Patience(warn_s=0.5, stall_s=2)
    said = []
    with dask_client(None, 1, 1) as client:
        with Executor(client, build_graph(stages(tiny_dataset), {"out"}), 0, "skip", 2, node=1,
                      patience=patience, on_wait=said.append, drain_s=0.1) as executor, \
                pytest.raises(HangError) as hang:
            next(executor.batches(Split.TRAIN, 0))
        assert len(said) == 1 and said[0].startswith("waiting ")
        for message in (said[0], str(hang.value)):
            assert re.search(r"batch task batch-\w+-train-0-0-0 needs a Dask worker with the resource node-1 and "
                             r"none of the 1 worker\(s\) has it \(n0-w0 \['node-0'\]\); start node 1's workers",
                             message)
        assert "timeouts.stall_s=2" in str(hang.value)
        with Executor(client, build_graph(stages(tiny_dataset, slow=30), {"out"}), 0, "skip", 1, node=0,
                      patience=patience, on_wait=said.append, drain_s=0.1) as executor, \
                pytest.raises(HangError, match=r"batch-\w+-train-0-0-0 runs on worker n0-w0 and has not finished: "
                                               r"a stage is stuck .*timeouts.stall_s=2"):
            next(executor.batches(Split.TRAIN, 0))


def test_a_nodes_executor_puts_its_graph_on_that_nodes_workers_only(tiny_dataset):
    """Two nodes, a worker each. An executor of node 0 sets its graph up on node 0's worker and no other
    (so that it never waits on another host's workers: one cut off and not yet removed would hold it up
    for Dask's connect timeout, then fail it), the scheduler keeps it for node 0's workers that join later,
    and it is gone everywhere once the executor is. (The mistake this catches: Dask's broadcast of the
    plugin to every worker, or a plugin that sets itself up on any node.) Node 0's workers are found on every
    asking, however often the client refreshes its cached copy of the scheduler's state: read from that copy,
    an asking raced the refresh and found no worker, so the graph went nowhere and the batch task failed."""
    graph = build_graph(stages(tiny_dataset), {"out"})
    held = lambda: sorted(__import__("pipeline.data.executor", fromlist=["_GRAPHS"])._GRAPHS)  # runs on a worker
    plugins = lambda dask_scheduler: sorted(dask_scheduler.worker_plugins)
    with dask.config.set({"distributed.client.scheduler-info-interval": "2ms"}), \
            dask_client(None, 2, 1, nodes=2) as client:
        by_name = {info["name"]: address for address, info in scheduler_workers(client).items()}
        assert all(node_workers(client, 0) == [by_name["n0-w0"]] for _ in range(500))
        with Executor(client, graph, 0, "skip", 2, node=0) as executor:
            list(executor.batches(Split.TRAIN, 0))
            on_workers = client.run(held)
            assert on_workers[by_name["n0-w0"]] == [executor.run_id] and on_workers[by_name["n1-w1"]] == []
            assert executor.plugin in client.run_on_scheduler(plugins)
        assert all(ids == [] for ids in client.run(held).values())
        assert executor.plugin not in client.run_on_scheduler(plugins)
