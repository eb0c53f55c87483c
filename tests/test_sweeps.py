"""Hydra multiruns of the real command, under the launchers and sweepers Hydra users pick: the basic
launcher (one job after another in this process), joblib's (parallel jobs in loky's worker processes),
submitit's (a process per job, as on Slurm; its local executor here), the project's own `shared`
launcher (jobs as one run) and the Optuna sweeper, which optimises the objective each job returns."""
import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml
from tensorboard.backend.event_processing.io_wrapper import GetLogdirSubdirectories

from pipeline.predict import load_ensemble
from pipeline.report.sweep import JOB_FILE
from stages.base import Split
from stages.read import ImageFolder
from tests.test_run import REPO, shm_segments

pytestmark = pytest.mark.slow


def multirun(tmp_path, *overrides: str) -> tuple[subprocess.Popen, str, str]:
    """The default ensemble, small: 4 models, one epoch on 3 classes of 12 images; the sweep's folder
    tmp_path/multirun, named as users name it, from where the command runs."""
    command = [sys.executable, "-m", "pipeline", "-m", "+ensemble=caltech256", f"dataset.root={tmp_path / 'data'}",
               "dataset.synthetic_classes=3", "dataset.synthetic_images_per_class=12", "pipeline.batch_size=16",
               "pipeline.image_size=32", "pipeline.alt_image_size=24", "trainer.epochs=1",
               f"hydra.sweep.dir={os.path.relpath(tmp_path / 'multirun', REPO)}", *overrides]
    job = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = job.communicate(timeout=600)  # Popen, not run: the rings are named by the job's pid
    return job, stdout, stderr


def outcome(job_folder) -> dict:
    """How the job ended, as its job.json says (its overrides left out)."""
    record = json.loads((job_folder / JOB_FILE).read_text())
    del record["overrides"]
    return record


def test_basic_launcher_runs_each_job_with_its_own_cluster_and_a_failed_job_fails_the_multirun(tmp_path):
    """What a user types: three jobs one after another, synthetic data generated, results written. The
    first job puts the default ensemble's 4 models on one CPU slot: one trainer packs them (no family
    to fuse). The third is a user's mistake: it says so in one line, the jobs before it keep their
    results and objective, the sweep summary marks it failed, and the multirun's exit code is not 0
    (when the job exited by itself, the sweep ended there with no summary)."""
    job, stdout, stderr = multirun(tmp_path, "trainer.slots=1,auto,0")
    assert job.returncode == 1, stdout[-2000:] + stderr[-3000:]
    assert "error: trainer.slots=0: give a positive integer or 'auto'" in stderr
    assert "SYNTHETIC stand-in" in stdout and "dataset.root=" in stdout
    assert stdout.count("cache    on: the decoded dataset") == 2  # each job says what its cache will hold
    assert "trainer.device=cuda" in stdout and "+ensemble=caltech256_paper" in stdout
    sweep = tmp_path / "multirun"
    one_slot, auto = [json.loads((sweep / str(n) / "results.json").read_text()) for n in (0, 1)]
    assert not (sweep / "2" / "results.json").exists()
    assert (one_slot["config"]["trainer"]["slots"], auto["config"]["trainer"]["slots"]) == (1, "auto")
    assert [(g["mode"], len(g["members"])) for g in one_slot["groups"].values()] == [("packed", 4)]
    assert all(m["epochs"] == 1 for m in one_slot["models"]) and len(one_slot["models"]) == 4
    assert sorted(g["mode"] for g in auto["groups"].values()) == ["alone"] * 4
    for n, results in enumerate((one_slot, auto)):  # by default, the kept ensemble's accuracy
        assert results["objective"]["value"] == results["ensemble"]["kept"]["val_accuracy"]
        assert outcome(sweep / str(n)) == {"status": "completed", "objective": results["objective"]["value"]}
    assert outcome(sweep / "2") == {"status": "failed", "error": "JobFailed: error: trainer.slots=0: give a "
                                    "positive integer or 'auto' (exit code 2 on its own)"}
    assert "failed: JobFailed: error: trainer.slots=0" in (sweep / "sweep.csv").read_text()
    values = [results["objective"]["value"] for results in (one_slot, auto)]  # the kept ensembles' accuracies
    best = 0 if values[0] >= values[1] else 1
    assert f'<tr class="best"><td><a href="{best}/report.html">' in (sweep / "sweep.html").read_text()
    assert shm_segments(job.pid) == set()  # the jobs' rings (named by the driver's pid) are gone
    assert not list(sweep.rglob(".run.lock"))  # the sweep's folder and its jobs' are let go, their locks removed


def test_optuna_sweeper_over_joblib_jobs_records_the_objective_each_trial_returned(tmp_path):
    """Two trials at once in joblib's worker processes, whose start method ("loky") a Dask worker
    spawned from them could not find: each job's local cluster starts, and the study holds each
    trial's value, the job's objective (resnet10_w16's lowest validation loss)."""
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    job, stdout, stderr = multirun(
        tmp_path, "ensemble.models.0.optimizer.lr=interval(0.01, 0.2)", "objective.of=resnet10_w16",
        "objective.metric=val_loss", "hydra/sweeper=optuna", "hydra.sweeper.direction=minimize",
        "hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=2", f"hydra.sweeper.storage={storage}",
        "hydra.sweeper.study_name=lr", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2")
    assert job.returncode == 0, stdout[-2000:] + stderr[-3000:]
    sweep = tmp_path / "multirun"
    trials = {}  # lr -> the job's objective
    for n in (0, 1):
        results = json.loads((sweep / str(n) / "results.json").read_text())
        member = results["models"][0]
        assert member["name"] == "resnet10_w16" and results["objective"]["value"] == min(member["val_loss"])
        assert outcome(sweep / str(n)) == {"status": "completed", "objective": results["objective"]["value"]}
        trials[member["optimizer"]["lr"]] = results["objective"]["value"]
    study = optuna.load_study(study_name="lr", storage=storage)
    assert {t.params["ensemble.models.0.optimizer.lr"]: t.value for t in study.trials} == trials
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert best["best_value"] == min(trials.values())


def test_submitit_jobs_run_in_processes_of_their_own_and_a_failed_one_fails_the_multirun(tmp_path):
    job, stdout, stderr = multirun(tmp_path, "hydra/launcher=submitit_local", "trainer.slots=0,2")
    assert job.returncode == 1, stdout[-2000:] + stderr[-3000:]
    sweep = tmp_path / "multirun"
    assert outcome(sweep / "0")["status"] == "failed" and "trainer.slots=0" in outcome(sweep / "0")["error"]
    results = json.loads((sweep / "1" / "results.json").read_text())
    assert len(results["models"]) == 4 and all(m["epochs"] == 1 for m in results["models"])
    assert outcome(sweep / "1") == {"status": "completed", "objective": results["objective"]["value"]}


def test_shared_launcher_trains_the_jobs_as_one_run_and_fails_only_those_whose_member_failed(tmp_path):
    """hydra/launcher=shared, 6 jobs that differ only in their ensembles. Jobs 2 and 5 declare a model that
    does not exist: the shared run's check refuses it, so they run alone and fail with a user's error in
    their own names, and the other 4 share one run, its data prepared once, holding 6 members (the 16 of
    the jobs, those the sweep leaves alone trained once). Jobs 1 and 4 hold a member that fails where it
    trains (scheduler.max_failures=0): they fail, and so does the multirun; jobs 0 and 3 complete, each
    with the folder Hydra's basic launcher gives a job (its overrides, results, report, checkpoints and
    tracking, under its members' own names) and its objective, its ensemble judged on its 4 members alone
    (load_ensemble of its folder predicts that accuracy).
    The jobs run in their folders (hydra.job.chdir=true). Mistakes it catches: a job's ensemble taken as
    the shared run's, the members every job shares trained again, one job's bad declaration or failed
    member failing every job, a job folder that lacks its members' files (the shared run's folder named
    from where a job runs)."""
    job, stdout, stderr = multirun(
        tmp_path, "hydra/launcher=shared", "ensemble.models.0.optimizer.lr=0.1,0.05",
        "ensemble.models.1.model._target_=pipeline.training.models.resnet,tests.failing_model.FailsWhereItTrains,"
        "tests.failing_model.NoSuchModel", "scheduler.max_failures=0", "trainer.slots=auto", "hydra.job.chdir=true")
    assert job.returncode == 1, stdout[-2000:] + stderr[-3000:]
    assert "jobs 2, 5 run alone: the shared run refused ensemble member j2.resnet10_w24" in stdout + stderr
    assert stdout.count("SYNTHETIC stand-in") == 1 and "jobs 0, 1, 3, 4 train as one run" in stdout
    sweep = tmp_path / "multirun"
    shared = json.loads((sweep / "shared-0-1_3-4" / "results.json").read_text())
    assert sorted(m["name"] for m in shared["models"]) == [
        "j0.densenet40_k12", "j0.densenet40_k8", "j0.resnet10_w16", "j0.resnet10_w24", "j1.resnet10_w24",
        "j3.resnet10_w16"]
    assert shared["given_up"] == ["j1.resnet10_w24"]
    names = ["resnet10_w16", "resnet10_w24", "densenet40_k12", "densenet40_k8"]
    for n, lr in ((0, 0.1), (3, 0.05)):
        folder = sweep / str(n)
        results = json.loads((folder / "results.json").read_text())
        assert [m["name"] for m in results["models"]] == names and results["models"][0]["optimizer"]["lr"] == lr
        assert all(m["epochs"] == 1 for m in results["models"])
        assert results["ensemble"]["val_accuracy"] == shared["parts"][str(n)]["val_accuracy"]
        assert sorted(results["ensemble"]["kept"]["epochs"]) == sorted(names)
        assert results["objective"]["value"] == results["ensemble"]["kept"]["val_accuracy"]
        assert outcome(folder) == {"status": "completed", "objective": results["objective"]["value"]}
        assert f"ensemble.models.0.optimizer.lr={lr}" in (folder / ".hydra" / "overrides.yaml").read_text()
        assert all(any((folder / "checkpoints" / name).glob("*.pt")) for name in names)
        files = ImageFolder(results["dataset"]["root"], 64).files[Split.VAL]  # its split.json's split
        predicted = load_ensemble(folder).predict([path for path, _ in files]).probabilities.argmax(1)  # the job's
        assert (predicted == [label for _, label in files]).mean() == pytest.approx(
            results["ensemble"]["kept"]["val_accuracy"])
        with (folder / "tracking" / "metrics.csv").open() as file:
            assert sorted(row["model"] for row in csv.DictReader(file)) == sorted(names)
        assert (folder / "report.html").exists()
    runs = {Path(run).relative_to(sweep).as_posix() for run in GetLogdirSubdirectories(str(sweep))}
    given_up = {f"{n}/tracking/resnet10_w24" for n in (1, 4)}  # (it finished no epoch)
    assert runs == {f"{n}/tracking/{name}" for n in (0, 1, 3, 4) for name in names} - given_up  # each member once
    for n in (1, 4):
        assert outcome(sweep / str(n)) == {
            "status": "failed", "error": "JobFailed: given up: resnet10_w24 (exit code 3 on its own)"}
    for n in (2, 5):
        failed = outcome(sweep / str(n))
        assert failed["status"] == "failed" and failed["error"].startswith(
            "JobFailed: error: ensemble member resnet10_w24: model (tests.failing_model.NoSuchModel)"), failed
        assert failed["error"].endswith("(exit code 2 on its own)"), failed
    assert shm_segments(job.pid) == set()


def test_a_sweeper_optimising_the_wrong_way_is_refused_before_any_trial_and_where_the_metric_is_swept_by_each(
        tmp_path):
    """Optuna's default direction (minimize) over the default objective (the ensemble's accuracy) would
    search for the worst accuracy: the multirun stops before its first trial, saying both fixes, and leaves
    no folder. With the metric in the search space (a choice of one, here) only a job knows its own: under
    the shared launcher each trial fails at once, and nothing trains."""
    trials = ("hydra/launcher=shared", "ensemble.models.0.optimizer.lr=interval(0.01, 0.2)", "hydra/sweeper=optuna",
              "hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=2")
    said = "error: hydra.sweeper.direction=minimize: the sweeper would minimize what each job returns"
    job, stdout, stderr = multirun(tmp_path / "fixed", *trials)
    assert job.returncode == 2, stdout[-2000:] + stderr[-3000:]
    assert stderr.startswith(said) and stderr.count("\n") == 1, stderr[-3000:]
    assert "set hydra.sweeper.direction=maximize, or objective.metric=val_loss" in stderr
    assert not (tmp_path / "fixed" / "multirun").exists()
    job, stdout, stderr = multirun(tmp_path / "swept", *trials, "objective.metric=choice(val_accuracy)")
    assert job.returncode == 1, stdout[-2000:] + stderr[-3000:]
    assert sum(line.startswith(said) for line in stderr.splitlines()) == 2, stderr[-3000:]  # each trial's own line
    assert not list((tmp_path / "swept" / "multirun").rglob("results.json"))


def test_optuna_batches_under_the_shared_launcher_are_one_run_each_and_the_study_has_every_trial(tmp_path):
    """Optuna asks for 4 trials, 2 at a time: each batch of 2 is one shared run, and the study holds each
    trial's value, the job's objective (its resnet10_w16's lowest validation loss)."""
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    job, stdout, stderr = multirun(
        tmp_path, "hydra/launcher=shared", "ensemble.models.0.optimizer.lr=interval(0.01, 0.2)",
        "objective.of=resnet10_w16", "objective.metric=val_loss", "hydra/sweeper=optuna",
        "hydra.sweeper.direction=minimize", "hydra.sweeper.n_trials=4", "hydra.sweeper.n_jobs=2",
        f"hydra.sweeper.storage={storage}", "hydra.sweeper.study_name=lr")
    assert job.returncode == 0, stdout[-2000:] + stderr[-3000:]
    sweep = tmp_path / "multirun"
    assert sorted(p.name for p in sweep.glob("shared-*")) == ["shared-0-1", "shared-2-3"]
    trials, values = {}, {}
    for n in range(4):
        results = json.loads((sweep / str(n) / "results.json").read_text())
        member = results["models"][0]
        assert member["name"] == "resnet10_w16" and results["objective"]["value"] == min(member["val_loss"])
        trials[member["optimizer"]["lr"]] = values[n] = results["objective"]["value"]
    study = optuna.load_study(study_name="lr", storage=storage)
    assert {t.params["ensemble.models.0.optimizer.lr"]: t.value for t in study.trials} == trials
    # The sweep's best job, said at its end, is the study's best trial (the lowest loss).
    best = min(values, key=values.get)
    assert values[best] == study.best_value
    assert re.search(rf"^best job: {best} \(ensemble.models.0.optimizer.lr=\S+\): val_loss of resnet10_w16 "
                     rf"{values[best]:.6g} \(minimized\)$", stdout, re.M), stdout[-2000:]
