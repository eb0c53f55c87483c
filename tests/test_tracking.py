"""Tracking: each member's metrics per epoch, as the recorder has them, written as a CSV and as TensorBoard
event files that TensorBoard's own reader reads back."""
import csv
import math

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pipeline.measure.recorder import RunRecorder
from pipeline.measure.tracking import CSV_FILE, FOLDER, TAGS, Tracker
from pipeline.training.group import GroupSpec
from pipeline.training.reports import TrainReport, ValReport
from tests.conftest import member


def test_an_epoch_s_metrics_are_its_rank_0_report_over_the_model_s_slots_and_its_validation():
    """A model on 2 slots: rank 0 trained 40 images in 2 s of steps and waited 0.5 s, so the model 80 images
    at 40 images/s, stalled 20% of its time. Fails if images/s counts one rank's images or the waits, or if
    the stall is taken over the steps alone (25%)."""
    recorder = RunRecorder([member("m")], {"m": 1}, {"m": 32})
    recorder.joined(GroupSpec("m", (member("m"),)), 0, ("cpu", "cpu"), 0)
    recorder.add_report(TrainReport("m", 0, 0, 1.5, 40, 2.0, 0.5, lr=0.05))
    recorder.add_report(TrainReport("m", 1, 0, 9.0, 40, 2.0, 0.5, lr=None))  # rank 1 speaks for nobody
    recorder.add_report(ValReport("m", 0, 0.5, np.array([[0.8, 0.2], [0.8, 0.2]], np.float32), np.array([0, 1])))
    assert recorder.epoch_metrics("m", 0) == pytest.approx({
        "train_loss": 1.5, "val_accuracy": 0.5, "val_loss": -(math.log(0.8) + math.log(0.2)) / 2, "lr": 0.05,
        "images_per_s": 40.0, "data_stall_pct": 20.0})
    assert recorder.epoch_metrics("m", 1) == dict.fromkeys(TAGS)  # not trained yet


def epoch(loss, accuracy, lr=0.1):
    return {"train_loss": loss, "val_accuracy": accuracy, "val_loss": None, "lr": lr, "images_per_s": 100.0,
            "data_stall_pct": 5.0}


def test_tensorboard_reads_a_run_per_member_and_the_csv_a_row_per_member_epoch(tmp_path):
    models = [member("a"), member("b", lr=0.05)]
    with Tracker(tmp_path, models, tensorboard=True) as tracker:
        tracker.epoch("a", 1, epoch(2.0, 0.4))
        tracker.epoch("b", 1, epoch(2.5, 0.3, lr=0.05))
        tracker.epoch("a", 2, epoch(1.5, 0.6))
    with Tracker(tmp_path, models, tensorboard=True) as resumed:  # a resumed run appends
        resumed.epoch("b", 2, epoch(2.0, 0.5, lr=0.025))
    folder = tmp_path / FOLDER
    runs = {}
    for name in ("a", "b"):
        events = EventAccumulator(str(folder / name))
        events.Reload()
        runs[name] = {tag: [(e.step, round(e.value, 6)) for e in events.Scalars(tag)]
                      for tag in events.Tags()["scalars"]}
    assert runs["a"]["val/accuracy"] == [(1, 0.4), (2, 0.6)] and runs["a"]["train/loss"] == [(1, 2.0), (2, 1.5)]
    assert runs["b"]["train/lr"] == [(1, 0.05), (2, 0.025)]  # across both writers' files
    assert "val/loss" not in runs["a"]  # a metric not measured is left out, not written as 0
    assert set(runs["a"]) == set(TAGS.values()) - {"val/loss"}
    rows = list(csv.DictReader((folder / CSV_FILE).open()))
    assert [(r["model"], r["epoch"], r["val_accuracy"], r["val_loss"]) for r in rows] == [
        ("a", "1", "0.4", ""), ("b", "1", "0.3", ""), ("a", "2", "0.6", ""), ("b", "2", "0.5", "")]


def test_tensorboard_s_hparams_dashboard_compares_every_job_s_members_by_setting_and_last_metric(tmp_path):
    """Two jobs of a sweep, each a run of members a and b, one job resumed: TensorBoard's HParams plugin,
    reading the sweep's folder as `tensorboard --logdir` does, lists a session per member and job with its
    settings (a learning rate a number it filters by range, a target and a bool as text, a None left out) and
    its last validation accuracy, and every scalar tag as a metric. Fails without the sessions' start (the
    dashboard is empty), if a bool is written as a number, or a None as text (the key would be text)."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import api_pb2, backend_context, list_session_groups

    sweep = tmp_path / "multirun"
    for job, lr in ((0, 0.1), (1, 0.02)):
        models = [member("a", lr=lr), member("b", lr=lr / 2)]
        models[1].optimizer["nesterov"] = False
        models[0].lr_scheduler["eta_min"] = None if job == 0 else 0.001  # a None is left out, not text
        with Tracker(sweep / str(job), models, tensorboard=True) as tracker:
            tracker.epoch("a", 1, epoch(2.0, 0.4 + lr))
            tracker.epoch("b", 1, epoch(2.0, 0.3 + lr))
        with Tracker(sweep / str(job), models, tensorboard=True) as resumed:
            resumed.epoch("a", 2, epoch(1.5, 0.6 + lr))
    runs = plugin_event_multiplexer.EventMultiplexer()
    runs.AddRunsFromDirectory(str(sweep))
    runs.Reload()
    hparams = backend_context.Context(base_plugin.TBContext(
        data_provider=data_provider.MultiplexerDataProvider(runs, str(sweep)), logdir=str(sweep)))
    request = context.RequestContext()
    experiment = hparams.experiment_from_metadata(request, "", True, hparams.hparams_metadata(request, ""),
                                                  hparams.hparams_from_data_provider(request, "", None))
    kinds = {info.name: api_pb2.DataType.Name(info.type) for info in experiment.hparam_infos}
    assert kinds["optimizer.lr"] == "DATA_TYPE_FLOAT64" and kinds["model.depth"] == "DATA_TYPE_FLOAT64"
    assert kinds["model._target_"] == kinds["optimizer.nesterov"] == "DATA_TYPE_STRING"
    assert kinds["lr_scheduler.eta_min"] == "DATA_TYPE_FLOAT64"
    assert {info.name.tag for info in experiment.metric_infos} == set(TAGS.values()) - {"val/loss"}
    listed = list_session_groups.Handler(request, hparams, "", api_pb2.ListSessionGroupsRequest(
        start_index=0, slice_size=10, allowed_statuses=list(api_pb2.Status.values()))).run()
    sessions = {}
    for group in listed.session_groups:
        (session,) = group.sessions
        accuracy = {m.name.tag: (m.training_step, round(m.value, 6)) for m in session.metric_values}["val/accuracy"]
        settings = {key: value.WhichOneof("kind") and getattr(value, value.WhichOneof("kind"))
                    for key, value in group.hparams.items()}
        sessions[session.name] = (settings["optimizer.lr"], settings["optimizer.nesterov"], accuracy)
        assert ("lr_scheduler.eta_min" in settings) == (session.name == "1/tracking/a"), settings
    assert sessions == {"0/tracking/a": (0.1, "True", (2, 0.7)), "0/tracking/b": (0.05, "False", (1, 0.4)),
                        "1/tracking/a": (0.02, "True", (2, 0.62)), "1/tracking/b": (0.01, "False", (1, 0.32))}


def test_mlflow_holds_a_run_per_member_under_the_run_s_with_its_settings_and_epochs(tmp_path):
    """tracking.mlflow (a file store here): member runs under one parent, each with its own settings as
    parameters and its metrics by epoch; a resumed run logs into the same MLflow runs (an epoch trained
    again comes again). A new parent on resume, or a metric not measured logged as 0, fails."""
    mlflow = pytest.importorskip("mlflow")  # a test dependency; optional for users
    from pipeline.measure.tracking import MlflowRuns

    uri, models = f"file://{tmp_path / 'mlruns'}", [member("a", lr=0.1), member("b", lr=0.05)]
    run_dir = tmp_path / "run"
    said = []
    with Tracker(run_dir, models, tensorboard=False,
                 mlflow=MlflowRuns(uri, "search", run_dir, models, said.append)) as tracker:
        tracker.epoch("a", 1, epoch(2.0, 0.4))
        tracker.epoch("b", 1, epoch(2.5, 0.3, lr=0.05))
        tracker.status = "KILLED"  # stopped: resume= goes on
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    [experiment] = [e for e in client.search_experiments() if e.name == "search"]
    assert {r.info.status for r in client.search_runs([experiment.experiment_id])} == {"KILLED"}
    with Tracker(run_dir, models, tensorboard=False,
                 mlflow=MlflowRuns(uri, "search", run_dir, models, said.append)) as resumed:
        resumed.epoch("a", 2, epoch(1.5, 0.6))
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert sorted(runs) == ["a", "b", "run"]
    assert {runs[n].data.tags["mlflow.parentRunId"] for n in "ab"} == {runs["run"].info.run_id}
    assert runs["a"].data.params["optimizer.lr"] == "0.1" and runs["b"].data.params["optimizer.lr"] == "0.05"
    assert runs["a"].data.params["model._target_"] == "pipeline.training.models.resnet"
    history = lambda name, tag: [(m.step, m.value) for m in client.get_metric_history(runs[name].info.run_id, tag)]
    assert sorted(history("a", "val/accuracy")) == [(1, 0.4), (2, 0.6)] and history("b", "train/lr") == [(1, 0.05)]
    assert history("a", "val/loss") == []
    assert all(r.info.status == "FINISHED" for r in runs.values()) and said == []


def test_an_mlflow_store_that_fails_as_the_run_trains_is_said_once_and_the_run_goes_on(tmp_path):
    """The store goes away after epoch 1 (its folder removed: MLflow's own error on the next log): one
    warning naming it and the files that hold the metrics; the epochs after are in the CSV, and the run
    ends without an error. A run that fails ends its MLflow runs FAILED. MLflow's error used to end the
    training run, and a failed or stopped run's MLflow runs ended FINISHED."""
    mlflow = pytest.importorskip("mlflow")
    import shutil

    from pipeline.measure.tracking import MlflowRuns

    models, said = [member("a")], []
    uri = f"file://{tmp_path / 'mlruns'}"
    with Tracker(tmp_path / "run", models, tensorboard=False,
                 mlflow=MlflowRuns(uri, "search", tmp_path / "run", models, said.append)) as tracker:
        tracker.epoch("a", 1, epoch(2.0, 0.4))
        shutil.rmtree(tmp_path / "mlruns")
        tracker.epoch("a", 2, epoch(1.5, 0.6))
        tracker.epoch("a", 3, epoch(1.2, 0.7))
    (warning,) = said
    assert f"MLflow at {uri} failed (" in warning and "every epoch's metrics are in tracking/metrics.csv" in warning
    rows = list(csv.DictReader((tmp_path / "run" / FOLDER / CSV_FILE).open()))
    assert [r["epoch"] for r in rows] == ["1", "2", "3"]
    uri = f"file://{tmp_path / 'other'}"
    with pytest.raises(RuntimeError, match="a trainer crashed"):
        with Tracker(tmp_path / "run2", models, tensorboard=False,
                     mlflow=MlflowRuns(uri, "search", tmp_path / "run2", models, said.append)) as tracker:
            tracker.epoch("a", 1, epoch(2.0, 0.4))
            raise RuntimeError("a trainer crashed")
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    assert {r.info.status for e in client.search_experiments() for r in client.search_runs([e.experiment_id])} \
        == {"FAILED"}


def test_an_mlflow_server_that_does_not_answer_as_the_run_starts_is_one_line_naming_the_key(tmp_path, monkeypatch):
    """Nothing listens at the URI: the run stops before it trains, naming tracking.mlflow and the fix, with
    MLflow's reason; it raised MLflow's own exception, a traceback."""
    pytest.importorskip("mlflow")
    from pipeline.measure.tracking import MlflowRuns, TrackingError

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # (MLflow retries for minutes by default)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    with pytest.raises(TrackingError, match=r"^tracking.mlflow=http://127.0.0.1:9: MLflow could not start the "
                                            r"run's runs there \(.+\); start its tracking server, or set "
                                            r"tracking.mlflow=null$"):
        MlflowRuns("http://127.0.0.1:9", "search", tmp_path, [member("a")], print)


def test_mlflow_asked_for_where_it_is_not_installed_is_one_line_naming_the_key(monkeypatch):
    import importlib.util

    from pipeline.config import ConfigError, check
    from tests.conftest import compose_config

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "mlflow" else found(name, *rest))
    with pytest.raises(ConfigError, match="tracking.mlflow=file:./mlruns: MLflow is not installed here; pip install "
                                          "mlflow-skinny, or set tracking.mlflow=null"):
        check(compose_config(["+ensemble=caltech256", "tracking.mlflow=file:./mlruns"]))
