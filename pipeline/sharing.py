"""Sweep jobs trained as one run: what the `shared` Hydra launcher does (hydra_plugins/pipeline_launcher).

Jobs of one launch whose configs agree on everything but `ensemble` and `objective` read, decode and
augment the same images the same way, so they train as one run: their members join one ensemble fed by
one pipeline, packed or fused on the slots as any run's members are. A member is named `j<job>.<name>`
there and keeps the seed its job's own run would give it; a member whose settings (seed included, so
its name too) equal one of an earlier job's, one the sweep does not change, is trained once for both.
Jobs that differ elsewhere (the dataset, the pipeline, the trainer, the scheduler, the seed) form
separate shared runs, one after another; jobs that halve, profile or resume run alone.

Each job then gets what Hydra promises it, in its own folder: its results.json (its members, its
ensemble's accuracy and loss computed over its members alone, its objective), report, checkpoints and
tracking, taken from the shared run's folder (files hard-linked; the TensorBoard files then leave the
shared run's folder, so TensorBoard over the sweep shows each member once), and its return value. A job
whose member was given up (with its slot group) fails; the others complete. A shared run that fails before
its plan is made (a declaration it refuses, a crash or hang measuring a member) leaves its jobs to run
alone (the launcher, hydra_plugins/pipeline_launcher), so that again only the jobs at fault fail. A shared
run that was stopped (or crashed once planned) resumes when the same jobs are launched into its sweep's folder,
and one that finished writes their folders again.
"""
from __future__ import annotations

import contextlib
import copy
import csv
import itertools
import json
import os
import shutil
import zlib
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from pipeline.config import (ENSEMBLE, MEMBER_DEFAULTS, ExitCode, JobFailed, MemberConf, Mode, ObjectiveConf,
                             check_objective, check_sweeper, expand_ensemble)
from pipeline.measure.objective import objective_record
from pipeline.measure.recorder import write_json
from pipeline.measure.tracking import CSV_FILE, FOLDER as TRACKING
from pipeline.report import write_report
from pipeline.runtime.errors import UserError

JOB_KEYS = ("ensemble", "objective")  # what jobs of one shared run may differ in
MEMBER_KEYS = tuple(f.name for f in fields(MemberConf))  # what a member declares (ModelSpec holds more)
SHARED_FOLDER = "shared-{jobs}"  # in the sweep's folder, beside the jobs' numbered folders
MOST_NAMED = 100  # characters of the jobs' spans in a shared run's folder name; more are named by a digest


@dataclass(frozen=True)
class SharedRun:
    """Jobs that train as one run: its config, and each job's members by their names in it."""

    cfg: DictConfig
    members: dict[int, dict[str, str]]  # job number -> its member's name -> its name in the shared run

    @property
    def parts(self) -> dict[str, list[str]]:
        """The jobs as sub-ensembles of the shared run (RunRecorder's parts)."""
        return {str(job): sorted(names.values()) for job, names in self.members.items()}

    def own_names(self, number: int) -> dict[str, str]:
        """Job `number`'s members: their names in the shared run -> their own."""
        return {shared: own for own, shared in self.members[number].items()}

    def jobs_holding(self, member: str) -> list[int]:
        """The jobs one of whose members is `member` of the shared run."""
        return [job for job, names in self.members.items() if member in names.values()]

    def folder(self, sweep_dir: Path) -> Path:
        """Its folder, named after its jobs (shared-0-7; shared-0-2_4-7 where job 3 ran alone), so that a launch
        of the same jobs finds it again and one of other jobs does not."""
        spans = [[n for _, n in span] for _, span in itertools.groupby(enumerate(sorted(self.members)),
                                                                        lambda pair: pair[1] - pair[0])]
        jobs = "_".join(f"{span[0]}-{span[-1]}" if len(span) > 1 else f"{span[0]}" for span in spans)
        if len(jobs) > MOST_NAMED:  # a folder's name has at most 255 bytes: the first and last, and a digest of all
            jobs = f"{spans[0][0]}-{spans[-1][-1]}-{zlib.crc32(jobs.encode()):08x}"
        return Path(sweep_dir) / SHARED_FOLDER.format(jobs=jobs)


def batches(jobs: dict[int, DictConfig]) -> list[list[int]]:
    """The jobs, by job number, in the runs they share: jobs that train (not resumed, no halving) and agree on
    everything but JOB_KEYS (and on the environment Hydra sets for them, hydra.job.env_set) together, in the
    order their first job comes; every other job alone (one whose ensemble or objective is wrong, or whose
    sweeper optimises the other way, too: on its own it fails, saying why, as any job would)."""
    shared: dict[str, list[int]] = {}
    alone = []
    for number, cfg in jobs.items():
        with as_job(cfg):  # its values as its own run reads them (`seed: ${hydra:job.num}` differs by job)
            # halving ranks a run's members against each other, by the run's objective metric: not across jobs
            if cfg.mode == Mode.train and not cfg.resume and not cfg.scheduler.halving.eta and _checks(cfg):
                settings = {key: value for key, value in OmegaConf.to_container(task_config(cfg), resolve=True).items()
                            if key not in JOB_KEYS}
                settings["hydra.job.env_set"] = env_set(cfg)
                shared.setdefault(json.dumps(settings, sort_keys=True, default=str), []).append(number)
            else:
                alone.append([number])
    return sorted([*shared.values(), *alone], key=min)


@contextlib.contextmanager
def as_job(cfg: DictConfig):
    """Within: the job's Hydra config is the one set, as Hydra's run_job sets it (a task's config may read it:
    `${hydra:job.num}`); then the one before. (Setting it leaves the job's `hydra` node read-only, as run_job
    does.)"""
    held = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(cfg)
    try:
        yield
    finally:
        HydraConfig.instance().cfg = held


def task_config(cfg: DictConfig) -> DictConfig:
    """The config a job's task is given: all but its `hydra` node."""
    return OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])


def env_set(cfg: DictConfig) -> dict[str, str]:
    """The environment variables Hydra sets for the job (hydra.job.env_set): its shared run's too."""
    return {key: str(value) for key, value in (OmegaConf.select(cfg, "hydra.job.env_set") or {}).items()}


def _checks(cfg: DictConfig) -> bool:
    try:
        check_objective(cfg.objective, expand_ensemble(cfg.ensemble, cfg.seed))
        check_sweeper(cfg.objective, OmegaConf.select(cfg, "hydra.sweeper"))
    except UserError:
        return False
    return True


def combine(jobs: dict[int, DictConfig]) -> SharedRun:
    """One run's config holding every job's members (as expanded by the job's own ensemble config)."""
    members, specs = {}, []
    trained: dict[str, str] = {}  # a member's settings but its name -> its name in the shared run
    for number, cfg in jobs.items():
        members[number] = {}
        with as_job(cfg):
            expanded = expand_ensemble(cfg.ensemble, cfg.seed)
        for spec in expanded:
            settings = {key: asdict(spec)[key] for key in MEMBER_KEYS}
            key = json.dumps({**settings, "name": None}, sort_keys=True, default=str)
            if key in trained and trained[key] not in members[number].values():
                members[number][spec.name] = trained[key]  # an earlier job's: trained once for both
                continue
            name = f"j{number}.{spec.name}"
            trained.setdefault(key, name)
            members[number][spec.name] = name
            specs.append(MemberConf(**{**settings, "name": name}))
    cfg = copy.deepcopy(jobs[min(jobs)])
    with open_dict(cfg):
        cfg.pop("hydra", None)  # each job keeps its own
    with as_job(jobs[min(jobs)]):  # what it reads of a job's Hydra config, read as the jobs' own runs read it
        OmegaConf.resolve(cfg)  # (alike: batches); the shared run has none set
    with open_dict(cfg):
        cfg.ensemble.models = specs  # each complete: its job's defaults are already in it, and no other's
        for key in MEMBER_DEFAULTS:  # may add to it (a key job 0's optimiser sets, the other job's lacks)
            cfg.ensemble[key] = {"_target_": cfg.ensemble[key]["_target_"]}
        cfg.ensemble.grid = {}
        cfg.objective = OmegaConf.structured(ObjectiveConf(of=ENSEMBLE))  # each job's is its own
    return SharedRun(cfg, members)


def job_results(shared: dict, run: SharedRun, number: int, cfg: DictConfig, shared_dir: Path) -> dict:
    """Job `number`'s results, from the shared run's: its members under their own names (their rows and
    GPU memory peaks; other jobs' members left out of those), its ensemble, its objective and config.
    What is by slot group or describes the shared run as a whole (groups, rates, the scheduler's
    decisions, the timeline, the pipeline) keeps the shared run's names."""
    names = run.own_names(number)
    results = {key: value for key, value in shared.items() if key != "parts"}
    trained = {m["name"]: m for m in shared["models"]}
    results["models"] = [{**trained[new], "name": old} for old, new in run.members[number].items()]  # its order
    if "peak_allocated_bytes" in shared:  # by member
        results["peak_allocated_bytes"] = {names[name]: peak for name, peak in shared["peak_allocated_bytes"].items()
                                           if name in names}
    ensemble = results["ensemble"] = copy.deepcopy(shared["parts"][str(number)])
    if ensemble["kept"]:
        ensemble["kept"]["epochs"] = {names[name]: epochs for name, epochs in ensemble["kept"]["epochs"].items()}
    if "given_up" in shared:
        results["given_up"] = [names[name] for name in shared["given_up"] if name in names]
    results["objective"] = objective_record(results, cfg.objective)
    results["config"] = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    results["shared_run"] = {"folder": str(shared_dir), "jobs": sorted(run.members),
                             "members": run.members[number]}
    return results


def write_job(shared: dict, run: SharedRun, number: int, cfg: DictConfig, shared_dir: Path,
              job_dir: Path) -> dict:
    """Job `number`'s folder: results.json, the report, and its members' checkpoints and tracking."""
    results = job_results(shared, run, number, cfg, shared_dir)
    for old, new in run.members[number].items():
        for kind in ("checkpoints", TRACKING):
            if (shared_dir / kind / new).is_dir():
                shutil.copytree(shared_dir / kind / new, job_dir / kind / old, copy_function=_linked,
                                dirs_exist_ok=True)
    _split_metrics(shared_dir / TRACKING / CSV_FILE, job_dir / TRACKING / CSV_FILE, run.own_names(number))
    write_json(job_dir / "results.json", results)
    write_report(results, job_dir)
    return results


def release_events(shared_dir: Path) -> None:
    """The shared run's TensorBoard files that its jobs' folders now hold (hard links: a file linked there has
    more than one), dropped from its own folder, so that TensorBoard over the sweep's folder shows each
    member once, in its job's folder. A file that no job's folder holds (its job failed before its folder was
    written) stays. (A job's folder removed and written again from the finished run gets none.)"""
    for member in (shared_dir / TRACKING).glob("*/"):
        for events in member.glob("*tfevents*"):  # TensorBoard's own test for an event file
            if events.stat().st_nlink > 1:
                events.unlink()
        if not any(member.iterdir()):
            member.rmdir()


def _linked(source: str, target: str) -> None:
    """`target` a hard link to `source`, unless it is one already (a job's folder written again from its
    finished shared run); a file of another run there fails the job, saying so."""
    if os.path.exists(target) and os.path.samefile(source, target):
        return
    if os.path.exists(target):
        raise JobFailed(ExitCode.user_error, f"error: {target} is another run's: launch these jobs into a new "
                                             "hydra.sweep.dir")
    os.link(source, target)


def _split_metrics(source: Path, target: Path, names: dict[str, str]) -> None:
    """The rows of `names`' members (shared name -> the job's) of the shared run's tracking CSV."""
    if not source.exists():
        return
    with source.open(newline="") as file:
        reader = csv.DictReader(file)
        rows = [{**row, "model": names[row["model"]]} for row in reader if row["model"] in names]
        fields = reader.fieldnames
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def job_failure(results: dict) -> JobFailed | None:
    """Why a job's results fail it: a member given up."""
    if results.get("given_up"):
        return JobFailed(ExitCode.models_given_up, f"given up: {', '.join(results['given_up'])}")
    return None
