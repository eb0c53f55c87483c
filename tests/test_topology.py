"""Topologies: the plans of the scheduler's streams, the collective exchange, and the
delivery invariants of every topology in real runs on two simulated nodes
(own Dask workers and trainers each, gloo over loopback)."""
import functools
import multiprocessing as mp
import os
import signal
import threading
import time
import zlib

import numpy as np
import pytest
from omegaconf import OmegaConf

from pipeline.data.graph import build_graph
from pipeline.delivery.plan import plan_delivery
from pipeline.measure.recorder import RunRecorder
from pipeline.scheduler.topology import TOPOLOGIES, split_streams
from stages.base import BatchContext, Split
from tests.conftest import compose_config, resnet_override

# A on node 0; B on 2 slots, so on node 1 (a model's slots share a node); C on node 0.
PLACEMENT = {"A": (0,), "B": (1, 1), "C": (0,)}


def test_single_broadcast_has_one_producer_where_most_trainers_are():
    plan = plan_delivery("single_broadcast", {"A": (0,), "B": (1, 1)}, (("A", "B"),))
    (stream,) = plan.streams
    assert not stream.gather and plan.hubs[stream.hubs[0]].node == 1 and plan.hubs[stream.hubs[0]].part == 0
    assert [h.part for h in plan.hubs] == [0, None]


def test_all_shared_makes_every_hub_a_share():
    plan = plan_delivery("all_shared", PLACEMENT, (("A", "B", "C"),))
    (stream,) = plan.streams
    assert stream.gather and stream.parts == 2 and sorted(h.part for h in plan.hubs) == [0, 1]


def test_multi_broadcast_gives_each_of_the_schedulers_streams_its_hubs():
    streams = split_streams("multi_broadcast", list(PLACEMENT), {"A": 100, "B": 10, "C": 90}, 2)
    plan = plan_delivery("multi_broadcast", PLACEMENT, streams)
    assert [s.members for s in plan.streams] == [("A", "C"), ("B",)]
    assert [len(s.hubs) for s in plan.streams] == [1, 1]
    spanning = plan_delivery("multi_broadcast", PLACEMENT, split_streams("multi_broadcast", list(PLACEMENT), {}, 2))
    assert [s.members for s in spanning.streams] == [("A", "B"), ("C",)]  # no rates: plan order
    assert {spanning.hubs[r].node for r in spanning.streams[0].hubs} == {0, 1}
    assert plan.hub_of("C", 0).stream == 0 and spanning.hub_of("C", 0).stream == 1


def test_duplicated_gives_every_member_its_own_pipeline():
    plan = plan_delivery("duplicated", PLACEMENT, split_streams("duplicated", list(PLACEMENT), {}, 2))
    assert [s.members for s in plan.streams] == [("A",), ("B",), ("C",)]
    assert all(h.part == 0 for h in plan.hubs)
    with pytest.raises(ValueError, match="the scheduler resolves topology=auto"):
        plan_delivery("auto", PLACEMENT, (("A", "B", "C"),))


def test_shares_assemble_into_the_batch_one_task_makes(tiny_dataset):
    stages = {"read": {"_target_": "stages.read.ImageFolder", "root": str(tiny_dataset), "batch_size": 10},
              "decode": {"_target_": "stages.decode.Decode", "inputs": ["read"]},
              "crop": {"_target_": "stages.augment.RandomResizedCropFlip", "inputs": ["decode"], "size": 24},
              "out": {"_target_": "stages.broadcast.Broadcast", "inputs": ["crop"]}}
    graph = build_graph(stages, {"out"})
    whole = graph.run(BatchContext(seed=4, split=Split.TRAIN, epoch=1, index=2)).batches["out"]
    shares = [graph.run(BatchContext(seed=4, split=Split.TRAIN, epoch=1, index=2, part=p, parts=3)).batches["out"]
              for p in range(3)]
    assert [len(s.labels) for s in shares] == [4, 4, 2]
    assert np.array_equal(np.concatenate([s.data for s in shares]), whole.data)
    assert np.array_equal(np.concatenate([s.labels for s in shares]), whole.labels)


def _exchange(rank, world, address, results):
    import torch.distributed as dist

    from pipeline.delivery.collective import StreamLink, init_process_group

    init_process_group(address, rank, world, "cpu", 60.0, "the test's hubs")
    group = dist.new_group([0, 1, 2])
    shapes = {"a": (4, 4, 3), "b": (2, 2, 3)}
    rng = np.random.default_rng(7)
    batch = {s: (rng.integers(0, 256, (5, *shape), dtype=np.uint8), np.arange(5) + 10 * i)
             for i, (s, shape) in enumerate(sorted(shapes.items()))}
    cast = StreamLink(group, (0, 1, 2), shapes, batch_size=5, gather=False, device="cpu", timeout_s=60)
    got = cast.broadcast(rank, 3, batch if rank == 0 else None)
    gather = StreamLink(group, (0, 1, 2), shapes, batch_size=5, gather=True, device="cpu", timeout_s=60)
    share = {s: (images[rank * 2:rank * 2 + 2], labels[rank * 2:rank * 2 + 2]) for s, (images, labels) in batch.items()}
    gathered = gather.all_gather(rank, 3, share)
    results.put((rank, all(np.array_equal(got[s][0], batch[s][0]) and np.array_equal(got[s][1], batch[s][1])
                           and np.array_equal(gathered[s][0], batch[s][0])
                           and np.array_equal(gathered[s][1], batch[s][1]) for s in batch)))
    dist.destroy_process_group()


def test_broadcast_and_all_gather_give_every_hub_the_whole_batch():
    context = mp.get_context("spawn")
    results = context.Queue()
    from pipeline.delivery.collective import LocalRendezvous

    rendezvous = LocalRendezvous()
    address = rendezvous.next()  # the three ranks' one group
    processes = [context.Process(target=_exchange, args=(rank, 3, address, results)) for rank in range(3)]
    try:
        for process in processes:
            process.start()
        outcome = dict(results.get(timeout=120) for _ in processes)
        for process in processes:
            process.join(30)
    finally:
        rendezvous.close()
    assert outcome == {0: True, 1: True, 2: True}


# --- the invariants in real runs ---------------------------------------------------------------

MODELS = f"[{resnet_override('A')}, {resnet_override('B', 'alt', slots=2)}, {resnet_override('C')}]"
VICTIM = "C"
# Batch tasks sleep a little: consume-only epochs would otherwise end before the faults land.
PACED = ["+pipeline.stages.pace={_target_: tests.slow_stage.SlowDown, inputs: [cache], seconds: 0.15}",
         "pipeline.stages.crop_main.inputs=[pace]", "pipeline.stages.crop_alt.inputs=[pace]"]


PAUSE_S = 4.0  # every trainer stopped (SIGSTOP) this long: the slowest consumers there are


def _pause_trainers(paused: list[float], stopped: list[int]) -> None:
    """Stop every trainer (SIGSTOP): `stopped` gets their pids, `paused` the time (time.time(), the clock of
    the run's timeline)."""
    stopped += [p.pid for p in mp.active_children() if p.name.startswith("trainer-")]
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    paused.append(time.time())


def _resume_then_kill_a_worker_then_a_trainer(pausing: threading.Event, delivered: threading.Event,
                                              reported: threading.Event, paused: list[float], stopped: list[int]):
    """Once the trainers are stopped: PAUSE_S later let them go on (producers must have waited, not piled
    batches up); then, once epoch 2's training batches are delivered (a worker killed earlier takes the
    batches made in the pause with it: made again, they would not count) and the driver has C's first
    epoch (reported after its checkpoint), SIGKILL a Dask worker (mid-split), then C's trainer."""
    assert pausing.wait(timeout=600)
    time.sleep(PAUSE_S)
    paused.append(time.time())
    for pid in stopped:
        os.kill(pid, signal.SIGCONT)
    assert delivered.wait(timeout=600) and reported.wait(timeout=600)
    workers = [p for p in mp.active_children() if "Dask Worker" in p.name]
    os.kill(workers[-1].pid, signal.SIGKILL)
    for process in mp.active_children():
        if process.name == f"trainer-{VICTIM}-0":
            os.kill(process.pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_every_topology_delivers_every_batch_once_in_order_bit_identical_through_faults(topology, tiny_dataset,
                                                                                         tmp_path, monkeypatch):
    """Every topology through a Dask worker killed mid-epoch and a trainer killed and resumed: every trainer
    receives every batch of an epoch once, in order, bit-identical to the graph's own output, and memory
    stays bounded while no trainer takes a batch. A lost or repeated batch, another order, other bytes, or
    a producer whose window is unbounded (it makes most of a split's batches while the trainers pause),
    fails."""
    from pipeline.orchestration.flotilla import Flotilla
    from pipeline.run import run
    from pipeline.training.reports import CheckpointSaved

    out = tmp_path / "out"
    cfg = compose_config(["+ensemble=caltech256", f"ensemble.models={MODELS}", f"topology={topology}",
                          f"dataset.root={tiny_dataset}", "dataset.synthetic=never", "pipeline.batch_size=4",
                          "pipeline.image_size=32", "pipeline.alt_image_size=24", "cluster.workers=2",
                          "cluster.nodes=2", "trainer.slots=4", "trainer.epochs=3", "trainer.consume_only=true",
                          "trainer.record_checksums=true", *PACED])
    rings = lambda: {name for name in os.listdir("/dev/shm") if name.startswith(f"ensemble-{os.getpid()}-")}
    before = rings()
    pausing, delivered, reported = threading.Event(), threading.Event(), threading.Event()
    poll, run_split = Flotilla.poll, Flotilla.run_split

    def poll_and_tell(self, timeout=None):  # the event the faults wait for: C's first epoch is checkpointed
        reports = poll(self, timeout)
        if any(isinstance(r, CheckpointSaved) and r.model == VICTIM and r.epochs == 1 for r in reports):
            reported.set()
        return reports

    monkeypatch.setattr(Flotilla, "poll", poll_and_tell)

    paused, stopped = [], []

    def run_split_and_tell(self, split, epoch):  # the pause starts as the hubs are told to deliver epoch 2
        if epoch == 1 and self.id == 0:
            if split is Split.TRAIN:
                _pause_trainers(paused, stopped)
                pausing.set()
            else:  # its training batches are delivered
                delivered.set()
        run_split(self, split, epoch)

    monkeypatch.setattr(Flotilla, "run_split", run_split_and_tell)
    origins, make_recorder = [], RunRecorder.__init__  # where the run's timeline starts

    def recorder_and_origin(self, models, *args):
        make_recorder(self, models, *args)
        if models:  # the run's own (a rate probe's records no model)
            origins.append(self.origin)

    monkeypatch.setattr(RunRecorder, "__init__", recorder_and_origin)
    killer = threading.Thread(target=_resume_then_kill_a_worker_then_a_trainer,
                              args=(pausing, delivered, reported, paused, stopped), daemon=True)
    killer.start()
    results = run(cfg, out)
    killer.join(timeout=5)

    # The faults were survived: C failed once, resumed from its checkpoint, finished.
    models = {m["name"]: m for m in results["models"]}
    assert len(models[VICTIM]["failures"]) == 1 and "was killed (SIGKILL)" in models[VICTIM]["failures"][0]
    first, again = models[VICTIM]["flotillas"]
    assert first["start_epoch"] == 0 and again["start_epoch"] >= 1  # consume-only epochs are quick: 1 or 2
    assert all(m["epochs"] == 3 for m in models.values())
    flotillas = results["delivery"]["flotillas"]
    assert all(info["topology"] == topology for info in flotillas.values())
    assert max(len(info["hubs"]) for info in flotillas.values()) >= (1 if topology == "duplicated" else 2)

    # Back-pressure: from the moment no trainer takes a batch, each producer starts at most what fits in
    # its rings, its tasks in flight and the batch in its hands. The pause starts as the hubs are told to
    # deliver epoch 2: a producer whose window is unbounded (all of a split's tasks submitted at once) makes
    # most of the split's 14 batches of 4 meanwhile, and fails.
    (origin,) = origins
    paused_from, paused_to = (t - origin for t in paused)
    made = [span for span in results["timeline"] if span["what"] == "task"
            and paused_from < span["start_s"] < paused_to]
    bound = sum(max(hub["ring_depth"].values()) + hub["in_flight"] + 1 for hub in flotillas["0"]["hubs"].values()
                if hub["part"] is not None)  # the pause falls in the first flotilla (C is killed after it)
    assert len(made) <= bound, (len(made), bound)

    received = results["delivery"]["received"]
    # A, B's two ranks, C (its killed trainer never reports; the resumed one does); the message names who
    # reported, and the flotillas' decisions, should one be missing (seen once in CI while a trainer's clean
    # exit counted as a failure, which could end the wait before its report was read)
    assert len(received) == 4, (sorted(received), results["scheduler"]["decisions"])
    assert_every_batch_once_in_order_bit_identical(cfg, results)
    assert {len({m[2] for m in msgs if m[0] == 0}) for t, msgs in received.items() if f"/{VICTIM}/" in t} \
        == {3 - again["start_epoch"]}

    # Clean shutdown: no shared memory, no process left.
    assert rings() <= before
    assert not [p for p in mp.active_children() if p.name.startswith(("hub-", "trainer-"))]


def assert_every_batch_once_in_order_bit_identical(cfg, results):
    """Every trainer that finished got every batch of every epoch it trained once, in order, and
    bit-identical to what one task makes in this process without the cache (whatever the topology,
    shares or faults; the run's epochs after the first come from its cache), with the test's pacing
    stage kept in the graph but not sleeping."""
    models = {m["name"]: m for m in results["models"]}
    stages = OmegaConf.to_container(cfg.pipeline.stages, resolve=True)
    stages["cache"]["budget_gb"] = 0
    for stage in stages.values():
        if stage["_target_"] == "tests.slow_stage.SlowDown":
            stage["seconds"] = 0
    graph = build_graph(stages, {"main", "alt"})
    batches = {0: graph.source.num_batches(Split.TRAIN), 1: graph.source.num_batches(Split.VAL)}

    @functools.cache
    def reference_crcs(sequence, split_id, epoch, index) -> dict[str, int]:
        out = graph.run(BatchContext(seed=cfg.seed, split=list(Split)[split_id], epoch=epoch, index=index,
                                     sequence=sequence))
        return {sink: zlib.crc32(batch.labels.tobytes(), zlib.crc32(np.ascontiguousarray(batch.data).tobytes()))
                for sink, batch in out.batches.items()}

    for trainer, messages in results["delivery"]["received"].items():
        flotilla, name, _, sink = trainer.split("/")
        assert sink == models[name]["input"]
        expected, epochs = [], sorted({m[2] for m in messages if m[0] == 0})
        for epoch in epochs:
            for split_id in (0, 1):
                expected += [(0, split_id, epoch, i, reference_crcs(int(flotilla), split_id, epoch, i)[sink])
                             for i in range(batches[split_id])]
                expected.append((1, split_id, epoch, 0, zlib.crc32(b"", zlib.crc32(b""))))
        assert [tuple(m) for m in messages[:-1]] == expected, trainer
        assert messages[-1][0] == 2  # STOP
