"""`hydra/launcher=shared`: a sweep's jobs that differ only in `ensemble` and `objective` train as one
run, one preprocessing pipeline feeding all their members (pipeline/sharing.py says how). Every job
still gets its own folder (with its .hydra files, unless hydra.output_subdir=null), its callbacks and its
JobReturn, as under Hydra's basic launcher, which runs the jobs that cannot share one by one.

(No `from __future__ import annotations`: Hydra imports plugin modules outside sys.modules, where
dataclasses cannot resolve string annotations.)"""

import functools
import json
import logging
import signal
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus, configure_log, env_override, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, open_dict

log = logging.getLogger(__name__)


@dataclass
class SharedLauncherConf:
    _target_: str = "hydra_plugins.pipeline_launcher.shared_launcher.SharedLauncher"


ConfigStore.instance().store(group="hydra/launcher", name="shared", node=SharedLauncherConf, provider="pipeline")


class SharedLauncher(Launcher):
    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        self.hydra_context, self.task_function, self.config = hydra_context, task_function, config

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from pipeline import sharing
        from pipeline.report.sweep import sweep_dir

        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep = sweep_dir(self.config)
        sweep.mkdir(parents=True, exist_ok=True)
        jobs = {}
        for number, overrides in enumerate(job_overrides, initial_job_idx):
            log.info(f"\t#{number} : {' '.join(filter_overrides(overrides))}")
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(cfg):
                cfg.hydra.job.id = number
                cfg.hydra.job.num = number
            jobs[number] = cfg
        returns = {}
        for batch in sharing.batches(jobs):
            returns.update(self._share(batch, jobs, sweep))
        return [returns[number] for number in sorted(returns)]

    def _share(self, batch: list, jobs: dict, sweep_dir: Path) -> dict:
        """The batch's jobs trained as one run, each job's folder and return split from it. A job with a
        member whose declaration the run's check refuses runs alone (so fails, saying why in its own names)
        and the others share again; any other user error, and any failure before the run's plan was made
        (a crash or hang measuring a member's rate, say), each job meets alone: only the jobs whose members
        cause it fail. Launched again into the sweep's folder, the same jobs go on with their shared run
        there: a stopped one resumes (any error then fails every job: alone, they would start anew), a
        finished one is split again; a job that trained alone goes on with its own run alone (_alone). Where
        the folders hold another run, the jobs fail, saying so: a run there would mix its checkpoints with
        the earlier run's (and a job whose own folder holds it fails without a file written there)."""
        from pipeline import sharing
        from pipeline.config import ExitCode, JobFailed, earlier_run
        from pipeline.run import planned, run_of
        from pipeline.training.members import MemberError

        own = {number: _own_run(jobs[number]) for number in batch}  # each job's folder, and its own run there
        returns = {number: self._alone(jobs[number], *own[number]) for number in batch if own[number][1]}
        batch = [number for number in batch if number not in returns]
        while len(batch) > 1:
            shared = sharing.combine({number: jobs[number] for number in batch})
            folder = shared.folder(sweep_dir)
            earlier = run_of(folder, shared.cfg)
            numbers = ", ".join(map(str, batch))
            if earlier == "finished":
                log.info(f"jobs {numbers}: their shared run finished in {folder}; their folders are written from it")
                return returns | self._split(batch, jobs, shared, json.loads((folder / "results.json").read_text()),
                                             folder)
            if earlier == "stopped":
                with open_dict(shared.cfg):
                    shared.cfg.resume = str(folder)
                log.info(f"jobs {numbers} go on with their shared run, stopped in {folder}")
            else:
                # another run where this one or a job's folder would go: training would mix their checkpoints
                where = {number: folder if earlier_run(folder) else own[number][0] for number in batch}
                refused = {number: _held(where[number], held) for number in batch
                           if (held := earlier_run(where[number]))}
                if refused:  # those jobs fail; the others share again
                    for number, failure in refused.items():
                        returns[number] = _unwritten(jobs[number], failure) if earlier_run(own[number][0]) \
                            else self._run_job(jobs[number], functools.partial(_failed, failure))
                    batch = [number for number in batch if number not in refused]
                    continue
                log.info(f"jobs {numbers} train as one run in {folder}")
            with env_override(sharing.env_set(jobs[batch[0]])):
                outcome = _train(shared, folder)
            if shared.cfg.resume and isinstance(outcome, MemberError):
                outcome = JobFailed(ExitCode.user_error, f"error: {outcome}")
            if isinstance(outcome, MemberError):
                alone = shared.jobs_holding(outcome.member) or batch  # (a member of no job: never loop)
                log.warning(f"jobs {', '.join(map(str, alone))} run alone: the shared run refused {outcome}")
            elif isinstance(outcome, JobFailed) and not shared.cfg.resume and \
                    (outcome.code == ExitCode.user_error or not planned(folder)):
                alone = batch
                how = "refused" if outcome.code == ExitCode.user_error else "failed before its plan was made"
                log.warning(f"each job runs alone: the shared run {how} ({outcome.why})")
            else:
                return returns | self._split(batch, jobs, shared, outcome, folder)
            for number in alone:
                returns[number] = self._alone(jobs[number], *own[number])
            batch = [number for number in batch if number not in alone]
        for number in batch:
            returns[number] = self._alone(jobs[number], *own[number])
        return returns

    def _alone(self, cfg: DictConfig, own: Path, earlier: str | None) -> JobReturn:
        """A job run on its own (the task, as Hydra's basic launcher runs it), `own` its folder and `earlier` the
        run of its own found there (_own_run). Launched again into its sweep's folder, one that trained goes on
        with its own run there as a shared run does: a stopped one resumes, a finished one returns its
        objective again, training nothing; a run of another config there fails it, saying so, without a file
        written over that run's."""
        from pipeline.config import earlier_run

        if earlier == "finished":
            log.info(f"job {cfg.hydra.job.num}: its run finished in {own}")
            return self._run_job(cfg, functools.partial(_finished, cfg.hydra.job.num, own))
        if earlier == "stopped":
            log.info(f"job {cfg.hydra.job.num} goes on with its run, stopped in {own}")
            with open_dict(cfg):
                cfg.resume = str(own)
        elif not cfg.resume and (held := earlier_run(own)):
            return _unwritten(cfg, _held(own, held))
        return self._run_job(cfg, self.task_function)

    def _split(self, batch: list, jobs: dict, shared, outcome, folder: Path) -> dict:
        """Each job of the batch through run_job, its folder and return taken from the shared run's `outcome`
        (its results, or the JobFailed every job fails with)."""
        from pipeline import sharing

        returns = {number: self._run_job(jobs[number], functools.partial(_job, shared, outcome, number, folder))
                   for number in batch}
        sharing.release_events(folder)
        return returns

    def _run_job(self, cfg: DictConfig, task_function) -> JobReturn:
        returned = run_job(hydra_context=self.hydra_context, task_function=task_function, config=cfg,
                           job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return returned


def _train(shared, folder: Path):
    """The shared run's results; or the MemberError of a member's declaration it refused; or the JobFailed
    each of its jobs fails with. A stop (Ctrl-C, SIGTERM, ...) ends the whole multirun, as it ends a job's run;
    the same command into the same sweep folder then resumes the shared run (SharedLauncher._share)."""
    from pipeline.config import ExitCode, JobFailed
    from pipeline.run import run
    from pipeline.runtime.hang import HangError
    from pipeline.runtime.lifetime import Interrupted, StopSignals
    from pipeline.training.members import MemberError
    from pipeline.runtime.errors import UserError

    with StopSignals() as stop:
        try:
            results = run(shared.cfg, folder, stop, shared.parts)
        except MemberError as refused:
            return refused
        except UserError as err:
            return JobFailed(ExitCode.user_error, f"error: {err}")
        except HangError as hung:
            return JobFailed(ExitCode.hung, f"error: {hung}")
        except Interrupted as stopped:
            print(f"{stopped}: the shared run of this sweep stopped before training began", file=sys.stderr)
            sys.exit(128 + stopped.signum)
        except Exception:  # every job of the batch fails with it, each through run_job as Hydra expects
            return JobFailed(ExitCode.crashed, f"the shared run in {folder} crashed:\n{traceback.format_exc()}")
    if "interrupted" in results:
        why = (f"the shared run in {folder} stopped ({results['interrupted']['cause']}); to go on from its last "
               f"finished epochs, launch the same jobs again with hydra.sweep.dir={folder.parent}")
        if stop.signum:
            print(why, file=sys.stderr)
            sys.exit(128 + stop.signum)
        return JobFailed(ExitCode.nodes_lost, why)
    if stop.signum:  # asked to stop as the finished run closed: the multirun stops (launched again, _share splits it)
        print(f"{signal.Signals(stop.signum).name}: stopped as the shared run in {folder} closed; it had finished: "
              f"launch the same jobs again with hydra.sweep.dir={folder.parent} to write their folders",
              file=sys.stderr)
        sys.exit(128 + stop.signum)
    return results


def _job(shared, outcome, number: int, folder: Path, cfg: DictConfig):
    """Job `number`'s task under run_job: its folder split from the shared run's, and its objective;
    or its failure, said and raised (Hydra marks the job failed)."""
    from pipeline import sharing
    from pipeline.config import JobFailed

    if isinstance(outcome, JobFailed):
        _failed(outcome, cfg)
    try:
        results = sharing.write_job(outcome, shared, number, cfg, folder, Path(HydraConfig.get().runtime.output_dir))
    except JobFailed as failure:  # another run's files in the job's folder
        _failed(failure, cfg)
    return _returned(number, results, f"its members trained in the shared run {folder}", cfg)


def _finished(number: int, folder: Path, cfg: DictConfig):
    """The task of job `number`, whose own run finished in `folder`, launched again: its objective, or its
    failure."""
    return _returned(number, json.loads((folder / "results.json").read_text()), f"its run finished in {folder}", cfg)


def _returned(number: int, results: dict, where: str, cfg: DictConfig):
    """What job `number` returns to Hydra from its `results`: its objective, said with `where` it trained; or
    its failure (a member given up), said and raised."""
    from pipeline import sharing

    failure = sharing.job_failure(results)
    if failure:
        _failed(failure, cfg)
    objective = results.get("objective")  # none in mode=profile
    if objective:
        print(f"job {number}: objective {objective['of']} {objective['metric']} = {objective['value']} ({where})")
    return objective["value"] if objective else None


def _failed(failure, cfg: DictConfig):
    """A job's task under run_job that fails as `failure` (a JobFailed) says, on stderr and to Hydra."""
    print(failure.why, file=sys.stderr)
    raise failure


def _held(folder: Path, held: str):
    """The JobFailed of a job whose run would go where `folder` holds an earlier run (`held`: its outputs)."""
    from pipeline.config import ExitCode, JobFailed

    return JobFailed(ExitCode.user_error, f"error: {folder} holds an earlier run ({held}): launch these jobs into a "
                                          "new hydra.sweep.dir")


def _unwritten(cfg: DictConfig, failure) -> JobReturn:
    """A job failed as `failure` says without Hydra's run_job, which would write the job's .hydra files and
    callbacks' files (job.json) over those of the earlier run its folder holds."""
    print(failure.why, file=sys.stderr)
    return JobReturn(overrides=list(cfg.hydra.overrides.task), status=JobStatus.FAILED, _return_value=failure)


def _own_run(cfg: DictConfig) -> tuple:
    """The job's own folder, and what it holds of a run of the job's config (pipeline.run.run_of): a run the
    job ran alone ("stopped" or "finished"), or None (a job split from a shared run holds none: its run is
    the shared one; a job given resume= goes on with that run, wherever it is)."""
    from pipeline.run import run_of
    from pipeline.sharing import as_job, task_config

    own = _job_dir(cfg)
    with as_job(cfg):  # the task's config may read the job's Hydra config, as under run_job
        return own, None if cfg.resume else run_of(own, task_config(cfg))


def _job_dir(cfg: DictConfig) -> Path:
    """The folder Hydra's run_job gives the job, found as run_job finds it: with the job's Hydra config set,
    which a subdir may read (`${hydra:job.num}`)."""
    from pipeline.report.sweep import sweep_dir
    from pipeline.sharing import as_job

    with as_job(cfg):
        return sweep_dir(cfg) / str(cfg.hydra.sweep.subdir)
