"""mode=profile: the dispatch, and the report's predictions checked against
re-measurement (issue 5, item 4): a throttled stage is named, its advice
applied, and the input rate moves as predicted."""
import json

import pytest

from pipeline.config import ConfigError
from pipeline.run import run
from tests.conftest import compose_config, resnet_override

SLEEP_S = 0.2  # per batch: a sleep needs no core, so a second worker really doubles the stage's throughput


def one_model(dataset, model: str, image_size: int, *extra: str) -> list[str]:
    """One model on the main branch (the alt branch removed: no model would read it)."""
    return ["+ensemble=caltech256", f"dataset.root={dataset}", "dataset.synthetic=never", "pipeline.batch_size=16",
            f"pipeline.image_size={image_size}", f"ensemble.models=[{model}]", "~pipeline.stages.crop_alt",
            "~pipeline.stages.alt", "mode=profile", *extra]


def profile(overrides: list[str], output_dir):
    """A short pass keeps each profile run to seconds; the defaults are for people."""
    return run(compose_config(overrides + ["profile.batches=16", "profile.steps=3", "profile.warmup=2"]),
               output_dir)


def test_profile_pass_settings_are_checked(tmp_path):
    with pytest.raises(ConfigError, match=r"profile.batches=0: the pass moves at least one batch; "
                                          r"set profile.batches=1 or more"):
        run(compose_config(["+ensemble=caltech256", "mode=profile", "profile.batches=0"]), tmp_path)


def worker_lanes(trace_file) -> list[list[tuple[float, float]]]:
    """The batch tasks' (start, end) on each Dask worker's lane of a report's trace.json."""
    events = json.loads(trace_file.read_text())["traceEvents"]
    workers = {e["tid"] for e in events if e["ph"] == "M" and e["args"]["name"].startswith("worker ")}
    lanes: dict[int, list] = {tid: [] for tid in workers}
    for e in events:
        if e["ph"] == "X" and e["tid"] in workers:
            lanes[e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
    return list(lanes.values())


@pytest.mark.slow
def test_throttled_stage_is_named_and_more_workers_move_the_rate_as_predicted(tiny_dataset, tmp_path):
    """A stage that sleeps SLEEP_S a batch on 1 worker: the report names it, advises cluster.workers=2
    and predicts the input rate's gain by Amdahl's law from how busy the worker was: with a sleeping
    stage it is nearly all busy, so between 1.5x and 2x. Applied as a user would (the override appended
    to the same command), the batch tasks run two at a time, which is what doubles the rate. Mistakes it
    catches: another stage named, advice that does not double the workers, a prediction above what two
    workers can give (or none), an override that does not reach the cluster (one lane, or lanes in
    turn). The rates themselves are timings, not checked."""
    throttled = one_model(tiny_dataset, resnet_override("tiny"), 32,
                          f"+pipeline.stages.slow={{_target_:tests.slow_stage.SlowDown,inputs:[cache],"
                          f"seconds:{SLEEP_S}}}", "pipeline.stages.crop_main.inputs=[slow]")
    before = profile(throttled + ["cluster.workers=1"], tmp_path / "before")
    report = json.loads((tmp_path / "before" / "report.json").read_text())
    assert (report["verdict"]["bound"], report["verdict"]["stage"]) == ("input", "slow"), report["verdict"]["line"]
    advice = next(a for a in report["actions"] if a["override"] and a["override"].startswith("cluster.workers="))
    assert advice["override"] == "cluster.workers=2"
    assert 1.5 <= advice["predicted_factor"] <= 2.0, advice["text"]
    assert len(worker_lanes(tmp_path / "before" / "trace.json")) == 1
    profile(throttled + [advice["override"]], tmp_path / "after")
    first, second = worker_lanes(tmp_path / "after" / "trace.json")
    together = sum(max(0.0, min(end, other_end) - max(start, other_start))
                   for start, end in first for other_start, other_end in second)
    assert together >= 0.5 * min(sum(end - start for start, end in lane) for lane in (first, second))
    # The same report files as a training run, and Dask's own report linked from the page.
    assert report["run"]["mode"] == "profile" and report["profile_pass"]["batches"] == 16
    assert set(before["differential"]["tiny"]) == {"synthetic_images_per_s", "cached_images_per_s",
                                                   "files_images_per_s", "compute_images_per_s"}
    assert (tmp_path / "before" / "results.json").is_file()
    # in_flight 2 (2 x 1 worker thread): one batch is the consumer's, one can wait.
    assert report["occupancy"]["pipeline pass prefetch"]["capacity"] == 1
    assert report["dask_report"] == "dask-report.html"
    assert '<a href="dask-report.html">' in (tmp_path / "before" / "report.html").read_text()


@pytest.mark.slow
def test_slow_trainer_and_fast_pipeline_is_compute_bound(tiny_dataset, tmp_path):
    slow_model = one_model(tiny_dataset, resnet_override("wide", width=48), 64,
                           "cluster.workers=2")
    results = profile(slow_model, tmp_path)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["verdict"]["bound"] == "compute" and report["verdict"]["model"] == "wide"
    assert results["models"][0]["data_stall_pct"] < 10
    assert report["actions"][0]["override"] == "ensemble.models.0.slots=2"


def test_the_files_pass_reads_and_decodes_what_the_pipeline_pass_left_in_the_cache(tiny_dataset, remove_stores):
    """The pipeline pass fills the cache with the batches the differential passes then take: the files
    pass must read and decode each of them again (the graph without its cache stage), and make the same
    images. It ran through the cache, which served them: its "files" rate timed no file."""
    from pipeline.report.profile_run import _uncached_graph
    from stages.base import BatchContext, Split
    from tests.test_cache import default_graph

    graph = default_graph(tiny_dataset, 1)
    remove_stores(graph)
    ctx = lambda: BatchContext(seed=5, split=Split.TRAIN, epoch=0, index=0)
    graph.run(ctx())  # the pipeline pass
    cached, files = graph.feeding({"main"}).run(ctx()), _uncached_graph(graph, "main").run(ctx())
    assert cached.cache_hits == 8 and cached.timings["decode"].items == 0  # what the files pass did before
    assert "cache" not in files.timings and files.timings["decode"].items == 8 and files.cache_hits == 0
    assert (files.batches["main"].data == cached.batches["main"].data).all()


def test_the_cached_pass_runs_every_stage_after_the_fetch_stages_and_the_synthetic_pass_none(tiny_dataset,
                                                                                            remove_stores):
    """Where the differential split puts a stage's cost follows from which stages each pass runs: a stage
    after decoding (here one planted after the cache) runs in the cached pass and the files pass, so its
    cost lands in preprocessing, not in fetch; read and decode run in the files pass only (the cached pass
    hands out decode's outputs held in memory, under its name, from no input). The passes overlap training,
    as a run does, so a stage's cost is not read back from their rates."""
    from pipeline.report.profile_run import _cached_graph, _fetch_outputs, _synthetic_graph, _uncached_graph
    from stages.base import BatchContext, Split
    from tests.test_cache import default_graph

    graph = default_graph(tiny_dataset, 1, "+pipeline.stages.slow={_target_:tests.slow_stage.SlowDown,"
                                           "inputs:[cache],seconds:0}", "pipeline.stages.crop_main.inputs=[slow]")
    remove_stores(graph)
    ctx = BatchContext(seed=5, split=Split.TRAIN, epoch=0, index=0)
    timings = {kind: pass_graph.run(ctx).timings for kind, pass_graph in (
        ("synthetic", _synthetic_graph(graph, "main", len(graph.source.class_names))),
        ("cached", _cached_graph(graph, "main", _fetch_outputs(graph, 5, "skip", 2))),
        ("files", _uncached_graph(graph, "main")))}
    ran = {kind: set(timed) for kind, timed in timings.items()}
    after_fetch = {"slow", "crop_main", "main"}
    assert after_fetch <= ran["cached"] and "read" not in ran["cached"], ran
    assert timings["cached"]["decode"].bytes_in == 0 < timings["files"]["decode"].bytes_in
    assert after_fetch | {"read", "decode"} <= ran["files"] and "cache" not in ran["files"], ran
    assert ran["synthetic"] == {"main"}, ran
