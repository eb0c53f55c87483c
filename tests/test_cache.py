"""The decoded-image cache: exact, within its budget, shared by a node's workers, and safe when a
worker dies."""
import multiprocessing as mp
import os
import shutil
import signal
import zlib

import numpy as np
import pytest
from omegaconf import OmegaConf

from pipeline.data.dataset import DatasetError
from pipeline.data.executor import Executor, cache_kept, dask_client
from pipeline.data.graph import build_graph
from pipeline.runtime.lifetime import remove_shm
from stages.base import BatchContext, Split
from stages.cache import SHM_DIR, Store, stored_bytes
from tests.conftest import compose_config


def default_graph(root, budget_gb, *extra):
    cfg = compose_config(["+ensemble=caltech256", f"dataset.root={root}", f"pipeline.cache_gb={budget_gb}",
                          "pipeline.batch_size=8", "pipeline.image_size=32", "pipeline.alt_image_size=24", *extra])
    return build_graph(OmegaConf.to_container(cfg.pipeline.stages, resolve=True), {"main", "alt"})


def store_files(graph):
    """The cache's image files (not its ledger) and the bytes they hold."""
    names = [name for name in os.listdir(SHM_DIR) if name.startswith(tuple(graph.cache.prefixes()))]
    images = [name for name in names if not name.endswith("-ledger")]
    return set(images), sum(os.stat(os.path.join(SHM_DIR, name)).st_blocks * 512 for name in images)


def epochs(graph, count, dataset_split=(Split.TRAIN, Split.VAL)):
    """Every batch of `count` epochs made in this process: (epoch, split, index) -> what the
    sinks got, and the cache's and the stages' counts."""
    made = {}
    for epoch in range(count):
        for split in dataset_split:
            for index in range(graph.source.num_batches(split)):
                out = graph.run(BatchContext(seed=5, split=split, epoch=epoch, index=index))
                made[epoch, split, index] = {
                    "streams": {name: (zlib.crc32(batch.data.tobytes()), batch.labels.tolist(), batch.paths)
                                for name, batch in out.batches.items()},
                    "skipped": out.skipped, "hits": out.cache_hits, "lookups": out.cache_lookups,
                    "read": out.timings["read"].items, "decoded": out.timings["decode"].items}
    return made


def per_epoch(made, key):
    return [sum(v[key] for (epoch, *_), v in made.items() if epoch == e) for e in sorted({k[0] for k in made})]


def test_cached_batches_are_the_uncached_ones_and_later_epochs_read_and_decode_only_bad_files(bad_dataset,
                                                                                              remove_stores):
    root, bad = bad_dataset
    uncached = epochs(default_graph(root, 0), 3)
    graph = default_graph(root, 1)
    remove_stores(graph)
    cached = epochs(graph, 3)
    assert {k: v["streams"] for k, v in cached.items()} == {k: v["streams"] for k, v in uncached.items()}
    assert {k: v["skipped"] for k, v in cached.items()} == {k: v["skipped"] for k, v in uncached.items()}
    files = len(graph.source.files[Split.TRAIN]) + len(graph.source.files[Split.VAL])
    unusable = 4  # corrupt, truncated, empty, not an image: never cached, rejected every epoch as before
    assert per_epoch(cached, "lookups") == [files] * 3
    assert per_epoch(cached, "hits") == [0, files - unusable, files - unusable]
    assert per_epoch(cached, "read") == [files, unusable, unusable]
    assert per_epoch(cached, "decoded") == [files - unusable, 0, 0]
    assert per_epoch(uncached, "decoded") == [files - unusable] * 3 and per_epoch(uncached, "hits") == [0] * 3
    assert len(store_files(graph)[0]) == files - unusable


def graph_without_cache(root):
    """The default graph with no cache stage: its crops take the decoded images."""
    cfg = compose_config(["+ensemble=caltech256", f"dataset.root={root}"])
    stages = OmegaConf.to_container(cfg.pipeline.stages, resolve=True)
    del stages["cache"]
    for name in ("crop_main", "crop_alt"):
        stages[name]["inputs"] = ["decode"]
    return build_graph(stages, {"main", "alt"})


@pytest.mark.parametrize("graph_of", [lambda root: default_graph(root, 1), lambda root: default_graph(root, 0),
                                      graph_without_cache], ids=["cache", "cache off", "no cache stage"])
def test_a_dataset_none_of_whose_sampled_files_can_be_used_stops_before_the_run_saying_why(tiny_dataset, tmp_path,
                                                                                          graph_of):
    """The files sampled before the run (the cache's size estimate; with the cache off, or no cache stage,
    through to a sink): where none can be used, e.g. iPhone photos in HEIC, which Pillow does not read, the
    run would skip every file and train on nothing (it did, exit 0, accuracy nan): a DatasetError says why
    before anything starts. One usable file is enough to go on: the run lists the others as it skips them."""
    from pipeline.run import _usable_sample

    root = tmp_path / "phone"
    for name in ("001.cats", "002.dogs"):
        (root / name).mkdir(parents=True)
        for i in range(10):
            (root / name / f"IMG_{i:04}.HEIC").write_bytes(b"\x00\x00\x00\x18ftypheic" + bytes(64))
        (root / name / "IMG_0010.HEIC").write_bytes(b"")
    file = rf"{root}/00\d.\w+/IMG_00\d\d.HEIC: (not an image \(unrecognised format\)|empty file)"
    with pytest.raises(DatasetError, match=rf"^dataset.root {root}: none of the 22 files sampled across it can be "
                                           rf"used \({file}; {file}; {file}; \.\.\.\), so the run would skip every "
                                           r"file and train on nothing: give it files it can read \(images Pillow "
                                           r"decodes: JPEG, PNG"):
        _usable_sample(graph_of(root))
    shutil.copy(next(tiny_dataset.rglob("*.jpg")), root / "002.dogs" / "IMG_0011.jpg")
    assert len(_usable_sample(graph_of(root)).labels) == 1


def test_a_budget_smaller_than_the_dataset_holds_what_fits_and_keeps_it(tiny_dataset, remove_stores):
    graph = default_graph(tiny_dataset, 0)
    per_item = graph.cached_bytes_per_item(graph.sample(64)[0])
    files = 64
    budget_gb = 0.4 * per_item * files / 1024**3
    graph = default_graph(tiny_dataset, budget_gb)
    remove_stores(graph)
    first = epochs(graph, 1)
    held, taken = store_files(graph)
    assert 0 < len(held) < files and taken <= graph.cache.budget_bytes
    later = epochs(graph, 3)
    assert store_files(graph)[0] == held  # kept, nothing evicted or replaced
    assert per_epoch(later, "hits")[1:] == [len(held)] * 2
    assert {k: v["streams"] for k, v in later.items() if k[0] == 0} == {k: v["streams"] for k, v in first.items()}
    uncached = epochs(default_graph(tiny_dataset, 0), 3)
    assert {k: v["streams"] for k, v in later.items()} == {k: v["streams"] for k, v in uncached.items()}


def _put_all(name, budget, seed, go):
    """In a process of its own: store 40 images (the same ones as its twin) as fast as it can."""
    store = Store(name, budget)
    go.wait()
    rng = np.random.default_rng(seed)
    for key in rng.permutation(40):
        store.put(f"image-{key}", np.full((60, 50 + int(key), 3), key, dtype=np.uint8))


def test_workers_storing_at_once_keep_one_copy_each_within_the_budget(remove_stores):
    name = f"ensemble-{os.getpid()}-cache-test{os.urandom(4).hex()}-n0"
    sizes = {key: stored_bytes(np.empty((60, 50 + key, 3), np.uint8)) for key in range(40)}
    budget = sum(sizes.values()) // 2
    context = mp.get_context("spawn")
    go = context.Event()
    writers = [context.Process(target=_put_all, args=(name, budget, seed, go)) for seed in (1, 2, 3)]
    for writer in writers:
        writer.start()
    go.set()
    for writer in writers:
        writer.join(60)
    try:
        assert [writer.exitcode for writer in writers] == [0, 0, 0]
        store = Store(name, budget)
        held = {key for key in range(40) if store.get(f"image-{key}") is not None}
        assert held and store.used() == sum(sizes[key] for key in held) <= budget
        for key in held:
            assert (store.get(f"image-{key}") == key).all() and store.get(f"image-{key}").shape == (60, 50 + key, 3)
        assert not [n for n in os.listdir(SHM_DIR) if n.startswith(name) and ".partial-" in n]
    finally:
        remove_shm(name)


def test_what_a_killed_writer_left_is_never_read():
    name = f"ensemble-{os.getpid()}-cache-test{os.urandom(4).hex()}-n0"
    store = Store(name, 1 << 20)
    try:
        path = store._path("a")
        with open(f"{path}.partial-dead", "wb") as file:  # killed before it published: a name never looked up
            file.write(b"EIC1")
        assert store.get("a") is None
        with open(path, "wb") as file:  # a short file under the final name (not ours): a miss, not garbage
            file.write(b"EIC1" + (10).to_bytes(4, "little") * 3)
        assert store.get("a") is None
    finally:
        remove_shm(name)


@pytest.mark.slow
def test_dask_workers_share_one_store_and_a_killed_worker_costs_a_recomputation(tiny_dataset):
    """Two workers of one node fill one store in epoch 0; epoch 1 comes from it, one worker
    SIGKILLed mid-epoch, bit-identical to batches made without the cache; the store is gone after."""
    slow = ["+pipeline.stages.slow={_target_: tests.slow_stage.SlowDown, inputs: [cache], seconds: 0.2}",
            "pipeline.stages.crop_main.inputs=[slow]", "~pipeline.stages.crop_alt", "~pipeline.stages.alt"]
    expected = epochs(build_graph(OmegaConf.to_container(compose_config(
        ["+ensemble=caltech256", f"dataset.root={tiny_dataset}", "pipeline.cache_gb=0", "pipeline.batch_size=8",
         "pipeline.image_size=32", *slow]).pipeline.stages, resolve=True), {"main"}), 2, (Split.TRAIN,))
    graph = build_graph(OmegaConf.to_container(compose_config(
        ["+ensemble=caltech256", f"dataset.root={tiny_dataset}", "pipeline.cache_gb=1", "pipeline.batch_size=8",
         "pipeline.image_size=32", *slow]).pipeline.stages, resolve=True), {"main"})
    received, hits, workers = {}, [], set()
    with dask_client(None, 2, 1) as client, cache_kept(client, graph):
        with Executor(client, graph, seed=5, on_error="skip", in_flight=4) as executor:
            pids, killed = client.run(os.getpid), None
            for epoch in (0, 1):
                for index, out in executor.batches(Split.TRAIN, epoch):
                    batch = out.batches["main"]
                    received[epoch, Split.TRAIN, index] = (zlib.crc32(batch.data.tobytes()), batch.labels.tolist(),
                                                           batch.paths)
                    hits.append((epoch, out.cache_hits, out.cache_lookups))
                    if epoch == 0:
                        workers.add(out.worker)
                    if epoch == 1 and killed is None:
                        busy = [address for address, keys in client.processing().items() if keys]
                        killed = busy[0]
                        os.kill(pids[killed], signal.SIGKILL)
        assert killed is not None
        assert store_files(graph)[0]
    assert len(workers) == 2  # both filled the node's one store in epoch 0: every image of epoch 1 came from it
    assert received == {k: v["streams"]["main"] for k, v in expected.items()}
    assert all(hit == 0 for epoch, hit, _ in hits if epoch == 0)
    assert all(hit == lookups for epoch, hit, lookups in hits if epoch == 1)
    assert not store_files(graph)[0] and not [n for n in os.listdir(SHM_DIR) if n.startswith(
        tuple(graph.cache.prefixes()))]


def test_the_first_lines_say_what_the_cache_holds_and_a_budget_the_host_cannot_hold_is_lowered(tiny_dataset,
                                                                                             monkeypatch):
    from collections import namedtuple

    from pipeline.run import _plan_cache

    overrides = ["+ensemble=caltech256", f"dataset.root={tiny_dataset}", "dataset.synthetic=never"]
    sample = default_graph(tiny_dataset, 0).sample(32)[0]
    per_item = default_graph(tiny_dataset, 0).cached_bytes_per_item(sample)
    dataset_gb = per_item * 64 / 1024**3
    for budget_gb, says in ((1, "on: the decoded dataset"), (dataset_gb / 4, "on, partly"), (0, "off")):
        cfg = compose_config([*overrides, f"pipeline.cache_gb={budget_gb}"])
        line = _plan_cache(cfg, default_graph(tiny_dataset, budget_gb), sample)
        assert says in line and "pipeline.stages.cache.budget_gb" in line, line
    assert "about 25% of the decoded dataset" in _plan_cache(compose_config(overrides),
                                                             default_graph(tiny_dataset, dataset_gb / 4), sample)
    # Two simulated nodes on this host, /dev/shm with room for one node's images only: each node's
    # budget is lowered to what the host allows, and the line says so.
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 40, 0, int(per_item * 64 * 1.2)))
    graph = default_graph(tiny_dataset, 2)
    line = _plan_cache(compose_config([*overrides, "cluster.nodes=2", "cluster.workers=2"]), graph, sample)
    assert "on, lowered: pipeline.stages.cache.budget_gb=2 per node, but this host allows" in line, line
    assert "for each of its 2 node(s) (80% of the" in line and "free in /dev/shm): it holds about 48%" in line, line
    assert "docker: --shm-size" in line
    assert graph.cache.budget_bytes == pytest.approx(0.8 * int(per_item * 64 * 1.2) / 2, abs=1)
