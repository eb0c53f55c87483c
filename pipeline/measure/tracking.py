"""Experiment tracking: each member's metrics, epoch by epoch as the run goes, where tracking tools
read them. One CSV for the run (tracking/metrics.csv, a row per member and epoch) and, with
tracking.tensorboard, TensorBoard event files, one TensorBoard run per member (tracking/<member>/):
`tensorboard --logdir <run folder>/tracking`, or `--logdir <sweep folder>` for every job of a sweep.
Each member's run starts with its settings as hyperparameters (a session of TensorBoard's HParams
dashboard), so a search's members, in one run or in many jobs, compare there by setting and metric.
A resumed run appends to both: an epoch trained again after a resume comes again, and its later
row is the one that stands.

With tracking.mlflow (a tracking URI), MLflow too: a parent run per run (named after its folder) and
a child run per member, with the member's settings as parameters (model.depth, optimizer.lr, ...) and
the same metrics by epoch. The runs' ids are kept in tracking/mlflow.json, so a resumed run goes on
logging into its own MLflow runs."""
from __future__ import annotations

import csv
import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable
from urllib.parse import urlparse

from hydra.utils import to_absolute_path

from pipeline.runtime.errors import UserError
from pipeline.runtime.files import write_whole
from pipeline.training.members import ModelSpec, flatten

FOLDER = "tracking"
CSV_FILE = "metrics.csv"
MLFLOW_IDS = "mlflow.json"
# metric (as RunRecorder.epoch_metrics names it) -> its TensorBoard tag
TAGS = {"train_loss": "train/loss", "val_accuracy": "val/accuracy", "val_loss": "val/loss", "lr": "train/lr",
        "images_per_s": "train/images_per_s", "data_stall_pct": "train/data_stall_pct"}


def settings(spec: ModelSpec) -> dict:
    """A member's settings as dotted keys (model.depth, optimizer.lr, ...): its MLflow parameters and its
    TensorBoard hyperparameters."""
    return flatten({key: value for key, value in asdict(spec).items() if key not in ("name", "unfusable")})


def _hparam(value):
    """A setting as a TensorBoard hyperparameter: a number stays a number (HParams filters it by range), None
    stays None (left out: a text "None" would make the key text in every session), anything else is its text
    (a bool's too, which torch would make 1.0)."""
    if value is None or isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    return str(value)


def launch_relative(uri: str) -> str:
    """An MLflow tracking URI whose local store's relative path (file:./mlruns, mlruns, sqlite:///mlflow.db) is
    read from where the command ran, as dataset.root is: under hydra.job.chdir=true a job runs in its own
    folder, and each job's store would be another."""
    parsed = urlparse(uri)
    query = f"?{parsed.query}" if parsed.query else ""
    local = parsed.scheme == "file" or not parsed.scheme and uri != "databricks"  # (MLflow's name, not a path)
    if local and not parsed.netloc and parsed.path and not os.path.isabs(parsed.path):
        return Path(to_absolute_path(parsed.path)).as_uri() + query
    database = parsed.path[1:]  # sqlite:///a.db is relative, sqlite:////a.db not; sqlite:///:memory: is no file
    if parsed.scheme == "sqlite" and not parsed.netloc and database and not os.path.isabs(database) \
            and database != ":memory:":
        return f"sqlite:///{to_absolute_path(database)}{query}"
    return uri


class TrackingError(UserError):
    """tracking.mlflow names a store the run cannot log to as it starts."""


class MlflowRuns:
    """A run's MLflow runs: one parent, a child per member, created as members first report. A store that
    fails once the run trains (a server gone) is said, once, and the run goes on without it: the CSV and
    TensorBoard's files hold every epoch. Each run ends FINISHED, KILLED (stopped: resume= logs on into it)
    or FAILED."""

    def __init__(self, uri: str, experiment: str, run_dir: Path, models: list[ModelSpec],
                 say: Callable[[str], None]):
        from mlflow.tracking import MlflowClient  # optional: config.check makes sure it imports

        self.client, self.uri, self.say, self.lost = MlflowClient(tracking_uri=uri), uri, say, False
        self.ids_file = run_dir / FOLDER / MLFLOW_IDS
        self.models = {m.name: m for m in models}
        self.ids = json.loads(self.ids_file.read_text()) if self.ids_file.exists() else {"members": {}}
        if "experiment" not in self.ids:
            try:
                found = self.client.get_experiment_by_name(experiment)
                self.ids["experiment"] = found.experiment_id if found else self.client.create_experiment(experiment)
                self.ids["parent"] = self.client.create_run(self.ids["experiment"], run_name=run_dir.name,
                                                            tags={"run_folder": str(run_dir)}).info.run_id
            except Exception as err:  # MLflow's own errors, or its connection's
                raise TrackingError(f"tracking.mlflow={uri}: MLflow could not start the run's runs there "
                                    f"({_said(err)}); start its tracking server, or set tracking.mlflow=null"
                                    ) from None
            self._save()

    def epoch(self, model: str, epoch: int, metrics: dict[str, float | None]) -> None:
        if self.lost:
            return
        try:
            self._log(model, epoch, metrics)
        except Exception as err:  # the run trains on: its metrics are in its own files
            self.lost = True
            self.say(f"[yellow]warning[/] MLflow at {self.uri} failed ({_said(err)}): nothing more is logged "
                     f"there this run; every epoch's metrics are in {FOLDER}/{CSV_FILE} (and TensorBoard's files)")

    def _log(self, model: str, epoch: int, metrics: dict[str, float | None]) -> None:
        from mlflow.entities import Metric, Param

        run = self.ids["members"].get(model)
        if run is None:
            spec = self.models[model]
            run = self.client.create_run(self.ids["experiment"], run_name=model,
                                         tags={"mlflow.parentRunId": self.ids["parent"]}).info.run_id
            self.client.log_batch(run, params=[Param(key, str(value)) for key, value in settings(spec).items()])
            self.ids["members"][model] = run
            self._save()
        now = int(time.time() * 1000)
        self.client.log_batch(run, metrics=[Metric(TAGS[key], value, now, epoch)
                                            for key, value in metrics.items() if value is not None])

    def close(self, status: str) -> None:
        """Each run ends with `status`: FINISHED, KILLED or FAILED."""
        if self.lost:
            return
        try:
            for run in [*self.ids["members"].values(), self.ids["parent"]]:
                self.client.set_terminated(run, status)
        except Exception as err:
            self.say(f"[yellow]warning[/] MLflow at {self.uri} failed ({_said(err)}): its runs stay RUNNING there")

    def _save(self) -> None:
        self.ids_file.parent.mkdir(parents=True, exist_ok=True)
        write_whole(self.ids_file, json.dumps(self.ids, indent=1))


def _said(err: BaseException) -> str:
    """An error's words on one line (MLflow's span many: the request, its retries)."""
    return " ".join(str(err).split())[:300] or type(err).__name__


class Tracker:
    """Used as a context: on leaving it, the files are closed and MLflow's runs end, FAILED where it is left
    by an exception, else as `status` says (the run sets KILLED when stopped)."""

    status = "FINISHED"

    def __init__(self, run_dir: Path, models: list[ModelSpec], tensorboard: bool, mlflow: MlflowRuns | None = None):
        self.models = {m.name: m for m in models}
        self.folder = run_dir / FOLDER
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / CSV_FILE
        new = not path.exists()
        self._file = path.open("a", newline="")
        self._csv = csv.writer(self._file)
        if new:
            self._csv.writerow(["model", "epoch", *TAGS])
        self._tensorboard = tensorboard
        self._writers: dict = {}  # member -> its SummaryWriter
        self._mlflow = mlflow

    def epoch(self, model: str, epoch: int, metrics: dict[str, float | None]) -> None:
        """`model` has trained `epoch` epochs (1 after its first); `metrics`: RunRecorder.epoch_metrics."""
        self._csv.writerow([model, epoch, *("" if metrics[key] is None else repr(metrics[key]) for key in TAGS)])
        self._file.flush()  # a row a killed run measured stays
        if self._mlflow:
            self._mlflow.epoch(model, epoch, metrics)
        if not self._tensorboard:
            return
        if model not in self._writers:
            from torch.utils.tensorboard import SummaryWriter  # 1.5 s of imports: only where it writes
            from torch.utils.tensorboard.summary import hparams

            self._writers[model] = SummaryWriter(str(self.folder / model))
            # the session's start (its hyperparameters) alone: TensorBoard works out the search's experiment
            # (every session's settings, every scalar tag as a metric) from its sessions
            _, start, _ = hparams({key: _hparam(value) for key, value in settings(self.models[model]).items()}, {})
            self._writers[model].file_writer.add_summary(start)
        writer = self._writers[model]
        for key, tag in TAGS.items():
            if metrics[key] is not None:
                writer.add_scalar(tag, metrics[key], epoch)
        writer.flush()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        for writer in self._writers.values():
            writer.close()
        self._file.close()
        if self._mlflow:
            self._mlflow.close("FAILED" if kind else self.status)
