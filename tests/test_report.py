"""Bottleneck reports: verdicts and predicted effects from hand-made results,
the optional measurements, the sweep summary, one real run, and the page as
a person sees it in headless Chromium."""
import csv
import json
import logging
import re
import shutil
import subprocess
import sys
from html import escape
from pathlib import Path

import numpy as np
import pytest
from omegaconf import DictConfig, OmegaConf
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pipeline.report import analyse, write_report
from pipeline.report.analysis import BUSY_THRESHOLD_PCT, STALL_THRESHOLD_PCT
from pipeline.report.build import report_dict
from pipeline.report.measurements import OPTIONAL, occupancy_stats
from pipeline.measure.tracking import CSV_FILE, FOLDER
from pipeline.report.sweep import JOB_FILE, METRICS, SweepSummary

CHROMIUM = "/usr/bin/chromium"


def make_results(rate: float, stage_wall: dict[str, float], models: list[tuple[str, float, float]],
                 workers: int = 2, images: int = 1000) -> dict:
    """A results.json as run.py writes it. stage_wall: seconds per stage (CPU = 80% of it);
    models: (name, compute images/s, data stall %)."""
    return {
        "dataset": {"name": "handmade", "train_images": images, "val_images": 0},
        "cluster": {"address": "local", "workers": workers, "in_flight": 2 * workers},  # auto: 2 a thread
        "wall_s": 30.0,
        "models": [{"name": name, "input": "main", "slots": 1, "images_per_s": speed, "data_stall_pct": stall,
                    "val_accuracy": [0.4, 0.6], "epochs": 2} for name, speed, stall in models],
        "ensemble": {"val_accuracy": [0.5, 0.7], "final_val_accuracy": 0.7},
        "pipeline": {"train_images": images, "images_per_s": rate, "cpu_s_per_epoch": 0.8 * sum(stage_wall.values()),
                     "stages": {name: {"wall_s": wall, "cpu_s": 0.8 * wall, "items": images}
                                for name, wall in stage_wall.items()}},
        "skipped": [{"path": "/data/001/bad.jpg", "reason": "truncated JPEG"}],
        "converted": [{"path": "/data/002/gray.jpg", "what": "grayscale -> RGB"}],
        "config": {"cluster": {"threads_per_worker": 1, "in_flight": "auto"}, "delivery": {"ring_depth": 4},
                   "ensemble": {"models": [{"name": name} for name, _, _ in models]},
                   "pipeline": {"stages": {"read": {"_target_": "stages.read.ImageFolder"},
                                           "decode": {"_target_": "stages.decode.Decode"},
                                           "crop": {"_target_": "stages.augment.RandomResizedCropFlip"}}}},
    }


# 10 ms of batch-task time per image on 2 threads: the workers can give 200 images/s.
STAGES = {"read": 1.0, "decode": 6.0, "crop": 3.0}


def input_bound() -> dict:
    """190 img/s reach trainers that could take 400: the workers are 95% busy."""
    return make_results(190, STAGES, [("resnet", 400, 50.0), ("densenet", 600, 65.0)])


def test_input_bound_names_the_stage_and_predicts_with_amdahl():
    analysis = analyse(input_bound())
    assert analysis.verdict.bound == "input" and analysis.verdict.stage == "decode"
    assert analysis.verdict.model == "resnet"  # the slowest model sets the pace
    assert analysis.workers.busy_pct == pytest.approx(95)  # 190 img/s x 10 ms / 2 threads
    assert analysis.workers.capacity_images_per_s == pytest.approx(200)
    workers, stage = analysis.actions
    assert workers.change == workers.override == "cluster.workers=4"
    assert workers.predicted_factor == pytest.approx(1.9048, abs=1e-4)  # Amdahl: 5% serial, 95% on 2x the workers
    assert "1.9x" in workers.text and "95% busy" in workers.text
    assert stage.change == "cheaper decode" and stage.override is None  # no single config key does it
    assert stage.predicted_factor == pytest.approx(1.3986, abs=1e-4)  # decode (60% of 95% busy) at twice the speed
    assert "decode takes 60% of batch-task time" in stage.text and "simplejpeg" in stage.text


def test_predictions_never_pass_the_slowest_trainer():
    results = make_results(190, STAGES, [("resnet", 250, 20.0), ("densenet", 600, 65.0)])
    workers = analyse(results).actions[0]
    assert workers.predicted_images_per_s == pytest.approx(250)
    assert "capped by the slowest trainer" in workers.text


def test_no_action_promises_less_than_today_s_rate():
    """400 img/s reach a pace-setter that computes 250 (a profile pass runs uncapped; flotillas add up) and
    waits 20%, the workers 90% busy: input-bound, but any speed-up of the input is capped at 250, below
    today's rate. Such actions said "about 0.6x input rate"; none is offered."""
    analysis = analyse(make_results(400, {"read": 1.0, "decode": 2.0, "crop": 1.5}, [("resnet", 250, 20.0)]))
    assert analysis.verdict.bound == "input" and analysis.actions == []


def test_compute_bound_despite_fast_models_waiting_for_the_slow_one():
    # The fast model waits 60% of its time, for its slow peer (back-pressure), not for the input.
    results = make_results(50, STAGES, [("slow", 50, 2.0), ("fast", 120, 60.0)])
    analysis = analyse(results)
    assert analysis.mean_stall_pct == pytest.approx(31)
    assert analysis.verdict.bound == "compute" and analysis.verdict.model == "slow"
    [action] = analysis.actions
    assert action.change == action.override == "ensemble.models.0.slots=2"
    assert action.predicted_images_per_s == pytest.approx(100)  # twice the slots, at best twice the rate
    assert action.predicted_factor == pytest.approx(2.0)


def test_a_grid_members_slots_action_counts_every_member_its_declaration_makes():
    """resnet_w16 and resnet_w32 are one declaration's grid members (ensemble.grid over the width): its
    slots key doubles both, so the action needs 2 more slots, not 1, and says whom it changes."""
    results = make_results(50, STAGES, [("resnet_w16", 50, 2.0), ("resnet_w32", 40, 2.0), ("other", 200, 30.0)])
    results["config"]["ensemble"]["models"] = [{"name": "resnet"}, {"name": "other"}]
    [action] = analyse(results).actions
    assert action.override == "ensemble.models.0.slots=2"
    assert "(each of the 2 members its declaration makes: resnet_w16, resnet_w32)" in action.text
    assert action.text.endswith("needs 2 more free slot(s)")


def test_compute_bound_prediction_is_capped_by_the_next_slowest_model():
    results = make_results(50, STAGES, [("slow", 50, 2.0), ("fast", 70, 30.0)])
    action = analyse(results).actions[0]
    assert action.predicted_images_per_s == pytest.approx(70)
    assert "next slowest model" in action.text


@pytest.mark.parametrize("kind, expected", [("cpu", "trainer.slots=3"), ("cuda", "trainer.slots_per_device=5")])
def test_a_packed_pace_setter_is_told_to_spread_its_group_over_more_slots(kind, expected):
    """A pace-setter packed with others: more slots. On GPUs, whose slots are every GPU already, that is
    one more trainer process per GPU (trainer.slots=5 on 1 GPU of 4 sub-slots was advised before, which
    the run then refuses)."""
    results = make_results(50, STAGES, [("slow", 50, 2.0), ("fast", 120, 60.0)])
    results["devices"] = {"kind": kind, "slots": 2 if kind == "cpu" else 4}
    results["config"]["trainer"] = {"slots_per_device": 4}
    results["groups"] = {"group0": {"members": ["slow", "fast"], "mode": "packed"}}
    for model in results["models"]:
        model.update(group="group0", group_mode="packed")
    [action] = analyse(results).actions
    assert action.change == action.override == expected
    assert "slow trains in group0 (2 models packed on one slot)" in action.text


def test_the_report_shows_the_processes_per_device_auto_measured(tmp_path):
    """results.json's sub_slots (trainer.grouping=auto): each layout's images/s and the one chosen, under
    the slot groups, even when every group holds one model."""
    results = make_results(50, STAGES, [("a", 50, 2.0), ("b", 60, 2.0)])
    results["sub_slots"] = {"images_per_s": {"1": 189.9, "2": 219.4}, "chosen": 2}
    html = write_report(results, tmp_path).html.read_text()
    assert "<h3>Slot groups</h3><p>Processes per device, measured side by side (images/s of a device's " \
           "models): 1: 189.9, 2: 219.4; chosen: 2 (trainer.grouping=auto).</p>" in html


def test_the_report_shows_what_auto_measured_of_each_slot_group(tmp_path):
    """results.json's grouping (trainer.grouping=auto): packed and fused where a family could fuse, and on a
    GPU the rates by CUDA streams, each on its group's row; a group that measured nothing shows a dash."""
    results = make_results(50, STAGES, [("a", 50, 2.0), ("b", 60, 2.0), ("c", 60, 2.0), ("d", 60, 2.0)])
    results["groups"] = {"g0": {"members": ["a", "b"], "mode": "fused on 2 streams", "devices": ["cuda:0"]},
                         "g1": {"members": ["c", "d"], "mode": "packed", "devices": ["cuda:1"]}}
    results["grouping"] = {"g0": {"packed": 100.0, "fused": 150.5, "array_size": 2,
                                  "cuda_streams": {"packed": {"1": 100.0, "2": 190.0},
                                                   "fused": {"1": 150.5, "2": 180.3}}}}
    html = write_report(results, tmp_path).html.read_text()
    assert ("<td>packed 100.0 / fused 150.5; packed on streams 1: 100.0, 2: 190.0; fused on streams 1: 150.5, "
            "2: 180.3</td>") in html
    assert "<td>g1</td><td>packed</td><td>2</td><td>cuda:1</td><td>-</td>" in html


def test_idle_workers_and_waiting_trainers_is_transport_bound():
    results = make_results(40, STAGES, [("resnet", 400, 60.0)])
    analysis = analyse(results)
    assert analysis.workers.busy_pct == pytest.approx(20)
    assert analysis.verdict.bound == "transport"
    in_flight, depth = analysis.actions
    assert in_flight.change == "cluster.in_flight=8"  # twice the window the run recorded
    assert in_flight.predicted_images_per_s == pytest.approx(200)  # the workers' capacity
    assert in_flight.predicted_factor == pytest.approx(5.0)
    assert depth.change == "delivery.ring_depth=8"
    assert (in_flight.override, depth.override) == ("cluster.in_flight=8", "delivery.ring_depth=8")


def test_measured_worker_utilisation_replaces_the_derived_one():
    results = input_bound()
    results["cluster"]["worker_busy_pct"] = {"tcp://a:1": 30.0, "tcp://b:2": 40.0}
    analysis = analyse(results)
    assert analysis.workers.busy_source == "measured" and analysis.workers.busy_pct == pytest.approx(35)
    assert analysis.verdict.bound == "transport"


def test_remote_cluster_without_thread_count_does_not_guess():
    results = input_bound()
    results["cluster"]["workers"] = "remote"
    analysis = analyse(results)
    assert analysis.verdict.bound == "input-or-transport" and analysis.actions == []
    assert "record cluster.threads" in analysis.verdict.line


def documented_schema() -> tuple[int, set[str], set[str]]:
    """docs/report.md's report.json: its version, the fields always written and those written only
    when the run recorded them (or in profile mode)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "report.md").read_text()
    version, block = re.search(r"## report\.json, schema version (\d+)\n.*?```text\n(.*?)```", text, re.S).groups()
    fields = re.split(r"\n(?=\S)", block)  # a field's line, then its indented continuation lines
    names = {field.split()[0].removesuffix("[]"): field for field in fields}
    optional = {name for name, field in names.items() if "only when recorded" in field or "profile mode only" in field}
    return int(version), set(names) - optional, optional


def test_report_files_are_self_contained_and_versioned(tmp_path):
    """A field renamed, or the version raised, without docs/report.md's schema following, fails; so does
    report.json leaving out an action that is not one config key."""
    paths = write_report(input_bound(), tmp_path)
    report = json.loads(paths.json.read_text())
    version, always, _ = documented_schema()
    assert report["schema_version"] == version and set(report) == always
    assert report["verdict"]["bound"] == "input"
    assert [a["override"] for a in report["actions"]] == ["cluster.workers=4", None]  # no key cheapens decode
    assert [s["name"] for s in report["stages"]] == ["read", "decode", "crop"]
    assert report["models"][1]["vs_slowest"] == pytest.approx(1.5)
    assert report["measurements_missing"] == list(OPTIONAL)
    assert paths.trace is None
    html = paths.html.read_text()
    assert "http://" not in html and "https://" not in html
    sources = re.findall(r'(?:src|href)="([^"]*)"', html)
    assert len(sources) == 3 and all(s.startswith("data:image/png;base64,") for s in sources)
    assert "truncated JPEG" in html and "grayscale -&gt; RGB" in html
    lines = paths.summary.splitlines()
    assert lines[0].startswith("bottleneck: INPUT-BOUND by stage decode") and len(lines) <= 6


def with_optional_measurements() -> dict:
    results = input_bound()
    for name, stage in results["pipeline"]["stages"].items():
        stage.update(latency_ms={"p50": 4.0, "p95": 9.0}, bytes_in=10_000_000, bytes_out=20_000_000)
    results["cluster"]["threads"] = 2
    results["cluster"]["worker_busy_pct"] = {"tcp://a:1": 94.0, "tcp://b:2": 96.0}
    results["pipeline"]["occupancy"] = {"prefetch": {"capacity": 4, "t_s": [0, 1, 3, 4], "filled": [0, 2, 4, 4]}}
    results["delivery"] = {"hubs": {"flotilla 0 single_broadcast hub 0 node 0": {
        "bytes": 5_000_000, "latency_ms": {"p50": 0.5, "p95": 2.0}}}}
    results["timeline"] = [
        {"lane": "worker a/0", "what": "task", "start_s": 0.0, "end_s": 0.5, "split": "train", "epoch": 0,
         "batch": 0},
        {"lane": "trainer resnet/0", "what": "wait", "start_s": 0.0, "end_s": 0.5},
        {"lane": "trainer resnet/0", "what": "step", "start_s": 0.5, "end_s": 0.8, "split": "train", "epoch": 0,
         "batch": 0}]
    results["differential"] = {"resnet": {"files_images_per_s": 100, "cached_images_per_s": 125,
                                          "synthetic_images_per_s": 200}}
    results["models"][0]["images_per_s"] = 250
    for index, model in enumerate(results["models"]):
        model["flotillas"] = [{"flotilla": index, "devices": ["cpu"], "start_epoch": 0}]
    return results


def test_optional_measurements_are_shown_when_recorded(tmp_path):
    paths = write_report(with_optional_measurements(), tmp_path)
    report = json.loads(paths.json.read_text())
    _, always, optional = documented_schema()
    assert set(report) == always | optional - {"profile_pass"}
    assert report["measurements_missing"] == []
    # time-weighted over [0,1): 0, [1,3): 2, [3,4): 4 of 4 slots
    assert report["occupancy"]["prefetch"] == {"capacity": 4, "mean_pct": 50.0, "p95_pct": 100.0,
                                               "full_pct": 25.0, "empty_pct": 25.0}
    split = report["differential"]["resnet"]  # 10 ms from files, 8 cached, 5 synthetic, 4 computing
    assert split["fetch_ms"] == pytest.approx(2) and split["fetch_pct"] == pytest.approx(20)
    assert split["preprocessing_ms"] == pytest.approx(3) and split["transport_ms"] == pytest.approx(1)
    assert split["files_images_per_s"] == 100 and split["compute_images_per_s"] == 250
    assert [m["flotilla"] for m in report["models"]] == [0, 1]
    trace = json.loads(paths.trace.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 3 and spans[2]["dur"] == pytest.approx(300_000)
    html = paths.html.read_text()
    for heading in ("Queue occupancy", "Dask workers", "Delivery", "Stall split", "Timeline"):
        assert heading in html
    assert html.count("data:image/png;base64,") == 6  # with the stall split
    assert "Not recorded by this run" not in html
    assert "stall split of resnet (10.00 ms per image from files): fetch 2.00 ms (20%)" in paths.summary


def test_compute_rate_of_the_differential_passes_decides_transport():
    results = with_optional_measurements()
    results["differential"]["resnet"]["compute_images_per_s"] = 500  # 2 ms per image
    report = report_dict(results, analyse(results))
    assert report["differential"]["resnet"]["transport_ms"] == pytest.approx(3)


def test_dask_performance_report_is_linked_when_the_run_wrote_one(tmp_path):
    paths = write_report(input_bound(), tmp_path)
    assert "dask-report.html" not in paths.html.read_text()
    assert json.loads(paths.json.read_text())["dask_report"] is None
    (tmp_path / "dask-report.html").write_text("<html></html>")
    paths = write_report(input_bound(), tmp_path)
    assert '<a href="dask-report.html">' in paths.html.read_text()  # relative: the folder may be moved
    assert json.loads(paths.json.read_text())["dask_report"] == "dask-report.html"
    assert "dask-report.html" in paths.summary


def test_remote_cluster_workers_action_has_no_override():
    results = input_bound()
    results["cluster"].update(workers="remote", threads=2)
    workers = analyse(results).actions[0]
    assert workers.change == "4 worker threads" and workers.override is None


def test_occupancy_of_a_queue_never_sampled_twice_is_unknown():
    assert occupancy_stats({"capacity": 2, "t_s": [0.0], "filled": [1]})["mean_pct"] is None


def fake_job(sweep: Path, number: int, overrides: list[str], results: dict | None) -> None:
    job = sweep / str(number)
    job.mkdir(parents=True)
    (job / JOB_FILE).write_text(json.dumps({"overrides": overrides, "status": "completed" if results else "running"}))
    if results is not None:
        (job / "results.json").write_text(json.dumps(results))


def multirun_config(sweep: Path) -> DictConfig:
    """What of a multirun's config the summary reads at its end."""
    return OmegaConf.create({"hydra": {"sweep": {"dir": sweep.name}, "runtime": {"cwd": str(sweep.parent)}}})


def test_sweep_callback_compares_jobs_side_by_side(tmp_path, caplog):
    sweep = multirun_config(tmp_path)
    fake_job(tmp_path, 0, ["+ensemble=caltech256", "cluster.workers=2"], input_bound())
    with caplog.at_level(logging.INFO):  # Hydra's level: matplotlib's notes would reach the console
        SweepSummary().on_multirun_end(sweep)  # (as after the first job: it is labelled by its folder, "0")
        fake_job(tmp_path, 1, ["+ensemble=caltech256", "cluster.workers=4"],
                 make_results(50, STAGES, [("slow", 50, 2.0), ("fast", 120, 60.0)]))
        SweepSummary().on_multirun_end(sweep)
    assert [r.getMessage() for r in caplog.records if r.name.startswith("matplotlib")] == []
    with (tmp_path / "sweep.csv").open() as file:
        rows = list(csv.DictReader(file))
    assert [r["job"] for r in rows] == ["0", "1"]
    assert rows[0]["overrides"] == "+ensemble=caltech256 cluster.workers=2"
    assert float(rows[0]["images_per_s"]) == 190 and float(rows[1]["mean_stall_pct"]) == 31
    assert float(rows[0]["ensemble_accuracy"]) == 70 and float(rows[1]["wall_s"]) == 30
    assert [r["verdict"] for r in rows] == ["input", "compute"]
    html = (tmp_path / "sweep.html").read_text()
    assert html.count("data:image/png;base64,") == len(METRICS) and "http" not in html
    assert "cluster.workers=4" in html and "<code>+ensemble=caltech256</code>" in html
    assert '<a href="1/report.html">1</a> (<a href="1/tracking/metrics.csv">metrics</a>)' in html


def test_sweep_lists_a_job_without_results(tmp_path):
    fake_job(tmp_path, 0, ["topology=a"], input_bound())
    fake_job(tmp_path, 1, ["topology=b"], None)
    SweepSummary().on_multirun_end(multirun_config(tmp_path))
    rows = list(csv.DictReader((tmp_path / "sweep.csv").open()))
    assert rows[1]["images_per_s"] == "" and rows[1]["verdict"].startswith("no results.json (the job is running")
    assert "<p>No best job: no job returned an objective.</p>" in (tmp_path / "sweep.html").read_text()


def test_the_sweep_lists_a_job_json_it_cannot_read_and_says_why(tmp_path, capsys):
    """A sweep folder that holds a job of an older version (its job.json without the overrides) or a
    job.json that is not JSON: every job still has its row, those two say which file and what to do, and
    neither is the best job. Fails if the summary stops at a KeyError (as it did) or drops those jobs."""
    objective = {"of": "ensemble", "metric": "val_accuracy", "direction": "maximize"}
    fake_job(tmp_path, 0, ["ensemble.models.0.optimizer.lr=0.1"],
             {**input_bound(), "objective": {**objective, "value": 0.5}})
    for number, text in ((1, json.dumps({"status": "completed", "objective": 0.9})), (2, "{not json")):
        fake_job(tmp_path, number, [], {**input_bound(), "objective": {**objective, "value": 0.9}})
        (tmp_path / str(number) / JOB_FILE).write_text(text)
    SweepSummary().on_multirun_end(multirun_config(tmp_path))
    assert capsys.readouterr().out.splitlines()[-1].startswith("best job: 0 ")
    rows = list(csv.DictReader((tmp_path / "sweep.csv").open()))
    assert [row["job"] for row in rows] == ["0", "1", "2"]
    for row in rows[1:]:
        assert row["verdict"] == (f"unreadable: {tmp_path / row['job'] / JOB_FILE} is not a job.json this "
                                  "version writes (an older version's?): run the job again")
        assert float(row["images_per_s"]) == 190  # its results.json is still read


@pytest.mark.parametrize("metric, direction, best", [("val_accuracy", "maximize", "1"), ("val_loss", "minimize", "2")])
def test_the_sweep_names_its_best_job_by_the_objectives_direction(tmp_path, capsys, metric, direction, best):
    """The job whose objective is best (highest accuracy, lowest loss), marked in sweep.html and said at the
    multirun's end; jobs without results, and failed ones, are passed over."""
    for number, value in enumerate((0.5, 0.9, 0.3)):
        fake_job(tmp_path, number, ["+ensemble=caltech256", f"ensemble.models.0.optimizer.lr={value}"],
                 {**input_bound(), "objective": {"of": "ensemble", "metric": metric, "direction": direction,
                                                 "value": value}})
    fake_job(tmp_path, 3, ["+ensemble=caltech256", "ensemble.models.0.optimizer.lr=0.01"], None)
    value = {"maximize": 0.99, "minimize": 0.01}[direction]  # the best value, of a job that failed
    fake_job(tmp_path, 4, ["+ensemble=caltech256", "ensemble.models.0.optimizer.lr=0.02"],
             {**input_bound(), "objective": {"of": "ensemble", "metric": metric, "direction": direction,
                                             "value": value}})
    record = json.loads((tmp_path / "4" / JOB_FILE).read_text())
    (tmp_path / "4" / JOB_FILE).write_text(json.dumps({**record, "status": "failed", "error": "JobFailed: ..."}))
    SweepSummary().on_multirun_end(multirun_config(tmp_path))
    value = {"1": 0.9, "2": 0.3}[best]
    line = f"best job: {best} (ensemble.models.0.optimizer.lr={value}): {metric} of ensemble {value} ({direction}d)"
    assert capsys.readouterr().out.splitlines()[-1] == line
    html = (tmp_path / "sweep.html").read_text()
    assert f"<p>B{line[1:]}.</p>" in html
    assert html.count('<tr class="best">') == 1 and f'<tr class="best"><td><a href="{best}/report.html">' in html
    rows = {row["job"]: row for row in csv.DictReader((tmp_path / "sweep.csv").open())}
    assert rows["4"]["objective"] == "" and rows["4"]["verdict"] == "failed: JobFailed: ..."  # it returned none


def test_jobs_whose_objectives_measure_different_things_have_no_best(tmp_path, capsys):
    for number, (metric, direction) in enumerate((("val_accuracy", "maximize"), ("val_loss", "minimize"))):
        fake_job(tmp_path, number, [f"objective.metric={metric}"],  # a sweep over objective.metric
                 {**input_bound(), "objective": {"of": "ensemble", "metric": metric, "direction": direction,
                                                 "value": 0.5}})
    SweepSummary().on_multirun_end(multirun_config(tmp_path))
    assert capsys.readouterr().out.splitlines()[-1] == \
        "no best job: the jobs' objectives measure different things (objective.of, objective.metric)"
    assert '<tr class="best">' not in (tmp_path / "sweep.html").read_text()


HYDRA_APP = """
import json
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig


@hydra.main(version_base="1.3", config_path=None, config_name=None)
def main(cfg):
    if cfg.rate < 0:
        raise ValueError("no negative rates")
    results = json.loads(Path(__file__).with_name("results.json").read_text())
    results["pipeline"]["images_per_s"] = cfg.rate
    results["objective"] = {"value": cfg.rate / 1000}
    (Path(HydraConfig.get().runtime.output_dir) / "results.json").write_text(json.dumps(results))
    return cfg.rate / 1000


main()
"""


def test_sweep_callback_records_each_job_of_a_real_hydra_multirun_failed_or_not(tmp_path):
    """Hydra's basic sweeper runs the batch, then raises the first failure: the multirun never ends, so
    the summary is written as each job ends. The jobs run in their own folders (hydra.job.chdir=true), the
    sweep's folder named from where the command ran, and without Hydra's .hydra files
    (hydra.output_subdir=null). Fails if job.json records a failure as completed (or its error as something
    else), if the summary waits for the multirun's end, or if it looks for the sweep's folder, or a job's
    overrides, anywhere else."""
    (tmp_path / "results.json").write_text(json.dumps(input_bound()))
    (tmp_path / "app.py").write_text(HYDRA_APP)
    multirun = subprocess.run([sys.executable, str(tmp_path / "app.py"), "-m", "+rate=100,-1,150",
                               "hydra.sweep.dir=sweep", "hydra.job.chdir=true", "hydra.output_subdir=null",
                               "+hydra.callbacks.sweep_summary._target_=pipeline.report.sweep.SweepSummary"],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert multirun.returncode == 1 and "no negative rates" in multirun.stderr
    assert "Callback" not in multirun.stderr, multirun.stderr  # Hydra's warning: a callback raised
    sweep = tmp_path / "sweep"
    assert not list(sweep.rglob(".hydra"))
    outcomes = [json.loads((sweep / str(job) / JOB_FILE).read_text()) for job in range(3)]
    assert outcomes == [{"overrides": ["+rate=100"], "status": "completed", "objective": 0.1},
                        {"overrides": ["+rate=-1"], "status": "failed", "error": "ValueError: no negative rates"},
                        {"overrides": ["+rate=150"], "status": "completed", "objective": 0.15}]
    rows = list(csv.DictReader((sweep / "sweep.csv").open()))
    assert [(r["overrides"], r["images_per_s"], r["objective"]) for r in rows] == [
        ("+rate=100", "100", "0.1"), ("+rate=-1", "", ""), ("+rate=150", "150", "0.15")]
    assert rows[1]["verdict"] == "failed: ValueError: no negative rates"
    assert "failed: ValueError: no negative rates" in (sweep / "sweep.html").read_text()


@pytest.mark.slow
def test_report_of_a_real_run(tiny_dataset, tmp_path):
    """A verdict read from the stall of a model that does not set the pace fails. Tracking holds each member's
    two epochs, in TensorBoard's files and the CSV; after the first, each member's rate is half its own (the
    cosine schedule, halfway): one member's rate reported for all fails (resnet10_w24's is 0.05); each
    member's TensorBoard run holds its settings for the HParams dashboard. MLflow (tracking.mlflow) has the
    same epochs, a run per member under the run's."""
    from mlflow.tracking import MlflowClient
    from tensorboard.plugins.hparams import metadata as hparams

    from pipeline.run import run
    from tests.conftest import compose_config

    mlflow_uri = f"file://{tmp_path / 'mlruns'}"
    cfg = compose_config(["+ensemble=caltech256", f"dataset.root={tiny_dataset}", "dataset.synthetic=never",
                          "pipeline.batch_size=16", "pipeline.image_size=32", "pipeline.alt_image_size=24",
                          "cluster.workers=2", "trainer.epochs=2", f"tracking.mlflow={mlflow_uri}"])
    results = json.loads(json.dumps(run(cfg, tmp_path), default=str))  # as read back from results.json
    rows = list(csv.DictReader((tmp_path / FOLDER / CSV_FILE).open()))
    assert sorted((r["model"], r["epoch"]) for r in rows) == sorted(
        (m["name"], str(e)) for m in results["models"] for e in (1, 2))
    for m in results["models"]:
        first = next(r for r in rows if r["model"] == m["name"] and r["epoch"] == "1")
        assert float(first["lr"]) == pytest.approx(m["optimizer"]["lr"] / 2, rel=1e-6)
        assert float(first["val_accuracy"]) == m["val_accuracy"][0] and float(first["val_loss"]) == m["val_loss"][0]
        events = EventAccumulator(str(tmp_path / FOLDER / m["name"]))
        events.Reload()
        assert [e.step for e in events.Scalars("train/images_per_s")] == [1, 2]
        settings = hparams.parse_session_start_info_plugin_data(  # its HParams session: its settings
            events.PluginTagToContent(hparams.PLUGIN_NAME)[hparams.SESSION_START_INFO_TAG]).hparams
        assert settings["optimizer.lr"].number_value == m["optimizer"]["lr"]
        assert settings["model._target_"].string_value == m["model"]["_target_"]
    client = MlflowClient(tracking_uri=mlflow_uri)
    [experiment] = [e for e in client.search_experiments() if e.name == "ensemble"]
    runs = {r.info.run_name: r.info.run_id for r in client.search_runs([experiment.experiment_id])}
    assert sorted(runs) == sorted([tmp_path.name, *(m["name"] for m in results["models"])])
    for m in results["models"]:
        history = client.get_metric_history(runs[m["name"]], "val/accuracy")
        assert sorted((h.step, h.value) for h in history) == [(1, m["val_accuracy"][0]), (2, m["val_accuracy"][1])]
    paths = write_report(results, tmp_path)
    report = json.loads(paths.json.read_text())
    # The verdict follows from the run's own numbers by docs/report.md's rule: the pace-setter's stall,
    # then how busy the worker threads were.
    (pace,) = [m for m in report["models"] if m["sets_pace"]]
    stall, busy = pace["data_stall_pct"], report["workers"]["busy_pct"]
    expected = "compute" if stall <= STALL_THRESHOLD_PCT else "input" if busy >= BUSY_THRESHOLD_PCT else "transport"
    assert (report["verdict"]["bound"], report["verdict"]["model"]) == (expected, pace["name"]), (stall, busy)
    assert {s["name"] for s in report["stages"]} == {"read", "decode", "cache", "crop_main", "crop_alt", "main",
                                                     "alt"}
    assert report["workers"]["threads"] == 2 and report["workers"]["busy_source"] == "measured"
    assert len(report["models"]) == 4 and report["run"]["epochs"] == 2  # (it read a key results.json lacks: null)
    # with CPU per epoch, the timeline, ring occupancy, the slots over time
    assert paths.html.read_text().count("data:image/png;base64,") == 7
    # One node, one hub (single_broadcast): its ring, and its prefetch queue of batch tasks.
    assert set(report["occupancy"]) == {"flotilla 0 hub 0 ring", "flotilla 0 hub 0 prefetch"}
    html = paths.html.read_text()
    assert "<h2>Delivery</h2>" in html
    # The decision log, each decision beside its cause (a log without causes fails).
    decisions = results["scheduler"]["decisions"]
    assert f"Scheduler decisions ({len(decisions)})" in html
    for d in decisions:
        cells = "".join(f"<td>{escape(cell)}</td>" for cell in (d["decision"], d["flotilla"], d.get("group", "")))
        assert cells in html and f"<td>{escape(d['cause'])}</td>" in html, d
    # Its trace: a lane for each trainer rank's steps and for each worker that ran batch tasks (a trainer's
    # steps missing, or steps and tasks in one lane, fail).
    lanes = {e["args"]["name"] for e in json.loads(paths.trace.read_text())["traceEvents"] if e["ph"] == "M"}
    trainers = {f"trainer {m['group']}/{rank}" for m in results["models"] for rank in range(m["slots"])}
    assert trainers <= lanes and set() < lanes - trainers <= {"worker n0-w0", "worker n0-w1"}, lanes


# Set by the page once loaded: how many images it has and how many decoded with a width.
RENDER_CHECK = """<script>window.addEventListener("load", () => {
  const marker = document.createElement("div");
  marker.id = "render-check";
  const images = [...document.images];
  const rendered = images.filter(i => i.complete && i.naturalWidth > 0);
  marker.textContent = `images=${images.length} rendered=${rendered.length}`;
  document.body.appendChild(marker);
});</script>"""


def chromium(page: Path, profile: Path, *args: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000"]
    return subprocess.run([CHROMIUM, *flags, *args, page.as_uri()], capture_output=True, text=True, timeout=120)


def console_messages(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


def test_report_renders_in_headless_chromium(tmp_path):
    """A page that renders blank, or a verdict that lost its coloured banner (its class), fails."""
    if not shutil.which(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install -y chromium; .ci/run installs it)")
    (tmp_path / "dask-report.html").write_text("<html></html>")  # linked, not loaded
    paths = write_report(with_optional_measurements(), tmp_path)
    # The check script goes into a copy: the report itself carries no script.
    probe = tmp_path / "report-probe.html"
    probe.write_text(paths.html.read_text().replace("</body>", RENDER_CHECK + "</body>"))
    dom = chromium(probe, tmp_path / "profile-dom", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert re.search(r'<div id="render-check">images=6 rendered=6</div>', dom.stdout), dom.stdout[-500:]
    assert "INPUT-BOUND by stage decode" in dom.stdout
    assert console_messages(dom.stderr) == []
    screenshot = tmp_path / "report.png"
    shot = chromium(paths.html, tmp_path / "profile-shot", f"--screenshot={screenshot}", "--window-size=1280,2000")
    assert shot.returncode == 0, shot.stderr[-2000:]
    assert console_messages(shot.stderr) == []
    pixels = np.asarray(Image.open(screenshot).convert("RGB"))
    assert pixels.shape == (2000, 1280, 3)  # the window
    # The input-bound verdict's banner (#fdecea) spans the body: 1198 px here (1200 px max-width within its
    # 1 px border); at least 1000, so that another Chromium's rounding or scrollbar passes too.
    banner = (pixels == (0xfd, 0xec, 0xea)).all(axis=2)
    assert banner.sum(axis=1).max() >= 1000
