"""How the shared launcher (pipeline/sharing.py) forms its runs: which jobs share one, and the members
of that run. The launcher itself, a real multirun: tests/test_sweeps.py."""
import copy
from pathlib import Path

import pytest
from omegaconf import open_dict

from pipeline.config import expand_ensemble
from pipeline.sharing import batches, combine, job_results
from tests.conftest import compose_config


def job(*overrides: str):
    """A job's config as the launcher has it: with its `hydra` node."""
    return compose_config(["+ensemble=caltech256", *overrides], with_hydra=True)


def numbered(jobs: dict) -> dict:
    """The jobs numbered, as the launcher numbers them."""
    for number, cfg in jobs.items():
        cfg.hydra.job.num = number
    return jobs


def test_jobs_share_a_run_when_only_their_ensembles_and_objectives_differ():
    """Jobs 0, 2 and 4 differ in a member's rate and the objective (and, as every job, in their own
    `hydra` node): one run. Job 1 trains longer, job 3 on another seed (other batches, other
    augmentations): each its own run. A profile job and a resumed one run alone, and so does job 7,
    whose objective names no member (on its own it fails, saying so), and jobs 8 and 9, which halve
    (halving would rank one job's members against another's). Jobs 10 and 11 differ from 0 only in their
    rate but Hydra sets an environment variable for them (hydra.job.env_set): their own run. Jobs grouped
    by anything less than the whole config but the ensemble, objective and hydra node (a trainer setting,
    the seed, the environment), or split by the rest of the hydra node, fail."""
    jobs = numbered({0: job("ensemble.models.0.optimizer.lr=0.1"), 1: job("trainer.epochs=20"),
                     2: job("objective.of=best_member"), 3: job("seed=1"),
                     4: job("ensemble.models.0.optimizer.lr=0.01"),
                     5: job("seed=1", "mode=profile"), 6: job("seed=1", "resume=/somewhere"),
                     7: job("objective.of=nobody"), 8: job("scheduler.halving.eta=2"),
                     9: job("scheduler.halving.eta=2"),
                     10: job("ensemble.models.0.optimizer.lr=0.2"), 11: job("ensemble.models.0.optimizer.lr=0.3")})
    for number in (10, 11):
        with open_dict(jobs[number]):
            jobs[number].hydra.job.env_set = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    assert batches(jobs) == [[0, 2, 4], [1], [3], [5], [6], [7], [8], [9], [10, 11]]


def test_a_setting_that_reads_the_jobs_hydra_config_is_read_as_the_jobs_own_run_reads_it():
    """`seed: ${hydra:job.num}` gives each job its own seed: jobs 0 and 1 differ (each its own run) and a run
    of job 1's is seeded 1, read without a job's Hydra config set (a shared run has none). The jobs were
    compared as written (alike: one run), and reading the seed raised "HydraConfig was not set"."""
    jobs = numbered({n: job(f"ensemble.models.0.optimizer.lr={lr}", "seed=${hydra:job.num}")
                     for n, lr in enumerate((0.1, 0.05))})
    assert batches(jobs) == [[0], [1]]
    shared = combine({1: jobs[1]})
    assert shared.cfg.seed == 1 and shared.members[1]["resnet10_w16"] == "j1.resnet10_w16"


def test_a_shared_run_holds_each_jobs_members_and_trains_what_jobs_share_once():
    """Two jobs differing in resnet10_w16's rate: the shared run holds both of its versions and the three
    members the sweep left alone once, each with the seed its job's own run would give it. A member
    trained once per job, a seed derived from the new name, or job 1's changed member taken as job 0's,
    fails."""
    jobs = numbered({0: job("ensemble.models.0.optimizer.lr=0.1"), 1: job("ensemble.models.0.optimizer.lr=0.01")})
    shared = combine(jobs)
    own = {n: {m.name: m for m in expand_ensemble(cfg.ensemble, cfg.seed)} for n, cfg in jobs.items()}
    members = {m.name: m for m in expand_ensemble(shared.cfg.ensemble, shared.cfg.seed)}
    assert sorted(members) == ["j0.densenet40_k12", "j0.densenet40_k8", "j0.resnet10_w16", "j0.resnet10_w24",
                               "j1.resnet10_w16"]
    assert shared.members[1] == {"resnet10_w16": "j1.resnet10_w16", "resnet10_w24": "j0.resnet10_w24",
                                 "densenet40_k12": "j0.densenet40_k12", "densenet40_k8": "j0.densenet40_k8"}
    for number, names in shared.members.items():
        for name, trained_as in names.items():
            mine, theirs = own[number][name], members[trained_as]
            assert (mine.seed, mine.optimizer, mine.model) == (theirs.seed, theirs.optimizer, theirs.model)
    assert shared.parts == {"0": sorted(shared.members[0].values()), "1": sorted(shared.members[1].values())}
    assert shared.jobs_holding("j1.resnet10_w16") == [1] and shared.jobs_holding("j0.resnet10_w24") == [0, 1]
    assert shared.cfg.objective.of == "ensemble" and "hydra" not in shared.cfg


def test_each_jobs_members_keep_their_own_jobs_ensemble_settings_and_no_others():
    """Job 0 smooths the ensemble's labels, job 1 does not: one shared run, and job 1's members train without
    smoothing as its own run would. The shared run kept job 0's ensemble-level loss, which the members' own
    (complete) losses were merged over again: job 1's members were trained as job 0's, label smoothing too,
    and its objective told of them."""
    jobs = numbered({0: job("++ensemble.loss.label_smoothing=0.1"), 1: job()})
    assert batches(jobs) == [[0, 1]]
    shared = combine(jobs)
    members = {m.name: m for m in expand_ensemble(shared.cfg.ensemble, shared.cfg.seed)}
    for number, cfg in jobs.items():
        for m in expand_ensemble(cfg.ensemble, cfg.seed):
            trained = members[shared.members[number][m.name]]
            assert (trained.loss, trained.optimizer, trained.lr_scheduler) == (m.loss, m.optimizer, m.lr_scheduler)
    assert members["j1.resnet10_w16"].loss == {"_target_": "torch.nn.CrossEntropyLoss"}


def test_a_jobs_results_name_its_members_as_it_does_and_leave_the_other_jobs_out():
    """Job 1's view of a shared run where each version of resnet10_w16 trained alone and the three
    members both jobs share packed as group0: its rows and GPU memory peaks under its own names, job 0's
    resnet10_w16 left out of them; what is by slot group (a row's group, rates) as the shared run names
    it. Shared names left in a job's rows or peaks, another job's member kept there, or slot groups
    renamed apart from the run's own `groups`, fail."""
    jobs = numbered({0: job("ensemble.models.0.optimizer.lr=0.1"), 1: job("ensemble.models.0.optimizer.lr=0.01")})
    run = combine(jobs)
    packed = ["j0.resnet10_w24", "j0.densenet40_k12", "j0.densenet40_k8"]
    alone = ["j0.resnet10_w16", "j1.resnet10_w16"]
    models = [{"name": name, "group": name if name in alone else "group0", "val_accuracy": [0.5]}
              for name in alone + packed]
    part = {"kept": {"epochs": {name: 1 for name in run.members[1].values()}, "val_accuracy": 0.6},
            "final_val_accuracy": 0.5}
    rates = {"j0.resnet10_w16": [10.0], "j1.resnet10_w16": [11.0], "group0": [5.0]}
    shared = {"models": models, "parts": {"0": part, "1": part}, "ensemble": part, "rates": rates,
              "peak_allocated_bytes": {name: 2**20 * (i + 1) for i, name in enumerate(alone + packed)}}
    task_cfg = compose_config(["+ensemble=caltech256", "ensemble.models.0.optimizer.lr=0.01"])  # as run_job gives it
    results = job_results(shared, run, 1, task_cfg, Path("/sweep/shared-0-1"))
    assert {m["name"]: m["group"] for m in results["models"]} == {
        "resnet10_w16": "j1.resnet10_w16", "resnet10_w24": "group0", "densenet40_k12": "group0",
        "densenet40_k8": "group0"}
    assert results["rates"] == rates
    assert results["peak_allocated_bytes"] == {"resnet10_w16": 2 * 2**20, "resnet10_w24": 3 * 2**20,
                                               "densenet40_k12": 4 * 2**20, "densenet40_k8": 5 * 2**20}
    assert results["objective"]["value"] == 0.6 and results["ensemble"]["kept"]["epochs"] == {
        name: 1 for name in run.members[1]}


@pytest.mark.parametrize("planned", [False, True])
def test_a_shared_run_that_fails_before_its_plan_leaves_each_job_to_run_alone(monkeypatch, tmp_path, planned):
    """A shared run that crashes before its plan is made (a member's rate measurement crashed, say: its
    state is not written yet) might be any one job's fault: each job then runs alone, as its own run, so
    only the jobs at fault fail. Once planned, the crash is the run's, and every job fails with it (as
    the real multirun test's trained failures do, by member). Failing every job of a batch for one
    member's crash before training, or running a batch again after it trained, fails."""
    from hydra_plugins.pipeline_launcher import shared_launcher
    from pipeline.config import STATE_DIR, ExitCode, JobFailed

    def crashed(shared, folder):
        if planned:
            (folder / STATE_DIR).mkdir(parents=True)
            (folder / STATE_DIR / "run.json").write_text("{}")
        return JobFailed(ExitCode.crashed, "the shared run crashed")

    # Composed first: Hydra's first compose scans its plugins, which runs the launcher's module again
    jobs = numbered({n: job(f"ensemble.models.0.optimizer.lr={lr}") for n, lr in enumerate((0.1, 0.05))})
    launcher = shared_launcher.SharedLauncher()
    launcher.task_function = "the job's own run"
    ran = []
    monkeypatch.setattr(shared_launcher, "_train", crashed)
    monkeypatch.setattr(launcher, "_run_job", lambda cfg, task: ran.append((cfg.hydra.job.num, task)) or cfg)
    launcher._share([0, 1], jobs, tmp_path)
    assert [number for number, _ in ran] == [0, 1]
    if planned:
        assert all(task.func is shared_launcher._job and task.args[1].why == "the shared run crashed"
                   for _, task in ran)
    else:
        assert all(task == "the job's own run" for _, task in ran)


def test_a_shared_run_goes_on_only_where_the_same_jobs_ran(tmp_path):
    """The launcher resumes a shared run whose folder holds a run of the same config that was stopped or
    crashed after its plan (timeouts may differ, as for resume=), and splits one that finished again. A run
    of other jobs there is neither."""
    import json

    from omegaconf import OmegaConf

    from pipeline.config import STATE_DIR
    from pipeline.run import run_of

    def launched(*rates):
        return combine(numbered({n: job(f"ensemble.models.0.optimizer.lr={lr}") for n, lr in enumerate(rates)}))

    shared = launched(0.1, 0.05)
    folder = shared.folder(tmp_path)
    assert run_of(folder, shared.cfg) is None  # nothing there yet
    (folder / STATE_DIR).mkdir(parents=True)
    (folder / STATE_DIR / "run.json").write_text(json.dumps(
        {"config": OmegaConf.to_container(shared.cfg, resolve=True, enum_to_str=True)}))
    assert run_of(folder, shared.cfg) == "stopped"  # crashed: planned, no results
    (folder / "results.json").write_text(json.dumps({"interrupted": {"cause": "SIGINT"}}))
    again = launched(0.1, 0.05)
    with open_dict(again.cfg):
        again.cfg.timeouts.stop_s = 30
    assert run_of(folder, again.cfg) == "stopped"
    assert run_of(folder, launched(0.1, 0.02).cfg) is None  # other jobs (Optuna's next trials, say)
    (folder / "results.json").write_text(json.dumps({"models": []}))
    assert run_of(folder, shared.cfg) == "finished"


def test_a_shared_runs_folder_names_its_jobs_within_a_folder_names_length():
    """Spans of consecutive jobs; past MOST_NAMED characters, the first and last job and a digest of them all."""
    from pipeline.sharing import MOST_NAMED, SharedRun

    def name(numbers):
        return SharedRun(None, {n: {} for n in numbers}).folder(Path("/sweep")).name

    assert [name(jobs) for jobs in ([0, 1], [0, 1, 2, 4, 5, 6, 7], [3, 5, 6])] == [
        "shared-0-1", "shared-0-2_4-7", "shared-3_5-6"]
    even, odd = name(range(0, 200, 2)), name([0, *range(3, 197, 2), 198])  # the same first and last jobs
    assert even.startswith("shared-0-198-") and odd.startswith("shared-0-198-") and even != odd
    assert len(name(range(0, 20000, 2))) < len("shared-") + MOST_NAMED


def test_a_batch_split_on_its_first_launch_goes_on_when_launched_again(monkeypatch, tmp_path):
    """Job 2's member is refused, so jobs 0, 1 and 3 share a run, which stops (planned, nothing finished).
    Launched again, the same jobs find it in its folder, named after them, and resume it. (Named after its
    first and last job, as the whole batch's run is, it was taken for a run of other jobs and every job
    failed: its folder held an earlier run.)"""
    import json

    from omegaconf import OmegaConf

    from hydra_plugins.pipeline_launcher import shared_launcher
    from pipeline.config import STATE_DIR, ExitCode, JobFailed
    from pipeline.training.members import MemberError

    def train(shared, folder):
        trained.append((folder.name, shared.cfg.resume))
        if 2 in shared.members:
            return MemberError("ensemble member j2.resnet10_w16: no module", "j2.resnet10_w16", "no module")
        (folder / STATE_DIR).mkdir(parents=True, exist_ok=True)  # planned, then stopped
        (folder / STATE_DIR / "run.json").write_text(json.dumps(
            {"config": OmegaConf.to_container(shared.cfg, resolve=True, enum_to_str=True)}))
        return JobFailed(ExitCode.nodes_lost, "stopped")

    ran, launches = [], []
    for _ in range(2):
        jobs = numbered({n: job(f"ensemble.models.0.optimizer.lr={lr}") for n, lr in enumerate((0.1, 0.05, 0.02,
                                                                                                0.01))})
        for cfg in jobs.values():
            cfg.hydra.sweep.dir = str(tmp_path)
        monkeypatch.setattr(shared_launcher, "_train", train)  # (after composing: Hydra's plugin scan runs the
        launcher = shared_launcher.SharedLauncher()           # launcher's module again, as it was)
        launcher.task_function = "the job's own run"
        monkeypatch.setattr(launcher, "_run_job", lambda cfg, task: ran.append(cfg.hydra.job.num) or cfg)
        trained = []
        launcher._share([0, 1, 2, 3], jobs, tmp_path)
        launches.append(trained)
    first, again = launches
    assert again == [first[0], (first[1][0], str(tmp_path / first[1][0]))]  # the same tries; the stopped run resumed
    assert [folder for folder, _ in first] == ["shared-0-3", "shared-0-1_3"]
    assert ran == [2, 0, 1, 3] * 2  # job 2 alone, the others split from their run


def test_a_job_that_ran_alone_goes_on_with_its_own_run_when_launched_again(monkeypatch, tmp_path):
    """Launched again, a job whose own folder holds its own run (one it ran alone: halving, say, or after its
    shared run failed before its plan) goes on with it alone: job 0's stopped run resumes there, job 1's
    finished one gives its objective again (or its failure), training nothing; jobs 2 and 3 share a run.
    (Before, both failed: their folders held an earlier run.)"""
    import json

    from omegaconf import OmegaConf

    from hydra_plugins.pipeline_launcher import shared_launcher
    from pipeline.config import STATE_DIR, ExitCode, JobFailed

    jobs = numbered({n: job(f"ensemble.models.0.optimizer.lr={lr}") for n, lr in enumerate((0.1, 0.05, 0.02, 0.01))})
    for number in (0, 1):  # each run's config saved as its run saved it: the task's, which run_job gives it
        task = copy.deepcopy(jobs[number])
        with open_dict(task):
            del task["hydra"]
        (tmp_path / str(number) / STATE_DIR).mkdir(parents=True)
        (tmp_path / str(number) / STATE_DIR / "run.json").write_text(json.dumps(
            {"config": OmegaConf.to_container(task, resolve=True, enum_to_str=True)}))
    (tmp_path / "1" / "results.json").write_text(json.dumps({"objective": {
        "of": "ensemble", "metric": "val_accuracy", "value": 0.75}}))
    for cfg in jobs.values():
        cfg.hydra.sweep.dir = str(tmp_path)
    launcher = shared_launcher.SharedLauncher()
    launcher.task_function = "the job's own run"
    trained, ran = [], {}
    monkeypatch.setattr(shared_launcher, "_train", lambda shared, folder: trained.append(sorted(shared.members))
                        or JobFailed(ExitCode.crashed, "the shared run crashed"))
    monkeypatch.setattr(launcher, "_run_job", lambda cfg, task: ran.setdefault(cfg.hydra.job.num, (cfg, task)))
    launcher._share([0, 1, 2, 3], jobs, tmp_path)
    assert trained == [[2, 3]]
    resumed, task = ran[0]
    assert task == "the job's own run" and resumed.resume == str(tmp_path / "0")
    _, finished = ran[1]
    assert finished.func is shared_launcher._finished and finished.args == (1, tmp_path / "1")
    assert finished(jobs[1]) == 0.75
    (tmp_path / "1" / "results.json").write_text(json.dumps({"given_up": ["resnet10_w16"]}))
    with pytest.raises(JobFailed, match="given up: resnet10_w16"):
        finished(jobs[1])


def test_jobs_whose_folders_hold_an_earlier_sweeps_runs_fail_saying_so(monkeypatch, tmp_path):
    """Where an earlier sweep's runs are, training would mix their checkpoints with this one's. The sweep's
    folder holds a finished shared run of other jobs where this batch's would go: every job fails, with the
    folder and the fix, and nothing trains. Then only job 1's own folder holds an earlier run: job 1 fails
    without Hydra's run_job (which would write its .hydra files and job.json over the earlier run's), jobs
    0 and 2 share a run."""
    import json

    from hydra_plugins.pipeline_launcher import shared_launcher
    from pipeline.config import STATE_DIR, ExitCode, JobFailed

    def launch(numbers):
        jobs = numbered({n: job(f"ensemble.models.0.optimizer.lr={lr}") for n, lr in enumerate((0.1, 0.05, 0.02))})
        for cfg in jobs.values():
            cfg.hydra.sweep.dir = str(tmp_path)
        launcher = shared_launcher.SharedLauncher()
        launcher.task_function = "the job's own run"
        ran, trained = [], []
        monkeypatch.setattr(shared_launcher, "_train", lambda shared, folder: trained.append(sorted(shared.members))
                            or JobFailed(ExitCode.crashed, "the shared run crashed"))
        monkeypatch.setattr(launcher, "_run_job", lambda cfg, task: ran.append((cfg.hydra.job.num, task)) or cfg)
        returns = launcher._share(numbers, jobs, tmp_path)
        return ran, trained, returns

    earlier = tmp_path / "shared-0-2"
    (earlier / STATE_DIR).mkdir(parents=True)
    (earlier / STATE_DIR / "run.json").write_text(json.dumps({"config": {}}))
    (earlier / "results.json").write_text("{}")
    ran, trained, _ = launch([0, 1, 2])
    assert trained == [] and [number for number, _ in ran] == [0, 1, 2]
    for _, task in ran:
        assert task.func is shared_launcher._failed and task.args[0].why == (
            f"error: {earlier} holds an earlier run (results.json, state): launch these jobs into a new "
            "hydra.sweep.dir")
    (earlier / "results.json").unlink()
    (earlier / STATE_DIR / "run.json").unlink()
    (earlier / STATE_DIR).rmdir()
    (tmp_path / "1" / "checkpoints").mkdir(parents=True)
    ran, trained, returns = launch([0, 1, 2])
    assert trained == [[0, 2]] and [number for number, _ in ran] == [0, 2]  # each alone, after the crash
    with pytest.raises(JobFailed, match=f"^error: {tmp_path / '1'} holds an earlier run"):
        returns[1].return_value


def test_a_resumed_shared_run_that_refuses_a_member_fails_every_job(monkeypatch, tmp_path):
    """Resumed (its folder holds the same jobs' stopped run), a shared run that now refuses a member's
    declaration (the user's code changed, say) fails every job with it: alone, the jobs would start anew and
    leave the stopped run behind."""
    import json

    from omegaconf import OmegaConf

    from hydra_plugins.pipeline_launcher import shared_launcher
    from pipeline.config import STATE_DIR
    from pipeline.training.members import MemberError

    jobs = numbered({n: job(f"ensemble.models.0.optimizer.lr={lr}") for n, lr in enumerate((0.1, 0.05))})
    shared = combine(jobs)
    folder = shared.folder(tmp_path)
    (folder / STATE_DIR).mkdir(parents=True)
    (folder / STATE_DIR / "run.json").write_text(json.dumps(
        {"config": OmegaConf.to_container(shared.cfg, resolve=True, enum_to_str=True)}))
    launcher = shared_launcher.SharedLauncher()
    launcher.task_function = "the job's own run"
    ran = []
    monkeypatch.setattr(shared_launcher, "_train", lambda shared, folder: MemberError(
        "ensemble member j0.resnet10_w16: no module", "j0.resnet10_w16", "no module"))
    monkeypatch.setattr(launcher, "_run_job", lambda cfg, task: ran.append((cfg.hydra.job.num, task)) or cfg)
    launcher._share([0, 1], jobs, tmp_path)
    assert [number for number, _ in ran] == [0, 1]
    for _, task in ran:
        assert task.func is shared_launcher._job and task.args[1].why == \
            "error: ensemble member j0.resnet10_w16: no module"


def test_a_jobs_folder_is_written_again_from_the_same_files_and_never_over_another_runs(tmp_path):
    """Splitting a finished shared run into its jobs' folders again links the files already linked; a file
    of another run where a link would go fails the job, saying so, and stays as it was."""
    from pipeline.config import JobFailed
    from pipeline.sharing import _linked

    source, target, other = tmp_path / "shared.pt", tmp_path / "job.pt", tmp_path / "earlier.pt"
    source.write_text("this run's")
    _linked(str(source), str(target))
    _linked(str(source), str(target))  # again: the same file
    assert target.samefile(source)
    other.write_text("an earlier run's")
    with pytest.raises(JobFailed, match=f"error: {other} is another run's: launch these jobs into a new"):
        _linked(str(source), str(other))
    assert other.read_text() == "an earlier run's"


def test_the_launcher_finds_a_jobs_folder_where_hydra_puts_it(tmp_path):
    """The folder whose earlier run the launcher looks for is the one Hydra's run_job writes the job to: a
    subdir may read the job's own Hydra config through Hydra's resolver, and a relative sweep folder is
    named from where the command ran (not from where a job runs: hydra.job.chdir=true)."""
    from hydra.core.hydra_config import HydraConfig

    from hydra_plugins.pipeline_launcher.shared_launcher import _job_dir

    cfg = numbered({3: job()})[3]
    cfg.hydra.sweep.dir = "multirun"
    cfg.hydra.sweep.subdir = "trial_${hydra:job.num}"
    cfg.hydra.runtime.cwd = str(tmp_path)
    held = HydraConfig.instance().cfg = "the launcher's own"
    assert _job_dir(cfg) == tmp_path / "multirun" / "trial_3"
    assert HydraConfig.instance().cfg is held  # as it was
    HydraConfig.instance().cfg = None


def test_tensorboard_files_a_jobs_folder_holds_leave_the_shared_runs_folder(tmp_path):
    """Once linked into a job's folder, a member's TensorBoard files leave the shared run's (TensorBoard over
    the sweep would show the member twice); those of a member no job's folder holds stay, with the CSV."""
    from pipeline.sharing import _linked, release_events

    shared, job = tmp_path / "shared-0-1" / "tracking", tmp_path / "0" / "tracking"
    for member in ("j0.a", "j1.a"):
        (shared / member).mkdir(parents=True)
        (shared / member / "events.out.tfevents.1.host").write_text(f"{member}'s epochs")
    (shared / "metrics.csv").write_text("model,epoch\n")
    (job / "a").mkdir(parents=True)
    _linked(str(shared / "j0.a" / "events.out.tfevents.1.host"), str(job / "a" / "events.out.tfevents.1.host"))
    release_events(tmp_path / "shared-0-1")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()) == [
        "0/tracking/a/events.out.tfevents.1.host", "shared-0-1/tracking/j1.a/events.out.tfevents.1.host",
        "shared-0-1/tracking/metrics.csv"]
    assert (job / "a" / "events.out.tfevents.1.host").read_text() == "j0.a's epochs"
    release_events(tmp_path / "shared-0-1")  # written again from the same run: nothing more leaves
    assert (shared / "j1.a" / "events.out.tfevents.1.host").exists()
